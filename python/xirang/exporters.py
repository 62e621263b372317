"""Optional exporters of xirang's operation records: Prometheus and TensorBoard.

    import xirang.exporters as xe
    prom = xe.start_prometheus()             # http://host:(XIRANG_PROMETHEUS_PORT + LOCAL_RANK)/metrics
    tb = xe.TensorBoardExporter("runs/comm") # then, every step or every few:
    tb.write(step)

Both read ``xirang.stats(process_group)`` (this rank's records) and only take records they have not
seen yet (told apart by their content, so point-to-point records, which all carry seq 0, count
too, and a default group destroyed and created again is counted from its start), so they are
cheap to call often. Records that left the group's ring (XIRANG_STATS_CAPACITY) before an
exporter read them cannot be counted: a WARNING says how many (``Aggregator.lost``). Neither
package is a dependency of xirang: ``prometheus_client`` and ``tensorboard`` are imported when
an exporter is created, with an ImportError that says what to install.

Metrics (labels: pg = the process group's c10d name ("0" the default group), op, group = the
hook's layer group or "-", phase):
    xirang_ops_total                      operations
    xirang_failed_ops_total               operations that failed
    xirang_bytes_raw_total                payload bytes the algorithm would send uncompressed
    xirang_bytes_wire_total               payload bytes sent (headers excluded)
    xirang_bytes_tcp_total, xirang_bytes_shm_total   of them, over TCP / written into shared memory
    xirang_bytes_cross_host_total, xirang_bytes_cross_rack_total
    xirang_phase_seconds_total{phase=}    queued, encode, scatter_reduce, allgather, decode,
                                          unattributed (total minus the four busy phases), total
    xirang_peer_recv_wait_seconds_total{peer=}   time waiting on receives from each peer
TensorBoard scalars (per write, over the new records): xirang/<group>/<phase>_ms (mean per
operation), xirang/<group>/bytes_wire, xirang/<group>/bytes_raw, xirang/ops.
"""
from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

from .report.records import PHASES, unattributed

log = logging.getLogger("xirang")


def _missing(pkg: str, what: str) -> ImportError:
    return ImportError(f"xirang.exporters: {what} needs the '{pkg}' package, which is not installed "
                       f"(pip install {pkg}); xirang itself does not depend on it")


def _group_of(r: dict) -> str:
    gid = r.get("group_id", -1)
    return str(gid) if isinstance(gid, int) and gid >= 0 else "-"


def _key(r: dict) -> tuple:
    """What tells one record from another: its content, less exposed_wait_s (it grows while a
    caller waits on the operation)."""
    return tuple(sorted((k, repr(v)) for k, v in r.items() if k != "exposed_wait_s"))


def _check_process_group(process_group, who: str) -> None:
    if process_group is None:
        return
    import torch.distributed as dist

    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"xirang.exporters.{who}: process_group must be None (the default group) or a "
                        f"torch.distributed ProcessGroup, got {type(process_group).__name__} {process_group!r}")


