"""Ranks for the GPU checks: `world` spawned processes on a free local port, each running
``worker(rank, world, port, *args, q)``, which must ``q.put((rank, result))`` once (a dict; an
``"error"`` key for a failure). Shared by check_collectives.py, check_ddp.py and check_fsdp.py."""
import socket

import torch.multiprocessing as mp


def run(worker, world, *args, timeout=240):
    """{rank: result} of every rank's worker (queue.Empty after `timeout` seconds without one)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=timeout) for _ in range(world))
    for p in procs:
        p.join(30)
    return got
