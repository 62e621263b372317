"""Optional exporters of xirang's operation records: Prometheus and TensorBoard.

    import xirang.exporters as xe
    prom = xe.start_prometheus()             # http://host:(XIRANG_PROMETHEUS_PORT + LOCAL_RANK)/metrics
    tb = xe.TensorBoardExporter("runs/comm") # then, every step or every few:
    tb.write(step)

Both read ``xirang.stats(process_group)`` (this rank's records) and only take records they have not
seen yet (by sequence number), so they are cheap to call often. Neither package is a dependency
of xirang: ``prometheus_client`` and ``tensorboard`` are imported when an exporter is created, with
an ImportError that says what to install.

Metrics (labels: pg, op, group = the hook's layer group or "-", phase):
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

import os
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

from .report.records import PHASES, unattributed


def _missing(pkg: str, what: str) -> ImportError:
    return ImportError(f"xirang.exporters: {what} needs the '{pkg}' package, which is not installed "
                       f"(pip install {pkg}); xirang itself does not depend on it")


def _group_of(r: dict) -> str:
    gid = r.get("group_id", -1)
    return str(gid) if isinstance(gid, int) and gid >= 0 else "-"


class Aggregator:
    """Cumulative sums over records, fed incrementally (records with a sequence number not above
    the last one seen are skipped, so the same record is never counted twice).

    ``fetch`` returns the current records (default: ``xirang.stats(process_group)``)."""

    def __init__(self, process_group=None, fetch: Optional[Callable[[], List[dict]]] = None, pg_name: str = ""):
        self._pg = process_group
        self._fetch = fetch
        self.pg_name = pg_name
        self.last_seq = 0
        self.lock = threading.Lock()
        # (pg, op, group) -> sums
        self.sums: Dict[Tuple[str, str, str], Dict[str, float]] = {}
        self.peer_wait: Dict[Tuple[str, str], float] = {}

    def _records(self) -> List[dict]:
        if self._fetch is not None:
            return self._fetch()
        import xirang

        return xirang.stats(self._pg)

    def update(self) -> List[dict]:
        """Fold new records into the sums; returns them."""
        with self.lock:
            new = [r for r in self._records() if int(r.get("seq", 0) or 0) > self.last_seq]
            for r in new:
                self.last_seq = max(self.last_seq, int(r.get("seq", 0) or 0))
                pg = str(r.get("pg", self.pg_name))
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
            return new


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
    Records are read at each scrape. Returns the Aggregator behind the metrics. Raises
    ValueError for a port outside 0..65535 or an XIRANG_PROMETHEUS_PORT that is not an integer
    (naming it), and for a second call with the same registry (every metric family would be
    served twice), before anything is registered; OSError for a port in use.
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
    reg = registry if registry is not None else prometheus_client.REGISTRY
    if reg in _REGISTERED:  # a second collector would serve every metric family twice
        raise ValueError("xirang.exporters.start_prometheus: xirang's metrics are already registered in this "
                         "registry (call it once per process; pass registry= for a second set)")
    agg = Aggregator(process_group, fetch)
    if port > 0:  # first: a port in use (OSError) leaves nothing registered
        prometheus_client.start_http_server(port, addr=addr, registry=reg)
    reg.register(_Collector(agg))
    _REGISTERED[reg] = agg
    return agg


# ---------------------------------------------------------------------------------------------
# TensorBoard
# ---------------------------------------------------------------------------------------------


class TensorBoardExporter:
    """Write scalars of the records that appeared since the last write: per layer group (or op
    kind outside the hook) mean phase times in ms per operation, bytes; and the op count."""

    def __init__(self, log_dir: Optional[str] = None, process_group=None, writer: Any = None,
                 fetch: Optional[Callable[[], List[dict]]] = None):
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
        new = self.agg.update()
        sc = self.scalars(new)
        for tag, v in sc.items():
            self.writer.add_scalar(tag, v, step)
        return sc

    def close(self) -> None:
        self.writer.close()
