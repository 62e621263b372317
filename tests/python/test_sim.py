"""xirang.sim: closed forms, the backend's own ring schedule, the timeline, and every CLI mode's JSON."""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import subprocess
import sys

import pytest

from xirang import sim
from xirang.sim import Cluster, Compute, Config, Model, RingSet, Sim

C = pytest.importorskip("xirang._C")


def small_sim(gpus=16, gph=4, hpr=4, placement="packed", tp=1, pp=1, **kw):
    cl = Cluster(gpus=gpus, gpus_per_host=gph, hosts_per_rack=hpr, placement=placement, **kw)
    return Sim(Model(layers=8, hidden=256, extra_params=1000, tp=tp, pp=pp), cl, Compute(fwd_s=0.05, bwd_s=0.1))


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8, 64])
@pytest.mark.parametrize("bw", [1e9, 12.5e9])
def test_ring_zero_latency_is_bandwidth_term(n, bw):
    numel = n * 1_000_003
    S = numel * 4
    assert sim.ring_time(numel, n, 4, 0.0, bw) == pytest.approx(2 * (n - 1) / n * S / bw, rel=1e-12)
    # same through the contention model: n GPUs in one host, one edge class
    cl = Cluster(gpus=n, gpus_per_host=n, hosts_per_rack=1, host_GBps=bw / 1e9, host_alpha_us=0.0)
    rs = RingSet([list(range(n))], cl)
    assert rs.time(numel, 4) == pytest.approx(2 * (n - 1) / n * S / bw, rel=1e-12)
    # latency adds exactly 2(n-1) alpha
    assert sim.ring_time(numel, n, 4, 1e-5, bw) - sim.ring_time(numel, n, 4, 0.0, bw) == pytest.approx(2 * (n - 1) * 1e-5)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 13, 64])
@pytest.mark.parametrize("numel", [0, 1, 3, 10, 1000, 1001, 65537, 10**9 + 7])
def test_bytes_match_backend_ring_replay(n, numel):
    replay = C.ring_allreduce_elements_sent(numel, n)
    assert sim.ring_elements_sent(numel, n) == list(replay)
    assert sum(replay) == 2 * (n - 1) * numel
    if n > 1:  # every edge crosses a rack: cross-rack bytes = the replay's bytes x element size
        cl = Cluster(gpus=n, gpus_per_host=1, hosts_per_rack=1)
        for es in (4, 2):
            assert RingSet([list(range(n))], cl).xrack_bytes(numel, es) == sum(replay) * es


def test_topology_ring_matches_backend_order_and_crosses_each_rack_once():
    cl = Cluster(gpus=64, gpus_per_host=2, hosts_per_rack=4, placement="random", seed=3)
    s = Sim(Model(layers=4, hidden=64, extra_params=0), cl, Compute())
    slots = s.groups[0]
    labels = [(r, f"h{cl.where(x)[1]:04d}", f"r{cl.where(x)[0]:03d}") for r, x in enumerate(slots)]
    order = [slots[r] for r in C.ring_order(labels, True)]
    assert order == sorted(slots, key=cl.where)
    topo, naive = s._ring_plan(True), s._ring_plan(False)
    assert len(topo.xrack_pos) == 64 // 8  # one crossing per rack
    assert len(naive.xrack_pos) > len(topo.xrack_pos)
    assert topo.xrack_bytes(10**6, 4) < naive.xrack_bytes(10**6, 4)


@pytest.mark.parametrize("numel", [4096 * 16, 10**6 + 3])
def test_two_level_equals_formula(numel):
    s = small_sim(gpus=16, gph=4, hpr=4, launch_us=0.0)  # 4 hosts of 4 GPUs in one rack
    t, xb = s.allreduce(numel, Config(two_level=True, topo=True))
    L = s.cl.links()
    (a_l, b_l), (a_x, b_x) = L["host"], L["rack"]
    assert t == pytest.approx(sim.two_level_time(numel, 4, 4, 4, a_l, b_l, a_x, b_x), rel=1e-12)
    part = math.ceil(numel / 4)
    manual = 2 * 3 * (a_l + part * 4 / b_l) + 2 * 3 * (a_x + math.ceil(part / 4) * 4 / b_x)
    assert t == pytest.approx(manual, rel=1e-12)
    assert xb == 0.0


