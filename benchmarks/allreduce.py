#!/usr/bin/env python3
"""Allreduce benchmark: xirang (TCP and shared memory) vs gloo vs raw TCP, in the same processes,
nccl-tests style.

    python3 benchmarks/allreduce.py                       # WS 2 and 4, 4 KiB .. 256 MiB, 15 reps
    python3 benchmarks/allreduce.py --ws 2 --sizes 64K-64M --reps 15 --markdown
    XIRANG_SEGMENT_BYTES=262144 python3 benchmarks/allreduce.py --ws 2 --sizes 16M,64M

One self-spawning job per world size (torch.multiprocessing, spawn). Each rank sets
torch.set_num_threads(1), creates a xirang default group with XIRANG_TRANSPORT_LOCAL=tcp, a
second xirang group with XIRANG_TRANSPORT_LOCAL=shm (the ranks' shared-memory domain; skipped
with --no-shm) and a gloo group (dist.new_group(backend="gloo")) plus a raw TCP ring (connect to rank+1, accept from rank-1;
for WS=2 that is one connection each way between the two processes), and for every size
runs warmup, then `--reps` repetitions in which xirang, xirang-shm, gloo and raw TCP take turns (the
order rotates every repetition). A repetition is `iters` back-to-back ops (more for small
sizes, so a repetition lasts long enough to time); its time is the slowest rank's.

Columns (1e9 B/s, like nccl-tests):
    time   median time of one allreduce, microseconds (IQR = p75 - p25 of the repetitions)
    algbw  bytes / time
    busbw  algbw * 2(N-1)/N  (bytes each rank sends in a ring allreduce, per second)
    ceil   raw TCP: each rank sends 2(N-1)/N * bytes to rank+1 while it receives as many from
           rank-1 (a thread sends, the main thread receives); GB/s of bytes sent per rank, so
           it compares directly with busbw. It moves bytes only (no reduction, no copy).
    x/g    xirang busbw / gloo busbw;   x/ceil  xirang busbw / ceiling
    shm    xirang over shared memory (XIRANG_TRANSPORT_LOCAL=shm): time, busbw; s/x = shm busbw /
           xirang (TCP) busbw, s/g = shm busbw / gloo busbw
    copy   torch copy_ of the buffer into another one on rank 0, measured in the same run (GB/s of
           bytes copied = read + write of `bytes` each): what one memory copy of the message
           costs; s/copy = shm algbw / copy bandwidth (shm reads every input once and writes
           and reads the results: below 1 by construction)
After the table: the CPU a rank burns while it waits in an allreduce for a late peer (rank 0
enters 2 s late), per transport, as % of one core.
XIRANG_* knobs set in the environment reach the ranks (e.g. XIRANG_SEGMENT_BYTES,
XIRANG_SMALL_BYTES, XIRANG_ALGO=ring|direct).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import machine_info, run_ranks  # noqa: E402

KiB = 1024
MiB = 1024 * 1024
DEFAULT_SIZES = [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
TARGET_LOOP_BYTES = 4 * MiB  # a repetition of a small size runs ~this many bytes (capped iters)


# ---------------------------------------------------------------- argument parsing
def parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    for suf, m in (("K", KiB), ("M", MiB), ("G", 1024 * MiB)):
        if s.endswith(suf):
            s, mult = s[:-1], m
            break
    return int(float(s) * mult)


def parse_sizes(spec: str) -> list[int]:
    """'64K-64M' = the default list (powers of 4 and 16/64 MiB) within the range; or '4K,1M,16M'."""
    if "-" in spec and "," not in spec:
        lo, hi = (parse_size(x) for x in spec.split("-", 1))
        out, s = [], 4 * KiB
        while s <= hi:
            if s >= lo:
                out.append(s)
            s *= 4
        for extra in (16 * MiB, 64 * MiB):
            if lo <= extra <= hi and extra not in out:
                out.append(extra)
        return sorted(out)
    return sorted({parse_size(x) for x in spec.split(",") if x.strip()})


def fmt_bytes(n: int) -> str:
    for unit, m in (("GiB", 1024 * MiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------- raw TCP ceiling
class RawRing:
    """Rank r sends to rank r+1 on one connection and receives from rank r-1 on another."""

    def __init__(self, store, rank: int, ws: int, tag: str):
        self.rank, self.ws = rank, ws
        lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lst.bind(("127.0.0.1", 0))
        lst.listen(4)
        store.set(f"{tag}/port/{rank}", str(lst.getsockname()[1]))
        nxt = (rank + 1) % ws
        port = int(store.get(f"{tag}/port/{nxt}").decode())
        self.tx = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.tx.settimeout(None)
        lst.settimeout(60)
        self.rx, _ = lst.accept()
        self.rx.settimeout(None)
        lst.close()
        for s in (self.tx, self.rx):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sendbuf = bytearray()
        self.recvbuf = bytearray()
        # a persistent sender thread; blocking sendall and recv_into(MSG_WAITALL) are (close to)
        # one syscall each, with the GIL released, so Python adds little per exchange
        self._go = threading.Semaphore(0)
        self._done = threading.Semaphore(0)
        self._n = 0
        self._err = None
        self._th = threading.Thread(target=self._sender, daemon=True)
        self._th.start()

    def _sender(self):
        while True:
            self._go.acquire()
            if self._n < 0:
                return
            try:
                self.tx.sendall(memoryview(self.sendbuf)[: self._n])
            except BaseException as e:  # pragma: no cover
                self._err = e
            self._done.release()

    def exchange(self, nbytes: int) -> None:
        if len(self.sendbuf) < nbytes:
            self.sendbuf = bytearray(b"\x01" * nbytes)
            self.recvbuf = bytearray(nbytes)
        self._n = nbytes
        self._go.release()
        view = memoryview(self.recvbuf)
        got = 0
        while got < nbytes:
            k = self.rx.recv_into(view[got:nbytes], nbytes - got, socket.MSG_WAITALL)
            if k == 0:
                raise RuntimeError("raw TCP: peer closed")
            got += k
        self._done.acquire()
        if self._err:
            raise self._err

    def close(self):
        self._n = -1
        self._go.release()
        self._th.join()
        self.tx.close()
        self.rx.close()


# ---------------------------------------------------------------- one rank
def worker(rank: int, ws: int, port: int, cfg: dict, q) -> None:
    try:
        import torch
        import torch.distributed as dist

        import xirang  # noqa: F401  registers the backend

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, ws, rank == 0, timeout=datetime.timedelta(seconds=60))
        timeout = datetime.timedelta(seconds=cfg["op_timeout"])
        os.environ["XIRANG_TRANSPORT_LOCAL"] = "tcp"  # read when a group is created
        dist.init_process_group("xirang", store=store, rank=rank, world_size=ws, timeout=timeout)
        groups = {"xirang": dist.group.WORLD, "gloo": dist.new_group(backend="gloo", timeout=timeout)}
        if cfg["shm"]:
            os.environ["XIRANG_TRANSPORT_LOCAL"] = "shm"
            groups["shm"] = dist.new_group(backend="xirang", timeout=timeout)
        gloo = groups["gloo"]
        ring = RawRing(store, rank, ws, "rawtcp") if cfg["ceiling"] else None
        dtype = getattr(torch, cfg["dtype"])
        esize = torch.empty((), dtype=dtype).element_size()
        busfac = 2.0 * (ws - 1) / ws

        def sync():
            dist.barrier(group=gloo)

        def run_op(kind: str, t, iters: int, raw_bytes: int) -> float:
            """Runs `iters` ops of `kind`; returns this rank's seconds per op."""
            sync()
            t0 = time.perf_counter()
            if kind == "tcp":
                for _ in range(iters):
                    ring.exchange(raw_bytes)
            elif kind == "copy":  # rank 0 copies; the others only keep the rhythm
                if rank == 0:
                    for _ in range(iters):
                        copy_dst.copy_(t)
            else:
                g = groups[kind]
                for _ in range(iters):
                    dist.all_reduce(t, group=g)
            return (time.perf_counter() - t0) / iters

        rows = []
        for nbytes in cfg["sizes"]:
            n = max(1, nbytes // esize)
            nbytes = n * esize
            iters = cfg["iters"] or max(1, min(50, TARGET_LOOP_BYTES // nbytes))
            t = torch.empty(n, dtype=dtype)
            copy_dst = torch.empty_like(t)
            raw_bytes = int(round(busfac * nbytes))
            colls = ["xirang"] + (["shm"] if cfg["shm"] else []) + ["gloo"]
            kinds = colls + (["tcp"] if ring else []) + ["copy"]
            # correctness spot check, then warmup (zeros keep repeated sums finite and exact)
            for k in colls:
                t.fill_(rank + 1)
                dist.all_reduce(t, group=groups[k])
                want = ws * (ws + 1) / 2
                if not (t[0].item() == want and t[-1].item() == want):
                    raise RuntimeError(f"{k}: wrong allreduce result {t[0].item()} != {want} at {nbytes} B")
            t.zero_()
            for _ in range(cfg["warmup"]):
                for k in kinds:
                    run_op(k, t, 1, raw_bytes)
            times = {k: [] for k in kinds}
            for r in range(cfg["reps"]):
                order = kinds[r % len(kinds):] + kinds[: r % len(kinds)]
                for k in order:
                    times[k].append(run_op(k, t, iters, raw_bytes))
            # the time of a repetition is the slowest rank's
            for k in kinds:
                tt = torch.tensor(times[k], dtype=torch.float64)
                dist.all_reduce(tt, op=dist.ReduceOp.MAX, group=gloo)
                times[k] = tt.tolist()
            if rank == 0:
                row = {"ws": ws, "bytes": nbytes, "elements": n, "dtype": cfg["dtype"], "iters": iters,
                       "reps": cfg["reps"]}
                for k in kinds:
                    qs = statistics.quantiles(times[k], n=4, method="inclusive") if len(times[k]) > 1 else [times[k][0]] * 3
                    med = statistics.median(times[k])
                    if k == "tcp":
                        row["ceil_gbps"] = raw_bytes / med / 1e9
                        row["ceil_time_us"] = med * 1e6
                        row["ceil_iqr_us"] = (qs[2] - qs[0]) * 1e6
                    elif k == "copy":
                        row["copy_gbps"] = nbytes / med / 1e9
                    else:
                        algbw = nbytes / med / 1e9
                        row[k] = {"time_us": med * 1e6, "iqr_us": (qs[2] - qs[0]) * 1e6,
                                  "algbw": algbw, "busbw": algbw * busfac,
                                  "samples_us": [x * 1e6 for x in times[k]]}
                # xirang's own record of this rank's timed ops of this size: where the time went
                try:
                    rec = [r for r in xirang.stats() if r.get("numel") == n and r.get("ok", True)]
                    rec = rec[-cfg["reps"] * iters:]
                    if rec:
                        row["xirang_rank0"] = {"algorithm": rec[-1].get("algorithm"),
                                               "bytes_wire": rec[-1].get("bytes_wire")}
                        for f in ("queued_s", "encode_s", "scatter_reduce_s", "allgather_s", "decode_s", "total_s"):
                            vals = [r[f] for r in rec if isinstance(r.get(f), (int, float))]
                            if vals:
                                row["xirang_rank0"][f.replace("_s", "_us")] = statistics.median(vals) * 1e6
                except Exception as e:  # stats are a diagnostic only
                    row["xirang_rank0"] = {"error": repr(e)}
                rows.append(row)
                q.put(("row", row))
            del t
        if ring:
            ring.close()
        # CPU of a waiting rank: every rank but 0 enters a small allreduce at once, rank 0 two
        # seconds later; the waiters' process CPU time over their wait, in % of one core.
        idle = {}
        for k in [c for c in colls if c != "gloo"]:
            x = torch.ones(1024)
            sync()
            if rank == 0:
                time.sleep(2.0)
            c0, w0 = time.process_time(), time.perf_counter()
            dist.all_reduce(x, group=groups[k])
            cpu = torch.tensor([100.0 * (time.process_time() - c0) / (time.perf_counter() - w0) if rank else 0.0])
            dist.all_reduce(cpu, op=dist.ReduceOp.MAX, group=gloo)
            idle[k] = round(cpu.item(), 1)
        if rank == 0:
            q.put(("info", {f"waiting_rank_cpu_pct_{k}": v for k, v in idle.items()}))
        dist.barrier(group=gloo)
        dist.destroy_process_group()
        q.put(("done", rank))
    except BaseException:
        q.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


# ---------------------------------------------------------------- driver
def run_ws(ws: int, cfg: dict, on_row) -> tuple[list, dict]:
    rows, info = [], {}

    def on_message(kind, val):
        if kind == "row":
            rows.append(val)
            on_row(val)
        elif kind == "info":
            info.update(val)

    run_ranks(worker, ws, cfg, on_message)
    return rows, info


HDR = (f"{'size':>9} {'elements':>10} | {'xirang us':>10} {'iqr':>7} {'algbw':>6} {'busbw':>6} |"
       f" {'gloo us':>10} {'iqr':>7} {'algbw':>6} {'busbw':>6} | {'ceil':>6} | {'x/g':>5} {'x/ceil':>6} |"
       f" {'shm us':>9} {'busbw':>6} {'s/x':>6} {'s/g':>6} | {'copy':>6} {'s/copy':>6}")


def fmt_row(r: dict) -> str:
    x, g = r["xirang"], r["gloo"]
    ceil = r.get("ceil_gbps")
    s = (f"{r['bytes']:>9} {r['elements']:>10} | {x['time_us']:>10.1f} {x['iqr_us']:>7.1f} {x['algbw']:>6.2f}"
         f" {x['busbw']:>6.2f} | {g['time_us']:>10.1f} {g['iqr_us']:>7.1f} {g['algbw']:>6.2f} {g['busbw']:>6.2f} |")
    s += f" {ceil:>6.2f} |" if ceil else f" {'-':>6} |"
    s += f" {x['busbw'] / g['busbw']:>5.2f}"
    s += f" {x['busbw'] / ceil:>6.2f} |" if ceil else f" {'-':>6} |"
    m = r.get("shm")
    if m:
        s += (f" {m['time_us']:>9.1f} {m['busbw']:>6.2f} {m['busbw'] / x['busbw']:>6.2f}"
              f" {m['busbw'] / g['busbw']:>6.2f} |")
    else:
        s += f" {'-':>9} {'-':>6} {'-':>6} {'-':>6} |"
    c = r.get("copy_gbps")
    s += f" {c:>6.2f} " + (f"{m['algbw'] / c:>6.2f}" if m else f"{'-':>6}")
    return s


def markdown(rows: list) -> str:
    out = ["| WS | size | xirang time us (IQR) | xirang busbw | gloo time us (IQR) | gloo busbw | TCP ceiling"
           " | xirang/gloo | xirang/ceiling | shm time us (IQR) | shm busbw | shm/xirang | shm/gloo | copy_ GB/s"
           " | shm algbw/copy |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        x, g, c, m, cp = r["xirang"], r["gloo"], r.get("ceil_gbps"), r.get("shm"), r.get("copy_gbps")
        line = (f"| {r['ws']} | {fmt_bytes(r['bytes'])} | {x['time_us']:.1f} ({x['iqr_us']:.1f}) | {x['busbw']:.2f}"
                f" | {g['time_us']:.1f} ({g['iqr_us']:.1f}) | {g['busbw']:.2f} | "
                + (f"{c:.2f}" if c else "-") + f" | {x['busbw'] / g['busbw']:.2f} | "
                + (f"{x['busbw'] / c:.2f}" if c else "-") + " | ")
        if m:
            line += (f"{m['time_us']:.1f} ({m['iqr_us']:.1f}) | {m['busbw']:.2f} | {m['busbw'] / x['busbw']:.2f}"
                     f" | {m['busbw'] / g['busbw']:.2f} | ")
        else:
            line += "- | - | - | - | "
        line += (f"{cp:.2f}" if cp else "-") + " | " + (f"{m['algbw'] / cp:.2f}" if m and cp else "-") + " |"
        out.append(line)
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4K-256M",
                    help="'LO-HI' (powers of 4 from 4 KiB, plus 16M and 64M, within the range) or a list '4K,1M,16M'")
    ap.add_argument("--ws", default="2,4", help="world sizes, comma-separated (default 2,4)")
    ap.add_argument("--reps", type=int, default=15, help="timed repetitions per backend and size (default 15)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed ops per backend and size first (default 3)")
    ap.add_argument("--iters", type=int, default=0,
                    help="ops per repetition (default 0 = auto: up to 50 for small sizes, 1 from 4 MiB)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    ap.add_argument("--no-ceiling", dest="ceiling", action="store_false", help="skip the raw TCP ceiling")
    ap.add_argument("--no-shm", dest="shm", action="store_false",
                    help="skip the xirang group over shared memory (XIRANG_TRANSPORT_LOCAL=shm)")
    ap.add_argument("--timeout", type=float, default=1800, help="wall-clock bound per world size, seconds")
    ap.add_argument("--op-timeout", type=float, default=300, help="group timeout of both groups, seconds")
    ap.add_argument("--json", metavar="PATH", help="write rows, samples and machine info as JSON")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="after each row, print xirang's own phase times on rank 0 (xirang.stats())")
    ap.add_argument("--markdown", action="store_true", help="also print a markdown table (for the README)")
    a = ap.parse_args(argv)

    try:
        sizes = parse_sizes(a.sizes)
    except (ValueError, OverflowError):
        ap.error(f"--sizes {a.sizes!r}: expected 'LO-HI' or a list like '4K,1M,16M' (suffixes K, M, G)")
    if any(not 1 <= x <= 16 * 1024 * MiB for x in sizes):
        ap.error(f"--sizes {a.sizes!r}: every size must be 1 byte to 16 GiB")
    try:
        wss = [int(x) for x in a.ws.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--ws {a.ws!r}: expected world sizes like '2,4'")
    if a.iters < 0 or a.warmup < 0:
        ap.error("--iters and --warmup must be >= 0 (--iters 0: auto)")
    if not 0 < a.timeout < 1e7 or not 0 < a.op_timeout < 1e7:
        ap.error("--timeout and --op-timeout must be > 0 seconds (and finite)")
    cfg = {"sizes": sizes, "reps": a.reps, "warmup": a.warmup, "iters": a.iters,
           "dtype": a.dtype, "ceiling": a.ceiling, "shm": a.shm, "timeout": a.timeout, "op_timeout": a.op_timeout}
    if not wss or min(wss) < 2:
        ap.error("--ws: world sizes must be >= 2 (busbw is 0 at WS=1)")
    if a.reps < 1 or not cfg["sizes"]:
        ap.error("need --reps >= 1 and at least one size")
    info = machine_info()
    print(f"# xirang allreduce benchmark: {info.get('cpu', '?')}, {info['cpus']} CPUs, "
          f"load {tuple(round(x, 2) for x in info.get('loadavg', ()))}, torch {info.get('torch')}, "
          f"dtype {a.dtype}, reps {a.reps}, env {info['env'] or '{}'}")
    print("# times: median (IQR) of the slowest rank, microseconds; bandwidths 1e9 B/s;"
          " busbw = algbw*2(N-1)/N; ceil = raw TCP GB/s sent per rank")
    all_rows, failures = [], []
    for ws in wss:
        print(f"\n# WS={ws}\n{HDR}", flush=True)
        try:
            def on_row(r):
                print(fmt_row(r), flush=True)
                if a.verbose and r.get("xirang_rank0"):
                    x = r["xirang_rank0"]
                    print("#   xirang rank 0 (median us): " + ", ".join(
                        f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}" for k, v in x.items()), flush=True)

            rows, extra = run_ws(ws, cfg, on_row)
            all_rows += rows
            if extra:
                print(f"# {extra}")
        except Exception as e:
            failures.append(str(e))
            print(f"# FAILED: {e}", file=sys.stderr, flush=True)
    info["loadavg_end"] = os.getloadavg()
    print(f"\n# load average at end: {tuple(round(x, 2) for x in info['loadavg_end'])}")
    if a.markdown and all_rows:
        print()
        print(markdown(all_rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": info, "config": cfg, "rows": all_rows, "failures": failures}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
