"""Alpha-beta cost of one allreduce: ring arithmetic (the schedule of csrc/core/ring), closed
forms, and the concurrent rings of a cluster whose slowest edge sets the pace."""
from __future__ import annotations

import math

from .model import Cluster


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
