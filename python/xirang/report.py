"""Communication latency breakdown: a self-contained HTML dashboard from xirang's operation records.

    XIRANG_STATS_DIR=/tmp/xr torchrun ... train.py          # every rank appends rank<N>.jsonl
    python -m xirang.report /tmp/xr -o report.html           # dashboard + text summary on stdout
    python -m xirang.report /tmp/xr --json                   # the analysis as JSON on stdout

The page needs no network: the plotting code (a few hundred lines of SVG drawing) is inlined and
the data travel in ``<script type="application/json" id="xirang-data">`` (``records``: every
record of the run shown, as read; ``analysis``: what the plots show).

What is derived, and how
- Runs. Records are grouped by ``run_id``; without one, a new run starts in a rank's file when
  its sequence numbers start again (files are appended to). The last run is shown (``--run``).
- Steps. A step is one round of the hook's layer groups: on each rank, a step ends when a
  ``group_id`` comes again. Operations of other kinds between a step's first and last hook
  operation are counted in it as "other". Without hook records, each operation is one "step".
- Phases. Per operation: queued (waiting behind earlier operations; not part of ``total_s``),
  encode, scatter-reduce, allgather, decode, and "unattributed" = total_s minus those four
  (bookkeeping, copies, and in tests the XIRANG_TEST_DELAY_MS sleep). Per step and group the
  mean over ranks is plotted.
- Hottest group: the largest busy time (sum of ``total_s``, mean over ranks) over the run.
- Hidden vs exposed. A record whose ``exposed_wait_s`` is a number (how long the caller blocked
  in ``Work.wait()`` on it: synchronous collectives, ``work.wait()``) counts as measured. The
  others (null: nobody was blocked in ``Work.wait()`` when it completed, e.g. the hook's
  operations, which DDP waits on through their futures) are ESTIMATED, labelled as such on the
  page: per rank and step, exposed = how long their communication still ran after the last of
  them was enqueued (with the hook that is the last layer group's launch at the end of
  backward, after which DDP waits). Per rank and step, exposed = measured + estimated; hidden =
  busy time minus exposed. The estimate counts an async operation waited on only later as
  exposed; ``xirang.stats()`` (in memory) has its measured value once the wait has begun.
- Slowest rank: the rank with the largest NET WAIT INTRODUCED = seconds its receivers spent
  waiting on data from it (their ``peers[].recv_s`` for it) minus seconds it spent waiting on
  data from its own senders, summed over operations seen by every rank of their group. A late
  rank makes its ring successor wait, the successor then makes its own successor wait, and so
  on: every rank but the late one is both made to wait and makes the next one wait, which
  cancels, while the late one makes others wait without waiting itself (its inputs are already
  there when it starts). Raw wait alone would blame the successor, or tie along the ring.
- Slowest link: per link a -> b (a sends to b; in a ring, b is a's successor), transfer time =
  per operation min(a's ``send_s`` to b, b's ``recv_s`` from a). A slow link keeps both ends
  busy; a slow rank only one of them (its successor waits in recv, while the late rank's own
  sends go through quickly), so the min isolates the link. Each operation's transfer times are
  compared with that operation's median link (message sizes differ between operations):
  slowness = the median over operations of (time + 50 us) / (median link's time + 50 us), robust
  to one-off stalls such as the first operation's connection set-up; slowest = largest slowness.
"""
from __future__ import annotations

import argparse
import errno
import glob
import html
import json
import os
import re
import statistics
import sys
from typing import Any, Dict, Iterable, List, Optional, Tuple

PHASES = ("queued_s", "encode_s", "scatter_reduce_s", "allgather_s", "decode_s")
BUSY_PHASES = ("encode_s", "scatter_reduce_s", "allgather_s", "decode_s")
STACK = PHASES + ("unattributed_s",)
LINK_EPS_S = 50e-6  # added to link times before comparing them (timer and scheduling noise)
NOISE_RATIO = 1.5  # "slowest" is flagged as clear only when it beats the runner-up by this much


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------


def load_records(path: str) -> Tuple[List[dict], List[str]]:
    """Records from ``path`` (a directory of rank<N>.jsonl, or one .jsonl file), in file order
    (files sorted by rank number). Returns (records, warnings).

    A line that is not a JSON object with an ``"op"`` field (not JSON, a truncated last line,
    another program's log) is skipped and counted: one warning per file names how many of its
    lines were unreadable and the first few of them. Blank lines are ignored.
    Bytes that are not UTF-8 are read as U+FFFD (such a line is then usually unreadable JSON).
    Raises FileNotFoundError when ``path`` does not exist, OSError when a file cannot be read.
    """
    if os.path.isdir(path):
        files = glob.glob(os.path.join(path, "rank*.jsonl"))

        def key(f):
            m = re.search(r"rank(\d+)\.jsonl$", f)
            return (int(m.group(1)) if m else 1 << 30, f)

        files.sort(key=key)
    elif os.path.exists(path):
        files = [path]
    else:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    recs: List[dict] = []
    warns: List[str] = []
    for f in files:
        lines = 0
        bad: List[str] = []
        with open(f, encoding="utf-8", errors="replace") as fh:
            for i, line in enumerate(fh, 1):
                line = line.strip()
                if not line:
                    continue
                lines += 1
                try:
                    r = json.loads(line)
                except json.JSONDecodeError as e:
                    bad.append(f"line {i}: {e.msg}")
                    continue
                if not isinstance(r, dict) or "op" not in r:
                    bad.append(f"line {i}: not an operation record")
                    continue
                if "global_rank" not in r:
                    m = re.search(r"rank(\d+)\.jsonl$", f)
                    if m:
                        r["global_rank"] = int(m.group(1))
                recs.append(r)
        if bad:
            more = f"; {len(bad) - 3} more" if len(bad) > 3 else ""
            warns.append(f"{os.path.basename(f)}: {len(bad)} of {lines} lines unreadable, skipped "
                         f"({'; '.join(bad[:3])}{more})")
    return recs, warns


