#!/usr/bin/env python3
"""Cost of xirang's operation records: is leaving them on cheap enough?

    python3 benchmarks/stats_overhead.py                    # WS 2, 1, 4, 16, 64 MiB, 11 reps
    python3 benchmarks/stats_overhead.py --ws 4 --sizes 1M,16M --reps 21 --json /tmp/so.json

What is measured (one job of --ws processes on 127.0.0.1, torch.set_num_threads(1) each), with
four xirang groups over the same ranks, created with:
  off   XIRANG_STATS=0: no records at all (no per-peer timings either, Work.wait not timed)
  off2  the same again: the control (what two identical groups differ by on this machine)
  on    the default: records kept in memory (xirang.stats())
  file  records in memory and XIRANG_STATS_DIR set: one JSON line written and flushed per op

1. Records per operation: records added to xirang.stats() per allreduce (expected: 1).
2. ns per record, measured directly: each group counts the nanoseconds it spends building and
   storing its records (the caller's share in enqueue, the communication thread's after the
   operation, the JSON line when XIRANG_STATS_DIR is set): backend.record_cost(), read before
   and after the timed allreduces; the largest over ranks. It excludes the two clock reads around
   the operation and the per-peer timings inside the algorithms: those show in (3) only.
   Reported: the mean over the timed allreduces of (3), and the median of --samples single-op
   samples (the counter read around one untimed allreduce); wall time, so a preemption of the
   communication thread inside the record's code counts, which the median leaves out.
   ratio = ns per record (mean) x records per op / median allreduce time with records off; the
   target is <= 1 % at >= 1 MiB.
3. Records on vs off, interleaved: a repetition is a barrier and --iters back-to-back
   allreduces on one group; its time is the slowest rank's. Repetitions rotate which group goes
   first. Reported: the median per op and IQR of each group, and the median of the
   per-repetition paired differences (on - off, file - off, and the control off2 - off) with
   their IQR. A difference within the control's spread is noise.
4. Python read cost: ns per record of xirang.stats() (paid only when someone reads them).
The machine's other load shows up as spread: read the IQR before the medians.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import sys
import tempfile
import time


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def q(xs, p):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


GROUPS = ("off", "off2", "on", "file")


def worker(rank, ws, port, args, stats_dir, out_q):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    import xirang

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, ws, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("xirang", store=store, rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=120))
    groups = {}
    for name in GROUPS:  # the knobs are read when a group is created
        os.environ.pop("XIRANG_STATS_DIR", None)
        os.environ.pop("XIRANG_STATS", None)
        if name.startswith("off"):
            os.environ["XIRANG_STATS"] = "0"
        elif name == "file":
            os.environ["XIRANG_STATS_DIR"] = stats_dir
        groups[name] = dist.new_group(backend="xirang")
    solo = {}
    for name in ("on", "file"):  # one-rank groups: the record's cost with no network, caches warm
        os.environ.pop("XIRANG_STATS_DIR", None)
        if name == "file":
            os.environ["XIRANG_STATS_DIR"] = stats_dir
        for r in range(ws):  # every rank takes part in every new_group call
            g = dist.new_group(ranks=[r], backend="xirang")
            if r == rank:
                solo[name] = g
    os.environ.pop("XIRANG_STATS_DIR", None)
    os.environ.pop("XIRANG_STATS", None)
    backend = {n: xirang._backend_for(g) for n, g in groups.items()}
    res = {"sizes": {}, "solo_ns_per_record": {}}

    t1 = torch.zeros(1)
    for name, g in solo.items():
        b = xirang._backend_for(g)
        for _ in range(200):
            dist.all_reduce(t1, group=g)
        c0 = b.record_cost()
        for _ in range(2000):
            dist.all_reduce(t1, group=g)
        c1 = b.record_cost()
        res["solo_ns_per_record"][name] = (c1["ns"] - c0["ns"]) / max(1, c1["records"] - c0["records"])

    def slowest(v):
        t = torch.tensor([v], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    for size in args.sizes:
        x = torch.ones(size // 4, dtype=torch.float32)
        for g in groups.values():
            for _ in range(args.warmup):
                dist.all_reduce(x, group=g)
        n0 = len(xirang.stats(groups["on"]))
        dist.all_reduce(x, group=groups["on"])
        per_op_records = len(xirang.stats(groups["on"])) - n0
        times = {n: [] for n in GROUPS}
        cost0 = {n: backend[n].record_cost() for n in ("on", "file")}
        for rep in range(args.reps):
            order = GROUPS[rep % len(GROUPS):] + GROUPS[:rep % len(GROUPS)]  # rotate who goes first
            for name in order:
                g = groups[name]
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    dist.all_reduce(x, group=g)
                times[name].append(slowest((time.perf_counter() - t0) / args.iters))
        ns_per_record, ns_median = {}, {}
        for n in ("on", "file"):
            c = backend[n].record_cost()
            recs = c["records"] - cost0[n]["records"]
            ns_per_record[n] = slowest((c["ns"] - cost0[n]["ns"]) / max(1, recs))
            # per-op samples (untimed loop): the counter moves before the op's Work completes
            samples = []
            for _ in range(args.samples):
                c0 = backend[n].record_cost()["ns"]
                dist.all_reduce(x, group=groups[n])
                samples.append((backend[n].record_cost()["ns"] - c0) / per_op_records)
            ns_median[n] = slowest(q(samples, 0.5))
        res["sizes"][size] = {**times, "records_per_op": per_op_records, "ns_per_record": ns_per_record,
                              "ns_per_record_median": ns_median}

    # reading the records from Python
    b = backend["on"]
    n = len(b.records())
    t0 = time.perf_counter()
    for _ in range(5):
        b.records()
    res["read_ns_per_record"] = (time.perf_counter() - t0) / 5 / max(1, n) * 1e9
    res["read_records"] = n
    res["records_off"] = len(xirang.stats(groups["off"]))
    dist.barrier()
    if rank == 0:
        out_q.put(res)
    dist.destroy_process_group()


def _lab(size):
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ws", type=int, default=2)
    ap.add_argument("--sizes", default="1M,4M,16M,64M", help="comma list (>= 1 MiB for the 1 %% check)")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--samples", type=int, default=21, help="per-op samples of the record cost per group and size")
    ap.add_argument("--json", default=None, help="write the raw numbers here")
    args = ap.parse_args()
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stats_dir = tempfile.mkdtemp(prefix="xirang-stats-bench-")
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.ws, port, args, stats_dir, out_q)) for r in range(args.ws)]
    for p in procs:
        p.start()
    try:
        res = out_q.get(timeout=900)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    lines = sum(1 for f in os.listdir(stats_dir) for _ in open(os.path.join(stats_dir, f)))
    shutil.rmtree(stats_dir, ignore_errors=True)
    try:
        load = "load %.1f" % os.getloadavg()[0]
    except OSError:
        load = "load ?"

    print(f"xirang stats overhead: WS={args.ws}, {args.reps} interleaved reps x {args.iters} allreduces per group, "
          f"float32, 127.0.0.1, {os.cpu_count()} CPUs, {load} at the end")
    print(f"JSON lines written (the 'file' group and its one-rank twin): {lines}; records kept by an XIRANG_STATS=0 group: "
          f"{res['records_off']}")
    so = res["solo_ns_per_record"]
    print(f"ns/record on a one-rank group (1-element allreduces back to back, no network, caches warm; rank 0): "
          f"{so['on']:.0f} in memory, {so['file']:.0f} with the JSON line")
    print(f"reading records from Python: {res['read_ns_per_record']:.0f} ns per record ({res['read_records']} records)")
    print()
    print("| size | records/op | ns/record (memory): median (mean) | ns/record (+ JSON line): median (mean) "
          "| allreduce, records off: us (IQR) "
          "| records on: us (IQR) | on - off: us (IQR) | control off2 - off: us (IQR) | + JSON lines - off: us (IQR) "
          "| ratio (memory) | ratio (+ JSON line) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def mi(xs):
        return q(xs, 0.5), q(xs, 0.75) - q(xs, 0.25)

    def fmt(m):
        return f"{m[0] * 1e6:.1f} ({m[1] * 1e6:.1f})"

    table = []
    for size in args.sizes:
        d = res["sizes"][size]
        off = d["off"]
        pair = {n: [a - b for a, b in zip(d[n], off)] for n in ("on", "off2", "file")}
        m_off = q(off, 0.5)
        npr, nmed = d["ns_per_record"], d["ns_per_record_median"]
        row = {"size": size, "records_per_op": d["records_per_op"],
               "ns_per_record": npr["on"], "ns_per_record_file": npr["file"],
               "ns_per_record_median": nmed["on"], "ns_per_record_file_median": nmed["file"],
               **{f"{n}_s": mi(d[n]) for n in GROUPS},
               **{f"{n}_minus_off_s": mi(pair[n]) for n in pair},
               "ratio_pct": npr["on"] * 1e-9 * d["records_per_op"] / m_off * 100,
               "ratio_file_pct": npr["file"] * 1e-9 * d["records_per_op"] / m_off * 100}
        table.append(row)
        print(f"| {_lab(size)} | {d['records_per_op']} | {nmed['on']:.0f} ({npr['on']:.0f}) "
              f"| {nmed['file']:.0f} ({npr['file']:.0f}) | {fmt(row['off_s'])} "
              f"| {fmt(row['on_s'])} | {fmt(row['on_minus_off_s'])} | {fmt(row['off2_minus_off_s'])} "
              f"| {fmt(row['file_minus_off_s'])} | {row['ratio_pct']:.4f}% | {row['ratio_file_pct']:.4f}% |")
    big = [r for r in table if r["size"] >= 1 << 20]
    print()
    print("ns/record: the largest over ranks of the median of --samples single-op samples (the mean over the")
    print("timed allreduces in brackets: wall time, so a preemption of the communication thread inside the")
    print("record's code lands in it). The ratio uses the mean.")
    print("ratio = ns/record x records/op / median allreduce time with records off; target <= 1% at >= 1 MiB: "
          + ("met (memory: %s; with JSON lines: %s)" % (
              "yes" if all(r["ratio_pct"] <= 1 for r in big) else "NO",
              "yes" if all(r["ratio_file_pct"] <= 1 for r in big) else "NO")))
    print("on - off etc. are medians of per-repetition paired differences; compare them with the control's.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "raw": res, "table": table,
                       "json_lines": lines}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