class Aggregator:
    """Cumulative sums over records, fed incrementally: each record is counted exactly once,
    point-to-point ones (seq 0) included.

    ``fetch`` returns the current records, oldest first (default: ``xirang.stats(process_group)``,
    the group's ring of XIRANG_STATS_CAPACITY records). A record is told from the others by its
    content (seq, op, t_enqueue, times, bytes; not exposed_wait_s, which grows while a caller
    waits): the records after the last one counted are the new ones. When that one is no longer
    in the list, every record in it is new: the group was destroyed and created again (its seq
    restarts at 1), its records were cleared, or its ring wrapped between two updates. In the last
    case the records that dropped out of the ring before they were read cannot be counted: with the
    default ``fetch`` their number is known from the group's record count and is added to
    ``lost`` and logged as a WARNING on the "xirang" logger (a custom ``fetch`` cannot tell).
    The ``pg`` key of the sums is a record's own "pg" field (the JSON lines have one), else
    ``pg_name``, else the name c10d gave the process group read (``ProcessGroup.group_name``).

    Raises TypeError when process_group is neither None (the default group) nor a
    torch.distributed ProcessGroup.
    """

    def __init__(self, process_group=None, fetch: Optional[Callable[[], List[dict]]] = None, pg_name: str = ""):
        _check_process_group(process_group, "Aggregator")
        self._pg = process_group
        self._fetch = fetch
        self.pg_name = pg_name
        self.lock = threading.Lock()
        self.lost = 0  # records that left the ring before they were read (default fetch only)
        self._last_key: Optional[tuple] = None  # content key of the last record counted
        self._source: Any = None  # weakref to the ProcessGroup read last (default fetch)
        self._built = 0  # the group's records built as of the end of the last read (default fetch)
        self._source_name = ""  # that group's name (c10d's), the pg label of its records
        # (pg, op, group) -> sums
        self.sums: Dict[Tuple[str, str, str], Dict[str, float]] = {}
        self.peer_wait: Dict[Tuple[str, str], float] = {}

    def _records(self) -> Tuple[List[dict], Optional[Tuple[int, int]]]:
        """(records, (built before, built after) the read, or None when not known)."""
        if self._fetch is not None:
            return list(self._fetch()), None
        import torch.distributed as dist

        from ._backend import backend_for

        pg = self._pg if self._pg is not None else dist.distributed_c10d._get_default_group()
        be = backend_for(pg)
        if self._source is None or self._source() is not pg:  # a new group: count it from its start
            self._source = weakref.ref(pg)
            self._source_name = str(getattr(pg, "group_name", "") or "")
            self._last_key = None
            self._built = 0
        before = int(be.record_cost()["records"])
        recs = list(be.records())
        after = int(be.record_cost()["records"])
        return recs, (before, after)

    def update(self) -> List[dict]:
        """Fold the records not counted yet into the sums; returns them, oldest first."""
        with self.lock:
            recs, built = self._records()
            new = recs
            if self._last_key is not None:
                for i in range(len(recs) - 1, -1, -1):
                    if _key(recs[i]) == self._last_key:
                        new = recs[i + 1:]
                        break
            if built is not None:
                before, after = built
                if new is recs:  # the last record counted is gone (or none was): were records lost?
                    # a lower bound: `before` is at most the records built up to the read, and
                    # self._built at least those built up to the previous read
                    missed = before - self._built - len(recs)
                    if missed > 0:
                        self.lost += missed
                        log.warning(
                            "xirang.exporters: at least %d operation records could not be counted: they left the "
                            "ring of XIRANG_STATS_CAPACITY records per group (or were cleared) before the "
                            "exporter read them; raise XIRANG_STATS_CAPACITY or read (scrape / write) more "
                            "often", missed)
                self._built = after
            if recs:
                self._last_key = _key(recs[-1])
            for r in new:
                # records read from the backend carry no "pg" (the JSON lines add it): the group's name
                pg = str(r.get("pg", self.pg_name or self._source_name))
                k = (pg, str(r.get("op", "?")), _group_of(r))
                s = self.sums.setdefault(k, {"ops": 0.0, "failed": 0.0, "bytes_raw": 0.0, "bytes_wire": 0.0,
                                              "bytes_tcp": 0.0, "bytes_shm": 0.0,
                                              "bytes_cross_host": 0.0, "bytes_cross_rack": 0.0,
                                              **{p: 0.0 for p in PHASES}, "unattributed_s": 0.0, "total_s": 0.0})
                s["ops"] += 1
                s["failed"] += 0 if r.get("ok", True) else 1
                for b in ("bytes_raw", "bytes_wire", "bytes_tcp", "bytes_shm", "bytes_cross_host", "bytes_cross_rack"):
                    s[b] += float(r.get(b, 0) or 0)
                for p in PHASES + ("total_s",):
                    s[p] += float(r.get(p, 0.0) or 0.0)
                s["unattributed_s"] += unattributed(r)
                for p in r.get("peers") or []:
                    pk = (pg, str(p.get("peer")))
                    self.peer_wait[pk] = self.peer_wait.get(pk, 0.0) + float(p.get("recv_s", 0.0) or 0.0)
            return list(new)