def from_gathered(per_rank: List[List[dict]], pg: str = "") -> List[dict]:
    """Flatten ``xirang.stats(gather=True)``'s result (index = group rank) into report records."""
    out = []
    ws = len(per_rank)
    for r, lst in enumerate(per_rank or []):
        for rec in lst or []:
            d = dict(rec)
            d.setdefault("group_rank", r)
            d.setdefault("global_rank", r)
            d.setdefault("world_size", ws)
            d.setdefault("pg", pg)
            d.setdefault("run_id", "")
            out.append(d)
    return out


def _rank_of(r: dict) -> int:
    v = r.get("global_rank")
    if v is None:
        v = r.get("group_rank", 0)
    return int(v)


def _grank(r: dict) -> int:
    v = r.get("group_rank")
    if v is None:
        v = r.get("global_rank", 0)
    return int(v)


def split_runs(records: List[dict]) -> List[Tuple[str, List[dict]]]:
    """[(run name, records)] in order of first appearance."""
    session: Dict[tuple, int] = {}
    last_seq: Dict[tuple, int] = {}
    runs: Dict[tuple, List[dict]] = {}
    for r in records:
        rid = r.get("run_id") or ""
        k = (_rank_of(r), rid, r.get("pg", ""))
        seq = int(r.get("seq", 0) or 0)
        if seq > 0:  # point-to-point sends carry seq 0
            if k in last_seq and seq <= last_seq[k]:
                session[k] = session.get(k, 0) + 1
            last_seq[k] = seq
        runs.setdefault((rid, session.get(k, 0)), []).append(r)
    out = []
    n_sessions: Dict[str, int] = {}
    for rid, s in runs:
        n_sessions[rid] = max(n_sessions.get(rid, 0), s + 1)
    for (rid, s), lst in runs.items():
        name = rid or "(no run id)"
        if n_sessions[rid] > 1:
            name += f" #{s + 1}"
        out.append((name, lst))
    return out


# ---------------------------------------------------------------------------------------------
# analysis
# ---------------------------------------------------------------------------------------------


def _f(r: dict, k: str) -> float:
    v = r.get(k)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def unattributed(r: dict) -> float:
    return max(0.0, _f(r, "total_s") - sum(_f(r, p) for p in BUSY_PHASES))


def _gkey(r: dict) -> str:
    gid = r.get("group_id", -1)
    if isinstance(gid, int) and gid >= 0:
        return f"group {gid}"
    return f"other: {r.get('op', '?')}"


def _mean(xs: Iterable[float]) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def _assign_steps(pg_recs: List[dict]) -> Tuple[str, Dict[int, int]]:
    """seq -> step index for one process group's records, and the mode ('hook' or 'ops')."""
    by_rank: Dict[int, List[dict]] = {}
    for r in pg_recs:
        if int(r.get("seq", 0) or 0) > 0:
            by_rank.setdefault(_grank(r), []).append(r)
    hook = any(isinstance(r.get("group_id"), int) and r["group_id"] >= 0 for r in pg_recs)
    seq_step: Dict[int, int] = {}
    if not hook:
        seqs = sorted({int(r["seq"]) for lst in by_rank.values() for r in lst})
        return "ops", {s: i for i, s in enumerate(seqs)}
    # The ranks issue the same sequence; take each seq's step from the first rank that has it.
    for rank in sorted(by_rank):
        lst = sorted(by_rank[rank], key=lambda r: int(r["seq"]))
        step, seen, spans = -1, set(), []
        for r in lst:
            gid = r.get("group_id", -1)
            if isinstance(gid, int) and gid >= 0:
                if step < 0 or gid in seen:
                    step += 1
                    seen = set()
                    spans.append([int(r["seq"]), int(r["seq"])])
                seen.add(gid)
                spans[step][1] = int(r["seq"])
        for r in lst:
            s = int(r["seq"])
            if s in seq_step:
                continue
            for i, (a, b) in enumerate(spans):
                if a <= s <= b:
                    seq_step[s] = i
                    break
    return "hook", seq_step


