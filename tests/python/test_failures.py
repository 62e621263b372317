"""Peer failure, timeouts, poisoning and resource leaks (xirang only).

Each test spawns its own ranks (a dedicated ``mp_pool.Pool``) because it kills ranks or leaves
its group in an error state.  Run them against gloo, for harness development only, with
XIRANG_TEST_XIRANG_ONLY_ON_GLOO=1 (the assertions are xirang's; gloo is not expected to meet them).
"""
from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import mp_pool

pytestmark = [pytest.mark.xirang_only, pytest.mark.dedicated, pytest.mark.slow]


def _ms(x):
    return datetime.timedelta(milliseconds=x)


def _wait_key(key, seconds=60):
    mp_pool.W.store.wait([key], datetime.timedelta(seconds=seconds))


def _second_op_raises(t, group=None):
    """After an error the group is poisoned: the next op raises too (quickly)."""
    return mp_pool.capture(dist.all_reduce, t, group=group)


# ---------------------------------------------------------------- a peer exits after a barrier
def w_peer_exits():
    dist.barrier()
    if dist.get_rank() == 0:
        os._exit(0)
    t = torch.ones(1000)
    first = mp_pool.capture(dist.all_reduce, t)
    second = _second_op_raises(t)
    return first, second


def test_peer_exit_detected_fast(backend):
    with mp_pool.Pool(2, backend, timeout_s=60) as pool:
        res = pool.run(w_peer_exits, allow_exit=[0], timeout=60)
        assert isinstance(res[0], mp_pool.Exited)
        first, second = res[1]
        print(f"{backend}: peer exit -> rank 1 raised after {getattr(first, 'elapsed', None)}: {first}")
        assert isinstance(first, mp_pool.ExcInfo), "rank 1's all_reduce did not raise after rank 0 exited"
        assert first.is_runtime_error, f"not a RuntimeError: {first}"
        assert first.elapsed < 5.0, f"rank 1 raised after {first.elapsed:.2f} s (want ~2 s, group timeout 60 s)"
        assert isinstance(second, mp_pool.ExcInfo) and second.is_runtime_error, "group not poisoned"
        assert second.elapsed < 5.0, f"second op took {second.elapsed:.2f} s to raise"


