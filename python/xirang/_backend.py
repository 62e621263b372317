"""Creation of ProcessGroupXirang objects from torch.distributed's creator arguments."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import socket
import time
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
    """Import and return xirang._C after the torch version check. Loading it registers
    ``_C._shutdown_for_exit`` with :mod:`atexit` (bindings.cpp)."""
    check_torch_version()
    from . import _C  # noqa: N812

    return _C


_ALGORITHMS = ("auto", "ring", "direct", "two_level")
_RING_ORDERS = ("topology", "rank")
_MAX_SECONDS = 1e9  # about 31 years: far beyond any run, far below a deadline's overflow


def _check_seconds(field: str, value, *, timedelta_ok: bool) -> None:
    """None, or a positive finite number of seconds (int/float, not bool; a timedelta if allowed)."""
    if value is None:
        return
    types = (int, float, timedelta) if timedelta_ok else (int, float)
    accepted = ("a positive number of seconds (int or float) or a positive datetime.timedelta" if timedelta_ok
                else "a positive number of seconds (int or float)") + ", or None"
    if isinstance(value, bool) or not isinstance(value, types):
        raise TypeError(f"xirang.Options: {field} must be {accepted}, got {type(value).__name__} {value!r}")
    s = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not (math.isfinite(s) and 0 < s <= _MAX_SECONDS):
        raise ValueError(f"xirang.Options: {field} must be {accepted} (at most {_MAX_SECONDS:.0e} s), got {value!r}")


def _check_choice(field: str, value, choices, none_ok: bool) -> None:
    if value is None and none_ok:
        return
    accepted = ", ".join(repr(c) for c in choices) + (" or None" if none_ok else "")
    if not isinstance(value, str):
        raise TypeError(f"xirang.Options: {field} must be one of {accepted}, got {type(value).__name__} {value!r}")
    if value not in choices:
        raise ValueError(f"xirang.Options: {field} must be one of {accepted}, got {value!r}")


def _check_elastic(value) -> None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"xirang.Options: elastic must be True, False or None, got {type(value).__name__} {value!r}")


_CHECKS = {
    "timeout": lambda v: _check_seconds("timeout", v, timedelta_ok=True),
    "algorithm": lambda v: _check_choice("algorithm", v, _ALGORITHMS, none_ok=False),
    "ring_order": lambda v: _check_choice("ring_order", v, _RING_ORDERS, none_ok=True),
    "elastic": _check_elastic,
    "heartbeat_s": lambda v: _check_seconds("heartbeat_s", v, timedelta_ok=False),
}


@dataclasses.dataclass
class Options:
    """Options of a xirang group, passed as `pg_options=` to init_process_group / new_group.

    Every field is checked when it is set (at construction and on assignment): a value of the
    wrong type raises TypeError, a value out of range ValueError, both naming the field and the
    accepted values; assigning to a name that is not a field raises AttributeError.

    Attributes:
        timeout: a positive number of seconds (int or float, not bool) or a positive
            datetime.timedelta; overrides the group's timeout when set (per-op timeouts, e.g.
            AllreduceOptions().timeout, still win). None: the group's timeout.
        algorithm: "auto" (direct exchange up to XIRANG_SMALL_BYTES; above it two-level where hosts
            hold equal numbers of ranks, else the ring), "ring", "direct", "two_level". Default
            "auto" defers to XIRANG_ALGO.
        ring_order: "topology" (sorted by rack, host, rank; labels from XIRANG_HOST/XIRANG_RACK/
            XIRANG_TOPOLOGY_FILE) or "rank"; None defers to XIRANG_RING_ORDER.
        elastic: True or False: elastic mode (also XIRANG_ELASTIC=1): when a rank is lost the
            survivors agree through the store on the live ranks, rebuild the ring without it and go
            on; operations in flight raise xirang.MembershipChanged (the comm hook's own operation
            is retried on the new ring). None defers to XIRANG_ELASTIC. See README "Elastic mode".
        heartbeat_s: elastic mode: a rank whose store heartbeat is silent this long (a positive
            number of seconds) is declared failed; None defers to XIRANG_HEARTBEAT_S.
    """

    timeout: Optional[Union[float, timedelta]] = None
    algorithm: str = "auto"
    ring_order: Optional[str] = None
    elastic: Optional[bool] = None
    heartbeat_s: Optional[float] = None

    def __setattr__(self, name, value):
        check = _CHECKS.get(name)
        if check is None:
            raise AttributeError(f"xirang.Options has no field {name!r}; fields: {', '.join(_CHECKS)}")
        check(value)
        object.__setattr__(self, name, value)


def _labels(C) -> tuple:
    """This rank's (host, rack) labels: XIRANG_HOST (default hostname), XIRANG_RACK, else the
    XIRANG_TOPOLOGY_FILE line 'hostname rack' for the host, else 'rack0'."""
    host = C.env_get("XIRANG_HOST") or socket.gethostname()
    rack = C.env_get("XIRANG_RACK")
    path = C.env_get("XIRANG_TOPOLOGY_FILE")
    if not rack and path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"XIRANG_TOPOLOGY_FILE={path!r}: no such file")
        with open(path) as f:
            for line in f:
                parts = line.split("#", 1)[0].split()
                if len(parts) >= 2 and parts[0] == host:
                    rack = parts[1]
                    break
    rack = rack or "rack0"
    for name, value in (("XIRANG_HOST", host), ("XIRANG_RACK", rack)):
        if not value.isprintable():  # one line in logs and error messages, one word in a topology file
            raise ValueError(f"{name}={value!r}: a host or rack label must be printable (no tabs or newlines)")
    return host, rack


def _shared_settings(C, opts, local: str, order: str, elastic: bool, heartbeat_s: float) -> dict:
    """The settings every rank of a group must share, as this rank resolved them: knob name (or the
    Options field and its knob) -> value. Compared across the ranks at creation, resolved so that
    spellings of one setting agree ("64K" and "65536"; XIRANG_CUDA_TRANSPORT auto, host and mirror:
    auto is host, and the staged and mirror engines send the same frames over TCP). Not here: what
    may differ per host (XIRANG_SHM_BYTES: the ranks of one host use the value of the one that
    creates their segment) or per rank."""
    algorithm = opts.algorithm if opts.algorithm != "auto" else C.env_get("XIRANG_ALGO")
    cuda = C.env_get("XIRANG_CUDA_TRANSPORT")
    shared = {
        "XIRANG_TRANSPORT_LOCAL": local,
        "XIRANG_CUDA_TRANSPORT": "host" if cuda in ("auto", "mirror") else cuda,
        "algorithm (Options.algorithm / XIRANG_ALGO)": algorithm,
        "ring order (Options.ring_order / XIRANG_RING_ORDER)": order,
        "XIRANG_SEGMENT_BYTES": C.env_int("XIRANG_SEGMENT_BYTES"),
        "elastic mode (Options.elastic / XIRANG_ELASTIC)": bool(elastic),
    }
    if algorithm == "auto":  # the size at which auto leaves the direct exchange for the ring
        shared["XIRANG_SMALL_BYTES"] = C.env_int("XIRANG_SMALL_BYTES")
    if elastic:  # a rank with a shorter heartbeat bound would declare live peers failed
        shared["heartbeat period in seconds (Options.heartbeat_s / XIRANG_HEARTBEAT_S)"] = float(heartbeat_s)
    return shared


def _get_label(store, ns: str, r: int, rank: int, group_name: str, timeout_s: float) -> str:
    """Rank r's label, polled until the group timeout: RuntimeError at once when rank 0's
    generation handshake failed (it writes why under the generation), RuntimeError naming rank r
    at the timeout (a store get would wait the store's own timeout instead)."""
    key, failed = f"{ns}/label/{r}", f"{ns}/failed"
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if store.check([failed]):
            raise RuntimeError(f"xirang rank {rank}: creating group '{group_name}' failed on its rank 0: "
                               f"{store.get(failed).decode()}")
        if time.monotonic() >= deadline:
            raise RuntimeError(f"xirang rank {rank}: rank {r} of group '{group_name}' did not publish its topology "
                               f"label within the group timeout ({timeout_s:g} s): it failed or never got there")
        time.sleep(0.02)
    return store.get(key).decode()


def _exchange_labels(store, ns: str, rank: int, size: int, group_name: str, join: bool,
                     mine: dict, problem: Optional[BaseException], timeout_s: float = 1800.0) -> list:
    """Every rank's label ({"host", "rack", "settings"}), through the group's store.

    Each rank first writes its own: its labels and shared settings, or {"error": why} when its own
    settings are bad (`problem`, raised here after writing), so that its peers raise too instead of
    waiting for a label that never comes. A spare (`join`) writes nothing: it takes the dead
    rank's place, labels included, as the survivors know them (the ring, shared memory and host
    counters must see one topology on every rank), and a spare refused here leaves no trace.
    Raises ValueError on every rank naming a rank whose settings are bad, a shared setting two
    ranks disagree on (both values), or a label this version cannot read; on a spare whose world
    size is not the group's (each label carries it), naming both. RuntimeError when rank 0's
    generation handshake failed, or a rank's label is not there within ``timeout_s``."""
    if not join:
        entry = {"error": f"{type(problem).__name__}: {problem}"} if problem is not None else dict(mine, size=size)
        store.set(f"{ns}/label/{rank}", json.dumps(entry, sort_keys=True))
    if problem is not None:
        raise problem
    if join:  # a spare started with another WORLD_SIZE would wait for labels that never come
        try:
            theirs = json.loads(_get_label(store, ns, 0, rank, group_name, timeout_s)).get("size")
        except (TypeError, AttributeError, json.JSONDecodeError):
            theirs = None  # not this version's label: the loop below says so
        if isinstance(theirs, int) and theirs != size:
            raise ValueError(f"xirang rank {rank}: this spare's world size is {size}, but group '{group_name}' "
                             f"has {theirs} ranks (its rank 0's label): start the spare with the job's WORLD_SIZE")
    labels = []
    for r in range(size):
        raw = _get_label(store, ns, r, rank, group_name, timeout_s)
        try:
            entry = json.loads(raw)
            if "error" in entry:
                raise ValueError(f"xirang rank {rank}: rank {r} cannot create group '{group_name}': {entry['error']}")
            entry = {"host": str(entry["host"]), "rack": str(entry["rack"]), "settings": dict(entry["settings"])}
        except (TypeError, KeyError, json.JSONDecodeError):
            raise ValueError(f"xirang rank {rank}: rank {r}'s label {raw[:200]!r} is not this version's "
                             "(every rank of a group must run the same xirang)") from None
        labels.append(entry)
    for name, value in mine["settings"].items():
        # labels[rank] is this rank's own, or for a spare the lost rank's it replaces: not a peer's
        differ = [r for r in range(size) if r != rank and labels[r]["settings"].get(name) != value]
        if differ:
            theirs = ", ".join(f"rank {r}: {labels[r]['settings'].get(name)!r}" for r in differ[:8])
            more = f" (and {len(differ) - 8} more ranks)" if len(differ) > 8 else ""
            raise ValueError(f"xirang rank {rank}: {name} must agree across the group's ranks "
                             f"(group '{group_name}'): this rank {value!r}, {theirs}{more}")
    return labels


def create(dist_backend_opts, backend_options):
    """torch.distributed's creator of a xirang group (extended API).

    backend_options: a xirang.Options, or None for the defaults (an object of another backend's
    options type is ignored, as gloo does, so that "cpu:xirang,cuda:nccl" can take NCCL's).
    Knobs are read through xirang._C (declared in csrc/core/env.cc). A bad value raises ValueError
    naming the knob and the accepted values (OSError for an unusable XIRANG_STATS_DIR or
    XIRANG_TOPOLOGY_FILE) on this rank, and ValueError naming this rank and the error on its
    peers, which it tells through the store (only a bad XIRANG_JOIN, which the store's use
    depends on, fails this rank alone). Ranks that disagree on a shared setting
    (_shared_settings) raise ValueError on every rank naming it and both values.
    """
    C = load_C()
    opts = backend_options if isinstance(backend_options, Options) else Options()
    timeout = dist_backend_opts.timeout.total_seconds()
    if opts.timeout is not None:
        timeout = opts.timeout.total_seconds() if isinstance(opts.timeout, timedelta) else float(opts.timeout)
    store = dist_backend_opts.store
    rank, size = dist_backend_opts.group_rank, dist_backend_opts.group_size
    group_name = str(getattr(dist_backend_opts, "group_id", "") or "")
    global_ranks = list(getattr(dist_backend_opts, "global_ranks_in_group", []) or range(size))
    global_rank = int(global_ranks[rank]) if rank < len(global_ranks) else rank
    join = C.env_bool("XIRANG_JOIN")  # the generation needs it: a bad value fails this rank alone
    # This rank's own settings. A bad one is raised after this rank has told its peers (the label
    # exchange below), so that every rank fails at once instead of waiting for it.
    problem = None
    elastic, heartbeat_s, stats_dir, run_id, order, mine = False, 1.0, "", "", "", {}
    try:
        C.env_log_level()  # XIRANG_DEBUG: WARN, INFO or TRACE
        elastic = C.env_bool("XIRANG_ELASTIC") if opts.elastic is None else opts.elastic
        heartbeat_s = opts.heartbeat_s
        if heartbeat_s is None:
            heartbeat_s = C.env_double("XIRANG_HEARTBEAT_S")
            if not (math.isfinite(heartbeat_s) and heartbeat_s > 0):
                raise ValueError("XIRANG_HEARTBEAT_S must be > 0 seconds (finite), "
                                 f"got {C.env_get('XIRANG_HEARTBEAT_S')!r}")
        local = C.env_get("XIRANG_TRANSPORT_LOCAL")
        if local not in ("auto", "shm", "tcp"):
            raise ValueError(f"XIRANG_TRANSPORT_LOCAL must be auto, shm or tcp, got {local!r}")
        order = opts.ring_order or C.env_get("XIRANG_RING_ORDER")
        if order not in _RING_ORDERS:
            raise ValueError(f"XIRANG_RING_ORDER must be topology or rank, got {order!r}")
        C.check_settings(opts.algorithm)  # the knobs the C++ group reads on this rank alone
        shared = _shared_settings(C, opts, local, order, elastic, heartbeat_s)
        host, rack = _labels(C)
        mine = {"host": host, "rack": rack, "settings": shared}
        stats_dir = C.env_get("XIRANG_STATS_DIR")
        if stats_dir:
            try:
                os.makedirs(stats_dir, exist_ok=True)
            except OSError as e:
                raise OSError(f"XIRANG_STATS_DIR={stats_dir!r}: cannot create the directory: {e}") from None
        run_id = C.env_get("XIRANG_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "")
    except (ValueError, OSError) as e:
        if size <= 1:
            raise
        problem = e

    if join and (problem is not None or not elastic):  # a spare fails alone and at once: no group waits for it
        raise problem or ValueError("XIRANG_JOIN=1 (a spare taking a dead rank's place) needs elastic mode "
                                    "(XIRANG_ELASTIC=1)")
    # This creation's generation: every store key of the group lives under it, so a store that
    # outlives an earlier creation (torchrun's restarts) never hands this one that one's keys.
    generation = C.generation(store, rank, size, timeout, join, group_name)
    ns = C.key_namespace(generation)

    # Topology labels of every rank, with the per-group settings every rank must share: ranks
    # that disagree on one would run different exchanges and wait for each other until the
    # timeout (XIRANG_TRANSPORT_LOCAL: each other's shared memory; the algorithm, ring order or
    # segment sizes: frames the peer never sends; XIRANG_CUDA_TRANSPORT: an NCCL communicator the
    # peer never joins).
    hosts, racks, ring = [], [], []
    if size > 1:
        labels = _exchange_labels(store, ns, rank, size, group_name, join, mine, problem, timeout)
        hosts = [x["host"] for x in labels]
        racks = [x["rack"] for x in labels]
        ring = list(C.ring_order([(r, x["host"], x["rack"]) for r, x in enumerate(labels)], order == "topology"))
    return C.ProcessGroupXirang(
        store,
        rank,
        size,
        timeout,
        group_name,
        opts.algorithm,
        ring,
        hosts,
        racks,
        global_rank,
        stats_dir,
        run_id,
        elastic,
        heartbeat_s,
        join,
        generation,
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
