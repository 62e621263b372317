"""One configuration of optimisations on one cluster: which rings or two-level plan an allreduce
takes, and the timeline of a step (layer groups launched as backward finishes them, one
collective at a time)."""
from __future__ import annotations

import dataclasses
import math

from .cost import RingSet
from .model import GB, Cluster, Compute, Model, SettingsError

OPTS = ("overlap", "bucketing", "topo", "two_level", "bf16")
ALL = "+".join(OPTS)


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


def serial_queue(units, slow_until_s: float = 0.0, slowdown: float = 1.0) -> tuple:
    """Collectives run one at a time in launch order (FIFO, one communication thread or link).

    ``units``: ``(ready_s, cost_s)`` per collective, in launch order, seconds from a common origin
    (e.g. the start of backward): each starts at ``max(ready_s, end of the previous)`` and takes
    ``cost_s``. Before ``slow_until_s`` a collective progresses ``slowdown`` (>= 1) times slower
    (compute beside it takes the CPU it needs: loopback, CPU tensors); 1, the default, is the
    model's usual assumption that nothing slows communication. Returns ``(end of the last, sum of
    the durations)`` in seconds; ``(0.0, 0.0)`` for none.
    """
    free = total = 0.0
    for ready, cost in units:
        start = max(free, ready)
        dur = cost
        if slowdown > 1.0 and start < slow_until_s:
            room = (slow_until_s - start) / slowdown  # work it can do before slow_until_s
            dur = cost * slowdown if cost <= room else (slow_until_s - start) + (cost - room)
        free = start + dur
        total += dur
    return free, total


def exposed_comm(units, bwd_end_s: float, slowdown: float = 1.0) -> tuple:
    """``(exposed_s, total_s)`` of :func:`serial_queue` ``units`` behind a backward that ends at
    ``bwd_end_s`` (same origin; collectives beside it ``slowdown`` times slower): exposed = what
    runs past the end of backward, ``max(0, end of the last collective - bwd_end_s)``, never more
    than the total (a bound only float rounding reaches)."""
    free, total = serial_queue(units, bwd_end_s, slowdown)
    return min(max(0.0, free - bwd_end_s), total), total


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
        xbytes = 0.0
        queue = []  # (ready_s, seconds) per collective, in launch order
        cache: dict = {}
        if self.dp > 1:
            for ready, ops in self.units(cfg):
                for numel in ops:
                    if numel not in cache:
                        cache[numel] = self.allreduce(numel, cfg)
                    t, xb = cache[numel]
                    queue.append((ready, t + cl.launch_us * 1e-6))
                    xbytes += xb
        launches = len(queue)
        exposed, total = exposed_comm(queue, c.bwd_s)
        step = compute + exposed
        whole, _ = self.allreduce(int(self.m.shard_params()), cfg) if self.dp > 1 else (0.0, 0.0)
        return {"config": cfg.label(), "gpus": cl.gpus, "dp": self.dp, "launches": launches,
                "two_level_applied": bool(cfg.two_level and self.two_level_plan(cfg.topo)),
                "allreduce_s": whole, "total_comm_s": total, "exposed_comm_s": exposed, "compute_s": compute,
                "step_s": step, "steps_per_s": 1 / step,
                "tokens_per_s": c.tokens_global / step if c.tokens_global else None,
                "xrack_GB": xbytes / GB}