# ---------------------------------------------------------------- a peer is SIGKILLed mid-op
def w_killed_during_large_allreduce():
    me = dist.get_rank()
    t = torch.ones(16 * 1024 * 1024)  # 64 MiB of float32
    dist.barrier()
    if me == 2:
        def killer():
            time.sleep(0.05)
            mp_pool.W.store.set("killed_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=killer, daemon=True).start()
    t_start = time.time()
    for i in range(200):  # keep 64 MiB all_reduces in flight until the kill lands
        try:
            dist.all_reduce(t)
        except Exception as e:  # noqa: BLE001
            t_err = time.time()
            killed_at = float(mp_pool.W.store.get("killed_at").decode())
            return dict(exc=mp_pool.exc_info(e), latency=t_err - killed_at, ops_done=i,
                        since_start=t_err - t_start, second=_second_op_raises(torch.ones(4)))
    return dict(exc=None, ops_done=200)


def test_peer_killed_during_64mib_allreduce(backend):
    with mp_pool.Pool(3, backend, timeout_s=60) as pool:
        res = pool.run(w_killed_during_large_allreduce, allow_exit=[2], timeout=60)
        assert isinstance(res[2], mp_pool.Exited)
        for r in (0, 1):
            d = res[r]
            print(f"{backend}: rank {r} after kill: {d}")
            assert d["exc"] is not None, f"rank {r} never raised after rank 2 was killed"
            assert d["exc"].is_runtime_error, f"rank {r}: not a RuntimeError: {d['exc']}"
            assert d["latency"] < 5.0, f"rank {r} raised {d['latency']:.2f} s after the kill (want ~2 s)"
            assert isinstance(d["second"], mp_pool.ExcInfo), f"rank {r}: group not poisoned"


# ---------------------------------------------------------------- group timeout 1 s
def w_group_timeout(seconds):
    g = dist.new_group(backend=mp_pool.W.backend, timeout=datetime.timedelta(seconds=seconds))
    dist.barrier(group=g)  # the group is connected and both ranks are here
    if dist.get_rank() == 1:  # never calls the all_reduce
        _wait_key("rank0_done")
        return None
    res = mp_pool.capture(dist.all_reduce, torch.ones(8), group=g)
    second = _second_op_raises(torch.ones(8), group=g)
    mp_pool.W.store.set("rank0_done", "1")
    return res, second


def test_group_timeout(backend):
    with mp_pool.Pool(2, backend, timeout_s=60) as pool:
        res = pool.run(w_group_timeout, 1.0, timeout=60)
        first, second = res[0]
        print(f"{backend}: group timeout 1 s -> raised after {getattr(first, 'elapsed', None)}: {first}")
        assert isinstance(first, mp_pool.ExcInfo), "all_reduce with an absent peer did not raise"
        assert first.is_runtime_error, f"not a RuntimeError: {first}"
        assert 0.8 <= first.elapsed <= 4.0, f"raised after {first.elapsed:.2f} s, want ~1 s (group timeout)"
        assert isinstance(second, mp_pool.ExcInfo), "group not poisoned after the timeout"
        assert second.elapsed < 4.0, f"second op took {second.elapsed:.2f} s"


# ---------------------------------------------------------------- per-op timeout beats group's
def w_op_timeout(numel):
    g = dist.new_group(backend=mp_pool.W.backend, timeout=datetime.timedelta(seconds=10))
    dist.barrier(group=g)
    if dist.get_rank() == 1:
        _wait_key("rank0_done")
        return None
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    opts.timeout = _ms(200)

    def op():
        return g.allreduce([torch.ones(numel)], opts).wait()

    first = mp_pool.capture(op)
    second = _second_op_raises(torch.ones(8), group=g)
    mp_pool.W.store.set("rank0_done", "1")
    return first, second


# 64 MiB: the ring's sends (32 MiB a step) run on the transport's helper sender thread and block
# on the absent peer's full socket when the deadline passes.
@pytest.mark.parametrize("numel", [8, 16 << 20], ids=["32B", "64MiB"])
def test_op_timeout_beats_group_timeout(backend, numel):
    with mp_pool.Pool(2, backend, timeout_s=60) as pool:
        first, second = pool.run(w_op_timeout, numel, timeout=60)[0]
        print(f"{backend}: op timeout 200 ms -> raised after {getattr(first, 'elapsed', None)}: {first}")
        assert isinstance(first, mp_pool.ExcInfo), "all_reduce with an absent peer did not raise"
        assert first.is_runtime_error, f"not a RuntimeError: {first}"
        assert 0.1 <= first.elapsed <= 2.0, f"raised after {first.elapsed:.2f} s, want ~0.2 s (op timeout)"
        assert isinstance(second, mp_pool.ExcInfo), "group not poisoned after the op timeout"
        assert second.elapsed < 4.0, f"second op took {second.elapsed:.2f} s (group timeout is 10 s)"


# ---------------------------------------------------------------- error reaches wait() and the future
def w_async_error_reaches_future():
    g = dist.new_group(backend=mp_pool.W.backend, timeout=datetime.timedelta(seconds=1))
    dist.barrier(group=g)
    if dist.get_rank() == 1:
        _wait_key("rank0_done")
        return None
    w = dist.all_reduce(torch.ones(8), group=g, async_op=True)
    fut = w.get_future()
    waited = mp_pool.capture(w.wait)
    fut_err = mp_pool.capture(fut.wait)
    mp_pool.W.store.set("rank0_done", "1")
    return waited, fut_err, w.is_completed()


def test_async_error_reaches_wait_and_future(backend):
    with mp_pool.Pool(2, backend, timeout_s=60) as pool:
        waited, fut_err, completed = pool.run(w_async_error_reaches_future, timeout=60)[0]
        assert isinstance(waited, mp_pool.ExcInfo), "Work.wait() did not raise"
        assert isinstance(fut_err, mp_pool.ExcInfo), "the Future did not carry the error"
        assert completed, "is_completed() False after the op failed"


# ---------------------------------------------------------------- no fd / thread leaks
def _counts():
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def w_group_cycles(n, warmup, default_group):
    backend, me, ws = mp_pool.W.backend, mp_pool.W.rank, mp_pool.W.world_size
    if default_group:
        dist.destroy_process_group()
    before = None
    for i in range(n):
        if i == warmup:
            before = _counts()
        if default_group:
            dist.init_process_group(backend, store=dist.PrefixStore(f"cycle{i}", mp_pool.W.store),
                                    rank=me, world_size=ws, timeout=datetime.timedelta(seconds=60))
            g = None
        else:
            g = dist.new_group(backend=backend)
        t = torch.ones(1000)
        dist.all_reduce(t, group=g)
        assert t[0].item() == ws
        if default_group:
            dist.destroy_process_group()
        else:
            dist.destroy_process_group(g)
    time.sleep(0.2)  # let exiting threads finish
    return before, _counts()


@pytest.mark.parametrize("default_group", [False, True], ids=["new_group", "init_process_group"])
def test_no_fd_or_thread_leak_over_50_groups(backend, default_group):
    with mp_pool.Pool(2, backend, timeout_s=60) as pool:
        res = pool.run(w_group_cycles, 50, 5, default_group, timeout=120)
        pool.discard()
        for r, ((fd0, th0), (fd1, th1)) in enumerate(res):
            print(f"{backend}: rank {r} fds {fd0}->{fd1} threads {th0}->{th1}")
            assert fd1 - fd0 <= 3, f"rank {r}: open fds {fd0} -> {fd1} over 45 create/use/destroy cycles"
            assert th1 - th0 <= 2, f"rank {r}: threads {th0} -> {th1} over 45 create/use/destroy cycles"


# ---------------------------------------------------------------- a peer exits before any op
def w_peer_exits_before_first_op():
    if dist.get_rank() == 1:
        os._exit(0)  # never connects to anybody
    time.sleep(0.5)
    return mp_pool.capture(dist.all_reduce, torch.ones(1000))


def test_peer_that_never_connected_is_detected_fast(backend):
    # TCP's listener probe (over shared memory the dead pid is what says so: test_shm.py)
    with mp_pool.Pool(2, backend, timeout_s=60, env={"XIRANG_TRANSPORT_LOCAL": "tcp"}) as pool:
        res = pool.run(w_peer_exits_before_first_op, allow_exit=[1], timeout=60)
        first = res[0]
        print(f"{backend}: rank 0 raised after {getattr(first, 'elapsed', None)}: {first}")
        assert isinstance(first, mp_pool.ExcInfo), "rank 0's all_reduce did not raise"
        assert first.elapsed < 5.0, f"raised after {first.elapsed:.2f} s (group timeout 60 s)"
        assert "refuses connections" in str(first), str(first)


# ---------------------------------------------------------------- destroy after the store's host left
_STORE_HOST_EXITS = r"""
import datetime, os, socket, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp


SUBGROUP = None


def run(rank, port, subgroup):
    global SUBGROUP
    import xirang  # noqa: F401
    # rank 0's process hosts the TCPStore (env:// without torchrun's agent)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("xirang", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    t = torch.ones(1000)
    if subgroup:  # a group Python still holds after destroy_process_group: shut down again at exit
        SUBGROUP = dist.new_group([0, 1])
        dist.all_reduce(torch.ones(4), group=SUBGROUP)
    dist.send(t, 1 - rank) if rank == 0 else dist.recv(t, 0)  # a TCP connection on every path
    # last: rank 0 leaves only once rank 1's receive is done (a receive still waiting when the
    # store's host exits asks the store whether rank 0 is gone, and torch's client logs the failure)
    dist.all_reduce(t)
    assert t[0].item() == 2.0
    if rank == 0:
        dist.destroy_process_group()
        return  # and the process exits, taking the store down
    deadline = time.time() + 60  # until rank 0's process has exited (its store refuses)
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            break
        time.sleep(0.1)
    dist.destroy_process_group()
    print("rank 1 destroyed", flush=True)


if __name__ == "__main__":
    mp.spawn(run, args=(int(sys.argv[1]), sys.argv[2] == "1"), nprocs=2)
"""


def _run_store_script(tmp_path, name, text, args, env, timeout):
    """Runs ``text`` (a script whose rank 0 hosts the TCPStore on the port given as its first
    argument, then ``args``) with ``env`` added; the CompletedProcess."""
    import socket
    import subprocess
    import sys

    from conftest import require_backend

    require_backend("xirang")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    script = tmp_path / name
    script.write_text(text)
    # The ranks share one stdout pipe, parsed line by line: buffered, print(..., flush=True) writes
    # a line in one write; under PYTHONUNBUFFERED its text and newline go apart and two ranks'
    # lines interleaved (a full run on 2026-12-07).
    env = {k: v for k, v in dict(os.environ, OMP_NUM_THREADS="1", **env).items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run([sys.executable, str(script), str(port), *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=str(tmp_path))


_LATE_AFTER_STORE_HOST_LEFT = r"""
import datetime, os, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp


def run(rank, port):
    import xirang  # noqa: F401
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("xirang", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=3))
    if rank == 1:
        time.sleep(8)  # rank 0 times out waiting for this rank, and exits with the store it hosts
    try:
        dist.all_reduce(torch.ones(16))
        err = None
    except RuntimeError as e:
        err = str(e)
    print(f"rank {rank} error: {err!r}", flush=True)
    if rank == 0:
        os._exit(0)


if __name__ == "__main__":
    ctx = mp.spawn(run, args=(int(sys.argv[1]),), nprocs=2, join=False)
    for p in ctx.processes:
        p.join(90)
"""


def test_a_late_rank_after_the_store_host_left_is_told_so(tmp_path):
    """TCP: rank 0 (the store's host) times out waiting for rank 1 and exits; rank 1's first
    collective, long after, cannot reach the store to find rank 0's address: it raises that the
    store is unreachable and that its host may have exited (found by a reviewer: it raised torch's
    bare "Failed to recv, got 0 bytes"), not a timeout and no hang."""
    p = _run_store_script(tmp_path, "late_rank.py", _LATE_AFTER_STORE_HOST_LEFT, [],
                          {"XIRANG_TRANSPORT_LOCAL": "tcp"}, timeout=120)
    out = p.stdout + p.stderr
    lines = {r: next((x for x in out.splitlines() if x.startswith(f"rank {r} error: ")), None) for r in (0, 1)}
    assert lines[0] is not None and "timed out" in lines[0] and "rank 1" in lines[0], out[-4000:]
    assert lines[1] is not None and "xirang rank 1: all_reduce" in lines[1], out[-4000:]
    assert "the store is unreachable" in lines[1] and "may have exited" in lines[1], lines[1]
    assert "frame #" not in lines[1], lines[1]


@pytest.mark.parametrize("local,subgroup", [("auto", False), ("tcp", False), ("tcp", True)])
def test_destroy_after_the_store_host_exited_is_quiet(tmp_path, local, subgroup):
    """A rank destroying its group after the rank that hosted the store exited writes no exit note
    (every peer is gone: nobody waits for it), so torch's TCPStore prints no failed send with a
    C++ backtrace on a clean job end. With a subgroup Python still holds, shut down a second time
    at exit (its connections closed by then), the note is not written again."""
    p = _run_store_script(tmp_path, "store_host_exits.py", _STORE_HOST_EXITS, ["1" if subgroup else "0"],
                          dict(XIRANG_TRANSPORT_LOCAL=local), timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "rank 1 destroyed" in out, out[-4000:]
    assert "sendBytes failed" not in out and "Broken pipe" not in out and "frame #" not in out, out[-4000:]


_STORE_HOST_KILLED = r"""
import datetime, os, signal, sys, threading
import torch, torch.distributed as dist, torch.multiprocessing as mp


def run(rank, port):
    import xirang  # noqa: F401
    os.environ["XIRANG_ELASTIC"] = "1"
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("xirang", store=store, rank=rank, world_size=3, timeout=datetime.timedelta(seconds=30))
    dist.all_reduce(torch.ones(8))
    if rank == 0:  # the store's host dies
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    err = None
    for _ in range(100000):
        try:
            dist.all_reduce(torch.ones(1024))
        except RuntimeError as e:
            err = str(e)
            break
    print(f"rank {rank} error: {err!r}", flush=True)
    dist.destroy_process_group()
    print(f"rank {rank} destroyed", flush=True)


if __name__ == "__main__":
    ctx = mp.spawn(run, args=(int(sys.argv[1]),), nprocs=3, join=False)
    for p in ctx.processes:
        p.join(90)
"""


def test_store_host_killed_in_elastic_mode_errors_without_a_backtrace(tmp_path):
    """Elastic mode, the rank that hosts the TCPStore SIGKILLed: the survivors raise "the store is
    unreachable (...)" (elastic mode needs a store that outlives every node) in one line, not with
    c10::Error's C++ backtrace (25 frames, found by a new user), and destroy writes no note into
    the dead store. torch's own store client may still log its first failed send once."""
    p = _run_store_script(tmp_path, "store_host_killed.py", _STORE_HOST_KILLED, [], {}, timeout=150)
    out = p.stdout + p.stderr
    for r in (1, 2):
        line = next((x for x in out.splitlines() if x.startswith(f"rank {r} error: ")), None)
        assert line is not None and f"rank {r} destroyed" in out, out[-4000:]
        assert "the store is unreachable" in line, line
        assert "frame #" not in line and "Exception raised from" not in line, line
    # torch's client logs a failed call with its frames: at most the calls racing into the dead
    # store at the moment it died (a survivor's heartbeat thread and its operation), none after
    # (before: every later store call, the abort and exit notes included, 5-6 per survivor)
    assert out.count("Exception raised from") <= 4, out[-6000:]


# ---------------------------------------------------------------- leaving Python without destroy
_EXIT_AFTER_TIMEOUT = r"""
import datetime, sys, time
import torch, torch.distributed as dist
import xirang  # noqa: F401

rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("xirang", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=2))
if rank == 0:
    try:
        dist.recv(torch.empty(4))  # from any rank; nobody sends
    except RuntimeError as e:
        print("rank 0 raised, timed out:", "timed out" in str(e), flush=True)
else:
    time.sleep(3)
# no destroy_process_group: the interpreter exits with the group alive
"""


def test_exit_without_destroy_after_a_receive_timed_out_is_clean(tmp_path):
    """A process leaving the interpreter with its group alive, just after a receive from any rank
    timed out, exits with status 0. Before xirang's exit handler, the point-to-point thread could
    drop the last reference to the receive's Work (and its tensor) while Python finalized; Python
    ended that thread inside a C++ destructor ("terminate called without an active exception",
    SIGABRT) in about one run of five. Three runs, TCP between the ranks."""
    import socket
    import subprocess
    import sys

    from conftest import require_backend

    require_backend("xirang")
    script = tmp_path / "exit_after_timeout.py"
    script.write_text(_EXIT_AFTER_TIMEOUT)
    env = dict(os.environ, XIRANG_TRANSPORT_LOCAL="tcp", OMP_NUM_THREADS="1")
    for attempt in range(3):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, cwd=str(tmp_path)) for r in range(2)]
        outs = [p.communicate(timeout=60) for p in procs]
        for r, (p, (out, err)) in enumerate(zip(procs, outs)):
            assert p.returncode == 0 and "terminate called" not in err, (attempt, r, p.returncode, err[-3000:])
        assert "rank 0 raised, timed out: True" in outs[0][0], (attempt, outs[0])


def test_exit_handler_shuts_live_groups_down():
    """xirang's atexit handler (registered when xirang._C loads) shuts every live group down, as
    destroy_process_group would: the group then refuses operations with a clear error."""
    import subprocess
    import sys

    code = (
        "import datetime, torch, torch.distributed as dist, xirang\n"
        "store = dist.TCPStore('127.0.0.1', 0, 1, True, timeout=datetime.timedelta(seconds=30))\n"
        "dist.init_process_group('xirang', store=store, rank=0, world_size=1)\n"
        "t = torch.ones(3); dist.all_reduce(t)\n"
        "xirang._backend.load_C()._shutdown_for_exit()\n"
        "try:\n"
        "    dist.all_reduce(t)\n"
        "except RuntimeError as e:\n"
        "    print('REFUSED', e)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "REFUSED" in p.stdout and "was shut down" in p.stdout, (p.stdout, p.stderr[-3000:])