def test_uplink_oversubscription_slows_cross_rack_ring():
    kw = dict(gpus=16, gph=1, hpr=4, placement="interleaved")
    fast, slow = small_sim(oversub=1.0, **kw), small_sim(oversub=8.0, **kw)
    cfg = Config()
    assert slow.allreduce(10**7, cfg)[0] > fast.allreduce(10**7, cfg)[0]
    # a topology-aware ring over packed racks: 1 flow per rack uplink of 4 NICs / 8 -> half a NIC
    t, _ = slow.allreduce(16 * 10**6, Config(topo=True))
    uplink = 4 * slow.cl.xrack_Gbps * 1e9 / 8 / 8.0
    assert t == pytest.approx(sim.ring_time(16 * 10**6, 16, 4, slow.cl.xrack_alpha_us * 1e-6, uplink), rel=1e-12)


@pytest.mark.parametrize("opts", [(), ("bucketing",), ("bf16",), ("topo", "two_level"), sim.OPTS])
@pytest.mark.parametrize("gpus,tp,pp", [(8, 1, 1), (64, 1, 1), (128, 8, 4), (256, 2, 2)])
def test_overlap_never_slower_than_compute_and_exposed_le_total(opts, gpus, tp, pp):
    cl = Cluster(gpus=gpus)
    m = Model(layers=32, hidden=1024, extra_params=5e7, tp=tp, pp=pp)
    for comp in (Compute(0.05, 0.1), Compute(0.5, 1.0, opt_s=0.01, microbatches=4), Compute(0.001, 0.002)):
        s = Sim(m, cl, comp)
        compute = comp.fwd_s + comp.bwd_s + comp.opt_s
        for group in (1, 3, 8):
            on = s.run(Config.of(set(opts) | {"overlap"}, group=group))
            off = s.run(Config.of(set(opts) - {"overlap"}, group=group))
            for r in (on, off):
                assert r["step_s"] >= compute - 1e-12
                assert 0 <= r["exposed_comm_s"] <= r["total_comm_s"] + 1e-12
                assert r["step_s"] <= compute + r["total_comm_s"] + 1e-12
            if "bucketing" not in opts:  # same collectives, only launched earlier
                assert on["total_comm_s"] == pytest.approx(off["total_comm_s"])
                assert on["step_s"] <= off["step_s"] + 1e-12
            assert off["exposed_comm_s"] == pytest.approx(off["total_comm_s"])


def run_main(capsys, *argv):
    assert sim.main(list(argv)) == 0
    return capsys.readouterr().out


def test_json_every_mode(capsys, tmp_path):
    single = json.loads(run_main(capsys, "--json", "--all", "--gpus", "64"))
    assert single["result"]["dp"] == 64 and single["result"]["step_s"] > 0
    paper = json.loads(run_main(capsys, "--paper", "--json"))
    assert paper["rows"] and paper["assumed"]
    rec = json.loads(run_main(capsys, "--recommend", "--json", "--model", "gpt3-1.3b"))
    assert [r["gpus"] for r in rec["rows"]] == [8, 16, 32, 64, 128, 256, 512, 1024]
    f = tmp_path / "ar.json"
    f.write_text(json.dumps([{"backend": "xirang", "ws": 2, "bytes": 2**k, "time_us": 50 + 2**k / 1e3} for k in range(20, 25)]))
    cal = json.loads(run_main(capsys, "--calibrate", str(f), "--json"))
    assert cal["rows"] and cal["alpha_us"] >= 0
    for argv in (["--all"], ["--paper"], ["--recommend", "--model", "gpt3-1.3b"], ["--calibrate", str(f)]):
        assert run_main(capsys, *argv).strip()  # the table modes print something


