"""Creation of ProcessGroupXirang objects from torch.distributed's creator arguments."""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
from datetime import timedelta
from typing import Optional, Union

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
        timeout: seconds (float) or a datetime.timedelta; overrides the group's timeout when set
            (per-op timeouts, e.g. AllreduceOptions().timeout, still win).
        algorithm: "auto" (direct exchange up to XIRANG_SMALL_BYTES; above it two-level where hosts
            hold equal numbers of ranks, else the ring), "ring", "direct", "two_level". Default
            "auto" defers to XIRANG_ALGO.
        ring_order: "topology" (sorted by rack, host, rank; labels from XIRANG_HOST/XIRANG_RACK/
            XIRANG_TOPOLOGY_FILE) or "rank"; None defers to XIRANG_RING_ORDER (default topology).
        elastic: elastic mode (#8; also XIRANG_ELASTIC=1): when a rank is lost the survivors agree
            through the store on the live ranks, rebuild the ring without it and go on; operations
            in flight raise xirang.MembershipChanged (the comm hook's own operation is retried on
            the new ring). None defers to XIRANG_ELASTIC. See README "Elastic mode".
        heartbeat_s: elastic mode: a rank whose store heartbeat is silent this long (seconds) is
            declared failed; None defers to XIRANG_HEARTBEAT_S (default 1.0).
    """

    timeout: Optional[Union[float, timedelta]] = None
    algorithm: str = "auto"
    ring_order: Optional[str] = None
    elastic: Optional[bool] = None
    heartbeat_s: Optional[float] = None

    def __post_init__(self):
        if self.algorithm not in ("auto", "ring", "direct", "two_level"):
            raise ValueError(
                f"xirang.Options: algorithm must be auto, ring, direct or two_level, got {self.algorithm!r}"
            )
        if self.ring_order not in (None, "topology", "rank"):
            raise ValueError(f"xirang.Options: ring_order must be topology or rank, got {self.ring_order!r}")
        if self.heartbeat_s is not None and not self.heartbeat_s > 0:
            raise ValueError(f"xirang.Options: heartbeat_s must be > 0 seconds, got {self.heartbeat_s!r}")


def _env_flag(name: str) -> bool:
    v = os.environ.get(name, "0").strip().lower()
    if v in ("", "0", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name} must be 0 or 1, got {os.environ[name]!r}")


def _labels() -> tuple:
    """This rank's (host, rack) labels: XIRANG_HOST (default hostname), XIRANG_RACK, else the
    XIRANG_TOPOLOGY_FILE line 'hostname rack' for the host, else 'rack0'."""
    host = os.environ.get("XIRANG_HOST") or socket.gethostname()
    rack = os.environ.get("XIRANG_RACK", "")
    path = os.environ.get("XIRANG_TOPOLOGY_FILE", "")
    if not rack and path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"XIRANG_TOPOLOGY_FILE={path!r}: no such file")
        with open(path) as f:
            for line in f:
                parts = line.split("#", 1)[0].split()
                if len(parts) >= 2 and parts[0] == host:
                    rack = parts[1]
                    break
    return host, rack or "rack0"


def create(dist_backend_opts, backend_options):
    C = load_C()
    opts = backend_options if isinstance(backend_options, Options) else Options()
    elastic = _env_flag("XIRANG_ELASTIC") if opts.elastic is None else bool(opts.elastic)
    heartbeat_s = opts.heartbeat_s
    if heartbeat_s is None:
        raw = os.environ.get("XIRANG_HEARTBEAT_S") or "1.0"
        try:
            heartbeat_s = float(raw)
        except ValueError:
            raise ValueError(f"XIRANG_HEARTBEAT_S must be a number of seconds, got {raw!r}") from None
        if not heartbeat_s > 0:
            raise ValueError(f"XIRANG_HEARTBEAT_S must be > 0 seconds, got {raw!r}")
    timeout = dist_backend_opts.timeout.total_seconds()
    if opts.timeout is not None:
        timeout = opts.timeout.total_seconds() if isinstance(opts.timeout, timedelta) else float(opts.timeout)
    store = dist_backend_opts.store
    rank, size = dist_backend_opts.group_rank, dist_backend_opts.group_size
    group_name = str(getattr(dist_backend_opts, "group_id", "") or "")
    global_ranks = list(getattr(dist_backend_opts, "global_ranks_in_group", []) or range(size))
    global_rank = int(global_ranks[rank]) if rank < len(global_ranks) else rank

    # Topology labels of every rank, exchanged through the group's (prefixed) store.
    host, rack = _labels()
    hosts, racks, ring = [host], [rack], []
    if size > 1:
        store.set(f"xirang/label/{rank}", f"{host}\t{rack}")
        labels = []
        for r in range(size):
            h, k = store.get(f"xirang/label/{r}").decode().split("\t")
            labels.append((r, h, k))
        hosts = [h for _, h, _ in labels]
        racks = [k for _, _, k in labels]
        order = opts.ring_order or os.environ.get("XIRANG_RING_ORDER") or "topology"
        if order not in ("topology", "rank"):
            raise ValueError(f"XIRANG_RING_ORDER must be topology or rank, got {order!r}")
        ring = list(C.ring_order(labels, order == "topology"))
    run_id = os.environ.get("XIRANG_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "")
    stats_dir = os.environ.get("XIRANG_STATS_DIR", "")
    if stats_dir:
        try:
            os.makedirs(stats_dir, exist_ok=True)
        except OSError as e:
            raise OSError(f"XIRANG_STATS_DIR={stats_dir!r}: cannot create the directory: {e}") from None
    return C.ProcessGroupXirang(
        store,
        rank,
        size,
        timeout,
        group_name,
        opts.algorithm,
        ring,
        hosts if size > 1 else [],
        racks if size > 1 else [],
        global_rank,
        stats_dir,
        run_id,
        elastic,
        heartbeat_s,
        _env_flag("XIRANG_JOIN"),
    )


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
    if not isinstance(be, C.ProcessGroupXirang) and isinstance(getattr(be, "wrapped_pg", None), C.ProcessGroupXirang):
        be = be.wrapped_pg  # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps every backend in torch's checker
    if not isinstance(be, C.ProcessGroupXirang):
        raise TypeError(
            f"xirang requires the xirang backend, got {dist.get_backend(pg)!r}: "
            "create the group with init_process_group(backend='xirang') (or 'cpu:xirang,...')"
        )
    return be