# ---------------------------------------------------------------------------------------------
# Prometheus
# ---------------------------------------------------------------------------------------------


class _Collector:
    def __init__(self, agg: Aggregator):
        self.agg = agg

    def describe(self):  # no records read at registration
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        self.agg.update()
        lab = ["pg", "op", "group"]
        fams = {
            "ops": CounterMetricFamily("xirang_ops", "xirang operations", labels=lab),
            "failed": CounterMetricFamily("xirang_failed_ops", "xirang operations that failed", labels=lab),
            "bytes_raw": CounterMetricFamily("xirang_bytes_raw", "payload bytes uncompressed", labels=lab),
            "bytes_wire": CounterMetricFamily("xirang_bytes_wire", "payload bytes sent (headers excluded)", labels=lab),
            "bytes_tcp": CounterMetricFamily("xirang_bytes_tcp", "payload bytes sent over TCP", labels=lab),
            "bytes_shm": CounterMetricFamily("xirang_bytes_shm", "payload bytes written into shared memory",
                                             labels=lab),
            "bytes_cross_host": CounterMetricFamily("xirang_bytes_cross_host", "payload bytes sent to other hosts", labels=lab),
            "bytes_cross_rack": CounterMetricFamily("xirang_bytes_cross_rack", "payload bytes sent to other racks", labels=lab),
        }
        phase = CounterMetricFamily("xirang_phase_seconds", "seconds per phase of xirang operations",
                                    labels=lab + ["phase"])
        wait = CounterMetricFamily("xirang_peer_recv_wait_seconds", "seconds until receives from a peer completed",
                                   labels=["pg", "peer"])
        with self.agg.lock:
            for (pg, op, grp), s in sorted(self.agg.sums.items()):
                for k, fam in fams.items():
                    fam.add_metric([pg, op, grp], s[k])
                for p in PHASES + ("unattributed_s", "total_s"):
                    phase.add_metric([pg, op, grp, p[:-2]], s[p])
            for (pg, peer), v in sorted(self.agg.peer_wait.items()):
                wait.add_metric([pg, peer], v)
        yield from fams.values()
        yield phase
        yield wait


_REGISTERED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # registry -> its xirang Aggregator


def start_prometheus(port: Optional[int] = None, process_group=None, addr: str = "0.0.0.0",
                     registry: Any = None, fetch: Optional[Callable[[], List[dict]]] = None) -> Aggregator:
    """Serve this rank's xirang metrics over HTTP for Prometheus.

    port: default XIRANG_PROMETHEUS_PORT + LOCAL_RANK (one port per process on a host); 0: no
    HTTP server (the metrics are only registered in ``registry``).
    Records are read at each scrape. Returns the Aggregator behind the metrics. Raises, before
    anything is registered: ValueError for a port outside 0..65535 or an XIRANG_PROMETHEUS_PORT
    that is not an integer (naming it), and for a second call with the same registry (every
    metric family would be served twice); TypeError for a process_group that is neither None nor
    a torch.distributed ProcessGroup; OSError (the errno of the failure, e.g. EADDRINUSE) naming
    addr:port and what to change when the HTTP server cannot listen there (a port in use).
    """
    try:
        import prometheus_client
    except ImportError:
        raise _missing("prometheus_client", "the Prometheus exporter") from None
    if port is None:
        from ._backend import load_C

        base = load_C().env_get("XIRANG_PROMETHEUS_PORT")
        if not base:
            raise ValueError("xirang.exporters.start_prometheus: pass port= or set XIRANG_PROMETHEUS_PORT")
        local = os.environ.get("LOCAL_RANK", "0") or "0"
        try:
            port = int(base) + int(local)
        except ValueError:
            raise ValueError(f"xirang.exporters.start_prometheus: XIRANG_PROMETHEUS_PORT ({base!r}) and LOCAL_RANK "
                             f"({local!r}) must be integers") from None
        where = f" (XIRANG_PROMETHEUS_PORT {base} + LOCAL_RANK {local})"
    else:
        where = ""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"xirang.exporters.start_prometheus: port must be an int in 0..65535 (0: no HTTP server), "
                         f"got {port!r}{where}")
    _check_process_group(process_group, "start_prometheus")
    reg = registry if registry is not None else prometheus_client.REGISTRY
    if reg in _REGISTERED:  # a second collector would serve every metric family twice
        raise ValueError("xirang.exporters.start_prometheus: xirang's metrics are already registered in this "
                         "registry (call it once per process; pass registry= for a second set)")
    agg = Aggregator(process_group, fetch)
    if port > 0:  # first: a port in use (OSError) leaves nothing registered
        try:
            prometheus_client.start_http_server(port, addr=addr, registry=reg)
        except OSError as e:
            knob = ("set XIRANG_PROMETHEUS_PORT to another base port" if where else "pass another port=")
            msg = (f"xirang.exporters.start_prometheus: cannot serve metrics on {addr}:{port}{where}: "
                   f"{e.strerror or e}; {knob} (port=0: no HTTP server), or another addr=")
            raise (OSError(e.errno, msg) if e.errno is not None else OSError(msg)) from e
    reg.register(_Collector(agg))
    _REGISTERED[reg] = agg
    return agg


