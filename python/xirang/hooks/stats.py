"""The hook's per-group view of its own communication (this rank, Python side)."""
from __future__ import annotations

from typing import Any, Dict, List

import torch

from .layout import Group

_SUMMED = ("bytes_raw_per_step", "bytes_wire_per_step", "launches_per_step", "collectives_per_step",
           "residual_bytes")


def group_record(g: Group, ring: float, wire_bytes: float = 2.0) -> Dict[str, Any]:
    """One group's figures; ``ring`` = 2(N-1)/N, the share of a buffer a rank sends in a ring
    allreduce; ``wire_bytes`` the compressed format's bytes per element. The bytes are the TCP ring's, computed: a group whose ranks share one host and
    run over shared memory (XIRANG_TRANSPORT_LOCAL) moves fp32 instead; what each operation
    really moved, and by which transport, is in its record (``bytes_tcp``, ``bytes_shm``)."""
    raw = 4 * g.ef_numel * ring
    wire = wire_bytes * g.ef_numel * ring
    for dt, k in g.plain_numel.items():
        item = torch.empty((), dtype=dt).element_size()
        raw += item * k * ring
        wire += item * k * ring
    res_bytes = sum(t.numel() * t.element_size() for t in (g.residual, g.staged) if t is not None)
    nl = max(1, g.launches_total)
    return {
        "group": g.index,
        "layers": list(g.layer_names),
        "numel_compressed": g.ef_numel,
        "numel_plain": {str(dt).replace("torch.", ""): k for dt, k in g.plain_numel.items()},
        "launches_per_step": g.launches_last_step,
        "launches_total": g.launches_total,
        "collectives_per_step": g.launches_last_step,  # one backend operation per launch
        "bytes_raw_per_step": raw * g.launches_last_step,
        "bytes_wire_per_step": wire * g.launches_last_step,
        "launch_delay_s": g.delay_bucket_s,
        "launch_delay_from_grad_ready_s": g.delay_grad_ready_s,
        "first_bucket_to_launch_s": g.delay_first_bucket_s,
        "comm_s": g.comm_s,
        "mean_launch_delay_s": g.sum_delay_bucket_s / nl,
        "mean_launch_delay_from_grad_ready_s": (
            g.sum_delay_grad_ready_s / g.n_delay_grad_ready if g.n_delay_grad_ready else None
        ),
        "mean_comm_s": g.sum_comm_s / nl,
        "residual_bytes": res_bytes,
    }


def hook_stats(groups: List[Group], world_size: int, exposed_s: float, sum_exposed_s: float, steps: int,
               skipped_steps: int, wire_bytes: float = 2.0) -> Dict[str, Any]:
    """``{"groups": [group_record...], "totals": {...}}``: see ``BF16ErrorFeedbackState.stats``."""
    n = world_size or 1
    ring = 2.0 * (n - 1) / n
    recs = [group_record(g, ring, wire_bytes) for g in groups]
    tot: Dict[str, Any] = {k: sum(r[k] for r in recs) for k in _SUMMED}
    tot["bytes_raw_per_step"] = float(tot["bytes_raw_per_step"])
    tot["bytes_wire_per_step"] = float(tot["bytes_wire_per_step"])
    tot["exposed_comm_s"] = exposed_s
    tot["mean_exposed_comm_s"] = sum_exposed_s / max(1, steps)
    tot["steps"] = steps
    tot["skipped_steps"] = skipped_steps
    tot["groups"] = len(groups)
    return {"groups": recs, "totals": tot}
