"""Check xirang.sim against this machine and the emulated cluster.

1. Calibrate on measured WS=2 xirang allreduce, 1-16 MiB float32 (in sample): alpha (per ring step)
   and beta (per byte of a ring chunk).
2. Predict and measure out of sample: 64 MiB at WS=2, and 4/16 MiB at WS=3 and WS=4, with two
   models fitted on the same rows: the plain alpha-beta ring, and the ring with its CPU shared: on
   loopback a ring step is CPU work from end to end (system calls, kernel copies in and out, the
   reduction), so n ranks on P < n cores take n / P times as long (xirang.sim.cpu_share; P =
   --cores: len(--pin), else the CPUs this process may use = os.cpu_count() unrestricted).
   With P >= n the two models are the same. A third check leaves the machine's load out: the CPU
   seconds of all ranks per op, 2(n-1)(n a + S b), fitted on the same in-sample rows.
3. Emulated cluster (tests/cluster/netns, benchmarks/topology.py): predict rank-order ring,
   topology ring, two-level and gloo with xirang.sim for that cluster (placement, rings, rack uplink
   rate, cross-rack latency; intra-host and intra-rack links: loopback/veth, i.e. part 1's alpha and
   CPU cost, all ranks sharing this machine's cores) and compare the predicted ordering of the
   configurations with the measured one at each size, times side by side.

    python benchmarks/sim_check.py [--iters 15] [--pin CPUS] [--cores N] [--save FILE] [--json]
                                   [--input allreduce.json]
                                   [--cluster-input topology.json | --cluster-run [--cluster-save FILE]]

--input takes benchmarks/allreduce.py output (see xirang.sim.load_measurements for the format);
without it the script measures: one spawned process per rank (4), one xirang group per world size
(ranks [0, 1], [0, 1, 2], all 4) and the (world size, size) points measured in turn within each of
--iters repetitions (the order rotates), so a change of the machine's load hits every point alike;
each timed op follows a small allreduce over all ranks and one untimed op of the same point (warm
buffers, as in a back-to-back loop; --cold: without it); its time is the slowest member's, the
statistic (--stat, median by default; min reported too) is taken over repetitions. Each rank's CPU
time (process_time: all its threads) is recorded too; "cores busy" = CPU s of all members / wall s.
--pin runs every rank on the given CPUs (sched_setaffinity), so that the cores the ranks get is
known rather than left to other jobs on the machine.
Part 3 input: --cluster-input FILE (benchmarks/topology.py --json output), else --cluster-run runs
benchmarks/topology.py --ddp-steps 0 (root; about 2.5 minutes), else part 3 is skipped.
An ordering "matches" at a size when every pair of configurations that the model separates by more
than --tie (10%) comes out in the same order measured; gloo is modelled as a rank-order ring (gloo's
ring allreduce), so gloo vs rank-order ring is a tie by construction.
Goal: |error| <= 25% on every out-of-sample point (the CPU-share model).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

MiB = 2**20
CAL = [1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB]
OUT = [(2, 64 * MiB), (3, 4 * MiB), (3, 16 * MiB), (4, 4 * MiB), (4, 16 * MiB)]
POINTS = [(2, b) for b in CAL] + OUT
GOAL_PCT = 25.0
HERE = os.path.dirname(os.path.abspath(__file__))
METHODS = ("rank-ring", "topo-ring", "two-level", "gloo")


# ======================================================================== parts 1-2: loopback
def _worker(rank, wmax, port, points, iters, warm, pin, q):
    import torch.distributed as dist

    import xirang  # noqa: F401  (registers the backend)

    if pin:
        os.sched_setaffinity(0, pin)  # before the backend starts its threads: they inherit it
    torch.set_num_threads(1)
    dist.init_process_group("xirang", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=wmax)
    groups = {n: (dist.group.WORLD if n == wmax else dist.new_group(list(range(n)), backend="xirang"))
              for n in sorted({n for n, _ in points})}
    sync = torch.zeros(1)
    bufs = {}
    wall = {p: [] for p in points}
    cpu = {p: [] for p in points}
    for rep in range(iters + 1):  # repetition 0: warm-up (connections, buffers, page faults)
        k = rep % len(points)
        for n, nbytes in points[k:] + points[:k]:
            dist.all_reduce(sync)
            if rank >= n:
                continue
            x = bufs.setdefault((n, nbytes), torch.ones(nbytes // 4))
            if warm:  # the same op untimed first: its buffers and socket state warm, as in a back-to-back loop
                dist.all_reduce(x, group=groups[n])
            c0, t0 = time.process_time(), time.perf_counter()
            dist.all_reduce(x, group=groups[n])
            t1, c1 = time.perf_counter(), time.process_time()
            if rep:
                wall[(n, nbytes)].append(t1 - t0)
                cpu[(n, nbytes)].append(c1 - c0)
    dist.all_reduce(sync)
    q.put((rank, wall, cpu))
    dist.destroy_process_group()


def measure(points, iters: int, warm: bool = True, pin=None, deadline_s: float = 300.0) -> dict:
    """{(ws, bytes): {"wall": [s per repetition, slowest member], "cpu": [CPU s of all members]}}."""
    wmax = max(n for n, _ in points)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, wmax, port, list(points), iters, warm, pin, q)) for r in range(wmax)]
    for p in procs:
        p.start()
    try:
        got = dict((r, (w, c)) for r, w, c in (q.get(timeout=deadline_s) for _ in range(wmax)))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    out = {}
    for n, b in points:
        members = range(n)
        out[(n, b)] = {"wall": [max(got[r][0][(n, b)][i] for r in members) for i in range(iters)],
                       "cpu": [sum(got[r][1][(n, b)][i] for r in members) for i in range(iters)]}
    return out


def analyse(rows, cores, sim) -> dict:
    """Fit on the in-sample rows (ws, bytes, s, cores busy), predict the rest."""
    cal = [(n, b, t) for n, b, t, _ in rows if n == 2 and MiB <= b <= 16 * MiB]
    test = [r for r in rows if (r[0], int(r[1])) in set(OUT)]
    if len(cal) < 2:
        raise SystemExit(f"need >= 2 WS=2 rows between 1 and 16 MiB, got {len(cal)}")
    try:
        alpha, beta = sim.fit(cal, cores)
        pa, pb = sim.fit(cal)  # the plain alpha-beta model, fitted on the same rows (the same fit when cores >= 2)
    except ValueError as e:
        raise SystemExit(f"sim_check: {e}") from None

    def row(n, S, t, busy, kind):
        plain = sim.predict(pa, pb, n, S)
        p = sim.predict(alpha, beta, n, S, cores)
        return {"kind": kind, "ws": n, "MiB": S / MiB, "measured_ms": 1e3 * t, "cores_busy": busy,
                "plain_ms": 1e3 * plain, "plain_err_pct": 100 * (plain / t - 1),
                "predicted_ms": 1e3 * p, "error_pct": 100 * (p / t - 1)}

    out = [row(n, b, t, busy, "in-sample") for n, b, t, busy in rows if (n, b, t) in cal] + \
          [row(*r, "out-of-sample") for r in test]
    # The model's premise, checked without the machine's load: CPU seconds of all ranks per op =
    # 2(n-1) (n a + S b) (each of 2(n-1) steps: every rank a fixed cost plus its S/n chunk), fitted
    # on the same in-sample rows, predicted for the rest. Wall = CPU / cores busy.
    cpu_rows = [(n, b, t * busy) for n, b, t, busy in rows if busy is not None and (n, b, t) in cal]
    if len(cpu_rows) >= 2:
        import numpy as np

        A = np.array([[2 * (n - 1) * n, 2 * (n - 1) * b] for n, b, _ in cpu_rows])
        y = np.array([c for _, _, c in cpu_rows])
        (ca, cb), *_ = np.linalg.lstsq(A / y[:, None], np.ones(len(y)), rcond=None)
        for r in out:
            n, S = r["ws"], r["MiB"] * MiB
            r["cpu_ms"] = r["measured_ms"] * r["cores_busy"]
            r["cpu_pred_ms"] = 1e3 * 2 * (n - 1) * (n * ca + S * cb)
            r["cpu_err_pct"] = 100 * (r["cpu_pred_ms"] / r["cpu_ms"] - 1)
    oos = [r for r in out if r["kind"] == "out-of-sample"]
    worst = max((abs(r["error_pct"]) for r in oos), default=None)
    return {"alpha_us": alpha * 1e6, "beta_ns_per_byte": beta * 1e9,
            "bandwidth_GBps": 1 / beta / 1e9 if beta > 0 else None, "rows": out,
            "worst_out_of_sample_pct": worst,
            "worst_plain_pct": max((abs(r["plain_err_pct"]) for r in oos), default=None),
            "worst_cpu_pct": max((abs(r["cpu_err_pct"]) for r in oos if "cpu_err_pct" in r), default=None),
            "pass": worst is not None and worst <= GOAL_PCT, "_alpha": alpha, "_beta": beta}


def loopback(a, sim) -> dict:
    load0 = os.getloadavg()
    cores = a.cores or None
    by_stat = {}
    if a.input:
        try:
            rows = [(n, b, t, None) for n, b, t in sim.load_measurements(a.input)]
        except ValueError as e:
            raise SystemExit(f"sim_check: --input: {e}") from None
        by_stat[a.stat] = analyse(rows, cores, sim)
    else:
        m = measure(POINTS, a.iters, not a.cold, a.pin)
        for name, stat in (("median", statistics.median), ("min", min)):
            rows = []
            for (n, b), d in m.items():
                i = d["wall"].index(stat(d["wall"])) if name == "min" else None
                busy = (d["cpu"][i] / d["wall"][i]) if i is not None else statistics.median(
                    c / w for c, w in zip(d["cpu"], d["wall"]))
                rows.append((n, float(b), stat(d["wall"]), busy))
            by_stat[name] = analyse(rows, cores, sim)
            if name == a.stat and a.save:
                with open(a.save, "w") as f:
                    json.dump([{"backend": "xirang", "ws": n, "bytes": int(b), "time_us": 1e6 * t, "cores_busy": busy}
                               for n, b, t, busy in rows], f, indent=1)
    load1 = os.getloadavg()
    rep = {"cpus": os.cpu_count(), "pin": a.pin, "cores": cores, "load_avg_1min": [load0[0], load1[0]], "stat": a.stat,
           "iters": a.iters, "goal_pct": GOAL_PCT, **by_stat[a.stat],
           "other_statistic": {k: {kk: v[kk] for kk in ("alpha_us", "beta_ns_per_byte", "worst_out_of_sample_pct",
                                                        "worst_plain_pct", "pass", "rows")}
                               for k, v in by_stat.items() if k != a.stat}}
    return rep


# ======================================================================== part 3: emulated cluster
def parse_rate_bps(s: str) -> float:
    """tc rate ('200mbit', '1gbit', '500kbit') -> bytes per second."""
    s = s.strip().lower()
    for suf, m in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if s.endswith(suf):
            return float(s[: -len(suf)]) * m / 8
    return float(s) / 8


def parse_time_s(s: str) -> float:
    s = (s or "0").strip().lower()
    for suf, m in (("ms", 1e-3), ("us", 1e-6), ("s", 1.0)):
        if s.endswith(suf):
            return float(s[: -len(suf)]) * m
    return float(s)


def emulated_sim(args: dict, info: dict, alpha: float, beta: float, cores: int, sim):
    """xirang.sim's picture of benchmarks/topology.py's cluster: rank placement as netns.placement,
    cross-rack: the rack uplink (the raw TCP probe's rate when measured, else --rate) shared by the
    flows leaving a rack, one-way --delay + alpha per step; in host and in rack: loopback / veth,
    i.e. alpha and no wire limit; every step also costs beta per chunk byte of CPU, all ranks taking
    turns on this machine's `cores` cores (the namespaces share them)."""
    R, H, G = args["racks"], args["hosts_per_rack"], args["ranks_per_host"]
    ws = R * H * G
    if args.get("placement", "roundrobin") == "roundrobin":
        host_of = [(r % R) * H + (r // R) % H for r in range(ws)]
    else:
        host_of = [r // G for r in range(ws)]
    used: dict = {}
    slots = []
    for h in host_of:
        slots.append(h * G + used.get(h, 0))
        used[h] = used.get(h, 0) + 1
    probe = (info.get("link_mbit") or {}).get("cross-rack")
    uplink = probe * 1e6 / 8 if probe else parse_rate_bps(args["rate"])
    delay = parse_time_s(args.get("delay") or "0")
    cl = sim.Cluster(gpus=ws, gpus_per_host=G, hosts_per_rack=H, host_GBps=float("inf"), host_alpha_us=alpha * 1e6,
                     rack_Gbps=float("inf"), rack_alpha_us=alpha * 1e6, xrack_Gbps=uplink * 8 / 1e9,
                     xrack_alpha_us=(alpha + delay) * 1e6, oversub=G * H, launch_us=0.0,
                     cpu_GBps=1 / beta / 1e9 if beta > 0 else 0.0, cores_per_host=cores, shared_cpu=True,
                     rank_slots=tuple(slots), placement="packed")
    m = sim.Model(layers=1, hidden=8, extra_params=0.0)
    s = sim.Sim(m, cl, sim.Compute())
    return s, {"uplink_MBps": uplink / 1e6, "uplink_source": "raw TCP probe" if probe else "--rate",
               "delay_ms": delay * 1e3, "slots": slots}


CONFIGS = {"rank-ring": dict(), "topo-ring": dict(topo=True), "two-level": dict(two_level=True, topo=True),
           "gloo": dict()}


def verdict(pred: dict, meas: dict, tie: float):
    """(match, [pair notes]): every pair the model separates by > tie must come out in that order."""
    ok, notes = True, []
    names = list(pred)
    for i, x in enumerate(names):
        for y in names[i + 1:]:
            a, b = (x, y) if pred[x] <= pred[y] else (y, x)
            if pred[b] / pred[a] <= 1 + tie:
                notes.append(f"{a} ~ {b} (tie in the model)")
                continue
            if meas[a] <= meas[b]:
                notes.append(f"{a} < {b} ok")
            else:
                ok = False
                notes.append(f"{a} < {b} predicted, measured {meas[b] * 1e3:.0f} < {meas[a] * 1e3:.0f} ms: MISMATCH")
    return ok, notes


def cluster(a, sim, alpha: float, beta: float) -> dict:
    if a.cluster_input:
        with open(a.cluster_input) as f:
            d = json.load(f)
        src = a.cluster_input
    elif a.cluster_run:
        if os.geteuid() != 0:
            return {"skipped": "--cluster-run needs root (network namespaces)"}
        out = a.cluster_save or tempfile.NamedTemporaryFile(prefix="simcheck_topo_", suffix=".json", delete=False).name
        cmd = [sys.executable, os.path.join(HERE, "topology.py"), "--ddp-steps", "0", "--sizes", a.cluster_sizes,
               "--reps", str(a.cluster_reps), "--probe-mb", "8", "--json", out]
        print("part 3: " + " ".join(cmd), file=sys.stderr, flush=True)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.cluster_timeout)
        if p.returncode != 0:
            return {"skipped": f"benchmarks/topology.py failed (rc {p.returncode}): {p.stderr[-400:]}"}
        with open(out) as f:
            d = json.load(f)
        if not a.cluster_save:
            os.unlink(out)
        src = "benchmarks/topology.py (this run" + (f", saved to {a.cluster_save})" if a.cluster_save else ")")
    else:
        return {"skipped": "no --cluster-input and no --cluster-run"}
    args, res = d["args"], d["result"]
    info = res["info"]
    cores = a.cores or os.cpu_count()
    s, par = emulated_sim(args, info, alpha, beta, cores, sim)
    # the model's rings vs the backend's (info["rings"] lists ranks in ring order)
    rank_of = {x: r for r, x in enumerate(par["slots"])}
    model_rings = {"rank-ring": [rank_of[x] for x in s._ring_plan(False).rings[0]],
                   "topo-ring": [rank_of[x] for x in s._ring_plan(True).rings[0]]}
    rings_ok = all(model_rings[k] == info["rings"].get(k) for k in model_rings)
    rows = []
    n_match = 0
    sizes = [r for r in res["rows"] if r["kind"] == "allreduce"]
    for r in sizes:
        numel = r["size"] // 4
        meas = {m: statistics.median(r["times"][m]) for m in METHODS}
        pred, xb = {}, {}
        for m in METHODS:
            pred[m], xb[m] = s.allreduce(numel, sim.Config(**CONFIGS[m]))
        ok, notes = verdict(pred, meas, a.tie)
        n_match += ok
        rows.append({"MiB": r["size"] / MiB, "reps": r["reps"], "measured_ms": {m: 1e3 * meas[m] for m in METHODS},
                     "measured_range_ms": {m: [1e3 * min(r["times"][m]), 1e3 * max(r["times"][m])] for m in METHODS},
                     "predicted_ms": {m: 1e3 * pred[m] for m in METHODS},
                     "error_pct": {m: 100 * (pred[m] / meas[m] - 1) for m in METHODS},
                     "measured_order": sorted(METHODS, key=meas.get), "predicted_order": sorted(METHODS, key=pred.get),
                     "xrack_MB_measured": {m: r["cross_rack"][m] / 1e6 for m in r.get("cross_rack", {})},
                     "xrack_MB_predicted": {m: xb[m] / 1e6 for m in METHODS[:3]},
                     "match": ok, "pairs": notes})
    return {"source": src, "setup": d.get("setup"), "loadavg": d.get("loadavg"), "elapsed_s": d.get("elapsed_s"),
            "params": {**par, "cores": cores, "alpha_us": alpha * 1e6, "beta_ns_per_byte": beta * 1e9,
                       "ws": len(par["slots"])},
            "rings_measured": info["rings"], "rings_model": model_rings, "rings_match": rings_ok,
            "tie_pct": 100 * a.tie, "rows": rows, "sizes_matching": n_match, "sizes": len(rows),
            "ordering_match": n_match == len(rows) and len(rows) > 0}


# ======================================================================== report
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--input", help="benchmarks/allreduce.py JSON (else measure here)")
    ap.add_argument("--iters", type=int, default=15, help="repetitions of every (world size, size) point")
    ap.add_argument("--cold", action="store_true", help="no untimed op of the same point right before each timed one")
    ap.add_argument("--stat", choices=["median", "min"], default="median", help="statistic over repetitions")
    ap.add_argument("--pin", type=lambda s: sorted({int(x) for x in s.split(",")}),
                    help="run every rank on these CPUs only (comma list; sched_setaffinity)")
    ap.add_argument("--cores", type=int, default=None,
                    help="cores the ranks share (default: len(--pin), else the CPUs this process may use, "
                         "os.cpu_count() when unrestricted); 0: a core per rank (plain alpha-beta)")
    ap.add_argument("--save", help="write the loopback measurements here (flat rows {backend, ws, bytes, time_us, "
                    "cores_busy}; --input and python -m xirang.sim --calibrate read them)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--cluster-input", help="benchmarks/topology.py --json output for part 3")
    g.add_argument("--cluster-run", action="store_true", help="run benchmarks/topology.py for part 3 (root)")
    ap.add_argument("--cluster-save", help="with --cluster-run: keep topology.py's JSON here")
    ap.add_argument("--cluster-sizes", default="1M,4M,16M,64M")
    ap.add_argument("--cluster-reps", type=int, default=3,
                    help="repetitions per size of the cluster run (the median is compared; single runs move "
                         "with the machine's load)")
    ap.add_argument("--cluster-timeout", type=float, default=1200)
    ap.add_argument("--tie", type=float, default=0.10, help="predicted times within this fraction are a tie")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.cores is not None and a.cores < 0:
        ap.error(f"--cores must be >= 0, got {a.cores}")
    if a.iters < 1 or a.cluster_reps < 1:
        ap.error("--iters and --cluster-reps must be >= 1")
    if a.cores is None:
        a.cores = len(a.pin) if a.pin else len(os.sched_getaffinity(0))
    from xirang import sim

    t0 = time.monotonic()
    rep = loopback(a, sim)
    rep["emulated_cluster"] = cluster(a, sim, rep.pop("_alpha"), rep.pop("_beta"))
    rep["elapsed_s"] = time.monotonic() - t0
    if a.json:
        print(json.dumps(rep, indent=1))
        return 0
    print(f"CPUs: {rep['cpus']}, ranks pinned to: {a.pin or 'any'}, model cores: {rep['cores']}; load average {rep['load_avg_1min'][0]:.1f} -> "
          f"{rep['load_avg_1min'][1]:.1f}; statistic: {'as in ' + a.input if a.input else f'{a.stat} of {a.iters}'}; fit on WS=2, 1-16 MiB: "
          f"alpha = {rep['alpha_us']:.1f} us/step, beta = {rep['beta_ns_per_byte']:.3f} ns/B "
          f"({rep['bandwidth_GBps']:.2f} GB/s)")
    print(sim.table(rep["rows"], ["kind", "ws", "MiB", "measured_ms", "cores_busy", "plain_ms", "plain_err_pct",
                                  "predicted_ms", "error_pct", "cpu_ms", "cpu_pred_ms", "cpu_err_pct"]))
    if rep["worst_out_of_sample_pct"] is None:
        print("worst out-of-sample error: none to report: the input has no out-of-sample point ("
              + ", ".join(f"WS={n} {b // MiB} MiB" for n, b in OUT) + "); goal: FAIL (not checked)")
    else:
        print(f"worst out-of-sample error: {rep['worst_out_of_sample_pct']:.1f}% with the CPU share "
              f"({rep['worst_plain_pct']:.1f}% plain alpha-beta); goal <= {GOAL_PCT:.0f}%: "
              f"{'PASS' if rep['pass'] else 'FAIL'}")
    if rep.get("worst_cpu_pct") is not None:
        print(f"CPU seconds per op (all ranks; load-independent check of the work 2(n-1)(n a + S b)): worst out-of-sample "
              f"error {rep['worst_cpu_pct']:.1f}%")
    for k, v in rep["other_statistic"].items():
        print(f"same repetitions, statistic {k}: alpha = {v['alpha_us']:.1f} us, beta = {v['beta_ns_per_byte']:.3f} ns/B; "
              "out of sample (ws/MiB: measured -> predicted ms, error): " + ", ".join(
                  f"{r['ws']}/{r['MiB']:.0f}: {r['measured_ms']:.1f} -> {r['predicted_ms']:.1f} ({r['error_pct']:+.0f}%)"
                  for r in v["rows"] if r["kind"] == "out-of-sample")
              + (f"; worst {v['worst_out_of_sample_pct']:.1f}% (plain {v['worst_plain_pct']:.1f}%)"
                 if v["worst_out_of_sample_pct"] is not None else ""))
    c = rep["emulated_cluster"]
    if "skipped" in c:
        print(f"emulated-cluster ordering: skipped: {c['skipped']}")
    else:
        p = c["params"]
        print(f"\nemulated cluster ({c['source']}): {c['setup']}")
        print(f"model: {p['ws']} ranks, uplink {p['uplink_MBps']:.1f} MB/s ({p['uplink_source']}), +{p['delay_ms']:.2f} ms "
              f"one way across racks, in host/rack alpha {p['alpha_us']:.1f} us + {p['beta_ns_per_byte']:.3f} ns/B CPU "
              f"shared by {p['ws']} ranks on {p['cores']} cores; rings as the backend's: "
              f"{'yes' if c['rings_match'] else 'NO ' + json.dumps(c['rings_model'])}")
        tab = []
        for r in c["rows"]:
            x = {"MiB": r["MiB"]}
            for m in METHODS:
                x[f"{m} meas/pred ms"] = f"{r['measured_ms'][m]:.0f} / {r['predicted_ms'][m]:.0f}"
            x["measured order"] = " < ".join(r["measured_order"])
            x["predicted order"] = " < ".join(r["predicted_order"])
            x["match"] = "yes" if r["match"] else "NO"
            tab.append(x)
        print(sim.table(tab, list(tab[0])))
        for r in c["rows"]:
            print(f"  {r['MiB']:.0f} MiB, {r['reps']} reps, measured min-max ms: " + ", ".join(
                f"{m} {lo:.0f}-{hi:.0f}" for m, (lo, hi) in r["measured_range_ms"].items()))
            print(f"  {r['MiB']:.0f} MiB: " + "; ".join(r["pairs"]) + "; xrack MB measured/predicted: " + ", ".join(
                f"{m} {r['xrack_MB_measured'].get(m, float('nan')):.1f}/{r['xrack_MB_predicted'][m]:.1f}" for m in METHODS[:3]))
        print(f"ordering (ties: predicted within {c['tie_pct']:.0f}%): {c['sizes_matching']}/{c['sizes']} sizes match"
              f"{'' if c['ordering_match'] else ' (NOT all)'}; cluster run load {c['loadavg']}")
    print(f"elapsed {rep['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
