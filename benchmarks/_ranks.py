"""Shared by the benchmarks: start one process per rank and collect what they report, and
describe the machine a table was measured on.

A worker is `worker(rank, ws, port, cfg, q)`; it puts `(kind, value)` tuples on `q`: `("done",
rank)` when finished, `("error", text)` on failure, anything else is handed to `on_message`.
Everything is bounded by `cfg["timeout"]` seconds; ranks left running are killed.
"""
from __future__ import annotations

import os
import platform
import queue as _queue
import socket
import time


def auto_warmup() -> int:
    """Untimed synced steps a ``layers_per_group="auto"`` hook needs before its choice is in use:
    DDP's first (not measured), the calibration's (``CALIBRATION_STEPS``), and the one whose first
    hook call applies the choice."""
    from xirang.hooks.autogroup import CALIBRATION_STEPS  # noqa: PLC0415  (xirang: the benchmarks' venv)

    return CALIBRATION_STEPS + 2


def auto_model(ag: dict) -> str:
    """``stats()["autogroup"]``'s fitted model in one line (both benchmarks print rank 0's): alpha
    (us per operation), beta (as MB/s) and its source, the contention at the size in use and by
    calibrated size, the tail (us + s/B), the slowdown, the predicted exposed ms by layers/group."""
    beta = ag.get("beta_s_per_byte")
    preds = sorted((ag.get("predictions_s") or {}).items(), key=lambda kv: int(kv[0]))
    return (f"alpha {1e6 * (ag.get('alpha_s') or 0):.1f} us/op, {(1e-6 / beta) if beta else float('nan'):.1f} MB/s "
            f"({ag.get('source')}), contention {ag.get('contention') or 0:.2f} (by calibrated size "
            f"{ag.get('contention_by_size')}), tail {1e6 * (ag.get('tail_s') or 0):.0f} us + "
            f"{ag.get('tail_s_per_byte') or 0:.3g} s/B, slowdown {ag.get('slowdown') or 1:.2f}; "
            "predicted exposed ms by layers/group: " + ", ".join(f"{k}: {v * 1e3:.2f}" for k, v in preds))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker, ws: int, cfg: dict, on_message) -> None:
    """Run `worker` on `ws` spawned ranks; raise RuntimeError with the first rank's error."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, ws, port, cfg, q), daemon=True) for r in range(ws)]
    for p in procs:
        p.start()
    done, err = 0, None
    deadline = time.monotonic() + cfg["timeout"]
    while done < ws and err is None:
        left = deadline - time.monotonic()
        if left <= 0:
            err = f"WS={ws}: timed out after {cfg['timeout']} s"
            break
        try:
            kind, val = q.get(timeout=min(left, 1.0))
        except _queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if not dead:
                continue
            try:  # give the error message a moment to arrive
                kind, val = q.get(timeout=2.0)
            except _queue.Empty:
                err = f"WS={ws}: rank(s) exited with {[p.exitcode for p in dead]}"
                break
        if kind == "done":
            done += 1
        elif kind == "error":
            err = val
        else:
            on_message(kind, val)
    for p in procs:
        p.join(timeout=10 if err is None else 2)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if err:
        raise RuntimeError(err)


def machine_info() -> dict:
    info = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        info["loadavg"] = os.getloadavg()
    except OSError:
        pass
    try:
        import torch

        import xirang

        info["torch"] = torch.__version__
        info["xirang"] = xirang.build_info()
    except Exception as e:  # pragma: no cover
        info["xirang_error"] = repr(e)
    info["env"] = {k: v for k, v in os.environ.items() if k.startswith("XIRANG_")}
    return info
