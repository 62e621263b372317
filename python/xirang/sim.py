"""Scale simulator: step time and communication cost of data-parallel gradient sync at scale.

    python -m xirang.sim [model/cluster/optimisation flags] [--json]   one configuration
    python -m xirang.sim --paper [--json]       the claims of the published 175B-parameter / 128-GPU
                                                platform report: internally consistent? reproduced?
    python -m xirang.sim --recommend [--json]   which optimisations pay, 8..1024 GPUs
    python -m xirang.sim --calibrate FILE [--cores N]  fit alpha/beta from benchmarks/allreduce.py JSON
                                                (ranks beyond N cores share them; N defaults to os.cpu_count())

Cost model (alpha-beta; Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009):
- ring allreduce of numel elements over n ranks: 2(n-1) lockstep steps, each sending one chunk
  (ceil(numel/n) elements) over every ring edge at once, so one step costs the slowest edge:
  max_e(alpha_e + chunk_bytes / B_e). With equal edges and n | numel this is exactly
  2(n-1) alpha + 2(n-1)/n S / B. Bytes each position sends are those of csrc/core/ring
  (2 numel - |chunk pos+1| - |chunk pos+2|), which tests check against xirang._C's replay.
- edge bandwidth by class: same host (NVLink-like), same rack (the GPU's NIC), cross rack: the NIC
  or the rack's share of its uplink, whichever is smaller. A rack's uplink carries
  gpus_per_rack x cross_rack_bw / oversubscription and is split evenly between the ring edges
  leaving that rack, counted over every data-parallel ring running at the same time (all tp x pp
  DP groups sync concurrently). One NIC per GPU; duplex links (send and receive do not compete).
- two-level: reduce-scatter inside the local group (host, else rack) of g DP members, g concurrent
  allreduces of S/g across the H groups, allgather inside: 2(g-1)(a_l + S/g/B_l) + ring(S/g, H).
- CPU cost per byte (optional: cpu_GBps > 0): every ring step a rank also spends chunk_bytes / cpu_Bps
  of CPU on the chunk (its copies in and out of the transport, the reduction). Pipelined by segments
  with the wire, so a step costs alpha_e + max(chunk / B_e, chunk / cpu_Bps x share), where share =
  max(1, ranks / cores) of the ranks that share those cores (a host's, or with shared_cpu the whole
  machine's: an emulated cluster on one box). cores_per_host = 0 means one core per rank (share 1):
  with cores >= ranks, or a CPU faster than the links, this is the alpha-beta model unchanged. On
  loopback the "wire" is itself CPU work (kernel copies), so --calibrate fits alpha and the per-byte
  cost together as CPU work and scales both by the share: T = share (2(n-1) alpha + 2(n-1)/n S beta).
- per-launch overhead per collective; BF16 halves bytes on the wire and adds a codec pass.
- timeline: layers finish backward one by one; a group's collectives may start when its last layer
  is done and the link is free (collectives run one at a time, FIFO). Exposed comm = what runs past
  the end of backward. Communication does not slow compute (no contention for SMs/memory).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import os
import random
import sys
from typing import Optional

GB = 1e9
OPTS = ("overlap", "bucketing", "topo", "two_level", "bf16")
ALL = "+".join(OPTS)

class SettingsError(ValueError):
    """Settings that do not fit together (GPUs vs tp x pp, whole hosts, layers vs pp); the CLI prints it
    as a one-line usage error."""


# ----------------------------------------------------------------------------------- inputs
PRESETS = {  # GPT-3 shapes (Brown et al. 2020, table 2.1): layers, hidden; vocab 50257, context 2048
    "gpt3-175b": (96, 12288), "gpt3-13b": (40, 5140), "gpt3-6.7b": (32, 4096),
    "gpt3-2.7b": (32, 2560), "gpt3-1.3b": (24, 2048),
}


@dataclasses.dataclass
class Model:
    layers: int = 96
    hidden: int = 12288
    extra_params: float = 50257 * 12288 + 2048 * 12288  # embeddings (token + position)
    tp: int = 1
    pp: int = 1
    elem_bytes: int = 4  # fp32 gradients

    @staticmethod
    def from_args(a) -> "Model":
        if a.params:  # generic GPT-shaped model: 12 h^2 params per layer
            h = int(round(math.sqrt(a.params / (12 * a.layers))))
            if h < 1:
                raise SettingsError(f"--params {a.params:g} is too few for {a.layers} layers of 12 h^2 parameters")
            return Model(layers=a.layers, hidden=h, extra_params=0.0, tp=a.tp, pp=a.pp)
        L, h = PRESETS[a.model]
        return Model(layers=L, hidden=h, extra_params=(50257 + 2048) * h, tp=a.tp, pp=a.pp)

    @property
    def params(self) -> float:
        return self.layers * sum(self.layer_tensors(1)) + self.extra_params

    def layer_tensors(self, tp: Optional[int] = None) -> list:
        """Gradient numels of one transformer layer on one GPU (tensor-parallel shard), in backward order."""
        h, t = self.hidden, tp or self.tp
        return [h, 4 * h * h // t, 4 * h // t, 4 * h * h // t, h, h, h, h * h // t, 3 * h // t, 3 * h * h // t, h, h]

    def layer_params(self) -> int:
        return sum(self.layer_tensors())

    @property
    def stage_layers(self) -> int:
        return self.layers // self.pp

    def shard_params(self) -> float:
        """Parameters whose gradients one GPU's DP group syncs (pipeline stage 0: its layers + embeddings)."""
        return self.stage_layers * self.layer_params() + self.extra_params / self.tp