# ---------------------------------------------------------------------------------------------
# TensorBoard
# ---------------------------------------------------------------------------------------------


class TensorBoardExporter:
    """Write scalars of the records that appeared since the last write: per layer group (or op
    kind outside the hook) mean phase times in ms per operation, bytes; and the op count.

    log_dir: the SummaryWriter's directory (None: its default, runs/...); writer: any object with
    ``add_scalar(tag, value, step)`` and ``close()`` instead of a SummaryWriter. Raises TypeError,
    before any event file is created, for a process_group that is neither None (the default
    group) nor a torch.distributed ProcessGroup.
    """

    def __init__(self, log_dir: Optional[str] = None, process_group=None, writer: Any = None,
                 fetch: Optional[Callable[[], List[dict]]] = None):
        _check_process_group(process_group, "TensorBoardExporter")
        self._closed = False
        if writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise _missing("tensorboard", "the TensorBoard exporter") from None
            writer = SummaryWriter(log_dir=log_dir)
        self.writer = writer
        self.agg = Aggregator(process_group, fetch)

    def scalars(self, new: List[dict]) -> Dict[str, float]:
        """The scalars for a batch of records (tag -> value)."""
        out: Dict[str, float] = {"xirang/ops": float(len(new))}
        per: Dict[str, List[dict]] = {}
        for r in new:
            g = _group_of(r)
            per.setdefault(f"group{g}" if g != "-" else str(r.get("op", "?")), []).append(r)
        for k, lst in sorted(per.items()):
            n = len(lst)
            for p in PHASES + ("total_s",):
                out[f"xirang/{k}/{p[:-2]}_ms"] = 1e3 * sum(float(r.get(p, 0.0) or 0.0) for r in lst) / n
            out[f"xirang/{k}/bytes_wire"] = float(sum(r.get("bytes_wire", 0) or 0 for r in lst))
            out[f"xirang/{k}/bytes_raw"] = float(sum(r.get("bytes_raw", 0) or 0 for r in lst))
        return out

    def write(self, step: int) -> Dict[str, float]:
        """Add the scalars of the records since the last write at ``step``; returns them (tag ->
        value; times in ms, bytes in bytes). Raises RuntimeError after close()."""
        if self._closed:
            raise RuntimeError("xirang.exporters.TensorBoardExporter.write: the exporter is closed "
                               "(close() was called); create a new TensorBoardExporter to write again")
        new = self.agg.update()
        sc = self.scalars(new)
        for tag, v in sc.items():
            self.writer.add_scalar(tag, v, step)
        return sc

    def close(self) -> None:
        """Close the writer (flushes the event file). A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self.writer.close()
