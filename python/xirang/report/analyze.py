"""The dashboard's numbers for one run: steps, per-group phases, hidden vs exposed communication,
the slowest rank and the slowest link (the package docstring says how each is derived)."""
from __future__ import annotations

import bisect
import statistics
from typing import Any, Dict, Iterable, List, Optional, Tuple

from .records import PHASES, STACK, grank, num, rank_of, unattributed
from .text import summary_lines

LINK_EPS_S = 50e-6  # added to link times before comparing them (timer and scheduling noise)


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
            by_rank.setdefault(grank(r), []).append(r)
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
        # The spans are in seq order and overlap at most at an end (a step starts at or after the
        # last seq of the one before, its end never precedes its start): the first span that
        # holds s is the first one ending at or after s, if it starts at or before s. A binary
        # search per record (O(n log n) in all; a scan of every span per record was quadratic in
        # the number of steps: 45,000 records per rank took 36 s).
        ends = [b for _, b in spans]
        for r in lst:
            s = int(r["seq"])
            if s in seq_step:
                continue
            i = bisect.bisect_left(ends, s)
            if i < len(spans) and spans[i][0] <= s:
                seq_step[s] = i
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
            gmap[pg][grank(r)] = rank_of(r)
    hook_pgs = [pg for pg, lst in pgs.items()
                if any(isinstance(r.get("group_id"), int) and r["group_id"] >= 0 for r in lst)]
    primary = (max(hook_pgs, key=lambda p: len(pgs[p])) if hook_pgs
               else (max(pgs, key=lambda p: len(pgs[p])) if pgs else ""))
    prim = pgs.get(primary, [])
    mode, seq_step = _assign_steps(prim)
    n_steps = (max(seq_step.values()) + 1) if seq_step else 0
    ranks_primary = sorted({grank(r) for r in prim})

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
        d = cell.setdefault((st, k), {}).setdefault(grank(r), {p: 0.0 for p in STACK + ("total_s",)})
        for p in PHASES:
            d[p] += num(r, p)
        d["unattributed_s"] += unattributed(r)
        d["total_s"] += num(r, "total_s")
        b = bytes_g.setdefault(k, {"raw": 0.0, "wire": 0.0, "tcp": 0.0, "shm": 0.0, "cross_host": 0.0,
                                   "cross_rack": 0.0})
        b["raw"] += num(r, "bytes_raw")
        b["wire"] += num(r, "bytes_wire")
        b["tcp"] += num(r, "bytes_tcp")
        b["shm"] += num(r, "bytes_shm")
        b["cross_host"] += num(r, "bytes_cross_host")
        b["cross_rack"] += num(r, "bytes_cross_rack")
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
            "bytes_tcp": bytes_g[k]["tcp"], "bytes_shm": bytes_g[k]["shm"],
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
            exp_cells.setdefault(seq_step[s], {}).setdefault(grank(r), []).append(r)
    exposed, hidden = [], []
    for st in range(n_steps):
        e_r, h_r = [], []
        for lst in exp_cells.get(st, {}).values():
            busy = sum(num(r, "total_s") for r in lst)
            e = sum(num(r, "exposed_wait_s") for r in lst if measured(r))
            est = [r for r in lst if not measured(r)]
            if est:
                last_enq = max(num(r, "t_enqueue") for r in est)
                end = max(num(r, "t_enqueue") + num(r, "queued_s") + num(r, "total_s") for r in est)
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
            d = rs(m.get(grank(r), grank(r)))
            d["ops"] += 1
            d["busy_s"] += num(r, "total_s")
            d["queued_s"] += num(r, "queued_s")
            d["unattributed_s"] += unattributed(r)
            d["bytes_wire"] += num(r, "bytes_wire")
        ws = max([int(r.get("world_size", 0) or 0) for r in lst] + [len(m)])
        by_op: Dict[int, Dict[int, dict]] = {}
        for r in lst:
            s = int(r.get("seq", 0) or 0)
            if s > 0:
                by_op.setdefault(s, {})[grank(r)] = r
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
                    if num(p, "bytes_recv") > 0 or num(p, "recv_s") > 0:
                        rs(gq)["waited_s"] += num(p, "recv_s")
                        rs(gp)["induced_s"] += num(p, "recv_s")
                    if num(p, "bytes_sent") > 0:
                        back = next((x for x in recs[peer].get("peers") or [] if int(x.get("peer", -1)) == q), None)
                        recv_s = num(back, "recv_s") if back else num(p, "send_s")
                        L = link_stat.setdefault((gq, gp), {"bytes": 0.0, "send_s": 0.0, "recv_wait_s": 0.0,
                                                            "transfer_s": 0.0, "expected_s": 0.0,
                                                            "ops": 0})
                        L["bytes"] += num(p, "bytes_sent")
                        L["send_s"] += num(p, "send_s")
                        L["recv_wait_s"] += recv_s
                        t = min(num(p, "send_s"), recv_s)
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

    raw = sum(num(r, "bytes_raw") for r in records)
    wire = sum(num(r, "bytes_wire") for r in records)
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
                  "tcp": sum(num(r, "bytes_tcp") for r in records),
                  "shm": sum(num(r, "bytes_shm") for r in records),
                  "cross_host": sum(num(r, "bytes_cross_host") for r in records),
                  "cross_rack": sum(num(r, "bytes_cross_rack") for r in records)},
        "failed_ops": sum(1 for r in records if r.get("ok") is False),
    }
    res["summary"] = summary_lines(res)
    return res