@dataclasses.dataclass
class Cluster:
    gpus: int = 128
    gpus_per_host: int = 8
    hosts_per_rack: int = 4
    host_GBps: float = 200.0  # intra-host, per GPU, one direction (GB/s)
    host_alpha_us: float = 5.0
    rack_Gbps: float = 100.0  # intra-rack (GPU NIC), Gbit/s
    rack_alpha_us: float = 10.0
    xrack_Gbps: float = 100.0  # cross-rack per GPU at full bisection, Gbit/s
    xrack_alpha_us: float = 20.0
    oversub: float = 4.0  # fat-tree oversubscription of the rack uplinks
    launch_us: float = 20.0  # per-collective launch overhead
    codec_GBps: float = 1000.0  # BF16 encode+decode throughput (fp32 GB/s) per GPU, pipelined with the wire
    placement: str = "random"  # how the scheduler hands out hosts: packed | random | interleaved
    seed: int = 0
    cpu_GBps: float = 0.0  # per-rank CPU throughput on a ring chunk (copies + reduce), GB/s with a core to itself; 0: not modelled
    cores_per_host: int = 0  # cores the ranks of a host share (0: one core per rank, never shared)
    shared_cpu: bool = False  # every host runs on the same cores_per_host cores (an emulated cluster on one machine)
    rank_slots: Optional[tuple] = None  # explicit rank -> GPU slot (overrides placement)

    def links(self):
        return {"host": (self.host_alpha_us * 1e-6, self.host_GBps * GB),
                "rack": (self.rack_alpha_us * 1e-6, self.rack_Gbps * GB / 8),
                "xrack": (self.xrack_alpha_us * 1e-6, self.xrack_Gbps * GB / 8)}

    def uplink_Bps(self) -> float:
        return self.gpus_per_host * self.hosts_per_rack * self.xrack_Gbps * GB / 8 / self.oversub

    def slot_of_rank(self) -> list:
        """rank -> physical GPU slot; slot s is on host s // gpus_per_host, rack host // hosts_per_rack.
        Ranks of one host are always consecutive (torchrun local ranks); hosts are handed out packed
        (rack by rack), randomly (seeded) or interleaved across racks."""
        if self.rank_slots is not None:
            if len(self.rank_slots) != self.gpus or len(set(self.rank_slots)) != self.gpus:
                raise ValueError(f"rank_slots must name {self.gpus} distinct slots, got {self.rank_slots!r}")
            return list(self.rank_slots)
        gph = self.gpus_per_host
        nh = math.ceil(self.gpus / gph)
        hosts = list(range(nh))
        if self.placement == "random":
            random.Random(self.seed).shuffle(hosts)
        elif self.placement == "interleaved":
            hosts.sort(key=lambda h: (h % self.hosts_per_rack, h // self.hosts_per_rack))
        elif self.placement != "packed":
            raise ValueError(f"placement must be packed, random or interleaved, got {self.placement!r}")
        return [hosts[r // gph] * gph + r % gph for r in range(self.gpus)]

    def where(self, slot: int):
        host = slot // self.gpus_per_host
        return host // self.hosts_per_rack, host

    def cpu_share(self, ranks_per_host: int, ranks_total: int) -> float:
        """How many times slower a rank's CPU work runs than on a core of its own: max(1, ranks / cores)."""
        if self.cores_per_host <= 0:
            return 1.0
        return max(1.0, (ranks_total if self.shared_cpu else ranks_per_host) / self.cores_per_host)

    def cpu_s_per_byte(self, slots) -> float:
        """CPU seconds per chunk byte of one ring step, the busiest host's ranks sharing its cores (0: off)."""
        if self.cpu_GBps <= 0:
            return 0.0
        slots = set(slots)
        per_host: dict = {}
        for x in slots:
            h = self.where(x)[1]
            per_host[h] = per_host.get(h, 0) + 1
        return self.cpu_share(max(per_host.values(), default=1), len(slots)) / (self.cpu_GBps * GB)


@dataclasses.dataclass
class Compute:
    fwd_s: float = 0.6
    bwd_s: float = 1.2
    opt_s: float = 0.0
    microbatches: int = 1  # pipeline: gradients are final only during the last micro-batch's backward
    tokens_global: float = 0.0  # tokens per step (for throughput in tokens/s; 0: steps/s only)


# ----------------------------------------------------------------------------------- ring arithmetic
def chunk_elems(numel: int, n: int, i: int) -> int:
    """Size of chunk i of partition(numel, n) in csrc/core/ring (first numel % n chunks get one more)."""
    return numel // n + (1 if i < numel % n else 0)


def ring_elements_sent(numel: int, n: int) -> list:
    """Elements each ring position sends in one ring allreduce (closed form of csrc/core/ring)."""
    if n == 1:
        return [0]
    return [2 * numel - chunk_elems(numel, n, (p + 1) % n) - chunk_elems(numel, n, (p + 2) % n) for p in range(n)]


def ring_time(numel: int, n: int, esize: int, alpha: float, bw: float, cpu_s_per_byte: float = 0.0) -> float:
    """Ring allreduce on n ranks over equal links: 2(n-1)(alpha + ceil(numel/n) esize / bw) seconds;
    with a CPU cost per chunk byte (already scaled by the core share), each step pays the slower of
    the wire and the CPU: 2(n-1)(alpha + max(chunk / bw, chunk x cpu_s_per_byte))."""
    if n <= 1 or numel == 0:
        return 0.0
    chunk = math.ceil(numel / n) * esize
    return 2 * (n - 1) * (alpha + max(chunk / bw, chunk * cpu_s_per_byte))


def two_level_time(numel: int, g: int, h: int, esize: int, a_l: float, b_l: float, a_x: float, b_x: float) -> float:
    """Reduce-scatter in groups of g, allreduce of S/g across h groups, allgather in groups of g."""
    part = math.ceil(numel / g)
    local = (g - 1) * (a_l + part * esize / b_l) if g > 1 else 0.0
    return 2 * local + ring_time(part, h, esize, a_x, b_x)


class RingSet:
    """Rings (lists of GPU slots, in ring order) that run at the same time; their slowest edge sets the pace."""

    def __init__(self, rings: list, cl: Cluster):
        self.n = len(rings[0]) if rings else 1
        self.rings = rings
        links = cl.links()
        out_flows: dict = {}
        edges = []
        for ring in rings:
            for p, u in enumerate(ring):
                v = ring[(p + 1) % len(ring)]
                (ru, hu), (rv, hv) = cl.where(u), cl.where(v)
                kind = "host" if hu == hv else ("rack" if ru == rv else "xrack")
                edges.append((kind, ru, p))
                if kind == "xrack":
                    out_flows[ru] = out_flows.get(ru, 0) + 1
        classes = set()
        self.xrack_pos = [p for kind, _, p in edges if kind == "xrack"]
        for kind, ru, _ in edges:
            a, b = links[kind]
            if kind == "xrack":
                b = min(b, cl.uplink_Bps() / out_flows[ru])
            classes.add((a, b))
        self.classes = sorted(classes)
        self.kinds = sorted({k for k, _, _ in edges})
        self.cpu = cl.cpu_s_per_byte(s for ring in rings for s in ring)  # all rings run at once: their ranks share cores

    def step(self, chunk_bytes: float) -> float:
        """One lockstep ring step: the slowest edge, each paying the slower of its wire and the CPU."""
        return max(a + max(chunk_bytes / b, chunk_bytes * self.cpu) for a, b in self.classes)

    def time(self, numel: int, esize: int) -> float:
        if self.n <= 1 or numel == 0:
            return 0.0
        return 2 * (self.n - 1) * self.step(math.ceil(numel / self.n) * esize)

    def xrack_bytes(self, numel: int, esize: int) -> float:
        n, q, r = self.n, numel // self.n, numel % self.n
        c = lambda i: q + (1 if i < r else 0)  # noqa: E731
        return float(sum(2 * numel - c((p + 1) % n) - c((p + 2) % n) for p in self.xrack_pos)) * esize


# ----------------------------------------------------------------------------------- one configuration
@dataclasses.dataclass
class Config:
    overlap: bool = False
    group: int = 8  # layers per group
    bucketing: bool = False
    bucket_mb: float = 0.0  # 0: one buffer per group (xirang's hook); >0: cap per bucket
    topo: bool = False
    two_level: bool = False
    bf16: bool = False

    @staticmethod
    def of(names, **kw) -> "Config":
        return Config(**{n: True for n in names}, **kw)

    def label(self) -> str:
        on = [o for o in OPTS if getattr(self, o)]
        return "+".join(on) if on else "none"


class Sim:
    def __init__(self, model: Model, cl: Cluster, comp: Compute):
        if cl.gpus % (model.tp * model.pp):
            raise SettingsError(f"gpus ({cl.gpus}) must be a multiple of tp x pp ({model.tp} x {model.pp})")
        if cl.gpus > cl.gpus_per_host and cl.gpus % cl.gpus_per_host:
            raise SettingsError(f"gpus ({cl.gpus}) must fill whole hosts of {cl.gpus_per_host} GPUs")
        if model.layers % model.pp:
            raise SettingsError(f"layers ({model.layers}) must be a multiple of pp ({model.pp}): equal pipeline stages")
        self.m, self.cl, self.comp = model, cl, comp
        self.dp = cl.gpus // (model.tp * model.pp)
        slot = cl.slot_of_rank()
        tp, dp = model.tp, self.dp  # Megatron rank order: tp fastest, then dp, then pp
        self.groups = [[slot[t + tp * (d + dp * p)] for d in range(dp)] for p in range(model.pp) for t in range(tp)]
        self._plans: dict = {}

    def _ring_plan(self, topo: bool) -> RingSet:
        key = ("ring", topo)
        if key not in self._plans:
            rings = [sorted(g, key=self.cl.where) if topo else g for g in self.groups]
            self._plans[key] = RingSet(rings, self.cl)
        return self._plans[key]

    def two_level_plan(self, topo: bool):
        """(g, local RingSet, cross RingSet) or None when no level has >1 DP member per group evenly."""
        key = ("2l", topo)
        if key not in self._plans:
            self._plans[key] = None
            for level in (1, 0):  # host, then rack
                locs, crosses = [], []
                for grp in self.groups:
                    by: dict = {}
                    for s in grp:
                        by.setdefault(self.cl.where(s)[level], []).append(s)
                    members = list(by.values())
                    if topo:
                        members.sort(key=lambda m: self.cl.where(m[0]))
                    g = len(members[0])
                    if g < 2 or len(members) < 2 or any(len(m) != g for m in members):
                        break
                    locs += members
                    crosses += [[m[j] for m in members] for j in range(g)]
                else:
                    self._plans[key] = (g, RingSet(locs, self.cl), RingSet(crosses, self.cl))
                    break
        return self._plans[key]

    def allreduce(self, numel: int, cfg: Config):
        """(seconds, cross-rack bytes summed over all DP groups) of one allreduce of numel elements per GPU."""
        es = 2 if cfg.bf16 else self.m.elem_bytes
        plan = self.two_level_plan(cfg.topo) if cfg.two_level else None
        if plan:
            g, loc, cross = plan
            part = math.ceil(numel / g)
            local = (g - 1) * loc.step(part * es)
            t = 2 * local + cross.time(part, es)
            xb = cross.xrack_bytes(part, es)  # local groups are a host or a rack: never cross racks
        else:
            r = self._ring_plan(cfg.topo)
            t, xb = r.time(numel, es), r.xrack_bytes(numel, es)
        if cfg.bf16:  # encode/decode is pipelined with the wire by segments: the slower of the two sets the pace
            t = max(t, 2 * numel * 4 / (self.cl.codec_GBps * GB))
        return t, xb

    def units(self, cfg: Config):
        """[(ready_s, [numel per collective])] in launch order."""
        c, m = self.comp, self.m
        Ls = m.stage_layers
        per_layer = c.bwd_s / c.microbatches / Ls
        start = c.bwd_s * (1 - 1 / c.microbatches)
        layer = m.layer_tensors()
        emb = [int(m.extra_params / m.tp)] if m.extra_params else []
        k = cfg.group if cfg.overlap else Ls
        out = []
        for g0 in range(0, Ls, k):
            g1 = min(Ls, g0 + k)
            tensors = layer * (g1 - g0) + (emb if g1 == Ls else [])
            out.append((start + g1 * per_layer, self._bucket(tensors, cfg)))
        return out

    @staticmethod
    def _bucket(tensors, cfg: Config):
        if not cfg.bucketing:
            return list(tensors)
        if cfg.bucket_mb <= 0:
            return [sum(tensors)]
        cap, out, cur = cfg.bucket_mb * 2**20 / 4, [], 0
        for t in tensors:  # DDP-style: close a bucket once it reaches the cap
            cur += t
            if cur >= cap:
                out.append(cur)
                cur = 0
        return out + ([cur] if cur else [])

    def run(self, cfg: Config) -> dict:
        c, cl = self.comp, self.cl
        compute = c.fwd_s + c.bwd_s + c.opt_s
        free, total, xbytes, launches = 0.0, 0.0, 0.0, 0
        cache: dict = {}
        if self.dp > 1:
            for ready, ops in self.units(cfg):
                for numel in ops:
                    if numel not in cache:
                        cache[numel] = self.allreduce(numel, cfg)
                    t, xb = cache[numel]
                    t += cl.launch_us * 1e-6
                    free = max(free, ready) + t
                    total += t
                    xbytes += xb
                    launches += 1
        exposed = min(max(0.0, free - c.bwd_s), total)  # min: float rounding only
        step = compute + exposed
        whole, _ = self.allreduce(int(self.m.shard_params()), cfg) if self.dp > 1 else (0.0, 0.0)
        return {"config": cfg.label(), "gpus": cl.gpus, "dp": self.dp, "launches": launches,
                "two_level_applied": bool(cfg.two_level and self.two_level_plan(cfg.topo)),
                "allreduce_s": whole, "total_comm_s": total, "exposed_comm_s": exposed, "compute_s": compute,
                "step_s": step, "steps_per_s": 1 / step,
                "tokens_per_s": c.tokens_global / step if c.tokens_global else None,
                "xrack_GB": xbytes / GB}


# ----------------------------------------------------------------------------------- CLI plumbing
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
           ("oversub", 0, False), ("launch_us", 0, True), ("codec_gbyteps", 0, False), ("cpu_gbyteps", 0, True),
           ("cores_per_host", 0, True), ("group", 1, True), ("bucket_mb", 0, True), ("cores", 0, True)]


def check_args(a) -> Optional[str]:
    """The first argument out of range as a one-line message ("--gpus must be >= 1, got 0"), or None.
    Counts are >= 1, rates and sizes > 0, latencies and overheads >= 0, --mfu in (0, 1], all finite."""
    for name, low, inclusive in _LIMITS:
        v = getattr(a, name, None)
        if v is None:
            continue
        flag = "--" + name.replace("_", "-")
        if not math.isfinite(v) or v < low or (v == low and not inclusive):
            return f"{flag} must be {'>=' if inclusive else '>'} {low}, got {v:g}"
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


def table(rows: list, cols: list) -> str:
    def f(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)
    cells = [[f(r.get(c)) for c in cols] for r in rows]
    w = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)] if cells else [len(c) for c in cols]
    line = lambda xs: "  ".join(x.ljust(w[i]) for i, x in enumerate(xs))  # noqa: E731
    return "\n".join([line(cols), line(["-" * x for x in w])] + [line(x) for x in cells])


def settings(sim: Sim) -> dict:
    return {"model": dataclasses.asdict(sim.m), "params": sim.m.params, "shard_params": sim.m.shard_params(),
            "cluster": dataclasses.asdict(sim.cl), "compute": dataclasses.asdict(sim.comp), "dp": sim.dp}


# ----------------------------------------------------------------------------------- --paper
PUBLICATION = ("the published platform report on training a 175B-parameter model on 128 GPUs "
               "(its claims table: the figures below)")
REPRODUCE_TOL = 0.25  # a simulated figure reproduces a published one within +-25% of it
TOLERANCE_TEXT = (f"a figure is reproduced when the model, in the literal or the sharded reading, lands within "
                  f"+-{REPRODUCE_TOL:.0%} of it (relative; for a published change in %, +-{REPRODUCE_TOL:.0%} of "
                  "that change; for a pair such as 3.2 s -> 2.6 s, both ends)")
PUBLISHED = dict(params=175e9, layers=96, link_Gbps=100.0, gpus=(8, 64, 128), ar8=0.3, ar128=1.4, group_layers=8,
                 groups=24, group_GB=30.0, exposed=(1.4, 0.5), total_comm_pct=5.0, bucket_eff_pct=25.0,
                 xrack_cut_pct=60.0, step=(3.2, 2.6), thr128_pct=18.0, thr64_pct=12.0, fail_s=15.0, fail_pct=0.5)


def paper(a) -> dict:
    P = PUBLISHED
    a.model, a.params = "gpt3-175b", 0
    a.bwd_layer_ms, a.fwd_ms = 1.2 / 96 * 1e3, 600.0  # 3.2 s step - 1.4 s exposed comm = 1.8 s compute, bwd = 2 fwd
    readings = {"literal": (1, 1), "sharded": (a.tp if a.tp > 1 else 8, a.pp if a.pp > 1 else 4)}
    tp_s, pp_s = readings["sharded"]
    none, ovl = Config(), Config(overlap=True, group=P["group_layers"])
    ovb = Config(overlap=True, bucketing=True, group=P["group_layers"])
    res: dict = {}
    for name, (tp, pp) in readings.items():
        a.tp, a.pp = tp, pp
        # a pipeline of pp stages, one micro-batch: the modelled stage (0, with the embeddings) waits for the
        # whole forward and the later stages' backward before its own 1.2/pp s of backward; the step's
        # compute stays the published 1.8 s
        a.fwd_ms = 600.0 + 1200.0 * (pp - 1) / pp
        r = {}
        for g in P["gpus"]:
            if g % (tp * pp) or g // (tp * pp) < 2:
                r[g] = None
                continue
            try:
                s = build(a, g)
            except SettingsError as e:
                raise SettingsError(f"--paper, {g} GPUs: {e}") from None
            runs = {c.label(): s.run(c) for c in [none, ovl, Config(bucketing=True), Config(topo=True), ovb,
                                                   Config(bf16=True), Config.of(OPTS, group=P["group_layers"])]}
            r[g] = {"runs": runs, "settings": settings(s)}
        res[name] = r
    if res["sharded"][128] is None:  # every claim is about 128 GPUs
        raise SettingsError(f"--paper: tp x pp = {tp_s} x {pp_s} must divide 64, so that 128 GPUs give data "
                            "parallelism >= 2")
    a.tp, a.pp = readings["sharded"]

    def sim(reading, g, cfg, key):
        x = res[reading].get(g)
        return None if x is None else x["runs"][cfg][key]

    def pct(x, y):  # None where there is no baseline (e.g. no cross-rack traffic to cut)
        return None if x is None or y is None or x == 0 else 100 * (y / x - 1)

    def both(fn):
        return {k: fn(k) for k in readings}

    S = P["params"] * 4
    bw = P["link_Gbps"] * GB / 8
    n = 128
    ring_bytes = 2 * (n - 1) / n * S
    rows = [
        ("fp32 gradients, 175B params", "~700 GB", both(lambda k: f"{res[k][128]['settings']['shard_params'] * 4 / GB:.1f} GB/GPU"),
         f"175e9 x 4 B = {S / GB:.0f} GB: consistent (for the whole model; a GPU syncs only its tp x pp shard)", False),
        ("700 GB over 100 Gbit/s", "~56 s", both(lambda k: None),
         f"{S / GB:.0f} GB / {bw / GB:.1f} GB/s = {S / bw:.0f} s: consistent as one pass; but a ring allreduce sends "
         f"2(N-1)/N x S = {ring_bytes / GB:.0f} GB per rank at N=128 -> {ring_bytes / bw:.0f} s", False),
        ("allreduce, 8 GPUs in one rack", "0.3 s", both(lambda k: sim(k, 8, "none", "allreduce_s")),
         f"8 GPUs: 2x7/8 x 700 GB = {1.75 * S / GB:.0f} GB per GPU in 0.3 s = {1.75 * S / 0.3 / GB:.0f} GB/s per GPU, "
         f"above any GPU link (NVLink-class ~{Cluster().host_GBps:.0f}-450 GB/s): cannot hold for 700 GB", True),
        ("allreduce, 128 GPUs across racks", "1.4 s", both(lambda k: sim(k, 128, "none", "allreduce_s")),
         f"ring: {ring_bytes / GB:.0f} GB per rank / 1.4 s = {ring_bytes / 1.4 / GB:.0f} GB/s = "
         f"{ring_bytes * 8 / 1.4 / GB / 1000:.1f} Tbit/s per GPU vs 100 Gbit/s ({ring_bytes / 1.4 / bw:.0f}x); even two-level "
         f"(S/8 across hosts) needs {2 * 15 / 16 * S / 8 / bw:.0f} s. 1.4 s fits a per-GPU shard of "
         f"{1.4 * bw / (2 * 127 / 128) / GB:.1f} GB (1/{S / (1.4 * bw / (2 * 127 / 128)):.0f} of the model)", True),
        ("ratio 128 vs 8", "4.7x", both(lambda k: None if sim(k, 8, "none", "allreduce_s") is None
                                        else sim(k, 128, "none", "allreduce_s") / sim(k, 8, "none", "allreduce_s")),
         "1.4/0.3 = 4.67: arithmetic consistent; the ring's bandwidth term grows only (2x127/128)/(2x7/8) = 1.13x, "
         "so the rest must be a ~4x slower bottleneck link across racks", False),
        ("layer groups", "groups of 8 layers, ~24 groups of ~30 GB", both(lambda k: f"{math.ceil(96 // readings[k][1] / 8)} groups of "
         f"{res[k][128]['settings']['shard_params'] * 4 / GB / math.ceil(96 // readings[k][1] / 8):.1f} GB"),
         f"96 layers / 8 = 12 groups, not 24; 700 GB / 12 = {S / 12 / GB:.0f} GB per group; 24 x 30 GB = 720 GB "
         f"(24 groups would be 4 layers each); one 30 GB group alone takes {30e9 / bw:.1f} s at 100 Gbit/s, more than "
         "the whole 1.4 s allreduce", True),
        ("exposed comm with overlap", "1.4 s -> 0.5 s (-64%)",
         both(lambda k: None if res[k][128] is None else
              f"{sim(k, 128, 'bucketing', 'exposed_comm_s'):.3g} s -> {sim(k, 128, 'overlap+bucketing', 'exposed_comm_s'):.3g} s "
              f"({pct(sim(k, 128, 'bucketing', 'exposed_comm_s'), sim(k, 128, 'overlap+bucketing', 'exposed_comm_s')):+.0f}%)"),
         "one allreduce after backward vs one per group; (1.4-0.5)/1.4 = 64%: consistent; with 1.2 s of backward and 12 groups, exposed >= 1.47 - (1.2 - 0.1) = 0.37 s, "
         "so 0.5 s is feasible", False),
        ("total comm with overlap", "+5% (launch overhead)",
         both(lambda k: pct(sim(k, 128, "bucketing", "total_comm_s"), sim(k, 128, "overlap+bucketing", "total_comm_s"))),
         "5% of 1.4 s = 70 ms over 11 extra collectives = 6.4 ms each, i.e. 2x127 ring steps x 25 us: plausible "
         "only as ring latency, not as a kernel launch (~10-50 us)", False),
        ("bucketing + ring, 128 GPUs", "+25% comm efficiency",
         both(lambda k: pct(sim(k, 128, "bucketing", "total_comm_s"), sim(k, 128, "none", "total_comm_s"))),
         "baseline unstated (we take one collective per tensor vs one buffer per unit); gain = latency saved", False),
        ("topology-aware ring", "-60% cross-rack traffic",
         both(lambda k: pct(sim(k, 128, "none", "xrack_GB"), sim(k, 128, "topo", "xrack_GB"))),
         "depends entirely on how the scheduler placed ranks (packed: 0%; random hosts: most crossings removed); "
         "the topology ring crosses racks exactly once per rack", False),
        ("BF16 + error feedback", "comm volume halved",
         both(lambda k: pct(sim(k, 128, "none", "xrack_GB"), sim(k, 128, "bf16", "xrack_GB"))),
         "4 B -> 2 B per element: -50% bytes, consistent (plus a codec pass; the fp32 residual costs 4 B/param of memory)", False),
        ("all combined, 128 GPUs: step", "3.2 s -> 2.6 s",
         both(lambda k: None if res[k][128] is None else
              f"{sim(k, 128, 'none', 'step_s'):.3g} s -> {sim(k, 128, ALL, 'step_s'):.3g} s"),
         "3.2 - 2.6 = 0.6 s saved, but overlap alone is claimed to save 1.4 - 0.5 = 0.9 s of exposed comm: "
         "everything together cannot save less than one of its parts (with 1.8 s compute, all-on should reach <= 2.3 s)",
         True),
        ("all combined, 128 GPUs: throughput", "+18%",
         both(lambda k: pct(1 / sim(k, 128, "none", "step_s"), 1 / sim(k, 128, ALL, "step_s"))
              if res[k][128] else None),
         f"3.2 / 2.6 = {3.2 / 2.6:.3f}: throughput +{100 * (3.2 / 2.6 - 1):.0f}%, not +18% "
         f"(the step-time cut is {100 * (1 - 2.6 / 3.2):.2f}%)", True),
        ("all combined, 64 GPUs: throughput", "+12%",
         both(lambda k: pct(1 / sim(k, 64, "none", "step_s"), 1 / sim(k, 64, ALL, "step_s"))
              if res[k][64] else None),
         "no 64-GPU baseline published; simulated only", False),
        ("rank failure", "~15 s total, <0.5% of training", both(lambda k: None),
         f"15 s < 0.5% needs >= {15 / 0.005:.0f} s ({15 / 0.005 / 60:.0f} min) of training per failure; not simulated", False),
    ]
    unit = {"fp32 gradients, 175B params": "GB", "exposed comm with overlap": "%",
            "all combined, 128 GPUs: step": "s", "allreduce, 8 GPUs in one rack": "s", "allreduce, 128 GPUs across racks": "s", "ratio 128 vs 8": "x",
            "total comm with overlap": "%", "bucketing + ring, 128 GPUs": "%", "topology-aware ring": "%",
            "BF16 + error feedback": "%", "all combined, 128 GPUs: throughput": "%",
            "all combined, 64 GPUs: throughput": "%"}
    # Claims the published figures alone cannot confirm or refute (a baseline or a placement not stated).
    unchecked = {"bucketing + ring, 128 GPUs", "topology-aware ring", "all combined, 64 GPUs: throughput",
                 "rank failure"}

    def groups(k):
        return math.ceil(96 // readings[k][1] / 8)

    # claim -> (the published figure as a number, or a tuple of numbers, in the row's unit; the simulated
    # number per reading where it is not the displayed value itself). Absent: nothing simulated to compare.
    figures = {
        "fp32 gradients, 175B params": (700.0, lambda k: res[k][128]["settings"]["shard_params"] * 4 / GB),
        "allreduce, 8 GPUs in one rack": (0.3, None), "allreduce, 128 GPUs across racks": (1.4, None),
        "ratio 128 vs 8": (4.7, None),
        "layer groups": (24, groups),
        "exposed comm with overlap": (-64.0, lambda k: None if res[k][128] is None else pct(
            sim(k, 128, "bucketing", "exposed_comm_s"), sim(k, 128, "overlap+bucketing", "exposed_comm_s"))),
        "total comm with overlap": (5.0, None), "bucketing + ring, 128 GPUs": (25.0, None),
        "topology-aware ring": (-60.0, None), "BF16 + error feedback": (-50.0, None),
        "all combined, 128 GPUs: step": ((3.2, 2.6), lambda k: None if res[k][128] is None else (
            sim(k, 128, "none", "step_s"), sim(k, 128, ALL, "step_s"))),
        "all combined, 128 GPUs: throughput": (18.0, None), "all combined, 64 GPUs: throughput": (12.0, None),
    }

    def within(pub, got) -> Optional[bool]:
        if got is None:
            return None
        if isinstance(pub, tuple):
            return all(within(p_, g_) for p_, g_ in zip(pub, got))
        return abs(got - pub) <= REPRODUCE_TOL * abs(pub)

    out_rows = []
    for c, pub, simv, chk, bad in rows:
        pub_v, num = figures.get(c, (None, None))
        got = {k: (num(k) if num else (v if isinstance(v, (int, float)) else None)) for k, v in simv.items()}
        per = {k: (None if pub_v is None else within(pub_v, g)) for k, g in got.items()}
        rep = True if True in per.values() else (False if False in per.values() else None)
        out_rows.append({"claim": c, "published": pub, **{f"sim_{k}": v for k, v in simv.items()}, "unit": unit.get(c),
                         "check": chk, "consistent": None if c in unchecked else not bad, "inconsistent": bad,
                         "published_value": pub_v, "simulated_value": got, "reproduced_by": per,
                         "reproduced": rep})
    assumed = {
        "compute": "fwd 0.6 s + bwd 1.2 s for the whole model (= published 3.2 s step - 1.4 s comm, backward = "
                   "2 x forward), 12.5 ms per layer; per GPU: " + "; ".join(
                       f"{k} {c['fwd_s']:.3g} s before its own backward (forward"
                       + (" + the later pipeline stages' backward" if readings[k][1] > 1 else "")
                       + f") + bwd {c['bwd_s']:.3g} s + optimiser {c['opt_s']:.3g} s, {c['microbatches']} microbatch(es)"
                       for k, c in ((k, res[k][128]["settings"]["compute"]) for k in readings)),
        "fixed by --paper": "model gpt3-175b, 8 / 64 / 128 GPUs, groups of 8 layers, one buffer per group, compute "
                            "from the published step (--model, --params, --gpus, --group, --bucket-mb, --bwd-layer-ms, "
                            "--fwd-ms, --gpu-tflops, --mfu and --tokens-per-gpu do not apply)",
        "literal reading": "tp=1, pp=1: every GPU syncs the full 175B fp32 gradient (what 700 GB / 24 x 30 GB say); "
                           "needs 700 GB of gradients per GPU, which no GPU holds",
        "sharded reading": f"tp={tp_s} ({'in host' if tp_s <= a.gpus_per_host else 'across hosts'}), pp={pp_s}: a GPU syncs "
                           f"{res['sharded'][128]['settings']['shard_params'] / 1e9:.2f}B params (stage 0 incl. embeddings); "
                           + ", ".join(f"DP = {g // (tp_s * pp_s)} at {g}" for g in P["gpus"] if res["sharded"][g])
                           + "".join(f"; {g} GPUs cannot hold the model" for g in P["gpus"] if not res["sharded"][g]),
        "cluster": f"{a.gpus_per_host} GPUs/host, {a.hosts_per_rack} hosts/rack ({a.gpus_per_host * a.hosts_per_rack} "
                   f"GPUs/rack), a {a.rack_gbitps:g} Gbit/s NIC per GPU in the rack (published link: "
                   f"{P['link_Gbps']:g} Gbit/s), {a.host_gbyteps:g} GB/s/GPU in host, cross-rack {a.xrack_gbitps:g} "
                   f"Gbit/s per GPU at full bisection with {a.oversub:g}:1 oversubscribed uplinks",
        "latencies": f"alpha {a.host_alpha_us:g} us in host, {a.rack_alpha_us:g} us in rack, {a.xrack_alpha_us:g} us "
                     f"across racks; {a.launch_us:g} us per launch; BF16 codec {a.codec_gbyteps:g} GB/s of fp32 per "
                     "GPU, pipelined with the wire",
        "placement": f"hosts handed out {a.placement} (seed {a.seed}) by the scheduler; 'topo' sorts the ring by (rack, host)",
        "baseline": "no overlap, one collective per tensor (12 per layer + embeddings), rank-order flat ring, fp32",
        "optimisations": "overlap = groups of 8 layers; bucketing = one buffer per group (per step without overlap); "
                         "two-level = reduce-scatter in host (or rack when one DP member per host), allreduce across",
        "8-GPU case": f"{-(-8 // a.gpus_per_host)} host(s) of {a.gpus_per_host} GPUs; the published '8 GPUs in one rack'",
    }
    return {"publication": PUBLICATION, "tolerance": TOLERANCE_TEXT, "rows": out_rows, "assumed": assumed,
            "runs": {k: {str(g): (None if v is None else v["runs"]) for g, v in r.items()} for k, r in res.items()},
            "inconsistent": [r["claim"] for r in out_rows if r["inconsistent"]],
            "reproduced": [r["claim"] for r in out_rows if r["reproduced"]],
            "not_reproduced": [r["claim"] for r in out_rows if r["reproduced"] is False]}


def print_paper(d: dict):
    print(f"Checking {d['publication']}.\n"
          "Each figure gets two verdicts:\n"
          "  internally consistent: whether it agrees with physics and with the report's own other figures "
          "(the arithmetic is under 'check'); 'unchecked' where the report does not say enough;\n"
          f"  reproduced by the model: {d['tolerance']}; 'not simulated' where the model has no such number.\n"
          "Readings: literal = tp=pp=1, every GPU syncs all 175B gradients; sharded = see the assumptions below.\n")
    for r in d["rows"]:
        def f(v):
            if v is None:
                return "-"
            if isinstance(v, tuple):
                return " -> ".join(f(x) for x in v)
            if not isinstance(v, float):
                return str(v)
            return {"%": f"{v:+.1f}%", "x": f"{v:.2f}x", "s": f"{v:.3g} s", "GB": f"{v:.4g} GB"}.get(r["unit"], f"{v:.3g}")
        cons = {True: "consistent", False: "INCONSISTENT", None: "unchecked"}[r["consistent"]]
        rep = {True: "reproduced", False: "NOT REPRODUCED", None: "not simulated"}[r["reproduced"]]
        got = ", ".join(f"{k} {f(v)}" for k, v in r["simulated_value"].items())
        if r["reproduced"] is None:
            why = "not simulated: the model has no number for this figure"
        else:
            yes = [k for k, ok in r["reproduced_by"].items() if ok]
            why = (f"yes ({' and '.join(yes)} reading)" if yes else "NO") + \
                f": {got} vs published {f(r['published_value'])} (tolerance +-{REPRODUCE_TOL:.0%} of it)"
        print(f"[{cons} | {rep}] {r['claim']}\n    published: {r['published']}\n"
              f"    simulated: literal {f(r['sim_literal'])} | sharded {f(r['sim_sharded'])}\n"
              f"    internally consistent? {cons}: {r['check']}\n"
              f"    reproduced by the model? {why}")
    n_sim = sum(1 for r in d["rows"] if r["reproduced"] is not None)
    n_unchecked = sum(1 for r in d["rows"] if r["consistent"] is None)
    print(f"\nSummary: of {len(d['rows'])} figures, {len(d['inconsistent'])} are internally inconsistent "
          f"({n_unchecked} cannot be checked); the model "
          f"reproduces {len(d['reproduced'])} of the {n_sim} it simulates"
          + (f" ({', '.join(d['reproduced'])})" if d["reproduced"] else "") + ".")
    print("\nAssumed (not stated in the report):")
    for k, v in d["assumed"].items():
        print(f"  {k}: {v}")
    for k, r in d["runs"].items():
        for g, runs in r.items():
            if runs:
                print(f"\n{k}, {g} GPUs:")
                print(table(list(runs.values()), ["config", "dp", "launches", "allreduce_s", "total_comm_s",
                                                  "exposed_comm_s", "step_s", "xrack_GB"]))


# ----------------------------------------------------------------------------------- --recommend
def advice(g: int) -> set:
    return {"overlap"} if g <= 8 else ({"overlap", "bucketing"} if g <= 64 else set(OPTS))


def recommend(a) -> dict:
    out = []
    scales = [2**i for i in range(3, 11)]
    first = None  # the smallest scale that runs: its settings head the report
    for g in scales:
        try:
            s = build(a, g)
        except ValueError as e:
            out.append({"gpus": g, "skip": str(e)})
            continue
        if s.dp < 2:
            out.append({"gpus": g, "skip": "dp < 2: no gradient sync"})
            continue
        first = first or s
        runs = {frozenset(c): s.run(Config.of(c, group=a.group, bucket_mb=a.bucket_mb))
                for k in range(len(OPTS) + 1) for c in itertools.combinations(OPTS, k)}
        base, allr = runs[frozenset()], runs[frozenset(OPTS)]
        best = min(runs, key=lambda c: runs[c]["step_s"])
        pub = frozenset(advice(g))
        row = {"gpus": g, "dp": s.dp, "base_step_s": base["step_s"], "all_step_s": allr["step_s"],
               "speedup_all": base["step_s"] / allr["step_s"],
               "alone_pct": {o: 100 * (base["step_s"] / runs[frozenset([o])]["step_s"] - 1) for o in OPTS},
               "leave_one_out_pct": {o: 100 * (runs[frozenset(OPTS) - {o}]["step_s"] / allr["step_s"] - 1) for o in OPTS},
               "best": sorted(best, key=OPTS.index), "best_step_s": runs[best]["step_s"],
               "published": sorted(pub, key=OPTS.index), "published_step_s": runs[pub]["step_s"]}
        pays = [o for o in OPTS if row["leave_one_out_pct"][o] > 1.0]
        row["pays"] = pays
        row["verdict"] = ("confirm" if runs[pub]["step_s"] <= runs[best]["step_s"] * 1.02
                          else f"correct: +{100 * (runs[pub]['step_s'] / runs[best]['step_s'] - 1):.0f}% slower than best")
        out.append(row)
    if first is None:
        raise SettingsError(f"--recommend: no scale in {scales[0]}..{scales[-1]} GPUs fits (tp x pp = {a.tp} x {a.pp}, "
                            f"{a.gpus_per_host} GPUs per host) with data parallelism >= 2: " + out[-1]["skip"])
    return {"settings": settings(first), "rows": out,
            "rule": "an optimisation 'pays' if removing it from the all-on set slows the step by > 1%; "
                    "'confirm' if the published set is within 2% of the best of all 32 subsets"}


def print_recommend(d: dict):
    m = d["settings"]["model"]
    print(f"Which optimisations pay: {d['settings']['params'] / 1e9:.1f}B params, tp={m['tp']} pp={m['pp']}; "
          f"{d['rule']}\n")
    rows = []
    for r in d["rows"]:
        if "skip" in r:
            rows.append({"gpus": r["gpus"], "verdict": r["skip"]})
            continue
        x = {"gpus": r["gpus"], "dp": r["dp"], "base_s": r["base_step_s"], "all_s": r["all_step_s"], "best_s": r["best_step_s"],
             "published_s": r["published_step_s"], "pays": ",".join(r["pays"]) or "-", "verdict": r["verdict"]}
        x.update({f"-{o}%": r["leave_one_out_pct"][o] for o in OPTS})
        rows.append(x)
    print(table(rows, ["gpus", "dp", "base_s", "all_s", "best_s", "published_s"] + [f"-{o}%" for o in OPTS] + ["pays", "verdict"]))
    print("\n-X% = slowdown when X is removed from all-on. best subsets:")
    for r in d["rows"]:
        if "best" in r:
            print(f"  {r['gpus']:5d} GPUs: best {'+'.join(r['best']) or 'none'}; published {'+'.join(r['published'])}")


# ----------------------------------------------------------------------------------- --calibrate
def load_measurements(path: str, backend: str = "xirang") -> list:
    """Rows (ws, bytes, seconds) of `backend`'s allreduce from a JSON file.

    Accepted: benchmarks/allreduce.py --json output ({"rows": [{"ws", "bytes", ..., "xirang": {"time_us"},
    "gloo": {"time_us"}}]}: the time under the backend's name), or a list of flat row dicts, or a dict
    holding one under "rows"/"results"/"data"/"measurements". A row needs a world size ("ws"/
    "world_size"/"n"), a message size ("bytes"/"size_bytes"/"nbytes"/"size"; or "numel" x "elem_bytes"
    (4)) and a time, flat or under the backend's name: "time_us"/"median_us"/"us" (microseconds),
    "time_ms"/"median_ms", or "time_s"/"median_s"/"seconds". Rows whose "backend" is given and differs
    from `backend`, whose "op"/"collective" is not an allreduce, that ran another algorithm than the ring
    ("<backend>_rank0": {"algorithm"}, e.g. xirang's direct exchange below XIRANG_SMALL_BYTES), with a
    world size below 2, or with a missing, non-numeric, non-positive or implausible size (> 2^50 B) or
    time (< 1 ns, > 1 day) are skipped.
    Raises ValueError (one line, naming the file) when the file cannot be read as JSON."""
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"cannot read {path} as JSON: {str(e)[:200]}") from None
    if isinstance(d, dict):
        d = next((d[k] for k in ("rows", "results", "data", "measurements") if isinstance(d.get(k), list)), [d])
    if not isinstance(d, list):
        return []

    def number(x, high: float) -> Optional[float]:
        if isinstance(x, bool):
            return None
        try:
            v = float(x)
        except (TypeError, ValueError, OverflowError):
            return None
        return v if math.isfinite(v) and 0 < v <= high else None

    out = []
    for r in d:
        if not isinstance(r, dict) or r.get("backend", backend) != backend:
            continue
        if "allreduce" not in str(r.get("op", r.get("collective", "allreduce"))):
            continue
        ws = number(next((r[k] for k in ("ws", "world_size", "n") if k in r), None), 2**20)
        nb = number(next((r[k] for k in ("bytes", "size_bytes", "nbytes", "size") if k in r), None), 2.0**50)
        if nb is None and "numel" in r:
            numel, esize = number(r["numel"], 2.0**50), number(r.get("elem_bytes", 4), 16)
            nb = numel * esize if numel and esize else None
        meta = r.get(f"{backend}_rank0")  # allreduce.py: what rank 0's record says about the op
        if isinstance(meta, dict) and meta.get("algorithm", "ring") != "ring":  # e.g. xirang's direct exchange of small messages: not the ring model
            continue
        src = r[backend] if isinstance(r.get(backend), dict) else r
        t = None
        for keys, scale in ((("time_us", "median_us", "us"), 1e-6), (("time_ms", "median_ms"), 1e-3),
                            (("time_s", "median_s", "seconds"), 1.0)):
            k = next((k for k in keys if k in src), None)
            if k is not None:
                t = number(src[k], 86400 / scale)
                t = t * scale if t and t * scale >= 1e-9 else None
                break
        if ws and nb and t and ws >= 2 and ws == int(ws):
            out.append((int(ws), nb, t))
    return out


def cpu_share(n: int, cores: Optional[int]) -> float:
    """max(1, n / cores): how many times longer n ranks' CPU work takes on `cores` cores than on one core
    each (None or 0: a core per rank, 1.0)."""
    return max(1.0, n / cores) if cores else 1.0


def fit(rows: list, cores: Optional[int] = None):
    """Least squares T = share(n) (2(n-1) alpha + 2(n-1)/n S beta) over rows (n, S bytes, T s) -> (alpha s, beta s/B).

    share(n) = max(1, n / cores) (cpu_share; cores None: 1): on loopback a ring step is CPU work from
    end to end (system calls, kernel copies, the reduction), and n ranks on fewer cores than ranks take
    turns on them. With a single world size the constant term cannot be split between per-step
    latency and launch overhead; it is all put into alpha. A negative alpha is pinned to 0 (beta refitted
    alone). Raises ValueError when fewer than two message sizes (or world sizes) make the two terms
    inseparable, or when beta <= 0 or explains < 1% of every row's time."""
    import numpy as np

    A = np.array([[2 * (n - 1) * cpu_share(n, cores), 2 * (n - 1) / n * S * cpu_share(n, cores)] for n, S, _ in rows])
    y = np.array([t for _, _, t in rows])
    if len(rows) < 2 or np.linalg.matrix_rank(A / np.abs(A).max(axis=0)) < 2:
        raise ValueError("alpha and beta cannot be told apart: measure at least two message sizes")
    w = 1 / y  # relative error: small messages matter as much as big ones
    (alpha, beta), *_ = np.linalg.lstsq(A * w[:, None], y * w, rcond=None)
    if alpha < 0:  # a negative latency is meaningless: fit beta alone with alpha = 0
        alpha = 0.0
        beta = float(np.dot(A[:, 1] * w, y * w) / np.dot(A[:, 1] * w, A[:, 1] * w))
    # the bandwidth term must explain a visible part (>= 1%) of some row's time
    if not (math.isfinite(alpha) and math.isfinite(beta)) or beta <= 0 or float((A[:, 1] * beta / y).max()) < 0.01:
        raise ValueError(f"the fit gives beta = {beta:.3g} s/B: the times do not grow with the message size "
                         "(measure a range of sizes, e.g. 64 KiB to 16 MiB)")
    return float(alpha), float(beta)


def predict(alpha: float, beta: float, n: int, S: float, cores: Optional[int] = None) -> float:
    """share(n) (2(n-1) alpha + 2(n-1)/n S beta); with cores None (or >= n) the plain alpha-beta ring."""
    return cpu_share(n, cores) * (2 * (n - 1) * alpha + 2 * (n - 1) / n * S * beta)


def loopback_cluster(n: int, alpha: float, beta: float, cores: Optional[int] = None) -> Cluster:
    """A Cluster for n ranks on one machine over loopback with a calibrated (alpha, beta): the links are
    free (infinite bandwidth) and beta is the CPU cost per chunk byte, shared when n > cores. Its
    RingSet time equals predict(alpha, beta, n, S, cores) up to the share on alpha (scaled by hand here)."""
    share = cpu_share(n, cores)
    return Cluster(gpus=n, gpus_per_host=n, hosts_per_rack=1, host_GBps=math.inf, host_alpha_us=alpha * share * 1e6,
                   launch_us=0.0, cpu_GBps=(1 / beta / GB) if beta > 0 else 0.0, cores_per_host=cores or 0,
                   placement="packed")


def calibrate(path: str, backend: str = "xirang", cores: Optional[int] = None) -> dict:
    """Fit (alpha, beta) to `backend`'s allreduce rows in `path` (load_measurements) and predict this
    machine's allreduce at WS 2, 4, 8 and 1 MiB-256 MiB. Raises SettingsError (one line) when the file
    cannot be read, holds fewer than 2 usable rows or the fit is not physical (beta <= 0)."""
    try:
        rows = load_measurements(path, backend)
        if len(rows) < 2:
            raise ValueError(f"need >= 2 usable {backend} allreduce rows in {path}, found {len(rows)}")
        alpha, beta = fit(rows, cores)
    except ValueError as e:
        raise SettingsError(f"--calibrate: {e}") from None
    pred = [{"ws": n, "bytes": S, "measured_s": t, "predicted_s": predict(alpha, beta, n, S, cores),
             "error_pct": 100 * (predict(alpha, beta, n, S, cores) / t - 1)} for n, S, t in rows]
    extra = [{"ws": n, "bytes": float(S), "predicted_s": predict(alpha, beta, n, S, cores)}
             for n in (2, 4, 8) for S in (2**20, 2**26, 2**28)]
    return {"alpha_us": alpha * 1e6, "beta_s_per_byte": beta, "bandwidth_GBps": 1 / beta / GB if beta > 0 else None,
            "cores": cores, "rows": pred, "predictions": extra}


# ----------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m xirang.sim", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--paper", action="store_true",
                      help="check the claims of the published platform report on a 175B-parameter model on 128 "
                           "GPUs: each figure internally consistent? reproduced by the model (within 25%%)?")
    mode.add_argument("--recommend", action="store_true", help="which optimisations pay, 8..1024 GPUs")
    mode.add_argument("--calibrate", metavar="FILE", help="fit alpha/beta from benchmarks/allreduce.py JSON")
    p.add_argument("--backend", default="xirang", help="backend rows to use with --calibrate")
    p.add_argument("--cores", type=int, default=os.cpu_count(),
                   help="--calibrate: cores the measured ranks shared (ranks beyond it take turns: "
                        "time x ranks / cores); 0: a core per rank (plain alpha-beta)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    add_args(p)
    a = p.parse_args(argv)
    bad = check_args(a)
    if bad:
        p.error(bad)
    try:
        return run_mode(a)
    except SettingsError as e:
        p.error(str(e))
    except OverflowError as e:
        p.error(f"the settings overflow the arithmetic ({e}): values this large are not physical")


def check_finite(d, where: str = "result") -> None:
    """Raise SettingsError naming the first inf/NaN number in d (nested dicts/lists): settings so
    extreme (e.g. --oversub 1e308) that the arithmetic overflows give no meaningful answer."""
    if isinstance(d, float) and not math.isfinite(d):
        raise SettingsError(f"the settings overflow the arithmetic: {where} = {d}; values this large are not physical")
    if isinstance(d, dict):
        for k, v in d.items():
            check_finite(v, f"{where}.{k}")
    elif isinstance(d, (list, tuple)):
        for i, v in enumerate(d):
            check_finite(v, f"{where}[{i}]")


def run_mode(a) -> int:
    if a.paper:
        d = paper(a)
        check_finite(d["runs"], "runs")
        print(json.dumps(d, indent=1)) if a.json else print_paper(d)
    elif a.recommend:
        d = recommend(a)
        check_finite(d["rows"], "rows")
        print(json.dumps(d, indent=1)) if a.json else print_recommend(d)
    elif a.calibrate:
        d = calibrate(a.calibrate, a.backend, a.cores or None)
        check_finite(d)
        if a.json:
            print(json.dumps(d, indent=1))
        else:
            bw = d["bandwidth_GBps"]
            print(f"alpha = {d['alpha_us']:.1f} us per ring step, beta = {d['beta_s_per_byte']:.3e} s/B "
                  f"({bw:.2f} GB/s), " + (f"ranks share {d['cores']} cores" if d["cores"] else "a core per rank (no sharing)"))
            print(table(d["rows"], ["ws", "bytes", "measured_s", "predicted_s", "error_pct"]))
            print("\npredicted for this machine:")
            print(table(d["predictions"], ["ws", "bytes", "predicted_s"]))
    else:
        s = build(a)
        cfg = Config.of([o for o in OPTS if getattr(a, o) or a.all], group=a.group, bucket_mb=a.bucket_mb)
        r = s.run(cfg)
        check_finite(r)
        if a.json:
            print(json.dumps({"settings": settings(s), "result": r}, indent=1))
        else:
            synced = f"{s.m.shard_params() / 1e9:.2f}B params synced per GPU" if s.dp > 1 else "nothing to sync (dp = 1)"
            print(f"{s.m.params / 1e9:.1f}B params, tp={s.m.tp} pp={s.m.pp}, {s.cl.gpus} GPUs, dp={s.dp}, {synced}")
            print(table([r], ["config", "launches", "allreduce_s", "total_comm_s", "exposed_comm_s", "compute_s",
                              "step_s", "tokens_per_s", "xrack_GB"]))
    return 0


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `... | head` ends quietly, as other CLI tools do
    sys.exit(main())
