"""Creation of ProcessGroupXirang objects from torch.distributed's creator arguments."""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch
import torch.distributed as dist

from . import _build_info

log = logging.getLogger("xirang")


class TorchVersionMismatch(RuntimeError):
    """xirang._C was compiled against a different torch than the one running."""


def check_torch_version() -> None:
    """Raise TorchVersionMismatch if the running torch is not the one xirang was built against."""
    built = _build_info.TORCH_VERSION
    if torch.__version__ != built:
        raise TorchVersionMismatch(
            f"xirang was built against torch {built} but torch {torch.__version__} is running; "
            "the C++ ABI differs between torch versions. Rebuild xirang against this torch: "
            "`pip install --no-build-isolation --force-reinstall --no-deps .` in the xirang source tree."
        )


def load_C():
    """Import and return xirang._C after the torch version check."""
    check_torch_version()
    from . import _C  # noqa: N812

    return _C


@dataclasses.dataclass
class Options:
    """Options of a xirang group, passed as `pg_options=` to init_process_group / new_group.

    Attributes:
        timeout: seconds; overrides the group's timeout when set (per-op timeouts still win).
        algorithm: "auto" (direct exchange up to XIRANG_SMALL_BYTES, ring above), "ring", "direct".
        ring_order: "topology" (rack, host, rank; see XIRANG_HOST/XIRANG_RACK) or "rank".
        elastic: reserved for fault-tolerant mode (XIRANG_ELASTIC); must be False for now.
    """

    timeout: Optional[float] = None
    algorithm: str = "auto"
    ring_order: str = "topology"
    elastic: bool = False

    def __post_init__(self):
        if self.algorithm not in ("auto", "ring", "direct"):
            raise ValueError(f"xirang.Options: algorithm must be auto, ring or direct, got {self.algorithm!r}")
        if self.ring_order not in ("topology", "rank"):
            raise ValueError(f"xirang.Options: ring_order must be topology or rank, got {self.ring_order!r}")
        if self.elastic:
            raise NotImplementedError("xirang.Options(elastic=True): elastic mode is not implemented yet")


def create(dist_backend_opts, backend_options):
    C = load_C()
    opts = backend_options if isinstance(backend_options, Options) else Options()
    timeout = dist_backend_opts.timeout.total_seconds()
    if opts.timeout is not None:
        timeout = float(opts.timeout)
    group_name = getattr(dist_backend_opts, "group_id", "") or ""
    pg = C.ProcessGroupXirang(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        timeout,
        str(group_name),
        opts.algorithm,
        [],
    )
    return pg


def backend_for(process_group=None):
    """The ProcessGroupXirang serving CPU tensors of `process_group` (None: the default group).

    Raises TypeError naming the backend found when the group is not xirang's.
    """
    pg = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
    try:
        be = pg._get_backend(torch.device("cpu"))
    except Exception as e:  # noqa: BLE001
        raise TypeError(f"xirang requires the xirang backend for CPU tensors; this group has none ({e})") from None
    C = load_C()
    if not isinstance(be, C.ProcessGroupXirang):
        raise TypeError(
            f"xirang requires the xirang backend, got {dist.get_backend(pg)!r}: "
            "create the group with init_process_group(backend='xirang') (or 'cpu:xirang,...')"
        )
    return be
