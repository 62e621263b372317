"""torchrun restarts onto the same store (#15 item 21).

torchrun's c10d rendezvous (its default) lets the workers of every attempt share the agents' store,
so a restarted attempt finds the previous attempt's keys there. Each case runs real torchrun agents
on this host (`--rdzv-backend=c10d --max-restarts=2`), a DDP training on xirang checked every step
against a single-process computation (restart_worker.py); one worker of the first attempt SIGKILLs
itself mid-training, the agents restart the workers, and the new attempt must train every step
with right values. In the new attempt rank 0 comes late, so the others meet the old keys first
(without generations that failed every time). WS 4 (2 agents x 2) and WS 2 (2 agents x 1: the
agents' restart counts differ). Every subprocess is bounded by a timeout.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.xirang_only, pytest.mark.dedicated, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 150.0  # seconds for the whole run: startup, the kill, the restart, the training


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agents(nnodes: int, nproc: int, out: str, steps: int, victim: int):
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # the shared store is the case under test
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=restart{port}",
           "--max-restarts=2", "--monitor-interval=0.1",
           os.path.join(HERE, "restart_worker.py"), "--out", out, "--steps", str(steps), "--kill-step", "4",
           "--victim", str(victim)]
    procs = []
    for node in range(nnodes):
        log = open(os.path.join(out, f"agent{node}.log"), "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True), log))
    deadline = time.monotonic() + TIMEOUT
    rcs = []
    for p, log in procs:
        try:
            rcs.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            rcs.append(None)
    for p, log in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # the agent's own session: it and its workers
            p.wait()
        log.close()
    return rcs


def _logs(out: str, nnodes: int) -> str:
    text = []
    for node in range(nnodes):
        with open(os.path.join(out, f"agent{node}.log")) as f:
            text.append(f"--- agent {node}\n" + f.read()[-5000:])
    return "\n".join(text)


@pytest.mark.parametrize("nnodes,nproc", [(2, 2), (2, 1)], ids=["2x2", "2x1"])
def test_torchrun_restart_on_shared_store_trains_right(nnodes, nproc, tmp_path):
    out = str(tmp_path)
    ws = nnodes * nproc
    steps = 10
    victim = ws - 1  # on the last node: not the one whose agent hosts the store
    rcs = _agents(nnodes, nproc, out, steps, victim)
    logs = _logs(out, nnodes)
    assert os.path.exists(os.path.join(out, "killed")), "the victim never killed itself\n" + logs
    assert rcs == [0] * nnodes, f"torchrun agents exited {rcs}\n{logs}"
    with open(os.path.join(out, "killed")) as f:
        killed_pid, t_kill = f.read().split()
    with open(os.path.join(out, "starts")) as f:
        starts = [line.split() for line in f if line.strip()]
    first_pids = {int(pid) for _, _, pid, _ in starts[:ws]}
    assert int(killed_pid) in first_pids, (killed_pid, starts)
    ready = []
    for r in range(ws):
        with open(os.path.join(out, f"done_rank{r}.json")) as f:
            done = json.load(f)
        assert done["world_size"] == ws and done["steps"] == steps
        assert done["pid"] not in first_pids, f"rank {r} finished in the first attempt: {done}\n{logs}"
        assert done["max_err"] <= 1e-9, done
        ready.append(done["t_ready"])
    print(f"WS {ws}: {len(starts) // ws - 1} restart(s); the restarted group was ready "
          f"{max(ready) - float(t_kill):.1f} s after the kill")
