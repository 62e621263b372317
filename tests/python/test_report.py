"""Operation records, xirang.stats(gather=True), XIRANG_STATS_DIR and the report (issue #7).

Real multi-rank runs (mp_pool.Pool, 2-4 ranks on 127.0.0.1) with XIRANG_STATS_DIR set:
- records add up: phases <= total_s, per-peer bytes sum to bytes_wire, and with XIRANG_ALGO=ring
  a 1 MiB float32 allreduce sends exactly the ring schedule's payload (2(N-1)/N x bytes);
- the JSON lines equal xirang.stats() and stats(gather=True) brings every rank's to rank 0;
- a rank slowed with XIRANG_TEST_DELAY_MS is the one the report names as slowest;
- the hook's operations carry group_id and the group's layer names; the report finds its steps;
- the page parses, references no external URL, embeds exactly the records, and renders in
  headless Chromium without script errors (skipped with the reason when Chromium is missing).
"""
from __future__ import annotations

import datetime
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from html.parser import HTMLParser

import pytest

import mp_pool
from conftest import require_backend
from mp_pool import W

MIB_NUMEL = 262144  # 1 MiB of float32
PHASES = ("encode_s", "scatter_reduce_s", "allgather_s", "decode_s")
FLOAT_KEYS = ("t_enqueue", "queued_s", "encode_s", "scatter_reduce_s", "allgather_s", "decode_s", "total_s")


@pytest.fixture(autouse=True)
def _need_xirang():
    require_backend("xirang")


# ---------------------------------------------------------------------------------------------
# rank-side functions (run in the pool's workers)
# ---------------------------------------------------------------------------------------------


def w_init(delay_rank=-1, delay_ms=0):
    import torch.distributed as dist

    if W.rank == delay_rank:
        os.environ["XIRANG_TEST_DELAY_MS"] = str(delay_ms)
    else:
        os.environ.pop("XIRANG_TEST_DELAY_MS", None)
    dist.init_process_group(
        "xirang", store=dist.PrefixStore("default_pg", W.store), rank=W.rank,
        world_size=W.world_size, timeout=datetime.timedelta(seconds=60),
    )
    return True


def w_allreduce(numel, iters):
    import torch
    import torch.distributed as dist

    import xirang

    t = torch.ones(numel, dtype=torch.float32)
    for _ in range(iters):
        dist.all_reduce(t)
    own = xirang.stats()
    gathered = xirang.stats(gather=True)
    ring = list(xirang._backend_for(None).ring)
    return {"own": own, "gathered": gathered, "ring": ring,
            "sent": list(xirang._C.ring_allreduce_elements_sent(numel, W.world_size))}


def w_exposed(late_s, async_sleep_s):
    """A synchronous allreduce that rank 1 joins late_s after rank 0, then an async one waited on
    only after async_sleep_s; the records of both, and a group made with XIRANG_STATS=0."""
    import time

    import torch
    import torch.distributed as dist

    import xirang

    be = xirang._backend_for(None)
    t = torch.ones(1024, dtype=torch.float32)
    dist.barrier()
    if W.rank == 1:
        time.sleep(late_s)
    dist.all_reduce(t)  # async_op=False: torch calls Work.wait()
    seq_sync = be.sequence_number
    dist.barrier()
    w = dist.all_reduce(t, async_op=True)
    seq_async = be.sequence_number
    time.sleep(async_sleep_s)  # the op completes meanwhile; nobody is waiting on it
    before = {r["seq"]: r for r in xirang.stats()}[seq_async]
    t0 = time.perf_counter()
    w.wait()
    wait_call_s = time.perf_counter() - t0
    recs = {r["seq"]: r for r in xirang.stats()}
    cost = be.record_cost()
    # records off: nothing kept, nothing timed, the collective still works
    os.environ["XIRANG_STATS"] = "0"
    try:
        g_off = dist.new_group(backend="xirang")
    finally:
        os.environ.pop("XIRANG_STATS", None)
    x = torch.ones(8)
    dist.all_reduce(x, group=g_off)
    off = {"records": xirang.stats(g_off), "cost": xirang._backend_for(g_off).record_cost(), "sum": x[0].item()}
    return {"sync": recs[seq_sync], "async_before": before, "async": recs[seq_async],
            "wait_call_s": wait_call_s, "cost": cost, "off": off}