def test_module_entry_point_json():
    p = subprocess.run([sys.executable, "-m", "xirang.sim", "--json", "--gpus", "16", "--overlap"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["result"]["config"] == "overlap"


def test_paper_flags_inconsistent_claims():
    a = argparse_defaults("--paper")
    d = sim.paper(a)
    bad = set(d["inconsistent"])
    assert {"allreduce, 8 GPUs in one rack", "allreduce, 128 GPUs across racks", "layer groups",
            "all combined, 128 GPUs: step", "all combined, 128 GPUs: throughput"} <= bad
    rows = {r["claim"]: r for r in d["rows"]}
    assert "96 layers / 8 = 12 groups, not 24" in rows["layer groups"]["check"]
    assert "+23%" in rows["all combined, 128 GPUs: throughput"]["check"]
    assert "79x" in rows["allreduce, 128 GPUs across racks"]["check"]
    assert not rows["BF16 + error feedback"]["inconsistent"]
    # literal reading: 700 GB fp32 over 128 GPUs at 100 Gbit/s is ~111 s, nowhere near 1.4 s
    assert rows["allreduce, 128 GPUs across racks"]["sim_literal"] == pytest.approx(2 * 127 / 128 * 698.4e9 / 12.5e9, rel=0.02)
    assert rows["BF16 + error feedback"]["sim_literal"] == pytest.approx(-50.0)


def test_paper_separates_consistency_from_reproduction(capsys):
    """--paper names the publication, gives every figure two verdicts, and never marks a figure the
    model does not reproduce as fine (issue #15, item 17: "[ok]" beside +12% published, +1062% simulated)."""
    d = json.loads(run_main(capsys, "--paper", "--json"))
    assert "platform report on training a 175B-parameter model on 128 GPUs" in d["publication"]
    tol = sim.REPRODUCE_TOL
    assert "25%" in d["tolerance"] and tol == 0.25

    def close(pub, got):  # the stated rule, re-derived here: within tol x |published|, every end of a pair
        if isinstance(pub, list):
            return all(close(p, g) for p, g in zip(pub, got))
        return abs(got - pub) <= tol * abs(pub)

    rows = {r["claim"]: r for r in d["rows"]}
    for r in d["rows"]:
        assert r["consistent"] in (True, False, None) and r["inconsistent"] == (r["consistent"] is False)
        pub = r["published_value"]
        for reading, got in r["simulated_value"].items():
            want = None if pub is None or got is None else close(pub, got)
            assert r["reproduced_by"][reading] == want, (r["claim"], reading, pub, got)
        per = [v for v in r["reproduced_by"].values() if v is not None]
        assert r["reproduced"] == (any(per) if per else None), r["claim"]
    # the figure of the issue: published +12%, simulated +1062% (literal) / +59% (sharded)
    r64 = rows["all combined, 64 GPUs: throughput"]
    assert r64["published_value"] == 12.0 and r64["reproduced"] is False
    assert r64["simulated_value"]["literal"] > 1000 and r64["simulated_value"]["literal"] == r64["sim_literal"]
    assert rows["BF16 + error feedback"]["reproduced"] is True          # -50% either way
    assert rows["allreduce, 128 GPUs across racks"]["reproduced"] is False  # 111 s / 10.6 s vs 1.4 s
    assert rows["layer groups"]["simulated_value"] == {"literal": 12, "sharded": 3}
    assert rows["rank failure"]["reproduced"] is None and rows["rank failure"]["consistent"] is None
    assert set(d["reproduced"]) == {c for c, r in rows.items() if r["reproduced"]}
    assert set(d["not_reproduced"]) == {c for c, r in rows.items() if r["reproduced"] is False}

    text = run_main(capsys, "--paper")
    assert text.startswith("Checking the published platform report on training a 175B-parameter model on 128 GPUs")
    assert "[ok" not in text and " ok]" not in text
    tags = {}
    for line in text.splitlines():
        if line.startswith("[") and "] " in line:
            tag, claim = line[1:].split("] ", 1)
            tags[claim] = tag
    assert set(tags) == set(rows)
    for c, r in rows.items():
        cons, rep = tags[c].split(" | ")
        assert cons == {True: "consistent", False: "INCONSISTENT", None: "unchecked"}[r["consistent"]], c
        assert rep == {True: "reproduced", False: "NOT REPRODUCED", None: "not simulated"}[r["reproduced"]], c
    assert tags["all combined, 64 GPUs: throughput"] == "unchecked | NOT REPRODUCED"


def _parser_of(main, argv=()):
    """The argparse parser `main` builds (stopped at parse_args, nothing runs)."""
    import argparse

    class Got(Exception):
        pass

    seen = []
    orig = argparse.ArgumentParser.parse_args

    def grab(self, *a, **k):
        seen.append(self)
        raise Got

    argparse.ArgumentParser.parse_args = grab
    try:
        with pytest.raises(Got):
            main(list(argv))
    finally:
        argparse.ArgumentParser.parse_args = orig
    return seen[0]


@pytest.mark.parametrize("module", ["xirang.sim", "xirang.report", "xirang.env"])
def test_every_cli_option_has_help(module):
    """Every option of `python -m xirang.sim / .report / .env` says what it does in --help."""
    import argparse
    import importlib

    p = _parser_of(importlib.import_module(module).main)
    actions = [a for a in p._actions if not isinstance(a, argparse._HelpAction)]
    assert actions
    missing = [a.option_strings[0] if a.option_strings else a.dest for a in actions
               if not a.help or a.help == argparse.SUPPRESS or not a.help.strip()]
    assert not missing, f"{module}: options without help: {missing}"
    p.format_help()  # every help string formats (a stray % would raise here)


def argparse_defaults(*argv):
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--paper", action="store_true")
    sim.add_args(p)
    return p.parse_args(list(argv))


def test_calibrate_recovers_alpha_beta(tmp_path):
    alpha, beta = 30e-6, 1 / 2e9
    rows = [{"backend": "xirang", "world_size": n, "size_bytes": S, "median_us": 1e6 * sim.predict(alpha, beta, n, S)}
            for n in (2, 3, 4) for S in (2**20, 2**22, 2**24)]
    rows.append({"backend": "gloo", "ws": 2, "bytes": 2**20, "time_us": 1.0})  # ignored: other backend
    f = tmp_path / "ar.json"
    f.write_text(json.dumps({"results": rows}))
    d = sim.calibrate(str(f))
    assert d["alpha_us"] == pytest.approx(30.0, rel=1e-6)
    assert d["bandwidth_GBps"] == pytest.approx(2.0, rel=1e-6)
    assert all(abs(r["error_pct"]) < 1e-6 for r in d["rows"])


# ----------------------------------------------------------------------------------- CPU cost shared by ranks (#9)
@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("S", [2**20, 10**7 + 4])
def test_cpu_share_reduces_to_alpha_beta_when_cores_suffice(n, S):
    alpha, beta = 40e-6, 1e-9
    for cores in (None, 0, n, n + 1, 64):
        assert sim.cpu_share(n, cores) == 1.0
        assert sim.predict(alpha, beta, n, S, cores) == sim.predict(alpha, beta, n, S)
    for cores in (1, 2):
        if n > cores:  # ranks beyond the cores take turns: exactly n / cores times as long
            assert sim.predict(alpha, beta, n, S, cores) == pytest.approx(n / cores * sim.predict(alpha, beta, n, S))


@pytest.mark.parametrize("n", [2, 3, 4, 7])
@pytest.mark.parametrize("cores", [None, 1, 2, 4, 16])
def test_loopback_ringset_equals_predict(n, cores):
    alpha, beta, numel = 30e-6, 0.8e-9, n * 250_001
    cl = sim.loopback_cluster(n, alpha, beta, cores)
    t = RingSet([list(range(n))], cl).time(numel, 4)
    assert t == pytest.approx(sim.predict(alpha, beta, n, numel * 4, cores), rel=1e-12)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_cpu_term_off_or_faster_than_links_leaves_model_unchanged(n):
    numel = n * 1_000_003
    base = Cluster(gpus=n, gpus_per_host=n, hosts_per_rack=1, host_GBps=10.0, host_alpha_us=7.0)
    t0 = RingSet([list(range(n))], base).time(numel, 4)
    assert t0 == pytest.approx(sim.ring_time(numel, n, 4, 7e-6, 10e9), rel=1e-12)
    for kw in (dict(cpu_GBps=0.0, cores_per_host=1),  # not modelled
               dict(cpu_GBps=20.0, cores_per_host=n),  # a core per rank, CPU faster than the link
               dict(cpu_GBps=20.0 * n, cores_per_host=1)):  # shared, but still faster than the link
        cl = dataclasses.replace(base, **kw)
        assert RingSet([list(range(n))], cl).time(numel, 4) == pytest.approx(t0, rel=1e-12)
    # the CPU slower than the link: each step pays chunk / cpu x share instead of chunk / link
    cl = dataclasses.replace(base, cpu_GBps=1.0, cores_per_host=2)
    chunk = numel // n * 4
    assert RingSet([list(range(n))], cl).time(numel, 4) == pytest.approx(
        2 * (n - 1) * (7e-6 + chunk * max(1, n / 2) / 1e9), rel=1e-12)
    assert sim.ring_time(numel, n, 4, 7e-6, 10e9, max(1, n / 2) / 1e9) == pytest.approx(
        RingSet([list(range(n))], cl).time(numel, 4), rel=1e-12)


def test_cpu_share_per_host_or_machine():
    # 8 ranks on 4 hosts of 2; 2 cores per host: no sharing; all hosts on one 2-core machine: 4x
    per_host = Cluster(gpus=8, gpus_per_host=2, hosts_per_rack=2, cpu_GBps=1.0, cores_per_host=2)
    shared = dataclasses.replace(per_host, shared_cpu=True)
    assert per_host.cpu_s_per_byte(range(8)) == pytest.approx(1e-9)
    assert shared.cpu_s_per_byte(range(8)) == pytest.approx(4e-9)
    assert dataclasses.replace(per_host, cores_per_host=1).cpu_s_per_byte(range(8)) == pytest.approx(2e-9)


def test_fit_with_cores_recovers_alpha_beta():
    alpha, beta = 25e-6, 0.5e-9
    rows = [(n, S, sim.predict(alpha, beta, n, S, 2)) for n in (2, 3, 4) for S in (2**20, 2**22, 2**24)]
    a, b = sim.fit(rows, 2)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)
    # at WS=2 on >= 2 cores the share is 1: the fit is the plain one
    two = [r for r in rows if r[0] == 2]
    assert sim.fit(two, 2) == pytest.approx(sim.fit(two))


def test_explicit_rank_slots():
    cl = Cluster(gpus=4, gpus_per_host=2, hosts_per_rack=1, rank_slots=(0, 2, 1, 3))
    assert cl.slot_of_rank() == [0, 2, 1, 3]
    with pytest.raises(ValueError):
        Cluster(gpus=4, gpus_per_host=2, rank_slots=(0, 0, 1, 2)).slot_of_rank()


def _sim_check():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "sim_check.py"
    spec = importlib.util.spec_from_file_location("sim_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_emulated_cluster_model_matches_backend_rings_and_bytes():
    sc = _sim_check()
    args = {"racks": 2, "hosts_per_rack": 2, "ranks_per_host": 2, "placement": "roundrobin", "rate": "200mbit",
            "delay": "1ms"}
    s, par = sc.emulated_sim(args, {}, 50e-6, 1e-9, 2, sim)
    rank_of = {x: r for r, x in enumerate(par["slots"])}
    # benchmarks/topology.py's rings on this placement (the backend's ring_order)
    assert [rank_of[x] for x in s._ring_plan(False).rings[0]] == list(range(8))
    assert [rank_of[x] for x in s._ring_plan(True).rings[0]] == [0, 4, 2, 6, 1, 5, 3, 7]
    assert par["uplink_MBps"] == pytest.approx(25.0) and par["delay_ms"] == pytest.approx(1.0)
    numel = 2**20 // 4
    xb = {k: s.allreduce(numel, Config(**sc.CONFIGS[k]))[1] for k in sc.CONFIGS}
    # the backend's bytes_cross_rack summed over ranks (README topology table, 1 MiB): 14.7 / 3.7 / 3.1 MB
    assert xb["rank-ring"] == 2 * 7 * numel * 4 and xb["rank-ring"] / 1e6 == pytest.approx(14.7, abs=0.05)
    assert xb["topo-ring"] / 1e6 == pytest.approx(3.7, abs=0.05)
    assert xb["two-level"] / 1e6 == pytest.approx(3.1, abs=0.05)
    t = {k: s.allreduce(numel, Config(**sc.CONFIGS[k]))[0] for k in sc.CONFIGS}
    assert t["gloo"] == t["rank-ring"] and t["two-level"] < t["topo-ring"] < t["rank-ring"]
    # rank-order ring: 4 flows leave each 200 Mbit/s rack uplink, each step one chunk of S/8
    assert t["rank-ring"] == pytest.approx(14 * (50e-6 + 1e-3 + numel * 4 / 8 / (25e6 / 4)), rel=1e-9)


def test_ordering_verdict_ties_and_mismatch():
    sc = _sim_check()
    ok, notes = sc.verdict({"a": 1.0, "b": 1.05, "c": 3.0}, {"a": 2.0, "b": 1.0, "c": 4.0}, 0.10)
    assert ok and any("tie" in x for x in notes)
    ok, notes = sc.verdict({"a": 1.0, "c": 3.0}, {"a": 4.0, "c": 3.0}, 0.10)
    assert not ok and "MISMATCH" in notes[0]


def test_calibrate_cli_cores(capsys, tmp_path):
    alpha, beta = 30e-6, 1e-9
    f = tmp_path / "ar.json"
    f.write_text(json.dumps([{"backend": "xirang", "ws": n, "bytes": S, "time_us": 1e6 * sim.predict(alpha, beta, n, S, 2)}
                             for n in (2, 4) for S in (2**20, 2**24)]))
    d = json.loads(run_main(capsys, "--calibrate", str(f), "--cores", "2", "--json"))
    assert d["cores"] == 2 and d["alpha_us"] == pytest.approx(30.0, rel=1e-6)
    assert all(abs(r["error_pct"]) < 1e-6 for r in d["rows"])
    plain = json.loads(run_main(capsys, "--calibrate", str(f), "--cores", "0", "--json"))
    assert plain["cores"] is None and max(abs(r["error_pct"]) for r in plain["rows"]) > 1


# ----------------------------------------------------------------------------------- inputs and files (#9)
def test_calibrate_reads_allreduce_benchmark_output(tmp_path):
    """--calibrate on what benchmarks/allreduce.py --json really writes (the time under the backend's
    name): every row read back equals the file's own numbers, for xirang and for gloo."""
    out = tmp_path / "ar.json"
    bench = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "allreduce.py"
    p = subprocess.run([sys.executable, str(bench), "--ws", "2", "--sizes", "1M-4M", "--reps", "3", "--warmup", "1",
                        "--iters", "2", "--no-ceiling", "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    doc = json.loads(out.read_text())
    raw = doc["rows"]
    assert len(raw) >= 2
    # The file as the benchmark wrote it, except each time: on 2 shared, loaded cores 4 MiB can
    # take less time than 1 MiB (a negative beta, which calibrate rightly rejects), and the fit is
    # not what this test is about. Times from 50 us + 1 ns/B, at each row's own place in the file.
    for r in raw:
        for backend in ("xirang", "gloo"):
            r[backend]["time_us"] = 50.0 + 1e-3 * r["bytes"] * (1.0 + 0.01 * r["ws"])
    out.write_text(json.dumps(doc))
    for backend in ("xirang", "gloo"):
        d = sim.calibrate(str(out), backend, cores=2)
        got = {(r["ws"], r["bytes"]): r["measured_s"] for r in d["rows"]}
        # xirang rows that ran the direct exchange instead of the ring are left out of the ring fit
        want = {(r["ws"], float(r["bytes"])): r[backend]["time_us"] * 1e-6 for r in raw
                if r.get(f"{backend}_rank0", {}).get("algorithm", "ring") == "ring"}
        assert len(want) >= 2
        assert got == pytest.approx(want, rel=1e-12)
        assert d["alpha_us"] >= 0 and d["beta_s_per_byte"] > 0


BAD_ARGS = [
    (["--gpus", "0"], "--gpus"), (["--gpus", "-8"], "--gpus"), (["--tp", "0"], "--tp"), (["--pp", "-1"], "--pp"),
    (["--layers", "0"], "--layers"), (["--params=-1e9"], "--params"), (["--params", "1"], "--params"),
    (["--overlap", "--group", "0"], "--group"), (["--launch-us=-1"], "--launch-us"), (["--mfu", "0"], "--mfu"),
    (["--mfu", "1.5"], "--mfu"), (["--bwd-layer-ms", "0"], "--bwd-layer-ms"), (["--opt-ms=-5"], "--opt-ms"),
    (["--xrack-gbitps", "0"], "--xrack-gbitps"), (["--xrack-gbitps", "nan"], "--xrack-gbitps"),
    (["--oversub=-4"], "--oversub"), (["--host-gbyteps", "inf"], "--host-gbyteps"),
    (["--microbatches", "0"], "--microbatches"), (["--tokens-per-gpu", "0"], "--tokens-per-gpu"),
    (["--gpus", "16", "--tp", "3"], "tp x pp"), (["--gpus", "12"], "whole hosts"),
    (["--gpus", "80", "--pp", "5"], "pp (5)"), (["--model", "gpt3-1.3b", "--gpus", "256", "--pp", "128"], "pp (128)"),
    (["--paper", "--tp", "3"], "--paper"), (["--paper", "--tp", "64"], "--paper"),
    (["--recommend", "--tp", "3"], "--recommend"), (["--paper", "--gpus-per-host", "6"], "--paper, 8 GPUs"),
    (["--oversub", "1e308"], "--oversub must be <= 1000"), (["--params", "1e307"], "overflow"),
    (["--mfu", "1e-320"], "overflow"), (["--paper", "--oversub", "1e308"], "--oversub must be <= 1000"),
    # found by a new user: 0.5 gave the numbers of 1 (the hosts' links bound the traffic), silently
    (["--oversub", "0.5"], "--oversub must be >= 1"),
    # found by a new user: --recommend ignored --gpus
    (["--recommend", "--gpus", "16"], "--gpus does not apply"), (["--recommend", "--gpus=64"], "--gpus does not apply"),
    (["--gpus", "16777216"], "--gpus must be <= 1048576"), (["--layers", "1000000"], "--layers must be <= 100000"),
    (["--microbatches", "1000000"], "--microbatches must be <= 100000"),
]


@pytest.mark.parametrize("argv,names", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bad_settings_are_one_line_usage_errors(capsys, argv, names):
    with pytest.raises(SystemExit) as e:
        sim.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("python -m xirang.sim: error:") and names in last, err
    assert "Traceback" not in err


@pytest.mark.parametrize("content,why", [
    (None, "cannot read"), ("{not json", "cannot read"), ("42", "found 0"), ("[]", "found 0"),
    (json.dumps([{"ws": 2, "bytes": 2**20, "time_us": "abc"}, {"ws": 2, "bytes": 2**22, "time_us": float("nan")}]),
     "found 0"),
    (json.dumps([{"ws": 2, "bytes": b, "time_us": t} for b, t in ((4096, 50.0), (16384, 48.0), (65536, 47.0))]),
     "beta"),
    (json.dumps([{"ws": 2, "bytes": 2**20, "time_us": t} for t in (700.0, 710.0)]), "two message sizes"),
    (json.dumps([{"ws": 2, "bytes": b, "time_us": t} for b, t in ((1e6, 1000.0), (2e6, 1000.0001))]), "beta"),
    (json.dumps([{"ws": 2, "bytes": True, "time_us": 5.0}, {"ws": 2, "bytes": 2**20, "time_us": 500.0}]), "found 1"),
    (json.dumps([{"ws": 2, "bytes": b, "time_us": 1e-300} for b in (2**20, 2**22)]), "found 0"),
    (json.dumps([{"ws": 2, "bytes": b, "xirang": {"time_us": 50.0 + b / 1e3}, "xirang_rank0": {"algorithm": "direct"}}
                 for b in (2**20, 2**22)]), "found 0"),
    ("[" * 100000 + "]" * 100000, "cannot read"),
])
def test_calibrate_bad_files_are_one_line_errors(capsys, tmp_path, content, why):
    f = tmp_path / "m.json"
    if content is not None:
        f.write_text(content)
    with pytest.raises(SystemExit) as e:
        sim.main(["--calibrate", str(f)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and why in err.strip().splitlines()[-1] and "Traceback" not in err, err


def test_fit_never_returns_negative_alpha():
    """Times below the bandwidth line (a negative intercept): alpha is pinned to 0 and beta is the
    weighted least-squares slope through the origin, sum(w^2 x y) / sum(w^2 x^2), w = 1/y."""
    beta = 1e-9
    rows = [(2, S, beta * S - 20e-6) for S in (2**20, 2**22, 2**24)]
    alpha, b = sim.fit(rows)
    xs, ys = [S for _, S, _ in rows], [t for _, _, t in rows]
    want = sum(x * y / y**2 for x, y in zip(xs, ys)) / sum(x * x / y**2 for x, y in zip(xs, ys))
    assert alpha == 0.0 and b == pytest.approx(want, rel=1e-9)


def test_two_level_reported_only_where_it_applies(capsys):
    one_per_host = json.loads(run_main(capsys, "--json", "--gpus", "16", "--gpus-per-host", "1",
                                       "--hosts-per-rack", "1", "--two-level"))["result"]
    plain = json.loads(run_main(capsys, "--json", "--gpus", "16", "--gpus-per-host", "1", "--hosts-per-rack", "1"))
    assert one_per_host["two_level_applied"] is False
    assert one_per_host["step_s"] == plain["result"]["step_s"]
    assert json.loads(run_main(capsys, "--json", "--gpus", "16", "--two-level"))["result"]["two_level_applied"] is True


def test_paper_assumptions_follow_the_flags(capsys):
    argv = ["--paper", "--rack-gbitps", "400", "--oversub", "1", "--launch-us", "100", "--tp", "2", "--pp", "2"]
    d = json.loads(run_main(capsys, "--json", *argv))
    assert "400 Gbit/s" in d["assumed"]["cluster"] and "1:1" in d["assumed"]["cluster"]
    assert "100 us per launch" in d["assumed"]["latencies"]
    assert "DP = 16 at 64, DP = 32 at 128" in d["assumed"]["sharded reading"]
    assert "DP = 2 at 8" in d["assumed"]["sharded reading"]
    text = run_main(capsys, *argv)
    thr = next(r for r in d["rows"] if r["claim"] == "all combined, 128 GPUs: throughput")
    assert thr["unit"] == "%" and f"{thr['sim_literal']:+.1f}%" in text


def test_paper_without_cross_rack_traffic(capsys):
    """Packed placement: the baseline crosses no more racks than the topology ring; the topology row has
    no percentage to report (None), everything else still runs."""
    d = json.loads(run_main(capsys, "--paper", "--json", "--placement", "packed"))
    topo = next(r for r in d["rows"] if r["claim"] == "topology-aware ring")
    runs = d["runs"]["sharded"]["128"]
    # sharded (tp=8, pp=4, dp=4): a DP group is one GPU on each of 4 consecutive hosts = one rack
    assert runs["none"]["xrack_GB"] == 0 and topo["sim_sharded"] is None
    # literal: a DP group spans all 4 racks; packed hosts already put ring neighbours together
    assert d["runs"]["literal"]["128"]["none"]["xrack_GB"] > 0 and topo["sim_literal"] == pytest.approx(0.0)
    assert all(math.isfinite(r["step_s"]) for r in runs.values())


def test_sim_check_input_without_out_of_sample_points(tmp_path):
    """sim_check --input with WS=2 1-16 MiB rows only: it fits, says there is nothing out of sample, fails the goal."""
    f = tmp_path / "in.json"
    f.write_text(json.dumps([{"backend": "xirang", "ws": 2, "bytes": b, "time_us": 100 + b / 2e3}
                             for b in (2**20, 2**22, 2**24)]))
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "sim_check.py"
    p = subprocess.run([sys.executable, str(path), "--input", str(f)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "no out-of-sample point" in p.stdout and "FAIL" in p.stdout and "Traceback" not in p.stderr