def analyze(records: List[dict], runs_available: Optional[List[str]] = None, run_name: str = "") -> Dict[str, Any]:
    """The dashboard's numbers for one run's records (see the module docstring)."""
    pgs: Dict[str, List[dict]] = {}
    for r in records:
        pgs.setdefault(r.get("pg", ""), []).append(r)
    # group rank -> global rank per pg
    gmap: Dict[str, Dict[int, int]] = {pg: {} for pg in pgs}
    for pg, lst in pgs.items():
        for r in lst:
            gmap[pg][_grank(r)] = _rank_of(r)
    hook_pgs = [pg for pg, lst in pgs.items()
                if any(isinstance(r.get("group_id"), int) and r["group_id"] >= 0 for r in lst)]
    primary = (max(hook_pgs, key=lambda p: len(pgs[p])) if hook_pgs
               else (max(pgs, key=lambda p: len(pgs[p])) if pgs else ""))
    prim = pgs.get(primary, [])
    mode, seq_step = _assign_steps(prim)
    n_steps = (max(seq_step.values()) + 1) if seq_step else 0
    ranks_primary = sorted({_grank(r) for r in prim})

    # ---- per step x group: mean over ranks of each stacked phase -----------------------------
    cell: Dict[Tuple[int, str], Dict[int, Dict[str, float]]] = {}
    labels: Dict[str, str] = {}
    bytes_g: Dict[str, Dict[str, float]] = {}
    order_g: Dict[str, float] = {}
    for r in prim:
        s = int(r.get("seq", 0) or 0)
        if s not in seq_step:
            continue
        st = seq_step[s]
        k = _gkey(r) if mode == "hook" else str(r.get("op", "?"))
        if r.get("label"):
            labels[k] = str(r["label"])
        d = cell.setdefault((st, k), {}).setdefault(_grank(r), {p: 0.0 for p in STACK + ("total_s",)})
        for p in PHASES:
            d[p] += _f(r, p)
        d["unattributed_s"] += unattributed(r)
        d["total_s"] += _f(r, "total_s")
        b = bytes_g.setdefault(k, {"raw": 0.0, "wire": 0.0, "cross_host": 0.0, "cross_rack": 0.0})
        b["raw"] += _f(r, "bytes_raw")
        b["wire"] += _f(r, "bytes_wire")
        b["cross_host"] += _f(r, "bytes_cross_host")
        b["cross_rack"] += _f(r, "bytes_cross_rack")
        gid = r.get("group_id", -1)
        order_g.setdefault(k, gid if isinstance(gid, int) and gid >= 0 else 1e9 + len(order_g))
    gkeys = sorted(order_g, key=lambda k: (order_g[k], k))
    groups = []
    for k in gkeys:
        per_step = {p: [] for p in STACK + ("total_s",)}
        for st in range(n_steps):
            c = cell.get((st, k), {})
            for p in per_step:
                per_step[p].append(_mean(v[p] for v in c.values()) if c else 0.0)
        busy = sum(per_step["total_s"])
        groups.append({
            "key": k, "label": labels.get(k, ""),
            "per_step": per_step,
            "busy_s": busy,
            "phase_s": {p: sum(per_step[p]) for p in STACK},
            "bytes_raw": bytes_g[k]["raw"], "bytes_wire": bytes_g[k]["wire"],
            "bytes_cross_host": bytes_g[k]["cross_host"], "bytes_cross_rack": bytes_g[k]["cross_rack"],
        })
    total_busy = sum(g["busy_s"] for g in groups) or 0.0
    for g in groups:
        g["share"] = g["busy_s"] / total_busy if total_busy > 0 else 0.0
    hot_pool = [g for g in groups if not g["key"].startswith("other")] or groups
    hottest = max(hot_pool, key=lambda g: g["busy_s"]) if hot_pool else None

    # ---- hidden vs exposed per step (mean over ranks) -----------------------------------------
    def measured(r: dict) -> bool:
        v = r.get("exposed_wait_s")
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0

    n_measured = sum(1 for r in prim if measured(r))
    exp_cells: Dict[int, Dict[int, List[dict]]] = {}
    for r in prim:
        s = int(r.get("seq", 0) or 0)
        if s in seq_step:
            exp_cells.setdefault(seq_step[s], {}).setdefault(_grank(r), []).append(r)
    exposed, hidden = [], []
    for st in range(n_steps):
        e_r, h_r = [], []
        for lst in exp_cells.get(st, {}).values():
            busy = sum(_f(r, "total_s") for r in lst)
            e = sum(_f(r, "exposed_wait_s") for r in lst if measured(r))
            est = [r for r in lst if not measured(r)]
            if est:
                last_enq = max(_f(r, "t_enqueue") for r in est)
                end = max(_f(r, "t_enqueue") + _f(r, "queued_s") + _f(r, "total_s") for r in est)
                e += max(0.0, end - last_enq)
            e_r.append(e)
            h_r.append(max(0.0, busy - e))
        exposed.append(_mean(e_r))
        hidden.append(_mean(h_r))
    est_note = ("exposed = communication still running after the step's last operation was "
                "enqueued; hidden = busy time - exposed")
    if n_measured == len(prim) and prim:
        source, note = "records (exposed_wait_s)", "exposed_wait_s from the records: how long the caller blocked"
    elif n_measured == 0:
        source, note = "estimate", "ESTIMATE (no record carries a caller's wait): " + est_note
    else:
        source = f"records (exposed_wait_s) for {n_measured} of {len(prim)} operations, estimate for the rest"
        note = ("exposed_wait_s where a caller blocked in Work.wait(); the rest (e.g. the hook's operations, "
                "waited on through futures) an ESTIMATE: " + est_note)
    exposure = {"source": source, "note": note, "measured_ops": n_measured, "exposed_s": exposed,
                "hidden_s": hidden}

    # ---- per rank / per link across ranks (every pg of the run) --------------------------------
    rank_stat: Dict[int, Dict[str, float]] = {}
    link_stat: Dict[Tuple[int, int], Dict[str, float]] = {}

    def rs(g: int) -> Dict[str, float]:
        return rank_stat.setdefault(g, {"ops": 0, "busy_s": 0.0, "queued_s": 0.0, "unattributed_s": 0.0,
                                        "waited_s": 0.0, "induced_s": 0.0, "bytes_wire": 0.0})

    n_matched = 0
    for pg, lst in pgs.items():
        m = gmap[pg]
        for r in lst:
            d = rs(m.get(_grank(r), _grank(r)))
            d["ops"] += 1
            d["busy_s"] += _f(r, "total_s")
            d["queued_s"] += _f(r, "queued_s")
            d["unattributed_s"] += unattributed(r)
            d["bytes_wire"] += _f(r, "bytes_wire")
        ws = max([int(r.get("world_size", 0) or 0) for r in lst] + [len(m)])
        by_op: Dict[int, Dict[int, dict]] = {}
        for r in lst:
            s = int(r.get("seq", 0) or 0)
            if s > 0:
                by_op.setdefault(s, {})[_grank(r)] = r
        for s, recs in by_op.items():
            if len(recs) < ws:
                continue  # some rank's record is missing (bounded buffer, file not there)
            n_matched += 1
            op_links: List[Tuple[Dict[str, float], float]] = []
            for q, r in recs.items():
                for p in r.get("peers") or []:
                    peer = int(p.get("peer", -1))
                    if peer not in recs:
                        continue
                    gq, gp = m.get(q, q), m.get(peer, peer)
                    if _f(p, "bytes_recv") > 0 or _f(p, "recv_s") > 0:
                        rs(gq)["waited_s"] += _f(p, "recv_s")
                        rs(gp)["induced_s"] += _f(p, "recv_s")
                    if _f(p, "bytes_sent") > 0:
                        back = next((x for x in recs[peer].get("peers") or [] if int(x.get("peer", -1)) == q), None)
                        recv_s = _f(back, "recv_s") if back else _f(p, "send_s")
                        L = link_stat.setdefault((gq, gp), {"bytes": 0.0, "send_s": 0.0, "recv_wait_s": 0.0,
                                                            "transfer_s": 0.0, "expected_s": 0.0,
                                                            "ops": 0})
                        L["bytes"] += _f(p, "bytes_sent")
                        L["send_s"] += _f(p, "send_s")
                        L["recv_wait_s"] += recv_s
                        t = min(_f(p, "send_s"), recv_s)
                        L["transfer_s"] += t
                        L["ops"] += 1
                        op_links.append((L, t))
            if op_links:
                # expected time of this op's transfers: the median link of the same op
                med = statistics.median(t for _, t in op_links)
                for L, t in op_links:
                    L["expected_s"] += med
                    L.setdefault("_ratios", []).append((t + LINK_EPS_S) / (med + LINK_EPS_S))
    ranks = []
    for g in sorted(rank_stat):
        d = dict(rank_stat[g])
        d["rank"] = g
        d["net_wait_introduced_s"] = d["induced_s"] - d["waited_s"]
        ranks.append(d)
    slowest_rank = None
    rank_clear = False
    if n_matched and len(ranks) > 1:
        srt = sorted(ranks, key=lambda d: d["net_wait_introduced_s"], reverse=True)
        if srt[0]["net_wait_introduced_s"] > 0:
            slowest_rank = srt[0]["rank"]
            second = max(0.0, srt[1]["net_wait_introduced_s"])
            spread = max(d["induced_s"] for d in ranks) or 1e-12
            rank_clear = (srt[0]["net_wait_introduced_s"] - second) > 0.25 * spread
    links = []
    for (a, b), L in sorted(link_stat.items()):
        d = dict(L)
        d["src"], d["dst"] = a, b
        d["throughput_Bps"] = d["bytes"] / d["transfer_s"] if d["transfer_s"] > 0 else None
        d["sec_per_MB"] = d["transfer_s"] / (d["bytes"] / 1e6) if d["bytes"] > 0 else 0.0
        # > 1: slower than the median link of the same operations (sizes differ between ops)
        ratios = d.pop("_ratios", [])
        d["slowness"] = statistics.median(ratios) if ratios else None
        links.append(d)
    slowest_link = None
    link_ratio = None
    cand = [d for d in links if d["bytes"] > 0 and d["slowness"] is not None]
    if cand:  # a link used by one or two operations only (a gather's) is weak evidence
        most = max(d["ops"] for d in cand)
        cand = [d for d in cand if d["ops"] >= min(3, most)]
    if cand:
        worst = max(cand, key=lambda d: d["slowness"])
        slowest_link = [worst["src"], worst["dst"]]
        link_ratio = worst["slowness"]

    raw = sum(_f(r, "bytes_raw") for r in records)
    wire = sum(_f(r, "bytes_wire") for r in records)
    res = {
        "version": 1,
        "run": {"name": run_name, "runs_available": runs_available or [run_name],
                "run_id": next((r.get("run_id") for r in records if r.get("run_id")), ""),
                "pgs": sorted(pgs), "primary_pg": primary, "records": len(records),
                "ranks": sorted(rank_stat), "world_size": len(ranks_primary),
                "matched_ops": n_matched},
        "mode": mode,
        "phases": list(STACK),
        "steps": n_steps,
        "groups": groups,
        "hottest_group": hottest["key"] if hottest else None,
        "exposure": exposure,
        "ranks": ranks,
        "slowest_rank": slowest_rank,
        "slowest_rank_clear": rank_clear,
        "links": links,
        "slowest_link": slowest_link,
        "slowest_link_ratio": link_ratio,
        "bytes": {"raw": raw, "wire": wire,
                  "cross_host": sum(_f(r, "bytes_cross_host") for r in records),
                  "cross_rack": sum(_f(r, "bytes_cross_rack") for r in records)},
        "failed_ops": sum(1 for r in records if r.get("ok") is False),
    }
    res["summary"] = summary_lines(res)
    return res


