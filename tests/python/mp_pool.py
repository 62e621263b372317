"""Multi-process harness for the xirang pytest suite.

A ``Pool`` is a set of long-lived worker processes (one per rank) that have joined one
``torch.distributed`` process group.  The test process ships a *module-level* function
(by module name + qualified name) to every rank, each rank calls it, and the return values
come back to the test process (pickled; tensors included), which then asserts.

Design points
- Workers are processes of their own, each in a session of its own.  They fork from a "zygote"
  (``zygote()``: multiprocessing's forkserver with torch imported once), which saves each
  worker the ~2 s of CPU of importing torch (the suite starts hundreds); the worker replaces its
  environment by the one it was given before it imports anything else.  A pool whose
  environment differs from the zygote's in a variable that torch or the C runtime reads at load
  (``TORCH_*``, ``OMP_*``, ...) starts its workers with ``subprocess`` instead.  Each worker connects back to
  the test process over a private AF_UNIX socket (multiprocessing ``Connection`` framing) and
  rendezvouses through a ``TCPStore`` whose *server lives in the test process*, so the store
  outlives any rank that dies and there is no free-port race.
- Every call has a deadline.  When it passes, the pool is killed and ``PoolTimeout`` is
  raised: a test fails, it never hangs.  A rank that raises unexpectedly poisons the pool
  (other ranks may be stuck inside a collective); the pool is killed after a short grace
  period and ``RemoteError`` carries every rank's traceback.
- ``PoolManager`` keeps one pool per (backend, world size) alive across tests and replaces
  dead / poisoned pools.  Tests that leave a group in an error state call ``pool.discard()``.
- Inside a worker, test functions reach the rank-local state through ``mp_pool.W`` /
  ``mp_pool.group()``.  A pool created with ``extra_backends=("gloo",)`` also holds a gloo
  group over the same ranks (``mp_pool.group("gloo")``), so a test can run the same inputs
  through the backend under test and through gloo in one call.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CALL_TIMEOUT = float(os.environ.get("XIRANG_TEST_CALL_TIMEOUT", "60"))
STARTUP_TIMEOUT = float(os.environ.get("XIRANG_TEST_STARTUP_TIMEOUT", "90"))
ERROR_GRACE = 5.0  # seconds the other ranks get once one rank raised unexpectedly


# --------------------------------------------------------------------------------------
# the zygote: worker processes forked with torch already imported
# --------------------------------------------------------------------------------------
# Read by torch, its OpenMP/BLAS runtimes or the dynamic loader when they load, i.e. in the
# zygote, not in the forked worker: a pool that sets one of these starts fresh interpreters.
_READ_AT_LOAD = ("TORCH_", "OMP_", "MKL_", "OPENBLAS_", "GOMP_", "KMP_", "LD_", "MALLOC_", "PYTHON")
_ZYGOTE_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel"]
_zygote_ctx = None
_zygote_env: dict = {}


def zygote():
    """The multiprocessing context whose processes fork from one server process that imported
    ``_ZYGOTE_PRELOAD`` (with OMP_NUM_THREADS=1), started on first use and shared by the
    session. Processes started from it must call ``zygote_child(env)`` first."""
    global _zygote_ctx, _zygote_env
    if _zygote_ctx is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_ZYGOTE_PRELOAD)
        old = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            multiprocessing.forkserver.ensure_running()
            _zygote_env = dict(os.environ)
        finally:
            if old is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = old
        _zygote_ctx = ctx
    return _zygote_ctx


def zygote_fits(env: dict) -> bool:
    """Whether a process with environment ``env`` (the whole of it) can fork from the zygote:
    it agrees with the zygote's on every variable read at load."""
    zygote()
    keys = {k for k in (*env, *_zygote_env) if k.startswith(_READ_AT_LOAD)}
    return all(env.get(k) == _zygote_env.get(k) for k in keys)


def zygote_child(env: dict) -> None:
    """In a process forked from the zygote: take ``env`` as the whole environment (the
    zygote's is the test process's at the time it started)."""
    os.environ.clear()
    os.environ.update(env)


def _zygote_worker(env: dict) -> None:
    os.setsid()  # as subprocess's start_new_session: Pool.kill() kills the process group
    zygote_child(env)
    _worker_main()


def _zygote_code(env: dict, code: str, out_path: str, err_path: str) -> None:
    zygote_child(env)
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = ["-c"]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})


