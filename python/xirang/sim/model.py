"""The simulator's inputs: the model (gradient tensors per layer), the cluster (links, placement,
CPU) and the compute times."""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Optional

GB = 1e9


class SettingsError(ValueError):
    """Settings that do not fit together (GPUs vs tp x pp, whole hosts, layers vs pp); the CLI prints it
    as a one-line usage error."""


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
