"""The command line's model, cluster and optimisation flags, their checks, and the Sim they build."""
from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Optional

from .model import PRESETS, Cluster, Compute, Model
from .timeline import OPTS, Sim

_OPT_HELP = {
    "overlap": "start each layer group's allreduce when its backward is done (groups of --group layers)",
    "bucketing": "one buffer per layer group (or per step without --overlap) instead of one collective per tensor",
    "topo": "order the ring by (rack, host), so neighbours share a host or rack",
    "two_level": "reduce-scatter inside a host (or rack), allreduce across, allgather inside",
    "bf16": "BF16 on the wire: half the bytes, plus a codec pass",
}


def add_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("model")
    g.add_argument("--model", default="gpt3-175b", choices=sorted(PRESETS),
                   help="GPT-3 shape (Brown et al. 2020, table 2.1): layers, hidden size, embeddings")
    g.add_argument("--params", type=float, default=0, help="parameter count (overrides --model; GPT-shaped)")
    g.add_argument("--layers", type=int, default=96, help="layers (with --params)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    g = p.add_argument_group("compute (either per-layer backward time or FLOP/s)")
    g.add_argument("--bwd-layer-ms", type=float, default=None, help="backward time of one layer, ms")
    g.add_argument("--fwd-ms", type=float, default=None, help="forward time, ms (default: half of backward)")
    g.add_argument("--gpu-tflops", type=float, default=989.0, help="peak GPU TFLOP/s (bf16)")
    g.add_argument("--mfu", type=float, default=0.4,
                   help="model FLOP utilisation, the fraction of --gpu-tflops reached, in (0, 1]")
    g.add_argument("--tokens-per-gpu", type=float, default=8192, help="tokens per GPU per step")
    g.add_argument("--opt-ms", type=float, default=0.0, help="optimiser step time after the sync, ms")
    g.add_argument("--microbatches", type=int, default=1,
                   help="pipeline micro-batches per step (gradients are final only during the last one's backward)")
    g = p.add_argument_group("cluster")
    d = Cluster()
    g.add_argument("--gpus", type=int, default=d.gpus, help="GPUs in all (a multiple of tp x pp and of whole hosts)")
    g.add_argument("--gpus-per-host", type=int, default=d.gpus_per_host, help="GPUs per host (one NIC each)")
    g.add_argument("--hosts-per-rack", type=int, default=d.hosts_per_rack, help="hosts per rack (one uplink per rack)")
    g.add_argument("--host-gbyteps", type=float, default=d.host_GBps, help="intra-host GB/s per GPU")
    g.add_argument("--host-alpha-us", type=float, default=d.host_alpha_us, help="latency of an intra-host ring step, us")
    g.add_argument("--rack-gbitps", type=float, default=d.rack_Gbps, help="intra-rack Gbit/s per GPU")
    g.add_argument("--rack-alpha-us", type=float, default=d.rack_alpha_us, help="latency of an intra-rack ring step, us")
    g.add_argument("--xrack-gbitps", type=float, default=d.xrack_Gbps, help="cross-rack Gbit/s per GPU at full bisection")
    g.add_argument("--xrack-alpha-us", type=float, default=d.xrack_alpha_us, help="latency of a cross-rack ring step, us")
    g.add_argument("--oversub", type=float, default=d.oversub, help="rack uplink oversubscription (1 = full bisection)")
    g.add_argument("--launch-us", type=float, default=d.launch_us, help="fixed overhead per collective launched, us")
    g.add_argument("--codec-gbyteps", type=float, default=d.codec_GBps,
                   help="BF16 encode + decode throughput per GPU, GB/s of fp32 (pipelined with the wire)")
    g.add_argument("--cpu-gbyteps", type=float, default=d.cpu_GBps,
                   help="per-rank CPU throughput on ring chunks (copies + reduce), GB/s on a core of its own; 0: not modelled")
    g.add_argument("--cores-per-host", type=int, default=d.cores_per_host,
                   help="cores a host's ranks share for that CPU work (0: one per rank)")
    g.add_argument("--placement", default=d.placement, choices=["packed", "random", "interleaved"],
                   help="how the scheduler hands out hosts: rack by rack, shuffled (--seed), or round-robin over racks")
    g.add_argument("--seed", type=int, default=0, help="seed of --placement random")
    g = p.add_argument_group("optimisations (single-configuration mode)")
    for o in OPTS:
        g.add_argument("--" + o.replace("_", "-"), action="store_true", help=_OPT_HELP[o])
    g.add_argument("--all", action="store_true", help="every optimisation")
    g.add_argument("--group", type=int, default=8, help="layers per group")
    g.add_argument("--bucket-mb", type=float, default=0.0,
                   help="cap per bucket with --bucketing, MiB (0: one buffer per layer group, as xirang's hook)")


# (flag, lowest value, whether the lowest value itself is allowed); every value must be finite
_LIMITS = [("params", 0, True), ("layers", 1, True), ("tp", 1, True), ("pp", 1, True),
           ("bwd_layer_ms", 0, False), ("fwd_ms", 0, True), ("gpu_tflops", 0, False), ("mfu", 0, False),
           ("tokens_per_gpu", 0, False), ("opt_ms", 0, True), ("microbatches", 1, True),
           ("gpus", 1, True), ("gpus_per_host", 1, True), ("hosts_per_rack", 1, True),
           ("host_gbyteps", 0, False), ("host_alpha_us", 0, True), ("rack_gbitps", 0, False),
           ("rack_alpha_us", 0, True), ("xrack_gbitps", 0, False), ("xrack_alpha_us", 0, True),
           ("oversub", 1, True), ("launch_us", 0, True), ("codec_gbyteps", 0, False), ("cpu_gbyteps", 0, True),
           ("cores_per_host", 0, True), ("group", 1, True), ("bucket_mb", 0, True), ("cores", 0, True)]


# counts the simulation walks one by one: beyond these a run takes minutes and gigabytes (2^24
# GPUs: 41 s, 3 GB); 2^20 GPUs and 10^5 layers are past any cluster or model built so far
_MAX = {"gpus": 1 << 20, "layers": 100_000, "microbatches": 100_000, "oversub": 1000}


def check_args(a) -> Optional[str]:
    """The first argument out of range as a one-line message ("--gpus must be >= 1, got 0"), or None.
    Counts are >= 1, rates and sizes > 0, latencies and overheads >= 0, --mfu in (0, 1], all finite;
    --gpus at most 2^20, --layers and --microbatches at most 10^5; --oversub (the uplinks'
    oversubscription ratio, 1 = full bisection: below 1 the hosts' own links bound the traffic, so
    it would change nothing) 1 to 1000."""
    for name, low, inclusive in _LIMITS:
        v = getattr(a, name, None)
        if v is None:
            continue
        flag = "--" + name.replace("_", "-")
        if not math.isfinite(v) or v < low or (v == low and not inclusive):
            return f"{flag} must be {'>=' if inclusive else '>'} {low}, got {v:g}"
        if name in _MAX and v > _MAX[name]:
            return f"{flag} must be <= {_MAX[name]}, got {v:g}"
    if a.mfu > 1:
        return f"--mfu is a fraction of peak, in (0, 1], got {a.mfu:g}"
    return None


def build(a, gpus: Optional[int] = None):
    m = Model.from_args(a)
    cl = Cluster(gpus or a.gpus, a.gpus_per_host, a.hosts_per_rack, a.host_gbyteps, a.host_alpha_us, a.rack_gbitps,
                 a.rack_alpha_us, a.xrack_gbitps, a.xrack_alpha_us, a.oversub, a.launch_us, a.codec_gbyteps,
                 a.placement, a.seed, cpu_GBps=getattr(a, "cpu_gbyteps", 0.0),
                 cores_per_host=getattr(a, "cores_per_host", 0))
    if a.bwd_layer_ms is not None:
        bwd = a.bwd_layer_ms * 1e-3 * m.stage_layers
    else:  # 6 P T FLOPs per step spread over all GPUs; backward is 2/3 of it
        bwd = 4 * m.params * a.tokens_per_gpu / (a.gpu_tflops * 1e12 * a.mfu)
    fwd = a.fwd_ms * 1e-3 if a.fwd_ms is not None else bwd / 2
    comp = Compute(fwd, bwd, a.opt_ms * 1e-3, a.microbatches, a.tokens_per_gpu * cl.gpus)
    return Sim(m, cl, comp)


def settings(sim: Sim) -> dict:
    return {"model": dataclasses.asdict(sim.m), "params": sim.m.params, "shard_params": sim.m.shard_params(),
            "cluster": dataclasses.asdict(sim.cl), "compute": dataclasses.asdict(sim.comp), "dp": sim.dp}