def run_code(code: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([python, "-c", code], env=env, capture_output=True, text=True,
    timeout=timeout)``, forked from the zygote where ``env`` allows (``zygote_fits``): the exit
    status (an uncaught exception: 1, its traceback on stderr), stdout and stderr as that run
    gives them. Raises ``subprocess.TimeoutExpired`` (the process killed) past ``timeout`` s."""
    if not zygote_fits(env):
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="xrcode") as d:
        out, err = os.path.join(d, "out"), os.path.join(d, "err")
        for path in (out, err):
            open(path, "w").close()
        p = _ZygoteProc(_zygote_code, env, code, out, err)
        try:
            rc = p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            raise subprocess.TimeoutExpired([sys.executable, "-c", code], timeout) from None
        with open(out, errors="replace") as fo, open(err, errors="replace") as fe:
            return subprocess.CompletedProcess([sys.executable, "-c", code], rc, fo.read(), fe.read())


class _ZygoteProc:
    """``target(*args)`` in a process forked from the zygote, with the part of
    ``subprocess.Popen``'s interface that ``Pool`` and ``run_code`` use (pid, poll, wait, kill;
    returncode -N for a signal)."""

    def __init__(self, target: Callable, *args):
        self._p = zygote().Process(target=target, args=args, daemon=True)
        self._p.start()
        self.pid = self._p.pid

    def poll(self) -> Optional[int]:
        return self._p.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._p.join(timeout)
        if self._p.exitcode is None:
            raise subprocess.TimeoutExpired("pool worker", timeout)
        return self._p.exitcode

    def kill(self) -> None:
        self._p.kill()


# --------------------------------------------------------------------------------------
# values that travel back to the test process
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class ExcInfo:
    """An exception raised on a rank, as data (returned by ``capture``)."""

    type_name: str
    mro_names: list
    message: str
    tb: str
    elapsed: float = 0.0

    def isinstance_of(self, name: str) -> bool:
        return name in self.mro_names

    @property
    def is_runtime_error(self) -> bool:
        return "RuntimeError" in self.mro_names

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}"


@dataclasses.dataclass
class Exited:
    """Placeholder result for a rank whose process exited during the call."""

    returncode: Optional[int]


class PoolError(Exception):
    pass


class PoolTimeout(PoolError):
    pass


class RemoteError(PoolError):
    def __init__(self, msg: str, per_rank: list):
        super().__init__(msg)
        self.per_rank = per_rank


def exc_info(e: BaseException, elapsed: float = 0.0) -> ExcInfo:
    return ExcInfo(
        type_name=type(e).__name__,
        mro_names=[c.__name__ for c in type(e).__mro__],
        message=str(e),
        tb="".join(traceback.format_exception(type(e), e, e.__traceback__)),
        elapsed=elapsed,
    )


def capture(fn: Callable, *args, **kwargs):
    """Run ``fn``; return its value, or an ``ExcInfo`` (with the elapsed time) if it raised."""
    t0 = time.monotonic()
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        return exc_info(e, time.monotonic() - t0)


# --------------------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------------------
class _WorkerState:
    rank: int = -1
    world_size: int = 0
    backend: str = ""
    groups: dict = {}
    current: str = ""
    store: Any = None  # PrefixStore shared by this pool's ranks (server in the test process)
    base_store: Any = None
    timeout_s: float = 60.0
    cfg: dict = {}


W = _WorkerState()


def group(name: Optional[str] = None):
    """The process group for ``name`` (default: the group chosen by the current call)."""
    return W.groups[name or W.current]


def _send(conn: Connection, obj) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection):
    return pickle.loads(conn.recv_bytes())


def _resolve(modname: str, qualname: str) -> Callable:
    mod = importlib.import_module(modname)
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _worker_main() -> None:
    cfg = json.loads(os.environ["XIRANG_TEST_WORKER_CFG"])
    sys.path.insert(0, HERE)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(cfg["sock"])
    conn = Connection(sock.detach())
    _send(conn, ("hello", cfg["rank"], os.getpid()))
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        import warnings

        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
        backend = cfg["backend"]
        if backend == "xirang" or "xirang" in cfg.get("extra_backends", []):
            import xirang  # noqa: F401  (registers the backend)
        W.rank, W.world_size, W.backend, W.cfg = cfg["rank"], cfg["world_size"], backend, cfg
        W.timeout_s = cfg["timeout_s"]
        timeout = datetime.timedelta(seconds=cfg["timeout_s"])
        W.base_store = dist.TCPStore(
            "127.0.0.1", cfg["store_port"], is_master=False,
            timeout=datetime.timedelta(seconds=max(60.0, cfg["timeout_s"])),
        )
        W.store = dist.PrefixStore(cfg["prefix"], W.base_store)
        if cfg.get("init", True):
            kwargs = {}
            if cfg.get("pg_options") is not None:
                kwargs["pg_options"] = _resolve(*cfg["pg_options"])()
            dist.init_process_group(
                backend, store=dist.PrefixStore("default_pg", W.store), rank=W.rank,
                world_size=W.world_size, timeout=timeout, **kwargs,
            )
            W.groups = {backend: dist.group.WORLD}
            for b in cfg.get("extra_backends", []):
                W.groups[b] = dist.new_group(backend=b, timeout=timeout)
        W.current = backend
        _send(conn, ("ready", W.rank))
    except BaseException as e:  # noqa: BLE001
        _send(conn, ("init_error", exc_info(e)))
        os._exit(3)

    while True:
        try:
            msg = _recv(conn)
        except (EOFError, OSError):
            os._exit(0)
        if msg[0] == "exit":
            try:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
            _send(conn, ("bye",))
            os._exit(0)
        _, modname, qualname, args, kwargs, gname = msg
        W.current = gname or W.backend
        try:
            fn = _resolve(modname, qualname)
            result = ("ok", fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001
            result = ("err", exc_info(e))
        try:
            _send(conn, result)
        except Exception as e:  # noqa: BLE001  (unpicklable result)
            _send(conn, ("err", exc_info(e)))


# --------------------------------------------------------------------------------------
# test-process side
# --------------------------------------------------------------------------------------
def _qualify(fn: Callable):
    mod = fn.__module__
    if mod == "__main__":
        raise ValueError("functions shipped to ranks must live in an importable module")
    return mod, fn.__qualname__


class Pool:
    """``world_size`` worker processes that joined one process group of ``backend``."""

    _counter = 0

    def __init__(
        self,
        world_size: int,
        backend: str,
        *,
        timeout_s: float = 60.0,
        extra_backends: Sequence[str] = (),
        env: Optional[dict] = None,
        init: bool = True,
        pg_options: Optional[Callable] = None,
        startup_timeout: float = STARTUP_TIMEOUT,
    ):
        import torch.distributed as dist

        Pool._counter += 1
        self.world_size, self.backend = world_size, backend
        self.extra_backends = tuple(extra_backends)
        self.poisoned = False
        self.closed = False
        self.procs: list = []
        self.conns: list = []
        self._tmp = tempfile.mkdtemp(prefix="xrpool")
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.prefix = f"pool{os.getpid()}_{Pool._counter}"
        sock_path = os.path.join(self._tmp, "s")
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lsock.bind(sock_path)
        lsock.listen(world_size)
        try:
            for rank in range(world_size):
                cfg = dict(
                    sock=sock_path, rank=rank, world_size=world_size, backend=backend,
                    extra_backends=list(self.extra_backends), store_port=self.store.port,
                    prefix=self.prefix, timeout_s=timeout_s, init=init,
                    pg_options=_qualify(pg_options) if pg_options else None,
                )
                penv = dict(os.environ, **(env or {}))
                penv["XIRANG_TEST_WORKER_CFG"] = json.dumps(cfg)
                penv.setdefault("OMP_NUM_THREADS", "1")
                if zygote_fits(penv):
                    self.procs.append(_ZygoteProc(_zygote_worker, penv))
                    continue
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-c",
                     f"import sys; sys.path.insert(0, {HERE!r}); import mp_pool; mp_pool._worker_main()"],
                    env=penv, stdin=subprocess.DEVNULL, start_new_session=True,
                ))
            deadline = time.monotonic() + startup_timeout
            by_rank: dict = {}
            while len(by_rank) < world_size:
                lsock.settimeout(max(0.05, deadline - time.monotonic()))
                try:
                    s, _ = lsock.accept()
                except socket.timeout:
                    raise PoolTimeout(f"{backend} pool ws={world_size}: workers did not connect") from None
                s.settimeout(None)
                c = Connection(s.detach())
                hello = self._recv_until(c, deadline, "connect")
                by_rank[hello[1]] = c
            self.conns = [by_rank[r] for r in range(world_size)]
            errors = []
            for r, c in enumerate(self.conns):
                msg = self._recv_until(c, deadline, f"init of rank {r}")
                if msg[0] == "init_error":
                    errors.append((r, msg[1]))
            if errors:
                raise RemoteError(
                    f"{backend} pool ws={world_size} failed to initialise:\n"
                    + "\n".join(f"--- rank {r}:\n{e.tb}" for r, e in errors),
                    [e for _, e in errors],
                )
        except BaseException:
            self.kill()
            raise
        finally:
            lsock.close()

    def _recv_until(self, c: Connection, deadline: float, what: str):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not c.poll(remaining):
            raise PoolTimeout(f"{self.backend} pool ws={self.world_size}: timed out waiting for {what}")
        return _recv(c)

    # ---- calls ----------------------------------------------------------------------
    def run(
        self,
        fn: Callable,
        *args,
        group: Optional[str] = None,
        timeout: float = DEFAULT_CALL_TIMEOUT,
        allow_exit: Sequence[int] = (),
        **kwargs,
    ) -> list:
        """Call ``fn(*args, **kwargs)`` on every rank; return the per-rank results.

        ``group`` picks the group ``mp_pool.group()`` returns on the ranks (default: the pool's
        backend).  Ranks in ``allow_exit`` may exit during the call; their result is ``Exited``.
        """
        __tracebackhide__ = True  # noqa: F841  (pytest: show the remote traceback, not this loop)
        if self.closed or self.poisoned:
            raise PoolError("pool is closed or poisoned")
        mod, qual = _qualify(fn)
        req = ("call", mod, qual, args, kwargs, group)
        for c in self.conns:
            _send(c, req)
        deadline = time.monotonic() + timeout
        results: list = [None] * self.world_size
        pending = set(range(self.world_size))
        failed: dict = {}
        while pending:
            now = time.monotonic()
            if now >= deadline:
                self.kill()
                msg = (f"{self.backend} ws={self.world_size}: {qual} "
                       + (f"did not finish within {ERROR_GRACE:.0f} s after ranks {sorted(failed)} failed"
                          if failed else f"timed out after {timeout:.0f} s")
                       + f"; ranks still running: {sorted(pending)}")
                if failed:
                    msg += "\n" + "\n".join(f"--- rank {r}:\n{e.tb}" for r, e in failed.items())
                    raise RemoteError(msg, [failed.get(r) for r in range(self.world_size)])
                raise PoolTimeout(msg)
            for r in list(pending):
                c = self.conns[r]
                try:
                    ready = c.poll(0.01)
                    msg = _recv(c) if ready else None
                except (EOFError, OSError):
                    rc = self._wait_rc(r)
                    if r in allow_exit:
                        results[r] = Exited(rc)
                        pending.discard(r)
                        self.poisoned = True
                        continue
                    failed[r] = ExcInfo("Exited", ["Exited"], f"rank {r} process exited (rc={rc})", f"rank {r} exited rc={rc}")
                    pending.discard(r)
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE)
                    continue
                if msg is None:
                    continue
                pending.discard(r)
                if msg[0] == "ok":
                    results[r] = msg[1]
                else:
                    failed[r] = msg[1]
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE)
        if failed:
            self.poisoned = True
            self.kill()
            raise RemoteError(
                f"{self.backend} ws={self.world_size}: {qual} raised on ranks {sorted(failed)}:\n"
                + "\n".join(f"--- rank {r}:\n{e.tb}" for r, e in sorted(failed.items())),
                [failed.get(r) for r in range(self.world_size)],
            )
        return results

    def _wait_rc(self, r: int) -> Optional[int]:
        try:
            return self.procs[r].wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    # ---- lifetime -------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return (not self.closed and not self.poisoned
                and all(p.poll() is None for p in self.procs))

    def discard(self) -> None:
        """Mark the pool unusable (e.g. its group is in an error state); the manager replaces it."""
        self.poisoned = True

    def close(self, timeout: float = 10.0) -> None:
        if self.closed:
            return
        if not self.poisoned and all(p.poll() is None for p in self.procs):
            try:
                for c in self.conns:
                    _send(c, ("exit",))
                deadline = time.monotonic() + timeout
                for p in self.procs:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001
                pass
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    try:
                        p.kill()
                    except ProcessLookupError:
                        pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for c in self.conns:
            try:
                c.close()
            except OSError:
                pass
        self.conns = []
        self.closed = True
        try:
            for f in os.listdir(self._tmp):
                os.unlink(os.path.join(self._tmp, f))
            os.rmdir(self._tmp)
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class PoolManager:
    """One live pool per (backend, world size), replaced when dead or poisoned.

    At most ``max_procs`` worker processes are kept; least recently used pools are closed first.
    """

    def __init__(self, max_procs: int = 10):
        self.max_procs = max_procs
        self.pools: dict = {}

    def get(self, backend: str, world_size: int) -> Pool:
        key = (backend, world_size)
        pool = self.pools.pop(key, None)
        if pool is not None and not pool.alive:
            pool.kill()
            pool = None
        if pool is None:
            self._evict(world_size)
            extra = ("gloo",) if backend != "gloo" else ()
            pool = Pool(world_size, backend, extra_backends=extra)
        self.pools[key] = pool  # re-insert: most recently used last
        return pool

    def _evict(self, incoming: int) -> None:
        while self.pools and sum(p.world_size for p in self.pools.values()) + incoming > self.max_procs:
            key = next(iter(self.pools))
            self.pools.pop(key).close()

    def close_all(self) -> None:
        for p in self.pools.values():
            p.close()
        self.pools.clear()
