"""--calibrate: fit alpha and beta to measured allreduce times (benchmarks/allreduce.py JSON), with
ranks sharing fewer cores than ranks; predictions for this machine."""
from __future__ import annotations

import json
import math
from typing import Optional

from .model import GB, Cluster, SettingsError


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


def fit_per_op(rows, clamp_alpha: bool = True) -> tuple:
    """Least squares ``T = alpha + beta B`` over rows ``(B bytes, T seconds)`` of single operations
    -> ``(alpha s per operation, beta s per byte)``, both clamped to >= 0 (alpha only with
    ``clamp_alpha``; without it a negative alpha is kept: a line that interpolates between the
    sizes measured, where big operations cost more per byte than small ones).

    The cost model of one operation of a known size on a known group (the hook's per-group
    allreduce: launch, latency and codec overheads in alpha, everything proportional to the bytes
    in beta), unweighted so that the predicted sum over a step's operations is right. A negative
    alpha (with ``clamp_alpha``) is pinned to 0 and beta refitted through the origin; a negative
    beta to 0 and alpha is the mean time. With one distinct size the two cannot be told apart:
    alpha = 0 and beta = mean(T / B) (or, with B = 0 only, alpha = mean(T)). Raises ValueError for no rows or a non-finite or
    negative value."""
    import numpy as np

    rows = [(float(b), float(t)) for b, t in rows]
    if not rows:
        raise ValueError("fit_per_op: no (bytes, seconds) rows")
    if not all(math.isfinite(b) and math.isfinite(t) and b >= 0 and t >= 0 for b, t in rows):
        raise ValueError("fit_per_op: bytes and seconds must be finite and >= 0")
    x = np.array([b for b, _ in rows])
    y = np.array([t for _, t in rows])
    if np.ptp(x) <= 1e-12 * max(1.0, float(np.abs(x).max())):  # one size: inseparable
        if x[0] <= 0:
            return float(y.mean()), 0.0
        return 0.0, float((y / x).mean())
    (beta, alpha) = np.polyfit(x, y, 1)
    if alpha < 0 and clamp_alpha:
        alpha, beta = 0.0, float(np.dot(x, y) / np.dot(x, x))
    if beta < 0:
        alpha, beta = float(y.mean()), 0.0
    return (max(0.0, float(alpha)) if clamp_alpha else float(alpha)), max(0.0, float(beta))


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
