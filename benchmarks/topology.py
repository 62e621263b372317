#!/usr/bin/env python3
"""Topology benchmark on the emulated cluster (tests/cluster/netns): rank-order ring vs
topology ring vs two-level vs gloo, allreduce 1-64 MiB and a DDP step, side by side in one run.

    sudo python3 benchmarks/topology.py                      # 2 racks x 2 hosts x 2 ranks, 200mbit uplinks
    sudo python3 benchmarks/topology.py --ranks-per-host 1 --sizes 1M,4M --markdown --json /tmp/t.json
    sudo python3 benchmarks/topology.py --ranks-per-host 1 --sizes '' --ddp-steps 0 --probe-mb 0 --sweep-groups 10
                                                             # layers_per_group auto vs 1, 2, 4, 8, 16 (slow links)

Set-up (defaults): 2 racks x 2 hosts (network namespaces) x 2 ranks; each rack is a bridge,
its uplink to the core bridge a veth pair shaped with tc tbf at --rate in both directions (queue
--queue, 5 ms: a shallow switch-port buffer, see tests/cluster/netns), plus
--delay one way across racks (netem where the kernel has sch_netem, else tests/cluster/netns's NFQUEUE delay
line, delayq.py; the header says which, and the cross-rack ping RTT measured at set-up);
intra-rack traffic is unlimited. Ranks are placed round-robin across racks (rank r on rack r % 2,
host (r // 2) % 2), the placement a launcher ignorant of the topology may produce; rendezvous
on a TCPStore in the root namespace at the core bridge's address.

In every rank, one process holds four groups over the same ranks:
  rank-ring   xirang, Options(algorithm="ring", ring_order="rank")  (= XIRANG_RING_ORDER=rank XIRANG_ALGO=ring)
  topo-ring   xirang, Options(algorithm="ring")                     (= XIRANG_ALGO=ring)
  two-level   xirang, Options(algorithm="two_level")                (= XIRANG_ALGO=two_level)
  gloo        the default group (GLOO_SOCKET_IFNAME=xeth0)
Allreduce: float32 SUM of integer-valued inputs (every result is checked exactly); --warmup
untimed ops per method at the smallest size, then per size repetitions in which the methods take
turns (order rotates); a repetition is one op after a gloo barrier, its time the slowest rank's. DDP: an MLP (--layers x Linear(--width, --width)), batch --batch; one step is
forward + backward (+ the comm hook) + SGD step, timed like an allreduce repetition. xirang methods
use `xirang.register_comm_hook(ddp_model)` (BF16 on the wire, error feedback); gloo runs DDP's
default fp32 allreduce and, as "gloo+fp16", torch's fp16_compress_hook (the same wire bytes as
xirang's hook); "xirang+fp16" / "xirang+int8" are the hook with wire="fp16" / "int8" on the
two-level group (fp32 inside hosts, the format across them). "compute" is the same step without
DDP (no communication).
Cross-rack MB: bytes_cross_rack of the op's xirang.stats() record, summed over ranks.
--sweep-groups STEPS: the hook (bf16) on the topology-ring group with layers_per_group --sweep-sizes
(default 1, 2, 4, 8, 16) and "auto" on --sweep-layers x [Linear(--sweep-width) + ReLU] blocks (one
layer each; --sweep-model gpt2: GPT-2's module tree, --sweep-layers blocks of width --sweep-width),
bucket_cap_mb
--sweep-bucket-mb; --sweep-warmup untimed steps per size (auto calibrates and decides there), then
STEPS timed steps with the sizes taking turns; the table gives each size's median step (slowest
rank), IQR and ratio to the best fixed size, auto's choice and rank 0's model (alpha, beta,
contention, slowdown, predicted exposed communication per size); --json keeps auto's calibration
samples and inputs (``auto_samples``, ``auto_inputs``: rank 0's), to replay its model offline.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "cluster"))
sys.path.insert(0, HERE)
from _ranks import auto_model, auto_warmup  # noqa: E402

KiB, MiB = 1024, 1024 * 1024
METHODS = ("rank-ring", "topo-ring", "two-level", "gloo")
SWEEP = "1,2,4,8,16"  # --sweep-sizes default: the fixed layers_per_group sizes auto is compared with


def parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("B").removesuffix("I")
    for suf, m in (("K", KiB), ("M", MiB), ("G", 1024 * MiB)):
        if s.endswith(suf):
            return int(float(s[:-1]) * m)
    return int(s)


def fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n // KiB} KiB"


# ======================================================================== worker (one rank)
def pair_socket(store, key, rank, src, dst, ips, socket):
    """A TCP connection from rank src to rank dst (dst listens on its own address, the port goes
    through the store under key): src and dst get their end, other ranks None."""
    if rank == dst:
        srv = socket.socket()
        srv.bind((ips[rank], 0))
        srv.listen(1)
        store.set(key, str(srv.getsockname()[1]))
        c, _ = srv.accept()
        srv.close()
        return c
    if rank == src:
        return socket.create_connection((ips[dst], int(store.get(key))))
    return None


def lockstep_probe(cfg, store, rank, socket, dist) -> dict:
    """k = 1, 2, 4 TCP flows each way between k ranks of rank 0's rack and k ranks of another rack,
    all at once (so data and ACKs of both directions share each uplink, as in a ring), in lockstep
    rounds as a ring's steps are: each round every flow moves --probe-mb / 4 bytes and a barrier ends
    it. Returns {k: Mbit/s the k flows of one direction moved together, the barrier's time taken
    off}: whether ring edges sharing a rack uplink split it without loss, as xirang.sim assumes
    (RingSet: uplink / flows)."""
    import threading

    racks = cfg["racks_of"]
    mine = [r for r in range(len(racks)) if racks[r] == racks[0]]
    other = [r for r in range(len(racks)) if racks[r] != racks[0]]
    chunk = max(1, cfg["probe_bytes"] // 4)
    rounds = 3
    out = {}
    for k in (1, 2, 4):
        if k > min(len(mine), len(other)):
            break
        flows = list(zip(mine[:k], other[:k])) + list(zip(other[:k], mine[:k]))
        tx = rx = None
        for i, (src, dst) in enumerate(flows):
            c = pair_socket(store, f"lockstep/{k}/{i}", rank, src, dst, cfg["ips"], socket)
            if rank == dst:
                rx = c
            elif rank == src:
                tx = c
        sbuf, rbuf = bytearray(chunk), bytearray(chunk)

        def one_round(nbytes):
            dist.barrier()
            t0 = time.perf_counter()
            th = None
            if tx is not None and nbytes:
                th = threading.Thread(target=tx.sendall, args=(memoryview(sbuf)[:nbytes],))
                th.start()
            if rx is not None and nbytes:
                view, got = memoryview(rbuf), 0
                while got < nbytes:
                    got += rx.recv_into(view[got:nbytes], nbytes - got)
            if th is not None:
                th.join()
            dist.barrier()
            return time.perf_counter() - t0

        one_round(chunk)  # warm-up (slow start)
        empty = min(one_round(0) for _ in range(3))
        t = sum(one_round(chunk) for _ in range(rounds)) - rounds * empty
        out[str(k)] = k * chunk * rounds * 8 / t / 1e6
        for c in (tx, rx):
            if c is not None:
                c.close()
        dist.barrier()
    return out


def worker() -> int:
    import socket

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import xirang

    cfg = json.loads(os.environ["XIRANG_BENCH_CFG"])
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=cfg["op_timeout"])
    dist.init_process_group("gloo", init_method="env://", timeout=timeout)
    rank, ws = dist.get_rank(), dist.get_world_size()
    groups = {
        "rank-ring": dist.new_group(backend="xirang", pg_options=xirang.Options(algorithm="ring", ring_order="rank")),
        "topo-ring": dist.new_group(backend="xirang", pg_options=xirang.Options(algorithm="ring")),
        "two-level": dist.new_group(backend="xirang", pg_options=xirang.Options(algorithm="two_level")),
        "gloo": dist.group.WORLD,
    }
    info = {"rings": {m: list(xirang._backend_for(groups[m]).ring) for m in METHODS if m != "gloo"}}

    def slowest(dt: float) -> float:
        t = torch.tensor([dt], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def rotate_timed(names, step, warmup: int, steps: int) -> dict:
        """`warmup` untimed step(n) of every name, then `steps` rounds in which the names take
        turns (the order rotates), each step after a barrier: name -> the slowest rank's seconds."""
        for _ in range(warmup):
            for n in names:
                step(n)
        times = {n: [] for n in names}
        for i in range(steps):
            k = i % len(names)
            for n in names[k:] + names[:k]:
                dist.barrier()
                t0 = time.perf_counter()
                step(n)
                times[n].append(slowest(time.perf_counter() - t0))
        return times

    def total(v: float) -> float:
        t = torch.tensor([v], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t)

    # ---- raw TCP between namespaces: rank 0 -> the first rank on another rack / same rack
    store = dist.distributed_c10d._get_default_store()
    link = {}
    for name, dst in (("cross-rack", cfg["probe_cross"]), ("intra-rack", cfg["probe_intra"])):
        if dst is None:
            continue
        nbytes = cfg["probe_bytes"]
        c = pair_socket(store, f"probe/{name}", rank, 0, dst, cfg["ips"], socket)
        if rank == dst:
            got = 0
            while got < nbytes:
                b = c.recv(1 << 20)
                if not b:
                    break
                got += len(b)
            c.sendall(b"k")
            c.close()
        elif rank == 0:
            buf = b"\0" * (1 << 20)
            t0 = time.perf_counter()
            sent = 0
            while sent < nbytes:
                c.sendall(buf)
                sent += len(buf)
            c.recv(1)
            link[name] = nbytes * 8 / (time.perf_counter() - t0) / 1e6
            c.close()
        dist.barrier()
    info["link_mbit"] = link
    if cfg["probe_cross"] is not None:
        info["lockstep_mbit"] = lockstep_probe(cfg, store, rank, socket, dist)

    # ---- allreduce
    rows = []
    for size in cfg["sizes"]:
        numel = size // 4
        base = ((torch.arange(numel, dtype=torch.int64) * (rank + 1)) % 61).to(torch.float32)
        ref = sum(((torch.arange(numel, dtype=torch.int64) * (r + 1)) % 61) for r in range(ws)).to(torch.float32)
        if size == cfg["sizes"][0]:  # warm-up (connections, buffers): smallest size only
            for m in METHODS:
                for _ in range(cfg["warmup"]):
                    dist.all_reduce(base.clone(), group=groups[m])
        reps = cfg["reps"].get(str(size), 1)
        times = {m: [] for m in METHODS}
        cross = {m: [] for m in METHODS}
        for i in range(reps):
            order = METHODS[i % 4:] + METHODS[:i % 4]
            for m in order:
                y = base.clone()
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(y, group=groups[m])
                dt = time.perf_counter() - t0
                times[m].append(slowest(dt))
                if not torch.equal(y, ref):
                    raise AssertionError(f"{m} {fmt_size(size)}: wrong allreduce result")
                if m != "gloo":
                    rec = [r for r in xirang.stats(groups[m]) if r["op"] == "all_reduce"][-1]
                    cross[m].append((total(rec["bytes_cross_rack"]), total(rec["bytes_cross_host"]), rec["algorithm"]))
        rows.append({"kind": "allreduce", "size": size, "reps": reps, "times": times,
                     "cross_rack": {m: cross[m][0][0] for m in METHODS if cross[m]},
                     "cross_host": {m: cross[m][0][1] for m in METHODS if cross[m]},
                     "algorithm": {m: cross[m][0][2] for m in METHODS if cross[m]}})
        if rank == 0:
            print(f"allreduce {fmt_size(size)}: " + "  ".join(
                f"{m} {statistics.median(times[m]) * 1e3:.0f} ms" for m in METHODS), file=sys.stderr, flush=True)

    # ---- DDP step
    if cfg["ddp_steps"] > 0:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def make_model():
            torch.manual_seed(0)
            layers = []
            for _ in range(cfg["layers"]):
                layers += [nn.Linear(cfg["width"], cfg["width"]), nn.ReLU()]
            return nn.Sequential(*layers)

        g = torch.Generator().manual_seed(rank)
        data = torch.randn(cfg["batch"], cfg["width"], generator=g)
        nparams = sum(p.numel() for p in make_model().parameters())
        # xirang+fp16 / +int8: the hook's scaled wire formats on the two-level group (fp32 inside
        # hosts, the format across them).
        ddp_methods = ["compute"] + list(METHODS) + ["gloo+fp16", "xirang+fp16", "xirang+int8"]
        models = {}
        for m in ddp_methods:
            net = make_model()
            if m == "compute":
                models[m] = (net, torch.optim.SGD(net.parameters(), lr=1e-3))
                continue
            pg = groups["gloo" if m.startswith("gloo") else ("two-level" if m.startswith("xirang+") else m)]
            d = DDP(net, process_group=pg, bucket_cap_mb=cfg["bucket_mb"])
            if m == "gloo+fp16":
                d.register_comm_hook(pg, default_hooks.fp16_compress_hook)
            elif m.startswith("xirang+"):
                xirang.register_comm_hook(d, wire=m.split("+")[1])
            elif m != "gloo":
                xirang.register_comm_hook(d)
            models[m] = (d, torch.optim.SGD(d.parameters(), lr=1e-3))

        def step(m):
            net, opt = models[m]
            opt.zero_grad(set_to_none=True)
            loss = net(data).pow(2).mean()
            loss.backward()
            opt.step()

        times = rotate_timed(ddp_methods, step, 1, cfg["ddp_steps"])  # warm-up: hook state, buckets
        cross = {}
        for m in list(METHODS[:3]) + ["xirang+fp16", "xirang+int8"]:  # one more step per xirang method: its records
            pg = groups["two-level" if m.startswith("xirang+") else m]
            n0 = len(xirang.stats(pg))
            step(m)
            new = xirang.stats(pg)[n0:]
            cross[m] = total(sum(r["bytes_cross_rack"] for r in new))
        rows.append({"kind": "ddp", "params": nparams, "times": times, "cross_rack": cross})
        if rank == 0:
            print("ddp step: " + "  ".join(f"{m} {statistics.median(times[m]) * 1e3:.0f} ms" for m in ddp_methods),
                  file=sys.stderr, flush=True)

    # ---- layers_per_group auto against fixed sizes (--sweep-groups): the hook on the topology ring
    if cfg["sweep_steps"] > 0:
        torch.manual_seed(0)
        width = cfg["sweep_width"]
        g = torch.Generator().manual_seed(rank)
        gpt2 = cfg["sweep_model"] == "gpt2"
        if gpt2:  # GPT-2's module tree (benchmarks/ddp_step.py's make_gpt2); token ids and next tokens
            sys.path.insert(0, HERE)
            from ddp_step import gpt2_vocab, make_gpt2  # noqa: PLC0415

            vocab, seq = gpt2_vocab(width), 64
            toks = torch.randint(0, vocab, (cfg["batch"], seq + 1), generator=g)
            data, target = toks[:, :-1].contiguous(), toks[:, 1:].contiguous()
        else:
            data = torch.randn(cfg["batch"], width, generator=g)
        sizes = [str(k) for k in cfg["sweep_sizes"]] + ["auto"]
        models = {}
        for k in sizes:
            torch.manual_seed(0)
            if gpt2:
                net = make_gpt2(cfg["sweep_layers"], width, 4, vocab, seq)
            else:
                net = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU())
                                      for _ in range(cfg["sweep_layers"])])
            d = DDP(net, process_group=groups["topo-ring"], bucket_cap_mb=cfg["sweep_bucket_mb"])
            st = xirang.register_comm_hook(d, layers_per_group="auto" if k == "auto" else int(k))
            models[k] = (d, torch.optim.SGD(d.parameters(), lr=1e-3), st)

        def sweep_step(k):
            net, opt, _ = models[k]
            opt.zero_grad(set_to_none=True)
            out = net(data)
            loss = (nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1)) if gpt2
                    else out.pow(2).mean())
            loss.backward()
            opt.step()

        # auto's calibration happens in the warm-up (DDP's first step + 4)
        times = rotate_timed(sizes, sweep_step, cfg["sweep_warmup"], cfg["sweep_steps"])
        st = models["auto"][2]
        a = st.stats()["autogroup"] or {}
        cal = st._auto.calibration_record()
        rows.append({"kind": "sweep", "times": times, "chosen": st.group_size(),
                     "predicted_exposed_s": a.get("predicted_exposed_comm_s"),
                     "measured_exposed_s": a.get("measured_exposed_comm_s"),
                     "autogroup": {k: a.get(k) for k in ("alpha_s", "beta_s_per_byte", "contention",
                                                         "contention_by_size", "slowdown", "tail_s",
                                                         "tail_s_per_byte",
                                                         "predictions_s", "source")},
                     "params": sum(p.numel() for p in models["auto"][0].parameters()),
                     # auto's calibration, to replay its model offline
                     "auto_inputs": cal["inputs"], "auto_samples": cal["samples"]})
        if rank == 0:
            print("sweep: " + "  ".join(f"{k} {statistics.median(times[k]) * 1e3:.0f} ms" for k in sizes)
                  + f"; auto chose {st.group_size()}", file=sys.stderr, flush=True)

    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump({"rows": rows, "info": info}, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ======================================================================== launcher
def main() -> int:
    import netns

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    netns.add_cluster_args(ap, ranks_per_host=2)
    ap.add_argument("--sizes", default="1M,4M,16M,64M")
    ap.add_argument("--reps", default="auto", help="repetitions per size: auto (3 below 16 MiB, 2 at "
                    "16 MiB, 1 above) or a number")
    ap.add_argument("--warmup", type=int, default=1, help="untimed ops per method before the first size")
    ap.add_argument("--ddp-steps", type=int, default=3, help="timed steps per method (0: no DDP)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--bucket-mb", type=float, default=25)
    ap.add_argument("--probe-mb", type=float, default=16, help="raw TCP probe size (0: none)")
    ap.add_argument("--sweep-groups", type=int, default=0, metavar="STEPS",
                    help="timed steps of the hook with layers_per_group auto against --sweep-sizes on the "
                         "topology ring (0: none), on the --sweep-model")
    ap.add_argument("--sweep-layers", type=int, default=24)
    ap.add_argument("--sweep-width", type=int, default=256)
    ap.add_argument("--sweep-model", choices=("stack", "gpt2"), default="stack",
                    help="stack: --sweep-layers x [Linear(--sweep-width) + ReLU]; gpt2: GPT-2's module tree "
                         "(benchmarks/ddp_step.py --model gpt2) with --sweep-layers blocks at width --sweep-width "
                         "(a multiple of 4), 4 heads, 64 tokens, vocabulary 50257 x width / 768; on a 2-core "
                         "machine use --sweep-layers 12 --sweep-width 128 --batch 8 (3.5 M parameters)")
    ap.add_argument("--sweep-sizes", default=SWEEP, help="fixed layers_per_group sizes auto is compared with "
                    "(comma-separated ints >= 1)")
    ap.add_argument("--sweep-warmup", type=int, default=None,
                    help="untimed steps per size first (default and least: auto's calibration, 8 with its defaults)")
    ap.add_argument("--sweep-bucket-mb", type=float, default=0.25, help="bucket_cap_mb of the sweep's DDP models")
    ap.add_argument("--timeout", type=float, default=900, help="wall-clock bound of the run, s")
    ap.add_argument("--op-timeout", type=float, default=300)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker()
    try:
        sweep_sizes = sorted({int(k) for k in a.sweep_sizes.split(",") if k.strip()})
    except ValueError:
        sweep_sizes = []
    if not sweep_sizes or min(sweep_sizes) < 1:
        ap.error(f"--sweep-sizes: comma-separated ints >= 1, got {a.sweep_sizes!r}")
    if a.sweep_groups > 0:  # auto_warmup() imports xirang: only for the sweep
        need = auto_warmup()
        if a.sweep_warmup is None:
            a.sweep_warmup = need
        if a.sweep_warmup < need:
            ap.error(f"--sweep-warmup must be >= {need} (auto's calibration: DDP's first step + "
                     f"{need - 2} measured, the choice applied at the next)")
    if a.sweep_model == "gpt2" and (a.sweep_width < 4 or a.sweep_width % 4):
        ap.error(f"--sweep-model gpt2: --sweep-width must be a positive multiple of 4 (4 heads), got {a.sweep_width}")

    if os.geteuid() != 0:
        print("topology benchmark: needs root (ip netns, tc)", file=sys.stderr)
        return 2
    ok, why = netns.probe()
    if not ok:
        print(f"topology benchmark: emulated cluster unavailable: {why}", file=sys.stderr)
        return 2
    sizes = sorted({parse_size(s) for s in a.sizes.split(",") if s.strip()})
    if a.reps == "auto":
        reps = {str(s): (3 if s < 16 * MiB else 2 if s == 16 * MiB else 1) for s in sizes}
    else:
        reps = {str(s): int(a.reps) for s in sizes}
    t_start = time.monotonic()
    load0 = os.getloadavg()
    with netns.Cluster(a.racks, a.hosts_per_rack, a.rate or None, a.delay or None, queue_latency=a.queue) as c:
        hosts = netns.placement(c, a.ranks_per_host, a.placement)
        ws = len(hosts)
        cross = next((r for r in range(1, ws) if hosts[r].rack != hosts[0].rack), None)
        intra = next((r for r in range(1, ws) if hosts[r].rack == hosts[0].rack and hosts[r].ns != hosts[0].ns), None)
        out = tempfile.NamedTemporaryFile(prefix="xrbench_", suffix=".json", delete=False).name
        cfg = {"sizes": sizes, "reps": reps, "warmup": a.warmup, "ddp_steps": a.ddp_steps, "layers": a.layers,
               "sweep_steps": a.sweep_groups, "sweep_layers": a.sweep_layers, "sweep_width": a.sweep_width,
               "sweep_warmup": a.sweep_warmup, "sweep_bucket_mb": a.sweep_bucket_mb,
               "sweep_sizes": sweep_sizes, "sweep_model": a.sweep_model,
               "width": a.width, "batch": a.batch, "bucket_mb": a.bucket_mb, "op_timeout": a.op_timeout,
               "ips": [h.ip for h in hosts], "probe_cross": cross if a.probe_mb > 0 else None,
               "probe_intra": intra if a.probe_mb > 0 else None, "probe_bytes": int(a.probe_mb * MiB), "out": out,
               "racks_of": [h.rack for h in hosts]}
        setup = c.describe()
        print(f"set-up: {setup}\n        {ws} ranks, {a.ranks_per_host} per host, placement {a.placement}: "
              + " ".join(f"{r}:{h.ns[-2:]}/{h.rack}" for r, h in enumerate(hosts)), file=sys.stderr, flush=True)
        try:
            netns.launch(c, [sys.executable, os.path.abspath(__file__), "--worker"], a.ranks_per_host, a.placement,
                         env={"XIRANG_BENCH_CFG": json.dumps(cfg)}, timeout=a.timeout)
        except RuntimeError as e:
            print(f"topology benchmark failed: {e}", file=sys.stderr)
            return 1
        with open(out) as f:
            res = json.load(f)
        os.unlink(out)
    elapsed = time.monotonic() - t_start
    load1 = os.getloadavg()
    report(res, a, setup, ws, hosts, elapsed, load0, load1)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"result": res, "setup": setup, "args": vars(a), "elapsed_s": elapsed,
                       "loadavg": [load0, load1]}, f, indent=1)
    return 0


