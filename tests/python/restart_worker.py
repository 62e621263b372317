"""Worker of test_restarts.py: DDP training on xirang under torchrun, checked every step against a
single-process computation; one worker of the first attempt SIGKILLs itself mid-training.

    torchrun ... restart_worker.py --out DIR --steps N --kill-step K --victim R

Every rank trains a float64 nn.Linear with DDP (gradients averaged by xirang's all_reduce) on its
own batch of step s (seeded by s and the rank) and, in the same process, a copy of the model on
the mean loss over every rank's batch of step s: the single-process computation DDP must equal.
Any parameter off by more than 1e-9 ends the worker with an error. Rank R of the first attempt
(the one that finds no DIR/killed file) kills itself with SIGKILL just before step K; torchrun's
agents then restart the workers and the new attempt trains all N steps from the start. In the
restarted attempts rank 0 creates its group --late-rank0-s seconds after the others, so they find
the previous attempt's keys in the store before rank 0 could replace any. Each rank
that finishes writes DIR/done_rank<r>.json (pid, attempt, steps, largest error, the time its
group and DDP were up); every attempt's
ranks append "<attempt> <rank> <pid> <unix time>" to DIR/starts.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import xirang  # noqa: F401  (registers the backend)


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(8, 16, generator=g, dtype=torch.float64),
            torch.randn(8, 4, generator=g, dtype=torch.float64))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-step", type=int, default=4)
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--late-rank0-s", type=float, default=1.0)
    args = p.parse_args()

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # differs between nodes
    if os.environ.get("RANK") == "0" and os.path.exists(os.path.join(args.out, "killed")):
        time.sleep(args.late_rank0_s)
    dist.init_process_group("xirang", timeout=datetime.timedelta(seconds=60))
    rank, ws = dist.get_rank(), dist.get_world_size()
    with open(os.path.join(args.out, "starts"), "a") as f:
        f.write(f"{attempt} {rank} {os.getpid()} {time.time():.3f}\n")

    torch.manual_seed(0)
    model = nn.Linear(16, 4).double()
    ref = copy.deepcopy(model)
    ddp = DDP(model)
    t_ready = time.time()  # the group and DDP (its broadcast and checks) are up
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    mse = nn.functional.mse_loss
    worst = 0.0
    for step in range(args.steps):
        flag = os.path.join(args.out, "killed")
        if rank == args.victim and step == args.kill_step and not os.path.exists(flag):
            with open(flag, "w") as f:
                f.write(f"{os.getpid()} {time.time():.3f}\n")
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step, rank)
        opt.zero_grad()
        mse(ddp(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        (sum(mse(ref(bx), by) for bx, by in (batch(step, r) for r in range(ws))) / ws).backward()
        ref_opt.step()
        err = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
        worst = max(worst, err)
        if err > 1e-9:
            raise SystemExit(f"rank {rank} step {step}: parameters differ from the single-process "
                             f"computation by {err}")
    dist.barrier()
    with open(os.path.join(args.out, f"done_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world_size": ws, "pid": os.getpid(), "attempt": attempt,
                   "steps": args.steps, "max_err": worst,
                   "t_ready": t_ready}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