def w_hook(steps, layers_per_group):
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import xirang

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    ddp = DDP(model, bucket_cap_mb=0.02)
    state = xirang.register_comm_hook(ddp, layers_per_group=layers_per_group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(8, 64)
    for _ in range(steps):
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
    return {"layers": [g["layers"] for g in state.stats()["groups"]], "records": xirang.stats()}


def w_destroy():
    import torch.distributed as dist

    dist.destroy_process_group()
    return True


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def run_pool(ws, stats_dir, fn, *args, env=None, delay_rank=-1, delay_ms=0, timeout=120):
    penv = {"XIRANG_STATS_DIR": stats_dir}
    penv.update(env or {})
    with mp_pool.Pool(ws, "xirang", init=False, env=penv, timeout_s=60) as pool:
        pool.run(w_init, delay_rank, delay_ms, timeout=60)
        res = pool.run(fn, *args, timeout=timeout)
        pool.run(w_destroy, timeout=30)  # closes the JSONL files
    return res


def read_jsonl(d):
    from xirang import report

    recs, warns = report.load_records(d)
    assert not warns, warns
    return recs


def make_report(d, tmp_path, name="report.html"):
    out = os.path.join(str(tmp_path), name)
    p = subprocess.run([sys.executable, "-m", "xirang.report", d, "-o", out],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    with open(out, encoding="utf-8") as f:
        return out, f.read(), p.stdout


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.urls, self.ids, self.scripts = [], set(), 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for k in ("src", "href", "action", "data", "poster"):
            if a.get(k):
                self.urls.append(a[k])
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "script":
            self.scripts += 1


def check_page(page):
    p = _Collect()
    p.feed(page)
    p.close()
    assert not p.urls, f"the page references {p.urls}"
    for want in ("xirang-data", "xirang-status", "c-phases", "c-share", "c-bytes", "c-exposed", "c-ranks", "c-links"):
        assert want in p.ids, want
    # No URL anywhere except the SVG namespace string the drawing code needs.
    urls = set(re.findall(r"https?://[^\s'\"<>)]+", page))
    assert urls <= {"http://www.w3.org/2000/svg"}, urls
    assert "url(" not in page and "@import" not in page


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=2e-9)


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ws", [2, 4])
def test_records_add_up_ring(ws, tmp_path):
    d = str(tmp_path / "stats")
    iters = 3
    res = run_pool(ws, d, w_allreduce, MIB_NUMEL, iters, env={"XIRANG_ALGO": "ring", "XIRANG_TRANSPORT_LOCAL": "tcp"})
    payload = MIB_NUMEL * 4
    lines = read_jsonl(d)
    for rank, r in enumerate(res):
        ring, sent = r["ring"], r["sent"]
        pos = ring.index(rank)
        ars = [x for x in r["own"] if x["op"] == "all_reduce"]
        assert len(ars) >= iters
        for rec in ars[:iters]:
            assert rec["ok"] is True and rec["algorithm"] == "ring", rec
            assert rec["numel"] == MIB_NUMEL and rec["dtype"] == "float32"
            assert rec["group_id"] == -1
            # payload only, exactly the ring schedule's count; 2(N-1)/N x payload here
            assert rec["bytes_wire"] == sent[pos] * 4
            assert rec["bytes_wire"] == 2 * (ws - 1) * payload // ws
            assert rec["bytes_raw"] == rec["bytes_wire"]
            assert rec["total_s"] > 0
            for p in PHASES + ("queued_s",):
                assert rec[p] >= 0
            for p in PHASES:
                assert rec[p] <= rec["total_s"] + 1e-9, (p, rec)
            assert sum(rec[p] for p in PHASES) <= rec["total_s"] * (1 + 1e-6) + 1e-9
            assert rec["scatter_reduce_s"] > 0 and rec["allgather_s"] > 0
            peers = {p["peer"]: p for p in rec["peers"]}
            assert sum(p["bytes_sent"] for p in peers.values()) == rec["bytes_wire"]
            nxt, prv = ring[(pos + 1) % ws], ring[(pos - 1) % ws]
            assert peers[nxt]["bytes_sent"] == rec["bytes_wire"]
            assert peers[prv]["bytes_recv"] == sent[(pos - 1) % ws] * 4
            for p in peers.values():
                assert 0 <= p["send_s"] <= rec["total_s"] + 1e-9
                assert 0 <= p["recv_s"] <= rec["total_s"] + 1e-9
        # the JSON lines carry the same records plus run/pg/rank fields
        mine = [x for x in lines if x["global_rank"] == rank]
        # stats(gather=True)'s own operations come after the snapshot
        assert len(mine) > len(r["own"])
        for a, b in zip(mine, r["own"]):
            assert a["group_rank"] == rank and a["world_size"] == ws
            assert isinstance(a["run_id"], str) and isinstance(a["pg"], str)
            for k, v in b.items():
                if k in FLOAT_KEYS:
                    assert close(a[k], v), (k, a[k], v)
                elif k == "exposed_wait_s":
                    # the line: blocked time up to completion (short of the wake-up) or null
                    # when the caller had not begun waiting; stats(): the whole wait
                    assert v is not None and v >= 0, rec
                    assert a[k] is None or -1e-6 <= v - a[k] < 0.05, (a[k], v)
                elif k == "peers":
                    assert [(p["peer"], p["bytes_sent"], p["bytes_recv"]) for p in a[k]] == \
                           [(p["peer"], p["bytes_sent"], p["bytes_recv"]) for p in v]
                else:
                    assert a[k] == v, (k, a[k], v)
    # stats(gather=True): rank 0 holds everyone's snapshot, the others None
    assert res[0]["gathered"] is not None and len(res[0]["gathered"]) == ws
    for rank in range(ws):
        assert res[0]["gathered"][rank] == res[rank]["own"]
    for rank in range(1, ws):
        assert res[rank]["gathered"] is None

    # the report's embedded data equal the records, its numbers equal theirs
    out, page, stdout = make_report(d, tmp_path)
    check_page(page)
    from xirang import report

    data = report.embedded_data(page)
    assert data["records"] == lines  # one run in the directory: all of them
    a = data["analysis"]
    assert a["run"]["ranks"] == list(range(ws))
    assert a["bytes"]["wire"] == sum(x["bytes_wire"] for x in lines)
    assert a["bytes"]["raw"] == sum(x["bytes_raw"] for x in lines)
    ar = [g for g in a["groups"] if g["key"] == "all_reduce"]
    assert ar and ar[0]["bytes_wire"] == sum(x["bytes_wire"] for x in lines
                                             if x["op"] == "all_reduce" and x["pg"] == a["run"]["primary_pg"])
    ring_links = {(x["src"], x["dst"]) for x in a["links"] if x["bytes"] >= payload}
    ring = res[0]["ring"]
    assert {(ring[i], ring[(i + 1) % ws]) for i in range(ws)} <= ring_links
    assert "hottest group:" in stdout and "slowest link:" in stdout


@pytest.mark.parametrize("ws,slow", [(2, 1), (4, 2)])
def test_slow_rank_is_named(ws, slow, tmp_path):
    d = str(tmp_path / "stats")
    iters = 4
    run_pool(ws, d, w_allreduce, MIB_NUMEL, iters, env={"XIRANG_ALGO": "ring", "XIRANG_TRANSPORT_LOCAL": "tcp"},
             delay_rank=slow, delay_ms=200, timeout=120)
    lines = read_jsonl(d)
    from xirang import report

    a = report.analyze(lines, run_name="t")
    assert a["slowest_rank"] == slow, json.dumps(a["ranks"], indent=1)
    assert a["slowest_rank_clear"]
    by = {r["rank"]: r for r in a["ranks"]}
    # ~200 ms per allreduce waited on the slow rank by the others, almost none by the slow rank
    assert by[slow]["net_wait_introduced_s"] > 0.5 * 0.2 * iters
    assert by[slow]["waited_s"] < 0.5 * by[slow]["induced_s"]
    # the delay shows as unattributed time inside the slow rank's own ops
    assert by[slow]["unattributed_s"] > 0.8 * 0.2 * iters
    # the CLI names it
    _, page, stdout = make_report(d, tmp_path)
    assert re.search(rf"^slowest rank: {slow}:", stdout, re.M), stdout
    check_page(page)
    assert report.embedded_data(page)["analysis"]["slowest_rank"] == slow


def test_exposed_wait(tmp_path):
    """exposed_wait_s = time the caller blocked in Work.wait(): ~late_s on the rank that came
    early, ~0 on the late one and for an async op waited on after it completed."""
    d = str(tmp_path / "stats")
    late, nap = 0.5, 0.3
    res = run_pool(2, d, w_exposed, late, nap, timeout=120)
    early, late_rank = res[0], res[1]
    assert early["sync"]["exposed_wait_s"] >= late - 0.1, early["sync"]
    assert early["sync"]["exposed_wait_s"] < late + 1.0, early["sync"]
    assert late_rank["sync"]["exposed_wait_s"] is not None
    assert 0 <= late_rank["sync"]["exposed_wait_s"] < 0.1, late_rank["sync"]
    for r in res:
        # the async op ran (ms) during the nap: unknown before the wait, ~0 after it
        assert r["async"]["total_s"] < nap, r["async"]
        assert r["async_before"]["exposed_wait_s"] is None
        assert 0 <= r["async"]["exposed_wait_s"] <= r["wait_call_s"] + 1e-6 < 0.05, r
        assert r["cost"]["on"] and r["cost"]["records"] >= 4 and r["cost"]["ns"] > 0
        off = r["off"]
        assert off["sum"] == 2.0 and off["records"] == [] and off["cost"] == {"records": 0, "ns": 0, "on": False}
    # the JSON lines: what was known at completion
    lines = read_jsonl(d)
    by = {(x["global_rank"], x["seq"]): x for x in lines}
    s0 = by[(0, early["sync"]["seq"])]["exposed_wait_s"]
    assert late - 0.1 <= s0 <= early["sync"]["exposed_wait_s"] + 1e-6
    for rank in range(2):
        assert by[(rank, res[rank]["async"]["seq"])]["exposed_wait_s"] is None
    assert not [x for x in lines if x["pg"] != by[(0, early["sync"]["seq"])]["pg"]], "XIRANG_STATS=0 wrote lines"
    from xirang import report

    a = report.analyze(lines)
    assert 0 < a["exposure"]["measured_ops"] < len(lines)
    # ops mode: each operation is a step; the early rank's sync allreduce shows ~late_s exposed
    assert max(a["exposure"]["exposed_s"]) >= (late - 0.1) / 2


def test_hook_steps_and_labels(tmp_path):
    d = str(tmp_path / "stats")
    steps, lpg = 3, 2
    # the BF16 ring (over shared memory the hook's op is fp32: test_shm.py)
    res = run_pool(2, d, w_hook, steps, lpg, env={"XIRANG_TRANSPORT_LOCAL": "tcp"}, timeout=180)
    layers = res[0]["layers"]
    assert len(layers) == 3
    hook = [x for x in res[0]["records"] if x["group_id"] >= 0]
    assert len(hook) == steps * len(layers)
    for x in hook:
        assert x["op"] == "allreduce_bf16_ef"
        assert x["label"] == ", ".join(layers[x["group_id"]])
        # BF16 on the wire for the matrices (fp32 raw); plain tensors, if folded in, go as they are
        assert x["bytes_wire"] < x["bytes_raw"] <= 2 * x["bytes_wire"]
    _, page, stdout = make_report(d, tmp_path)
    check_page(page)
    from xirang import report

    a = report.embedded_data(page)["analysis"]
    assert a["mode"] == "hook" and a["steps"] == steps
    keys = [g["key"] for g in a["groups"] if g["key"].startswith("group ")]
    assert keys == [f"group {i}" for i in range(len(layers))]
    for g in a["groups"]:
        if g["key"].startswith("group "):
            i = int(g["key"].split()[1])
            assert g["label"] == ", ".join(layers[i])
            assert all(v > 0 for v in g["per_step"]["total_s"])
    hottest = a["hottest_group"]
    assert hottest in keys
    assert f"hottest group: {hottest}" in stdout
    assert len(a["exposure"]["exposed_s"]) == steps


# ---------------------------------------------------------------------------------------------
# the page in a real browser
# ---------------------------------------------------------------------------------------------


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        p = shutil.which(name)
        if p:
            return p
    return None


def _png_stats(path):
    """(distinct colours in a sample, fraction of non-white pixels) of an 8-bit RGB/RGBA PNG."""
    try:
        from PIL import Image

        im = Image.open(path).convert("RGB")
        px = list(im.getdata())
        return len(set(px[:: max(1, len(px) // 200000)])), sum(1 for p in px if p != (255, 255, 255)) / len(px)
    except ImportError:
        pass
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, w = 8, b"", 0
    while pos < len(data):
        n, typ = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if typ == b"IHDR":
            w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and ctype in (2, 6), (depth, ctype)
            bpp = 3 if ctype == 2 else 4
        elif typ == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride = w * bpp
    prev = bytearray(stride)
    colours, nonwhite, total = set(), 0, 0
    i = 0
    for _ in range(h):
        ft = raw[i]
        line = bytearray(raw[i + 1:i + 1 + stride])
        i += 1 + stride
        for x in range(stride):
            a = line[x - bpp] if x >= bpp else 0
            b = prev[x]
            c = prev[x - bpp] if x >= bpp else 0
            if ft == 1:
                line[x] = (line[x] + a) & 255
            elif ft == 2:
                line[x] = (line[x] + b) & 255
            elif ft == 3:
                line[x] = (line[x] + ((a + b) >> 1)) & 255
            elif ft == 4:
                pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        prev = line
        for x in range(0, stride, bpp * 4):
            px = bytes(line[x:x + 3])
            colours.add(px)
            total += 1
            nonwhite += px != b"\xff\xff\xff"
    return len(colours), nonwhite / max(1, total)


def test_report_in_headless_chromium(tmp_path):
    exe = _chromium()
    if exe is None:
        pytest.skip("no chromium: tests/run.sh installs Debian's `chromium` when run as root with apt")
    d = str(tmp_path / "stats")
    run_pool(2, d, w_hook, 3, 2, timeout=180)
    out, page, _ = make_report(d, tmp_path)
    url = "file://" + out
    prof = tempfile.mkdtemp(prefix="xr-chromium-")
    flags = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--allow-file-access-from-files", f"--user-data-dir={prof}",
             "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000"]
    try:
        try:
            dom = subprocess.run(flags + ["--dump-dom", url], capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("chromium --dump-dom did not finish in 120 s")
        if dom.returncode != 0 and not dom.stdout:
            pytest.skip(f"chromium cannot run here (rc={dom.returncode}): {dom.stderr[-500:]}")
        console = dom.stderr
        assert "Uncaught" not in console, console[-3000:]
        m = re.search(r'id="xirang-status"[^>]*data-state="(\w+)"[^>]*>([^<]*)<', dom.stdout)
        assert m, dom.stdout[:2000]
        assert m.group(1) == "ok", m.group(2)
        assert re.search(r"rendered [1-9]\d* charts", m.group(2)), m.group(2)
        assert dom.stdout.count("<svg") >= 6 and dom.stdout.count("<rect") > 20
        shot = str(tmp_path / "shot.png")
        s = subprocess.run(flags + [f"--screenshot={shot}", "--window-size=1200,1600", url],
                           capture_output=True, text=True, timeout=120)
        assert "Uncaught" not in s.stderr, s.stderr[-3000:]
        assert os.path.exists(shot), s.stderr[-2000:]
        colours, nonwhite = _png_stats(shot)
        assert colours >= 8, colours          # text, axes and several bar colours
        assert nonwhite > 0.01, nonwhite       # not a blank page
    finally:
        shutil.rmtree(prof, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# pure-Python parts (no processes)
# ---------------------------------------------------------------------------------------------


def _rec(rank, seq, gid=-1, total=0.01, peers=(), **kw):
    r = {"run_id": "", "pg": "0", "group_rank": rank, "global_rank": rank, "world_size": 2, "seq": seq,
         "op": "allreduce_bf16_ef" if gid >= 0 else "all_reduce", "algorithm": "ring", "group_id": gid,
         "label": f"l{gid}" if gid >= 0 else "", "dtype": "float32", "numel": 4, "bytes_raw": 8, "bytes_wire": 4,
         "bytes_cross_host": 0, "bytes_cross_rack": 0, "t_enqueue": seq * 0.1, "queued_s": 0.0,
         "encode_s": 0.001, "scatter_reduce_s": 0.002, "allgather_s": 0.003, "decode_s": 0.001,
         "total_s": total, "ok": True, "peers": list(peers)}
    r.update(kw)
    return r


def test_runs_split_on_seq_restart_and_steps(tmp_path):
    from xirang import report

    d = tmp_path / "s"
    d.mkdir()
    for rank in range(2):
        with open(d / f"rank{rank}.jsonl", "w") as f:
            for run in range(2):
                seq = 0
                for step in range(3 + run):
                    for gid in (1, 0):  # launch order need not be increasing
                        seq += 1
                        f.write(json.dumps(_rec(rank, seq, gid, total=0.01 * (gid + 1))) + "\n")
            f.write("{not json\n")
    recs, warns = report.load_records(str(d))
    assert len(warns) == 2 and len(recs) == 2 * 2 * (3 + 4)
    runs = report.split_runs(recs)
    assert [n for n, _ in runs] == ["(no run id) #1", "(no run id) #2"]
    chosen, a, _ = report.build(str(d))
    assert a["steps"] == 4 and a["mode"] == "hook"
    assert a["hottest_group"] == "group 1"
    g1 = next(g for g in a["groups"] if g["key"] == "group 1")
    assert g1["per_step"]["total_s"] == [0.02] * 4
    assert math.isclose(g1["share"], 2 / 3)
    assert math.isclose(g1["per_step"]["unattributed_s"][0], 0.02 - 0.007)
    _, a1, _ = report.build(str(d), run="0")
    assert a1["steps"] == 3
    page = report.render_html(chosen, a)
    check_page(page)
    assert report.embedded_data(page)["records"] == chosen
    assert report.embedded_data(page)["records_total"] == len(chosen)


def test_many_records_are_not_embedded(monkeypatch, tmp_path):
    """Found by a new user: the page embedded every record (a 121 MB stats directory made a
    1.38 GB page). Above the cap the page keeps the analysis and says the records were left out."""
    from xirang import report
    from xirang.report import html as rhtml

    recs = [_rec(r, s, gid=s % 2) for s in range(1, 9) for r in range(2)]
    a = report.analyze(recs, ["(no run id)"], "(no run id)")
    monkeypatch.setattr(rhtml, "MAX_EMBEDDED_RECORDS", len(recs) - 1)
    page = report.render_html(recs, a)
    data = report.embedded_data(page)
    assert data["records"] == [] and data["records_total"] == len(recs)
    assert data["analysis"] == json.loads(json.dumps(a))
    assert f"({len(recs)} records: more than {len(recs) - 1}, so the page embeds the analysis only" in page
    monkeypatch.setattr(rhtml, "MAX_EMBEDDED_RECORDS", len(recs))
    assert report.embedded_data(report.render_html(recs, a))["records"] == recs


def test_slowest_metric_on_synthetic_ring():
    """4-rank ring, rank 1 late by 0.2 s: ranks 2, 3, 0 each wait once (the wait travels), rank 1 never."""
    from xirang import report

    ws, late, wait, xfer = 4, 1, 0.2, 0.001
    recs = []
    for seq in (1, 2):
        for r in range(ws):
            prv, nxt = (r - 1) % ws, (r + 1) % ws
            w = wait if r != late else 0.0
            peers = [{"peer": nxt, "send_s": xfer, "recv_s": 0.0, "bytes_sent": 100, "bytes_recv": 0},
                     {"peer": prv, "send_s": 0.0, "recv_s": w + xfer, "bytes_sent": 0, "bytes_recv": 100}]
            recs.append(_rec(r, seq, world_size=ws, peers=peers, bytes_wire=100))
    for x in recs:
        x["world_size"] = ws
    a = report.analyze(recs)
    assert a["slowest_rank"] == late
    by = {r["rank"]: r for r in a["ranks"]}
    assert math.isclose(by[late]["net_wait_introduced_s"], 2 * wait)
    assert math.isclose(by[(late - 1) % ws]["net_wait_introduced_s"], -2 * wait)
    # raw waits alone would tie ranks 1, 2 and 3 as "waited on"
    assert sorted(round(r["induced_s"], 6) for r in a["ranks"]) == [0.002, 0.402, 0.402, 0.402]
    # the link check: min(send, recv) = transfer only, so no link stands out
    assert a["slowest_link_ratio"] is not None and a["slowest_link_ratio"] < 1.5


def test_exposed_estimate_and_field():
    from xirang import report

    # one step, two groups: group 0 enqueued at 0.1 and ends 0.15, group 1 enqueued at 0.2, ends 0.26
    recs = []
    for r in range(2):
        recs.append(_rec(r, 1, 0, t_enqueue=0.1, total_s=0.05))
        recs.append(_rec(r, 2, 1, t_enqueue=0.2, total_s=0.06))
    a = report.analyze(recs)
    assert a["exposure"]["source"] == "estimate"
    assert math.isclose(a["exposure"]["exposed_s"][0], 0.06)
    assert math.isclose(a["exposure"]["hidden_s"][0], 0.05)
    for x in recs:
        x["exposed_wait_s"] = 0.01
    a = report.analyze(recs)
    assert a["exposure"]["source"].startswith("records")
    assert math.isclose(a["exposure"]["exposed_s"][0], 0.02)
    assert math.isclose(a["exposure"]["hidden_s"][0], 0.09)
    # mixed: group 1 waited on through its future (null): its part is estimated
    for x in recs:
        if x["group_id"] == 1:
            x["exposed_wait_s"] = None
    a = report.analyze(recs)
    assert "estimate" in a["exposure"]["source"] and a["exposure"]["measured_ops"] == 2
    assert math.isclose(a["exposure"]["exposed_s"][0], 0.01 + 0.06)


def test_from_gathered():
    from xirang import report

    g = [[_rec(0, 1)], [_rec(1, 1)]]
    for lst in g:
        for x in lst:
            del x["group_rank"], x["global_rank"], x["pg"]
    flat = report.from_gathered(g, pg="world")
    assert [x["group_rank"] for x in flat] == [0, 1] and all(x["pg"] == "world" for x in flat)


def test_exporters_aggregate_once():
    from xirang import exporters

    recs = [_rec(0, 1, 0, total=0.01), _rec(0, 2, -1, total=0.02, ok=False)]
    fed = list(recs)
    agg = exporters.Aggregator(fetch=lambda: list(fed))
    assert len(agg.update()) == 2
    assert agg.update() == []  # nothing new: nothing counted twice
    fed.append(_rec(0, 3, 0, total=0.03))
    assert len(agg.update()) == 1
    s = agg.sums[("0", "allreduce_bf16_ef", "0")]
    assert s["ops"] == 2 and math.isclose(s["total_s"], 0.04) and s["bytes_wire"] == 8
    assert math.isclose(s["unattributed_s"], 0.04 - 2 * 0.007)
    assert agg.sums[("0", "all_reduce", "-")]["failed"] == 1

    class FakeWriter:
        def __init__(self):
            self.calls = []

        def add_scalar(self, tag, v, step):
            self.calls.append((tag, v, step))

    w = FakeWriter()
    fed2 = [_rec(0, 1, 0, total=0.01), _rec(0, 2, 0, total=0.03)]
    tb = exporters.TensorBoardExporter(writer=w, fetch=lambda: fed2)
    sc = tb.write(7)
    assert math.isclose(sc["xirang/group0/total_ms"], 20.0) and sc["xirang/ops"] == 2
    assert all(step == 7 for _, _, step in w.calls) and len(w.calls) == len(sc)
    assert tb.write(8) == {"xirang/ops": 0.0}


def test_prometheus_exporter():
    prom = pytest.importorskip("prometheus_client", reason="prometheus_client not installed (optional)")
    from xirang import exporters

    reg = prom.CollectorRegistry()
    exporters.start_prometheus(port=0, registry=reg, fetch=lambda: [_rec(0, 1, 2, total=0.5)])
    text = prom.generate_latest(reg).decode()
    assert 'xirang_ops_total{group="2",op="allreduce_bf16_ef",pg="0"} 1.0' in text
    assert 'phase="total"' in text


@pytest.mark.parametrize("port, env, match", [
    (-5, None, r"port must be an int in 0\.\.65535 \(0: no HTTP server\), got -5"),
    (70000, None, "got 70000"),
    (True, None, "got True"),
    ("9100", None, "got '9100'"),
    (None, "abc", r"XIRANG_PROMETHEUS_PORT \('abc'\) and LOCAL_RANK \('0'\) must be integers"),
    (None, "65535", r"got 65536 \(XIRANG_PROMETHEUS_PORT 65535 \+ LOCAL_RANK 1\)"),
])
def test_prometheus_bad_ports_are_clear_errors(monkeypatch, port, env, match):
    """Found by a new user: 'abc' gave a bare int() error, 70000 an OverflowError from bind, -5 was
    silently taken as no server. Nothing is registered before the check."""
    prom = pytest.importorskip("prometheus_client", reason="prometheus_client not installed (optional)")
    from xirang import exporters

    if env is not None:
        monkeypatch.setenv("XIRANG_PROMETHEUS_PORT", env)
        monkeypatch.setenv("LOCAL_RANK", "1" if env == "65535" else "0")
    reg = prom.CollectorRegistry()
    with pytest.raises(ValueError, match=match):
        exporters.start_prometheus(port=port, registry=reg, fetch=lambda: [])
    assert list(reg._collector_to_names) == []


def test_prometheus_second_start_in_one_registry_raises():
    """Found by a new user: a second call registered a second collector, and every scrape then
    served each metric family twice (Prometheus rejects such a scrape)."""
    prom = pytest.importorskip("prometheus_client", reason="prometheus_client not installed (optional)")
    from xirang import exporters

    reg = prom.CollectorRegistry()
    exporters.start_prometheus(port=0, registry=reg, fetch=lambda: [_rec(0, 1, 2, total=0.5)])
    with pytest.raises(ValueError, match="already registered in this registry"):
        exporters.start_prometheus(port=0, registry=reg, fetch=lambda: [_rec(0, 1, 2, total=0.5)])
    text = prom.generate_latest(reg).decode()
    assert text.count("# TYPE xirang_ops_total counter") == 1, text
    other = prom.CollectorRegistry()  # another registry takes its own set
    exporters.start_prometheus(port=0, registry=other, fetch=lambda: [_rec(0, 1, 2, total=0.5)])
    assert 'xirang_ops_total{group="2",op="allreduce_bf16_ef",pg="0"} 1.0' in prom.generate_latest(other).decode()


def test_exporters_missing_packages_say_what_to_install(monkeypatch):
    import builtins

    from xirang import exporters

    real = builtins.__import__

    def fake(name, *a, **k):
        if name.startswith(("prometheus_client", "torch.utils.tensorboard")):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ImportError, match="pip install prometheus_client"):
        exporters.start_prometheus(port=0)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        exporters.TensorBoardExporter("/tmp/none")


# --- exporters: found by a new user (p2p records never counted, frozen after re-init, argument
# checks, write after close, port in use) ---


def w_exp_init(prefix, env=None):
    """Join a default xirang group through its own store prefix (so it can be created again)."""
    import torch.distributed as dist

    for k, v in (env or {}).items():
        os.environ[k] = v
    try:
        dist.init_process_group("xirang", store=dist.PrefixStore(prefix, W.store), rank=W.rank,
                                world_size=W.world_size, timeout=datetime.timedelta(seconds=30))
    finally:
        for k in env or {}:
            os.environ.pop(k, None)
    return True


def _exp_sums(agg):
    return {k: dict(v) for k, v in agg.sums.items()}


def w_exp_p2p():
    import torch
    import torch.distributed as dist

    import xirang
    from xirang import exporters

    agg = exporters.Aggregator()
    t = torch.ones(1000)
    peer = 1 - W.rank

    def p2p(n):
        if W.rank == 0:
            dist.send(torch.ones(n), peer)
        else:
            dist.recv(torch.empty(n), peer)

    dist.all_reduce(t)
    p2p(10)
    dist.all_reduce(t)
    dist.barrier()
    n1 = len(agg.update())
    p2p(25)
    dist.all_reduce(t)
    n2 = len(agg.update())
    n3 = len(agg.update())
    return {"n": [n1, n2, n3], "sums": _exp_sums(agg), "recs": xirang.stats(), "lost": getattr(agg, "lost", None)}


def w_exp_pg_label():
    import torch
    import torch.distributed as dist

    from xirang import exporters

    sub = dist.new_group([0, 1])
    world, other = exporters.Aggregator(), exporters.Aggregator(sub)
    dist.all_reduce(torch.ones(8))
    dist.all_reduce(torch.ones(8), group=sub)
    world.update()
    other.update()
    return {"world": sorted({k[0] for k in world.sums}), "sub": sorted({k[0] for k in other.sums}),
            "names": [dist.group.WORLD.group_name, sub.group_name]}


def w_exp_reinit():
    import torch
    import torch.distributed as dist

    import xirang
    from xirang import exporters

    agg = exporters.Aggregator()
    t = torch.ones(100)
    for _ in range(5):
        dist.all_reduce(t)
    n1 = len(agg.update())
    first = xirang.stats()
    dist.destroy_process_group()
    w_exp_init("exp_reinit_2")
    for _ in range(3):
        dist.all_reduce(t)
    n2 = len(agg.update())
    return {"n": [n1, n2], "sums": _exp_sums(agg), "first": first, "second": xirang.stats(),
            "lost": getattr(agg, "lost", None)}


def w_exp_wrap():
    """A group keeping 4 records: 3 ops read, then 10 ops between two reads, then 2 more."""
    import logging

    import torch
    import torch.distributed as dist

    import xirang
    from xirang import exporters

    msgs = []

    class H(logging.Handler):
        def emit(self, rec):
            msgs.append(rec.getMessage())

    h = H(level=logging.WARNING)
    logging.getLogger("xirang").addHandler(h)
    try:
        agg = exporters.Aggregator()
        t = torch.ones(100)
        out = {}
        for step, k in enumerate((3, 10, 2)):
            for _ in range(k):
                dist.all_reduce(t)
            out[f"n{step}"] = len(agg.update())
            out[f"lost{step}"] = getattr(agg, "lost", None)
            out[f"msgs{step}"] = list(msgs)
        out["ops"] = agg.sums[("0", "all_reduce", "-")]["ops"]
        out["built"] = xirang._backend_for(None).record_cost()["records"]
        out["kept"] = len(xirang.stats())
        return out
    finally:
        logging.getLogger("xirang").removeHandler(h)


def _exp_pool(fn, prefix, env=None):
    with mp_pool.Pool(2, "xirang", init=False, timeout_s=30) as pool:
        pool.run(w_exp_init, prefix, env, timeout=30)
        res = pool.run(fn, timeout=30)
        pool.run(w_destroy, timeout=30)
    return res


def _count(recs):
    """Per op: [records, bytes_wire, bytes_raw, total_s], counted here from the records."""
    out = {}
    for r in recs:
        c = out.setdefault(r["op"], [0, 0, 0, 0.0])
        c[0] += 1
        c[1] += r["bytes_wire"]
        c[2] += r["bytes_raw"]
        c[3] += r["total_s"]
    return out


def _check_sums(sums, recs):
    want = _count(recs)
    got = {op: [s["ops"], s["bytes_wire"], s["bytes_raw"], s["total_s"]] for (_, op, _), s in sums.items()}
    assert set(got) == set(want), (got, want)
    for op, w in want.items():
        assert got[op][:3] == w[:3], (op, got[op], w)
        assert math.isclose(got[op][3], w[3], rel_tol=1e-9, abs_tol=1e-12), (op, got[op], w)


def test_exporters_count_point_to_point_records():
    """Found by a new user: send/recv records carry seq 0 and the exporters (which kept only
    seq > the last seq) never counted them: 2 all_reduce + send/recv + barrier gave 3 ops."""
    res = _exp_pool(w_exp_p2p, "exp_p2p")
    for rank, r in enumerate(res):
        recs = r["recs"]
        p2p = "send" if rank == 0 else "recv"
        assert [x["op"] for x in recs].count(p2p) == 2 and all(x["seq"] == 0 for x in recs if x["op"] == p2p)
        assert len(recs) == 6, [(x["seq"], x["op"]) for x in recs]
        assert r["n"] == [4, 2, 0], r["n"]  # each record once, across reads
        _check_sums(r["sums"], recs)
        assert r["lost"] == 0
    sent = _count(res[0]["recs"])["send"]
    assert sent[1] == (10 + 25) * 4, sent  # the send's payload is in bytes_wire


def test_exporters_label_records_with_their_process_group():
    """Found by a review: records read from the backend carry no "pg" field, so every metric had
    pg="" whatever the group; each group's records now carry its c10d name."""
    res = _exp_pool(w_exp_pg_label, "exp_pglabel")
    for r in res:
        world, sub = r["names"]
        assert world == "0" and sub not in ("", world), r
        assert r["world"] == [world] and r["sub"] == [sub], r


def test_exporters_count_a_recreated_default_group():
    """Found by a new user: after destroy_process_group + init_process_group the new group's seq
    restarts at 1 and the exporters, waiting for a seq above the old group's last, froze."""
    res = _exp_pool(w_exp_reinit, "exp_reinit_1")
    for r in res:
        assert [x["seq"] for x in r["second"]] == [1, 2, 3]
        assert r["n"] == [5, 3], r["n"]
        _check_sums(r["sums"], r["first"] + r["second"])
        assert r["lost"] == 0


def test_exporters_say_how_many_records_left_the_ring():
    """A ring of XIRANG_STATS_CAPACITY=4 records and 10 ops between two reads: 6 cannot be counted,
    and a WARNING says so (once, with the number); what is still in the ring is counted once."""
    res = _exp_pool(w_exp_wrap, "exp_wrap", env={"XIRANG_STATS_CAPACITY": "4"})
    for r in res:
        assert r["built"] == 15 and r["kept"] == 4, r
        assert (r["n0"], r["n1"], r["n2"]) == (3, 4, 2), r
        assert (r["lost0"], r["lost1"], r["lost2"]) == (0, 6, 6), r
        assert r["ops"] + r["lost2"] == r["built"]
        assert r["msgs0"] == [] and len(r["msgs1"]) == 1 and r["msgs2"] == r["msgs1"], r
        assert "at least 6 operation records could not be counted" in r["msgs1"][0]
        assert "XIRANG_STATS_CAPACITY" in r["msgs1"][0]


def test_exporters_fed_records_count_seq0_and_a_seq_restart():
    """The same with records fed through fetch=: seq-0 records count, a restart from seq 1 too."""
    from xirang import exporters

    fed = [_rec(0, 1), _rec(0, 0, op="send", t_enqueue=0.15, bytes_wire=40), _rec(0, 2)]
    agg = exporters.Aggregator(fetch=lambda: list(fed))
    assert len(agg.update()) == 3
    fed.append(_rec(0, 0, op="send", t_enqueue=0.25, bytes_wire=60))
    assert [x["op"] for x in agg.update()] == ["send"]
    assert agg.update() == []
    fed[:] = [_rec(0, 1, t_enqueue=0.01, total=0.5), _rec(0, 2, t_enqueue=0.02, total=0.5)]  # a new group
    assert len(agg.update()) == 2
    send = agg.sums[("0", "send", "-")]
    assert send["ops"] == 2 and send["bytes_wire"] == 100
    assert agg.sums[("0", "all_reduce", "-")]["ops"] == 4


class _FakeWriter:
    def __init__(self):
        self.calls, self.closed = [], 0

    def add_scalar(self, tag, v, step):
        self.calls.append((tag, v, step))

    def close(self):
        self.closed += 1


@pytest.mark.parametrize("bad", ["notagroup", 0, object()])
def test_exporters_reject_a_bad_process_group(bad):
    """Found by a new user: process_group="notagroup" was accepted and write() failed later with
    an unclear TypeError. Checked at construction, before a writer or a metric exists."""
    from xirang import exporters

    with pytest.raises(TypeError, match=r"TensorBoardExporter: process_group must be None .* ProcessGroup, got"):
        exporters.TensorBoardExporter(writer=_FakeWriter(), process_group=bad)
    with pytest.raises(TypeError, match="TensorBoardExporter: process_group"):  # not the ImportError
        exporters.TensorBoardExporter("/nonexistent/xirang_tb", process_group=bad)
    with pytest.raises(TypeError, match="Aggregator: process_group"):
        exporters.Aggregator(process_group=bad)
    prom = pytest.importorskip("prometheus_client", reason="prometheus_client not installed (optional)")
    reg = prom.CollectorRegistry()
    with pytest.raises(TypeError, match="start_prometheus: process_group"):
        exporters.start_prometheus(port=0, registry=reg, process_group=bad)
    assert list(reg._collector_to_names) == []


def test_tensorboard_write_after_close_raises():
    """Found by a new user: write() after close() silently opened a second event file."""
    from xirang import exporters

    w = _FakeWriter()
    tb = exporters.TensorBoardExporter(writer=w, fetch=lambda: [_rec(0, 1)])
    assert tb.write(0)["xirang/ops"] == 1.0
    n = len(w.calls)
    tb.close()
    tb.close()  # a second close is fine
    with pytest.raises(RuntimeError, match=r"TensorBoardExporter.write: the exporter is closed"):
        tb.write(1)
    assert len(w.calls) == n and w.closed == 1


@pytest.mark.parametrize("from_env", [False, True])
def test_prometheus_port_in_use_names_it(monkeypatch, from_env):
    """Found by a new user: a port in use gave a bare '[Errno 98] Address already in use'."""
    import errno
    import socket

    prom = pytest.importorskip("prometheus_client", reason="prometheus_client not installed (optional)")
    from xirang import exporters

    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        reg = prom.CollectorRegistry()
        if from_env:
            monkeypatch.setenv("XIRANG_PROMETHEUS_PORT", str(port))
            monkeypatch.setenv("LOCAL_RANK", "0")
        with pytest.raises(OSError) as ei:
            exporters.start_prometheus(port=None if from_env else port, addr="127.0.0.1", registry=reg,
                                       fetch=lambda: [])
    finally:
        s.close()
    e = ei.value
    assert e.errno == errno.EADDRINUSE, e
    msg = str(e)
    assert f"cannot serve metrics on 127.0.0.1:{port}" in msg, msg
    if from_env:
        assert f"XIRANG_PROMETHEUS_PORT {port} + LOCAL_RANK 0" in msg and "set XIRANG_PROMETHEUS_PORT" in msg, msg
    else:
        assert "pass another port=" in msg, msg
    assert list(reg._collector_to_names) == []


def _report_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "xirang.report", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def _report_main(*args):
    """``xirang.report``'s main(args) in this process, as ``python -m xirang.report`` would end:
    the exit code (a SystemExit's text goes to stderr with code 1, as the interpreter does) and
    what it printed. No traceback is caught: an exception fails the test. For the parametrised
    cases, which would spend ~2 s each importing torch in a subprocess; the entry point itself
    runs as a subprocess in test_cli_errors_are_one_line and the others that use _report_cli."""
    import contextlib
    import io

    from xirang.report.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as e:
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
                rc = 1
            else:
                rc = e.code or 0
    return subprocess.CompletedProcess(["xirang.report", *args], rc, out.getvalue(), err.getvalue())


def test_cli_errors_are_one_line(tmp_path):
    """A missing input, an empty directory and an unwritable output: one line on stderr naming
    the path, a non-zero exit, no traceback (issue #15, item 16)."""
    missing = str(tmp_path / "nope")
    p = _report_cli(missing, "-o", str(tmp_path / "x.html"))
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines() == [f"xirang.report: cannot read {missing}: No such file or directory"]
    assert not (tmp_path / "x.html").exists()

    empty = tmp_path / "empty"
    empty.mkdir()
    p = _report_cli(str(empty), "-o", str(tmp_path / "x.html"))
    assert p.returncode != 0 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert f"no records in {empty}: no rank<N>.jsonl files" in p.stderr

    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(_rec(0, s)) + "\n" for s in (1, 2)))
    out = tmp_path / "no-such-dir" / "x.html"
    p = _report_cli(str(good), "-o", str(out))
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines() == [f"xirang.report: cannot write {out}: No such file or directory"]


@pytest.mark.parametrize("field, value, why", [
    ("seq", "abc", "field 'seq' is \"abc\", expected an integer"),
    ("global_rank", "zero", "field 'global_rank' is \"zero\", expected an integer"),
    ("total_s", float("nan"), "field 'total_s' holds a non-finite number"),
    ("total_s", float("inf"), "field 'total_s' holds a non-finite number"),
    ("total_s", "fast", "field 'total_s' is \"fast\", expected a number"),
    ("run_id", {"a": 1}, "field 'run_id' is {\"a\": 1}, expected text or an integer"),
    ("bytes_wire", True, "field 'bytes_wire' is true, expected an integer"),
    ("op", 5, "field 'op' is int, expected text"),
    # found by a new user: 1e308 made the sums infinite (the page then failed), 10^12 ranks a list
    # of 10^12, a negative duration a negative step time
    ("total_s", 1e308, "field 'total_s' holds a number beyond 1e+15 in magnitude"),
    ("total_s", -1.25, "field 'total_s' is -1.25, expected 0 to 1e+06"),
    ("world_size", 10 ** 12, "field 'world_size' is 1000000000000, expected 1 to 1.67772e+07"),
    ("global_rank", -3, "field 'global_rank' is -3, expected 0 to 1.67772e+07"),
    ("bytes_wire", -8, "field 'bytes_wire' is -8, expected 0 to 4.61169e+18"),
    ("seq", 10 ** 400, "field 'seq' holds a number beyond 1e+15 in magnitude"),
    ("peers", [{"peer": 1, "send_s": 1e300}], "field 'peers' holds a number beyond 1e+15 in magnitude"),
])
def test_records_with_fields_of_the_wrong_type_are_skipped(tmp_path, field, value, why):
    """A record that is JSON with an "op" but a field the analysis cannot use (found by a new user:
    each of these ended in a traceback) is skipped and counted like a garbage line; the others
    still make the report."""
    bad = dict(_rec(0, 2), **{field: value})
    f = tmp_path / "rank0.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in (_rec(0, 1), bad, _rec(0, 3))) + "\n")
    p = _report_main(str(f), "-o", str(tmp_path / "r.html"))
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert f"rank0.jsonl: 1 of 3 lines unreadable, skipped (line 2: {why})" in p.stderr, p.stderr
    only = tmp_path / "only.jsonl"
    only.write_text(json.dumps(bad) + "\n")
    p = _report_main(str(only), "-o", str(tmp_path / "o.html"))
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert f"no records in {only}: only.jsonl: 1 of 1 lines unreadable, skipped (line 2: {why})".replace(
        "line 2", "line 1") in p.stderr, p.stderr


@pytest.mark.parametrize("run", ["5", "-3", "1", "-2"])
def test_run_index_out_of_range_is_a_clear_error(tmp_path, run):
    f = tmp_path / "rank0.jsonl"
    f.write_text("".join(json.dumps(_rec(0, s)) + "\n" for s in (1, 2)))
    p = _report_main(str(f), "-o", str(tmp_path / "r.html"), "--run", run)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines() == [f"xirang.report: no run {run!r}; runs: (no run id)"], p.stderr
    p = _report_main(str(f), "-o", str(tmp_path / "r.html"), "--run", "0")
    assert p.returncode == 0, p.stderr


def test_a_missing_rank_file_is_named(tmp_path):
    """Found by a new user: a stats directory without rank2.jsonl (a rank on a host whose files
    were not copied) gave a report of 3 ranks out of 4 without a word."""
    from xirang.report.cli import build

    for rank in (0, 1, 3):
        (tmp_path / f"rank{rank}.jsonl").write_text(
            "".join(json.dumps(_rec(rank, s, world_size=4)) + "\n" for s in (1, 2)))
    _, _, warns = build(str(tmp_path))
    assert [w for w in warns if "no records from" in w] == [
        "no records from 1 of 4 ranks (2) in '(no run id)' (rank<N>.jsonl missing or empty): the figures "
        "cover the other ranks only"], warns
    big = tmp_path / "big"  # a world of 2^24 ranks, 3 present: named without a list of them all
    big.mkdir()
    (big / "rank0.jsonl").write_text("".join(json.dumps(_rec(r, 1, world_size=1 << 24)) + "\n" for r in (0, 1, 3)))
    assert [w for w in build(str(big))[2] if "no records from" in w] == [
        f"no records from {(1 << 24) - 3} of {1 << 24} ranks (2, 4, 5, 6, 7, 8, 9, 10, ...) in '(no run id)' "
        "(rank<N>.jsonl missing or empty): the figures cover the other ranks only"]
    (tmp_path / "rank2.jsonl").write_text(json.dumps(_rec(2, 1, world_size=4)) + "\n")
    assert not [w for w in build(str(tmp_path))[2] if "no records from" in w]
    # one rank's file given on its own: the other ranks are not expected
    assert not [w for w in build(str(tmp_path / "rank0.jsonl"))[2] if "no records from" in w]


def test_unreadable_lines_are_counted(tmp_path):
    """Garbage lines are counted per file ("3 of 10 lines unreadable") and the first ones named;
    a file of nothing but garbage says so in its one-line error."""
    from xirang import report

    r = {s: json.dumps(_rec(0, s)) for s in (1, 2, 4, 6, 7)}
    lines = [r[1],
             "",                # line 2: blank, neither a record nor unreadable
             r[2],
             "garbage",         # line 4: not JSON
             r[4],
             "[1, 2]",          # line 6: JSON, not an object
             r[6],
             '{"x": 1}',        # line 8: an object, not an operation record
             r[7],
             '{"op": "all_re']  # line 10: truncated (a rank killed mid-write)
    f = tmp_path / "rank0.jsonl"
    f.write_text("\n".join(lines))
    recs, warns = report.load_records(str(f))
    assert [r["seq"] for r in recs] == [1, 2, 4, 6, 7]
    assert len(warns) == 1, warns
    w = warns[0]
    assert w.startswith("rank0.jsonl: 4 of 9 lines unreadable"), w
    assert "line 4: Expecting value" in w and "line 6: not an operation record" in w, w
    assert "1 more" in w, w
    # Through the command line: the warning on stderr, the report still written.
    p = _report_cli(str(f), "-o", str(tmp_path / "r.html"))
    assert p.returncode == 0, p.stderr
    assert "xirang.report: rank0.jsonl: 4 of 9 lines unreadable" in p.stderr

    junk = tmp_path / "junk.jsonl"
    junk.write_bytes(b"hello\nworld\n\xff\xfe\x00binary\n")
    p = _report_cli(str(junk), "-o", str(tmp_path / "j.html"))
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and f"no records in {junk}: junk.jsonl: 3 of 3 lines unreadable" in err[0], err