def report(res, a, setup, ws, hosts, elapsed, load0, load1) -> None:
    md = a.markdown
    info = res["info"]
    lines = []
    lines.append(f"# topology benchmark: {ws} ranks = {a.racks} racks x {a.hosts_per_rack} hosts x "
                 f"{a.ranks_per_host} ranks, placement {a.placement}")
    lines.append(f"# {setup}")
    lines.append("# raw TCP from rank 0 (one stream): " + ", ".join(
        f"{k} {v:.0f} Mbit/s" for k, v in info.get("link_mbit", {}).items()))
    if info.get("lockstep_mbit"):
        lines.append("# cross-rack, k flows sharing the uplink in lockstep rounds: " + ", ".join(
            f"k={k} {v:.0f} Mbit/s" for k, v in info["lockstep_mbit"].items()))
    lines.append("# rings: " + "; ".join(f"{m} {r}" for m, r in info["rings"].items()))
    lines.append(f"# wall {elapsed:.0f} s, load average {load0[0]:.1f} -> {load1[0]:.1f} "
                 f"({os.cpu_count()} CPUs, shared)")
    sep = " | " if md else "  "

    def row(cells, widths):
        if md:
            return "| " + " | ".join(str(x) for x in cells) + " |"
        return sep.join(str(x).rjust(w) for x, w in zip(cells, widths))

    head = ["op", "size"] + [f"{m} ms" for m in METHODS] + ["topo/rank", "2lvl/rank", "best/gloo"] + \
           [f"xrack MB {m}" for m in METHODS[:3]]
    widths = [9, 8] + [12] * 4 + [9, 9, 9] + [16] * 3
    lines.append(row(head, widths))
    if md:
        lines.append("|" + "---|" * len(head))
    for r in res["rows"]:
        if r["kind"] != "allreduce":
            continue
        med = {m: statistics.median(r["times"][m]) for m in METHODS}
        best = min(med["topo-ring"], med["two-level"])
        cells = ["allreduce", fmt_size(r["size"])] + [f"{med[m] * 1e3:.0f}" for m in METHODS] + [
            f"{med['topo-ring'] / med['rank-ring']:.2f}", f"{med['two-level'] / med['rank-ring']:.2f}",
            f"{best / med['gloo']:.2f}"] + [f"{r['cross_rack'].get(m, 0) / 1e6:.1f}" for m in METHODS[:3]]
        lines.append(row(cells, widths))
    for r in res["rows"]:
        if r["kind"] != "ddp":
            continue
        med = {m: statistics.median(v) for m, v in r["times"].items()}
        best = min(med["topo-ring"], med["two-level"])
        cells = ["DDP step", f"{r['params'] * 4 / MiB:.0f} MiB"] + [f"{med[m] * 1e3:.0f}" for m in METHODS] + [
            f"{med['topo-ring'] / med['rank-ring']:.2f}", f"{med['two-level'] / med['rank-ring']:.2f}",
            f"{best / med['gloo']:.2f}"] + [
            (f"{r['cross_rack'][m] / 1e6:.1f}" if r["cross_rack"].get(m) is not None else "-") for m in METHODS[:3]]
        lines.append(row(cells, widths))
        lines.append(f"# DDP: {r['params'] / 1e6:.1f} M params ({a.layers} x Linear({a.width},{a.width})), batch "
                     f"{a.batch}, bucket {a.bucket_mb} MB; xirang methods with xirang.register_comm_hook (BF16 wire); "
                     f"gloo fp32 default hook {med['gloo'] * 1e3:.0f} ms, gloo+fp16_compress_hook "
                     f"{med['gloo+fp16'] * 1e3:.0f} ms; compute only (no DDP) {med['compute'] * 1e3:.0f} ms")
        if "xirang+int8" in med:
            lines.append("# the hook's other wire formats on the two-level group (fp32 inside hosts, the format "
                         "with error feedback across them): "
                         + ", ".join(f"{w} {med['xirang+' + w] * 1e3:.0f} ms ({med['xirang+' + w] / med['gloo']:.2f}x "
                                     f"gloo fp32, xrack {r['cross_rack'].get('xirang+' + w, 0) / 1e6:.1f} MB)"
                                     for w in ("fp16", "int8")))
    for r in res["rows"]:
        if r["kind"] != "sweep":
            continue
        med = {k: statistics.median(v) for k, v in r["times"].items()}
        iqr = {k: statistics.quantiles(v, n=4)[2] - statistics.quantiles(v, n=4)[0] if len(v) > 1 else 0.0
               for k, v in r["times"].items()}
        fixed = [k for k in med if k != "auto"]
        best = min(fixed, key=lambda k: med[k])
        shape = (f"GPT-2-shaped, {a.sweep_layers} blocks of width {a.sweep_width}" if a.sweep_model == "gpt2"
                 else f"{a.sweep_layers} x [Linear({a.sweep_width},{a.sweep_width}) + ReLU]")
        lines.append(f"# layers_per_group sweep: the hook (bf16) on the topology ring, {shape} "
                     f"({r['params'] / 1e6:.2f} M params), batch "
                     f"{a.batch}, bucket {a.sweep_bucket_mb} MB, {a.sweep_warmup} warmup + {a.sweep_groups} timed "
                     "steps per size, sizes taking turns")
        lines.append(row(["layers/group", "step ms", "iqr ms", "vs best fixed"], [14, 9, 9, 14]))
        if md:
            lines.append("|---|---:|---:|---:|")
        for k in med:
            label = f"auto -> {r['chosen']}" if k == "auto" else k
            lines.append(row([label, f"{med[k] * 1e3:.0f}", f"{iqr[k] * 1e3:.0f}", f"{med[k] / med[best]:.3f}x"],
                             [14, 9, 9, 14]))
        pe, me = r.get("predicted_exposed_s"), r.get("measured_exposed_s")
        lines.append(f"# best fixed: {best}; auto chose {r['chosen']} (rank 0 predicted exposed comm "
                     + (f"{pe * 1e3:.0f} ms" if pe is not None else "-") + ", this rank measured "
                     + (f"{me * 1e3:.0f} ms" if me is not None else "-") + ")")
        ag = r.get("autogroup") or {}
        if ag.get("predictions_s"):
            lines.append("# auto's model (rank 0): " + auto_model(ag))
    reps = {r["size"]: r["reps"] for r in res["rows"] if r["kind"] == "allreduce"}
    lines.append("# median of repetitions (" + ", ".join(f"{fmt_size(s)}: {n}" for s, n in reps.items())
                 + f"; DDP: {a.ddp_steps} steps) of the slowest rank's time; xrack MB = bytes_cross_rack "
                 "summed over ranks for one op (DDP: the hook's ops of one step)")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