# ---------------------------------------------------------------------------------------------
# text
# ---------------------------------------------------------------------------------------------


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def _bytes(b: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= k:
            return f"{b / k:.2f} {unit}"
    return f"{b:.0f} B"


def summary_lines(a: Dict[str, Any]) -> List[str]:
    run = a["run"]
    what = f"{a['steps']} steps of the hook's groups" if a["mode"] == "hook" else f"{a['steps']} operations (no hook records)"
    out = [f"xirang report: run {run['name']!r}, {len(run['ranks'])} ranks, {run['records']} records, "
           f"{what} on group {run['primary_pg']!r}"]
    g = next((x for x in a["groups"] if x["key"] == a["hottest_group"]), None)
    if g:
        dom = max(STACK, key=lambda p: g["phase_s"][p])
        per = g["busy_s"] / max(1, a["steps"])
        lab = f" ({g['label']})" if g["label"] else ""
        out.append(f"hottest group: {g['key']}{lab}: {100 * g['share']:.1f}% of communication time, "
                   f"{_ms(per)} per step (mean over ranks); largest phase {dom[:-2]} "
                   f"({100 * g['phase_s'][dom] / max(1e-12, sum(g['phase_s'].values())):.0f}%)")
    if a["slowest_rank"] is not None:
        rk = {d["rank"]: d for d in a["ranks"]}
        d = rk[a["slowest_rank"]]
        others = sorted((x for x in a["ranks"] if x["rank"] != d["rank"]),
                        key=lambda x: x["net_wait_introduced_s"], reverse=True)
        nxt = f"; next rank {others[0]['rank']}: {_ms(others[0]['net_wait_introduced_s'])}" if others else ""
        out.append(f"slowest rank: {d['rank']}: net wait introduced {_ms(d['net_wait_introduced_s'])} "
                   f"(its receivers waited {_ms(d['induced_s'])} on it, it waited {_ms(d['waited_s'])})"
                   f"{nxt}" + ("" if a["slowest_rank_clear"] else " [within noise]"))
    else:
        out.append("slowest rank: none stands out (no rank made others wait more than it waited)")
    if a["slowest_link"] is not None:
        s, t = a["slowest_link"]
        L = next(x for x in a["links"] if x["src"] == s and x["dst"] == t)
        thr = f"{L['throughput_Bps'] / 1e9:.3f} GB/s" if L["throughput_Bps"] else "n/a"
        ratio = a["slowest_link_ratio"]
        rtxt = f", typically {ratio:.2f}x the median link of the same operation" if ratio else ""
        noise = "" if (ratio and ratio >= NOISE_RATIO) else " [within noise]"
        out.append(f"slowest link: {s} -> {t}: {thr} ({_bytes(L['bytes'])} in {_ms(L['transfer_s'])} "
                   f"of transfer{rtxt}){noise}")
    b = a["bytes"]
    ratio = f" ({b['wire'] / b['raw']:.2f} of raw)" if b["raw"] else ""
    out.append(f"bytes: raw {_bytes(b['raw'])}, on the wire {_bytes(b['wire'])}{ratio}, "
               f"cross-host {_bytes(b['cross_host'])}, cross-rack {_bytes(b['cross_rack'])}")
    e = a["exposure"]
    te, th = sum(e["exposed_s"]), sum(e["hidden_s"])
    if te + th > 0:
        out.append(f"exposed communication ({e['source']}): {_ms(te / max(1, a['steps']))} per step, "
                   f"hidden {_ms(th / max(1, a['steps']))} per step ({100 * th / (te + th):.0f}% hidden)")
    if a["failed_ops"]:
        out.append(f"failed operations: {a['failed_ops']}")
    return out


# ---------------------------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:20px;color:#222;max-width:1100px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px;border-bottom:1px solid #ddd}
pre#summary{background:#f5f5f5;padding:10px;white-space:pre-wrap}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}
th{background:#eee}td.l{text-align:left}tr.slow td{background:#fdd}
.note{color:#666;font-size:12px}.chart{margin:8px 0}
svg text{font-size:11px;fill:#333}
"""

_JS = r"""
(function(){
"use strict";
var status=document.getElementById('xirang-status');
window.addEventListener('error',function(e){status.setAttribute('data-state','error');
  status.textContent='script error: '+e.message;});
var D=JSON.parse(document.getElementById('xirang-data').textContent);
var A=D.analysis, NS='http://www.w3.org/2000/svg', charts=0;
var PAL=['#4e79a7','#f28e2b','#e15759','#76b7b2','#59a14f','#edc948','#b07aa1','#ff9da7','#9c755f','#bab0ac'];
function el(tag,attrs,parent){var e=document.createElementNS(NS,tag);
  for(var k in attrs)e.setAttribute(k,attrs[k]);if(parent)parent.appendChild(e);return e;}
function fmtS(v){var a=Math.abs(v);if(a>=1)return v.toFixed(2)+' s';if(a>=1e-3)return (v*1e3).toFixed(2)+' ms';return (v*1e6).toFixed(1)+' us';}
function fmtB(v){var u=[['GB',1e9],['MB',1e6],['kB',1e3]];for(var i=0;i<u.length;i++)if(v>=u[i][1])return (v/u[i][1]).toFixed(2)+' '+u[i][0];return v.toFixed(0)+' B';}
function nice(m){if(!(m>0))return 1;var p=Math.pow(10,Math.floor(Math.log10(m))),f=m/p;return (f<=1?1:f<=2?2:f<=5?5:10)*p;}
/* bar chart: o={title,cats,series:[{name,values,color}],stacked,highlight,fmt,ylabel} */
function bars(id,o){
  var host=document.getElementById(id);host.innerHTML='';
  var W=1000,H=300,ml=70,mr=160,mt=24,mb=50,pw=W-ml-mr,ph=H-mt-mb,n=o.cats.length;
  var svg=el('svg',{width:W,height:H,viewBox:'0 0 '+W+' '+H,role:'img'},host);
  el('text',{x:ml,y:14,'font-weight':'bold'},svg).textContent=o.title;
  var max=0;for(var i=0;i<n;i++){var s=0;o.series.forEach(function(se){var v=se.values[i]||0;s=o.stacked?s+v:Math.max(s,v);});max=Math.max(max,s);}
  max=nice(max*1.05);var fmt=o.fmt||fmtS;
  for(var t=0;t<=4;t++){var y=mt+ph-ph*t/4;el('line',{x1:ml,x2:ml+pw,y1:y,y2:y,stroke:'#e4e4e4'},svg);
    el('text',{x:ml-4,y:y+4,'text-anchor':'end'},svg).textContent=fmt(max*t/4);}
  if(o.ylabel){var yl=el('text',{x:12,y:mt+ph/2,transform:'rotate(-90 12 '+(mt+ph/2)+')','text-anchor':'middle'},svg);yl.textContent=o.ylabel;}
  var bw=pw/Math.max(1,n),ns=o.series.length,every=Math.max(1,Math.ceil(n/25));
  for(var i=0;i<n;i++){
    var x0=ml+i*bw,base=0;
    o.series.forEach(function(se,j){var v=se.values[i]||0;var h=v/max*ph;
      var x=o.stacked?x0+bw*0.1:x0+bw*0.1+j*bw*0.8/ns,w=o.stacked?bw*0.8:bw*0.8/ns;
      var y=mt+ph-(o.stacked?base+h:h);
      var r=el('rect',{x:x,y:y,width:Math.max(w,0.5),height:Math.max(h,0),fill:se.colors?se.colors[i]:se.color},svg);
      el('title',{},r).textContent=o.cats[i]+' / '+se.name+': '+fmt(v);
      if(o.stacked)base+=h;});
    if(o.highlight===i){el('rect',{x:x0+1,y:mt,width:bw-2,height:ph,fill:'none',stroke:'#d00','stroke-width':2},svg);
      el('text',{x:x0+bw/2,y:mt-3,'text-anchor':'middle',fill:'#d00'},svg).textContent='slowest';}
    if(i%every===0){var lx=x0+bw/2,ly=mt+ph+14;var tx=el('text',{x:lx,y:ly,'text-anchor':n>12?'end':'middle',transform:n>12?'rotate(-35 '+lx+' '+ly+')':''},svg);tx.textContent=o.cats[i];}
  }
  el('line',{x1:ml,x2:ml+pw,y1:mt+ph,y2:mt+ph,stroke:'#888'},svg);
  o.series.forEach(function(se,j){var y=mt+j*16;el('rect',{x:ml+pw+10,y:y,width:10,height:10,fill:se.color},svg);
    el('text',{x:ml+pw+24,y:y+9},svg).textContent=se.name;});
  charts++;
}
function table(id,head,rows,slowIdx){
  var t=document.getElementById(id),h='<tr>'+head.map(function(x){return '<th>'+x+'</th>';}).join('')+'</tr>';
  rows.forEach(function(r,i){h+='<tr'+(i===slowIdx?' class="slow"':'')+'>'+r.map(function(c,j){return '<td'+(j===0?' class="l"':'')+'>'+String(c).replace(/&/g,'&amp;').replace(/</g,'&lt;')+'</td>';}).join('')+'</tr>';});
  t.innerHTML=h;
}
var steps=[];for(var s=0;s<A.steps;s++)steps.push((A.mode==='hook'?'step ':'op ')+s);
var PH=A.phases;
function phaseChart(){
  var k=document.getElementById('group-select').value;
  var g=A.groups.filter(function(x){return x.key===k;})[0];if(!g)return;
  bars('c-phases',{title:'phase breakdown per step: '+g.key+(g.label?' ('+g.label+')':'')+' (mean over ranks)',
    cats:steps,stacked:true,ylabel:'seconds',
    series:PH.map(function(p,j){return {name:p.replace(/_s$/,''),values:g.per_step[p],color:PAL[j]};})});
}
var sel=document.getElementById('group-select');
A.groups.forEach(function(g){var o=document.createElement('option');o.value=g.key;o.textContent=g.key+(g.label?' ('+g.label+')':'');
  if(g.key===A.hottest_group)o.selected=true;sel.appendChild(o);});
sel.addEventListener('change',phaseChart);
phaseChart();
bars('c-share',{title:"each group's busy time per step (stack = step's communication time)",cats:steps,stacked:true,ylabel:'seconds',
  series:A.groups.map(function(g,j){return {name:g.key,values:g.per_step.total_s,color:PAL[j%PAL.length]};})});
table('t-groups',['group','layers','busy','share','raw bytes','wire bytes','wire/raw'].concat(PH.map(function(p){return p.replace(/_s$/,'');})),
  A.groups.map(function(g){return [g.key+(g.key===A.hottest_group?' (hottest)':''),g.label,fmtS(g.busy_s),(100*g.share).toFixed(1)+'%',fmtB(g.bytes_raw),fmtB(g.bytes_wire),
    g.bytes_raw?(g.bytes_wire/g.bytes_raw).toFixed(3):'-'].concat(PH.map(function(p){return fmtS(g.phase_s[p]);}));}),
  A.groups.map(function(g){return g.key;}).indexOf(A.hottest_group));
bars('c-bytes',{title:'bytes per group, all ranks: raw vs on the wire',cats:A.groups.map(function(g){return g.key;}),fmt:fmtB,ylabel:'bytes',
  series:[{name:'raw',values:A.groups.map(function(g){return g.bytes_raw;}),color:PAL[0]},
          {name:'on the wire',values:A.groups.map(function(g){return g.bytes_wire;}),color:PAL[1]}]});
bars('c-exposed',{title:'hidden vs exposed communication per step (mean over ranks; '+A.exposure.source+')',cats:steps,stacked:true,ylabel:'seconds',
  series:[{name:'exposed',values:A.exposure.exposed_s,color:PAL[2]},{name:'hidden',values:A.exposure.hidden_s,color:PAL[4]}]});
var rk=A.ranks.map(function(r){return r.rank;}),si=rk.indexOf(A.slowest_rank);
bars('c-ranks',{title:'net wait introduced per rank (receivers waiting on it - it waiting on senders)',cats:rk.map(function(r){return 'rank '+r;}),
  highlight:si<0?null:si,ylabel:'seconds',
  series:[{name:'net wait introduced',values:A.ranks.map(function(r){return Math.max(0,r.net_wait_introduced_s);}),color:PAL[2],
           colors:A.ranks.map(function(r,i){return i===si?'#d00':PAL[0];})},
          {name:'waited on senders',values:A.ranks.map(function(r){return r.waited_s;}),color:PAL[5]}]});
table('t-ranks',['rank','ops','busy','queued','unattributed','waited on senders','receivers waited on it','net wait introduced','bytes sent'],
  A.ranks.map(function(r){return ['rank '+r.rank+(r.rank===A.slowest_rank?' (slowest)':''),r.ops,fmtS(r.busy_s),fmtS(r.queued_s),fmtS(r.unattributed_s),fmtS(r.waited_s),fmtS(r.induced_s),fmtS(r.net_wait_introduced_s),fmtB(r.bytes_wire)];}),si<0?null:si);
var lk=A.links.map(function(l){return l.src+' -> '+l.dst;}),li=-1;
A.links.forEach(function(l,i){if(A.slowest_link&&l.src===A.slowest_link[0]&&l.dst===A.slowest_link[1])li=i;});
bars('c-links',{title:"per link (sender -> receiver): transfer time / the same operations' median link",cats:lk,highlight:li<0?null:li,ylabel:'x median',
  fmt:function(v){return v.toFixed(2)+'x';},
  series:[{name:'slowness',values:A.links.map(function(l){return l.slowness||0;}),color:PAL[0],
           colors:A.links.map(function(l,i){return i===li?'#d00':PAL[0];})}]});
table('t-links',['link','ops','bytes','sender send time','receiver recv time','transfer (min)','x median','throughput'],
  A.links.map(function(l){return [l.src+' -> '+l.dst+(A.links.indexOf(l)===li?' (slowest)':''),l.ops,fmtB(l.bytes),fmtS(l.send_s),fmtS(l.recv_wait_s),fmtS(l.transfer_s),
    l.slowness?l.slowness.toFixed(2)+'x':'-',l.throughput_Bps?(l.throughput_Bps/1e9).toFixed(3)+' GB/s':'-'];}),li<0?null:li);
status.setAttribute('data-state','ok');status.setAttribute('data-charts',String(charts));
status.textContent='rendered '+charts+' charts from '+D.records.length+' records';
})();
"""


def _json_for_script(obj: Any) -> str:
    s = json.dumps(obj, separators=(",", ":"), allow_nan=False)
    # Inside <script>: no "</script>", no "<!--"; \u003c is the same string to JSON.
    return s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_html(records: List[dict], analysis: Dict[str, Any]) -> str:
    """The dashboard page: no external resource; data in #xirang-data, drawn by inline JS."""
    title = f"xirang communication breakdown: {analysis['run']['name']}"
    summary = "\n".join(analysis["summary"])
    data = _json_for_script({"records": records, "analysis": analysis})
    e = html.escape
    runs = ", ".join(analysis["run"]["runs_available"])
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>
<style>{_CSS}</style></head><body>
<h1>{e(title)}</h1>
<div id="xirang-status" data-state="pending">rendering (needs JavaScript)...</div>
<pre id="summary">{e(summary)}</pre>
<p class="note">Runs in the input: {e(runs)}. Process groups: {e(", ".join(analysis['run']['pgs']))}.
Steps and groups are taken from process group {e(repr(analysis['run']['primary_pg']))}.</p>
<h2>Per-group phase breakdown over steps</h2>
<label>group <select id="group-select"></select></label>
<div class="chart" id="c-phases"></div>
<p class="note">queued = waiting behind earlier operations (not in total_s); unattributed = total_s minus
encode, scatter-reduce, allgather and decode.</p>
<h2>Each group's share of step time</h2>
<div class="chart" id="c-share"></div>
<table id="t-groups"></table>
<h2>Bytes: raw vs on the wire</h2>
<div class="chart" id="c-bytes"></div>
<p class="note">raw = what this algorithm would send uncompressed; on the wire = payload sent (headers excluded).</p>
<h2>Hidden vs exposed communication</h2>
<div class="chart" id="c-exposed"></div>
<p class="note">{e(analysis['exposure']['note'])}</p>
<h2>Per rank</h2>
<div class="chart" id="c-ranks"></div>
<table id="t-ranks"></table>
<p class="note">Slowest rank = largest net wait introduced: seconds its receivers waited on its data minus
seconds it waited on its senders' data. A late rank makes its successor wait, which passes the wait on;
only the late rank makes others wait without waiting itself.</p>
<h2>Per link (sender -> receiver; in a ring the receiver is the sender's successor)</h2>
<div class="chart" id="c-links"></div>
<table id="t-links"></table>
<p class="note">transfer = per operation min(sender's send time, receiver's receive time): a slow link keeps both
ends busy, a slow rank only its successor's receive. Each operation's transfers are compared with that
operation's median link; slowness = median over operations of (transfer + 50 us) / (that operation's
median link + 50 us), so one-off stalls such as connection set-up do not count.</p>
<script type="application/json" id="xirang-data">{data}</script>
<script>{_JS}</script>
</body></html>
"""


def embedded_data(page: str) -> Dict[str, Any]:
    """The JSON of #xirang-data in a page written by render_html (used by the tests)."""
    from html.parser import HTMLParser

    class P(HTMLParser):
        def __init__(self):
            super().__init__()
            self.inside, self.buf = False, []

        def handle_starttag(self, tag, attrs):
            if tag == "script" and dict(attrs).get("id") == "xirang-data":
                self.inside = True

        def handle_endtag(self, tag):
            if tag == "script":
                self.inside = False

        def handle_data(self, data):
            if self.inside:
                self.buf.append(data)

    p = P()
    p.feed(page)
    p.close()
    return json.loads("".join(p.buf))


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def build(path: str, run: Optional[str] = None) -> Tuple[List[dict], Dict[str, Any], List[str]]:
    """(records of the run shown, analysis, warnings) for a stats directory or .jsonl file."""
    recs, warns = load_records(path)
    if not recs:
        why = "; ".join(warns) if warns else (
            "no rank<N>.jsonl files" if os.path.isdir(path) else "the file is empty")
        raise SystemExit(f"xirang.report: no records in {path}: {why} "
                         "(expected rank<N>.jsonl written with XIRANG_STATS_DIR)")
    runs = split_runs(recs)
    names = [n for n, _ in runs]
    if run is None:
        name, chosen = runs[-1]
    else:
        hit = [(n, lst) for n, lst in runs if n == run or n.split(" #")[0] == run]
        if not hit and run.lstrip("-").isdigit():
            hit = [runs[int(run)]]
        if not hit:
            raise SystemExit(f"xirang.report: no run {run!r}; runs: {', '.join(names)}")
        name, chosen = hit[-1]
    if len(runs) > 1:
        warns.append(f"{len(runs)} runs in the input ({', '.join(names)}); showing {name!r} (--run to choose)")
    return chosen, analyze(chosen, names, name), warns


def _fail(msg: str) -> int:
    print(f"xirang.report: {msg}", file=sys.stderr)
    return 1


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m xirang.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="XIRANG_STATS_DIR of a run (rank<N>.jsonl files), or one .jsonl file")
    ap.add_argument("-o", "--output", default="xirang-report.html", help="HTML file to write")
    ap.add_argument("--run", default=None, help="run to show (run id, 'id #k', or index; default: the last)")
    ap.add_argument("--json", action="store_true", help="print the analysis as JSON instead of the summary")
    args = ap.parse_args(argv)
    try:
        recs, a, warns = build(args.dir, args.run)
    except OSError as e:  # one line naming the path, not a traceback
        return _fail(f"cannot read {e.filename or args.dir}: {e.strerror or e}")
    for w in warns:
        print(f"xirang.report: {w}", file=sys.stderr)
    page = render_html(recs, a)
    try:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as e:
        return _fail(f"cannot write {args.output}: {e.strerror or e}")
    if args.json:
        print(json.dumps(a, indent=1))
    else:
        print("\n".join(a["summary"]))
        print(f"written: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
