#!/usr/bin/env python3
"""Multi-rank DDP training on real, offline data, with the xirang backend and comm hook.

Launch with torchrun (one process per rank)::

    torchrun --nproc_per_node=2 examples/train.py                      # xirang + bf16-ef hook
    torchrun --nproc_per_node=2 examples/train.py --backend gloo --hook none
    torchrun --nproc_per_node=2 examples/train.py --task text --steps 300
    torchrun --nproc_per_node=2 examples/train.py --task text --fsdp       # FSDP2 + xirang.fsdp.compress

The tasks, data and models are in examples/tasks.py (digits: sklearn's handwritten digits and a
24-block residual MLP; text: a byte-level GPT-style decoder on the Python standard library's
source). For a seed, world size, thread count and backend, runs are reproducible: the batch of a
step is a function of (seed, step, rank), so resuming needs only the step, which the checkpoint
stores with the model, optimizer, RNG states and the hook's residuals.

The summary (JSON on rank 0's stdout, and --summary) gives: final loss = mean of the last 20
steps' global (all-rank mean) loss; held-out metrics; step time = mean wall time of a step after
--warmup-steps, slowest rank; bytes on the wire per rank and step = 2(N-1)/N x gradient bytes
(computed) without the hook, the hook's ``state.stats()`` with it. The gloo-vs-xirang comparison
(two trainings, a table, exposed communication measured) is benchmarks/train_compare.py.
"""
from __future__ import annotations

import argparse
import gc
import inspect
import logging
import math
import os
import random
import signal
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch import Launch, device_of, dump, global_mean, import_xirang, setup, slowest, sync, write_summary  # noqa: E402
from tasks import PER_FILE_BYTES, evaluate, make_data, make_model, task_loss  # noqa: E402

log = logging.getLogger("xirang.examples.train")
LAST_N_LOSS = 20  # "final loss" = mean of the last 20 steps' global loss


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--task", choices=["digits", "text"], default="digits")
    p.add_argument("--backend", choices=["xirang", "gloo"], default="xirang")
    p.add_argument("--hook", choices=["none", "bf16-ef", "fp16-ef", "int8-ef", "int8-noef"], default=None,
                   help="DDP comm hook: none = DDP's own allreduce; bf16-ef = xirang's bf16 with error "
                        "feedback, fp16-ef / int8-ef its scaled fp16 / int8 wire formats, int8-noef int8 "
                        "without error feedback (needs --backend xirang). Default: bf16-ef with xirang, "
                        "none with gloo")
    p.add_argument("--fsdp", action="store_true",
                   help="FSDP2 instead of DDP: fully_shard on every block and the root, the reduce-scatter "
                        "through xirang.fsdp.compress (--fsdp-wire); --hook does not apply")
    p.add_argument("--fsdp-wire", choices=["bf16", "bf16-noef", "int8", "int8-noef", "fp32"], default="bf16",
                   help="--fsdp: bf16 or int8 (per-segment scales) with error feedback, either without it "
                        "(-noef), or fp32 (no compression)")
    p.add_argument("--layers-per-group", type=int, default=8)
    p.add_argument("--bucket-cap-mb", type=float, default=0.25,
                   help="DDP bucket cap; small buckets keep the hook's launch delay small")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=None, help="per-rank batch (default: digits 32 samples, text 8 sequences)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate of AdamW (default: digits 2e-3, text 3e-3)")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-steps", type=int, default=10, help="lr warm-up steps; also excluded from the step-time mean")
    p.add_argument("--depth", type=int, default=24, help="number of blocks")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--context", type=int, default=64, help="text: sequence length in bytes")
    p.add_argument("--data", default=None, help="text: a file or folder of text (default: the Python stdlib's source)")
    p.add_argument("--corpus-bytes", type=int, default=400_000,
                   help="text: bytes of the default corpus to use (the first %d bytes of each stdlib file, files "
                        "in sorted order, until this many)" % PER_FILE_BYTES)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank (0 = leave torch's default)")
    p.add_argument("--save", default=None, metavar="DIR", help="write a checkpoint at the end (DIR/rank<R>.pt per rank)")
    p.add_argument("--save-every", type=int, default=0, help="also checkpoint to --save every N steps (0 = only at the end)")
    p.add_argument("--resume", default=None, metavar="DIR", help="resume from a --save checkpoint of the same world size")
    p.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                   help="stop before STEP as if interrupted (the lr schedule still spans --steps)")
    p.add_argument("--stats-dir", default=None, help="write per-rank step records and hook stats (JSON) here")
    p.add_argument("--summary", default=None, metavar="PATH", help="also write the JSON summary here")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("--log-level", default="INFO")
    e = p.add_argument_group("elastic mode (xirang; see README 'Elastic mode')")
    e.add_argument("--elastic", action="store_true",
                   help="survive lost ranks: the survivors rebuild the ring and train on, re-sharding each step's "
                        "global batch over the live ranks; a process started with XIRANG_JOIN=1 and a dead rank's "
                        "RANK takes its place at the next admission")
    e.add_argument("--admit-every", type=int, default=20, metavar="N", help="--elastic: admit waiting spares every N steps (0 = never)")
    e.add_argument("--die-at", type=int, default=None, metavar="STEP",
                   help="--elastic demo: the ranks in --die-ranks SIGKILL themselves at STEP, as if their node had crashed")
    e.add_argument("--die-ranks", default="", metavar="R,R", help="--elastic demo: comma-separated ranks that die at --die-at")
    e.add_argument("--log-every", type=int, default=0, metavar="N",
                   help="print the live ranks' mean training loss every N steps (0 = never)")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Fill the task-dependent defaults; p.error() on settings that do not go together."""
    if args.fsdp:
        if args.elastic or args.save or args.resume:
            p.error("--fsdp: --elastic, --save and --resume are not supported with FSDP2 in this example")
        if args.hook not in (None, "none"):
            p.error("--fsdp replaces DDP: --hook does not apply (choose --fsdp-wire)")
        args.hook = "none"
    if args.hook is None:
        args.hook = "bf16-ef" if args.backend == "xirang" else "none"
    if args.batch_size is None:
        args.batch_size = 32 if args.task == "digits" else 8
    if args.lr is None:
        args.lr = 2e-3 if args.task == "digits" else 3e-3
    if args.steps < 1:
        p.error("--steps must be >= 1")
    for name in ("batch_size", "depth", "width", "context", "corpus_bytes", "layers_per_group"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("warmup_steps", "save_every", "admit_every", "log_every", "threads"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if not (args.lr > 0 and math.isfinite(args.lr)) or not (args.bucket_cap_mb > 0 and math.isfinite(args.bucket_cap_mb)):
        p.error("--lr and --bucket-cap-mb must be finite and > 0")
    if args.elastic and args.backend != "xirang":
        p.error("--elastic needs --backend xirang")
    if args.elastic and (args.save or args.resume):
        p.error("--elastic: --save/--resume are not supported (checkpoints assume a fixed world)")
    args.die_ranks = [int(r) for r in args.die_ranks.split(",") if r.strip()]
    if args.die_ranks and args.die_at is None:
        p.error("--die-ranks needs --die-at")
    return args


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up then cosine decay to 10 % of the peak (a pure function of the step)."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    t = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t))))


def make_ddp(model, args: argparse.Namespace, device: torch.device, xirang: Any, hook_sd: Optional[dict] = None):
    """DDP over the current default group, with the hook when --hook bf16-ef (residuals from hook_sd).

    Elastic: no per-forward buffer broadcast from rank 0 (its root may be gone): torch >= 2.13
    calls that switch ``forward_sync_buffers`` (``broadcast_buffers`` before); buffers are still
    broadcast once at construction, as the parameters are."""
    kw: Dict[str, Any] = {}
    if args.elastic:
        new = "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
        kw = {"forward_sync_buffers": False} if new else {"broadcast_buffers": False}
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=args.bucket_cap_mb, **kw)
    state = None
    if args.hook not in (None, "none"):
        wire, ef = args.hook.split("-")
        state = xirang.register_comm_hook(ddp, layers_per_group=args.layers_per_group, wire=wire,
                                          error_feedback=ef == "ef")
        if hook_sd is not None:
            state.load_state_dict(hook_sd)
    return ddp, state


def make_fsdp(model, args: argparse.Namespace, device: torch.device, xirang: Any):
    """FSDP2 over the default group (a 1-D mesh): fully_shard on each block, then the root;
    xirang.fsdp.compress for the reduce-scatters. Returns (the model, the compressor)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # FSDP2 warns once per module whose output is a view (a Linear on 3-D input): the tasks never
    # modify a module's output in place, which is what the warning is about.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model:
        if any(p.requires_grad for p in block.parameters()):
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    wire, ef = {"bf16": ("bf16", True), "bf16-noef": ("bf16", False), "int8": ("int8", True),
                "int8-noef": ("int8", False), "fp32": ("fp32", False)}[args.fsdp_wire]
    return model, xirang.fsdp.compress(model, wire=wire, error_feedback=ef)


def save_checkpoint(path: str, launch: Launch, step: int, ddp: DDP, opt, state: Any, losses: List[float],
                    args: argparse.Namespace) -> None:
    """One file per rank (the hook's residuals are per rank): DIR/rank<R>.pt, written atomically."""
    os.makedirs(path, exist_ok=True)
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    ck = {"format": "xirang-examples-train/1", "step": step, "world_size": launch.world, "rank": launch.rank,
          "task": args.task, "seed": args.seed, "backend": args.backend, "hook": args.hook,
          "model": ddp.module.state_dict(), "optimizer": opt.state_dict(), "rng": rng,
          "hook_state": state.state_dict() if state is not None else None, "losses": list(losses)}
    f = os.path.join(path, f"rank{launch.rank}.pt")
    torch.save(ck, f + ".tmp")
    os.replace(f + ".tmp", f)
    dist.barrier()
    if launch.rank == 0:
        log.info("checkpoint at step %d written to %s", step, path)


def load_checkpoint(path: str, launch: Launch) -> Dict[str, Any]:
    f = os.path.join(path, f"rank{launch.rank}.pt")
    if not os.path.isfile(f):
        raise FileNotFoundError(f"--resume {path}: no {os.path.basename(f)} (saved with another world size?)")
    ck = torch.load(f, map_location="cpu", weights_only=False)
    if ck.get("world_size") != launch.world:
        raise ValueError(f"--resume {path}: saved with world size {ck.get('world_size')}, this job has {launch.world}")
    return ck


def train(args: argparse.Namespace, launch: Launch, data: Any, device: torch.device, tag: str = "",
          after: Optional[Callable[[DDP, Any], Dict[str, Any]]] = None) -> Dict[str, Any]:
    """One training of --backend/--hook in a fresh process group; returns the summary.

    ``after(ddp, state)``, when given, runs once the summary is made (group still up) and its
    dict is merged into the summary (benchmarks/train_compare.py measures exposed communication)."""
    xirang = None
    if args.backend == "xirang" or args.hook != "none" or args.fsdp:
        xirang = import_xirang(f"--backend {args.backend} --hook {args.hook}" + (" --fsdp" if args.fsdp else ""))
    launch.init(args.backend, xirang.Options(elastic=True) if args.elastic else None)
    try:
        return _train_in_group(args, launch, data, device, xirang, tag, after)
    finally:
        dist.destroy_process_group()


def _train_in_group(args, launch: Launch, data, device, xirang, tag: str, after) -> Dict[str, Any]:
    rank, world = launch.rank, launch.world
    name = args.backend + ("" if args.hook == "none" else f"+{args.hook}") + (f"+fsdp-{args.fsdp_wire}" if args.fsdp else "")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    model = make_model(args.task, args.depth, args.width, args.context).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    # FSDP2 replaces the parameters by sharded ones: its optimizer is made after fully_shard
    opt = None if args.fsdp else torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    start_step, losses, ck = 0, [], None
    live = list(range(world))  # --elastic: the live ranks; each step's batch is cut over them
    if args.elastic:
        xirang.on_membership_change(lambda m: live.__setitem__(slice(None), m["live"]))
        live[:] = xirang.membership()["live"]
        if xirang.membership()["source"] >= 0:  # a spare (XIRANG_JOIN=1) that was just admitted
            start_step = xirang.sync_training_state(model, opt)
            log.warning("rank %d joined at step %d (live ranks %s)", rank, start_step, live)
    if args.resume:
        ck = load_checkpoint(args.resume, launch)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        start_step, losses = int(ck["step"]), list(ck["losses"])
    if args.fsdp:
        ddp, state = make_fsdp(model, args, device, xirang)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    else:
        ddp, state = make_ddp(model, args, device, xirang, ck.get("hook_state") if ck else None)
    if ck is not None:
        random.setstate(ck["rng"]["python"])
        np.random.set_state(ck["rng"]["numpy"])
        torch.set_rng_state(ck["rng"]["torch"])
        if "cuda" in ck["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(ck["rng"]["cuda"])
        if ck.get("hook_state") is None and state is not None:
            log.warning("checkpoint has no hook state: residuals start at zero")
    stop = args.steps if args.stop_at is None else max(start_step, min(args.steps, args.stop_at))
    if rank == 0:
        log.info("[%s] %s", name, data.describe())
        log.info("[%s] model: %d layers (%d blocks x width %d), %d parameters, %.1f KiB of fp32 gradients; "
                 "world size %d; per-rank batch %d; steps %d..%d", name, len(model), args.depth, args.width,
                 n_params, grad_bytes / 1024, world, args.batch_size, start_step, stop)
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=start_step, desc=name, unit="step", dynamic_ncols=True,
                   file=sys.stderr, mininterval=0.5 if sys.stderr.isatty() else 10.0)

    unit = "samples" if args.task == "digits" else "tokens"
    per_step = args.batch_size * world * (1 if args.task == "digits" else args.context)  # units per step
    step_times: List[float] = []
    local_losses: List[float] = []
    t_train = time.perf_counter()
    for step in range(start_step, stop):
        if args.elastic:
            if args.die_at == step and rank in args.die_ranks:
                log.warning("rank %d: simulating the loss of its node: SIGKILL at step %d", rank, step)
                logging.shutdown()  # the line is out before the process is
                os.kill(os.getpid(), signal.SIGKILL)  # the demo's node crash
            if args.admit_every and step > start_step and step % args.admit_every == 0:
                ddp, state = admit_spares(xirang, model, opt, ddp, state, step, args, device)
            if args.log_every and step % args.log_every == 0:
                log_elastic(xirang, step, local_losses[-1] if local_losses else None, live, rank)
        pos, n_shards = (live.index(rank), len(live)) if args.elastic else (rank, world)
        x, y = data.batch(args.seed, step, pos, n_shards, args.batch_size)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        sync(device)
        t0 = time.perf_counter()
        loss = task_loss(args.task, ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync(device)
        step_times.append(time.perf_counter() - t0)
        local_losses.append(loss.item())
        if not math.isfinite(local_losses[-1]):
            raise FloatingPointError(f"rank {rank}: loss is {local_losses[-1]} at step {step}")
        if bar is not None:
            bar.update(1)
            bar.set_postfix(refresh=False, loss=f"{local_losses[-1]:.4f}", **{f"{unit}/s": f"{per_step / step_times[-1]:,.0f}"})
        if args.save and args.save_every and (step + 1) % args.save_every == 0 and step + 1 < stop:
            losses, local_losses = losses + global_mean(local_losses, device), []
            save_checkpoint(args.save, launch, step + 1, ddp, opt, state, losses, args)
    train_s = time.perf_counter() - t_train
    if bar is not None:
        bar.close()

    # Global mean loss per step: one allreduce of the whole history, not one per step. (Elastic:
    # ranks may have run different numbers of steps, so each rank's own history.)
    losses = losses + (local_losses if args.elastic else global_mean(local_losses, device))
    if args.save:
        save_checkpoint(args.save, launch, stop, ddp, opt, state, losses, args)
    timed = step_times[args.warmup_steps:] or step_times
    step_s = slowest(float(np.mean(timed)) if timed else float("nan"), device, xirang if args.elastic else None)
    hook = state.stats() if state is not None else None
    ring_bytes = 2.0 * (world - 1) / world * grad_bytes
    summary = {
        "config": name, "backend": args.backend, "hook": args.hook, "task": args.task, "world_size": world,
        "seed": args.seed, "steps": args.steps, "steps_run": len(step_times), "start_step": start_step,
        "stopped_at": stop, "layers": len(model), "layers_per_group": args.layers_per_group,
        "parameters": n_params, "gradient_bytes": grad_bytes, "batch_size_per_rank": args.batch_size,
        "final_loss": float(np.mean(losses[-LAST_N_LOSS:])), "final_loss_over_steps": min(LAST_N_LOSS, len(losses)),
        **evaluate(args.task, model, data, device),
        "step_time_s": step_s, "train_wall_s": train_s,
        f"throughput_{unit}_per_s": per_step / step_s,
        "bytes_wire_per_step": hook["totals"]["bytes_wire_per_step"] if hook else ring_bytes,
        "bytes_wire_how": (("reported by xirang.fsdp's stats() (reduce-scatter only; FSDP's all-gathers not counted)"
                            if args.fsdp else "reported by state.stats()" + (
                                "; one host: DDP's fp32 buckets averaged in place over shared memory"
                                if hook["totals"].get("path") == "local" else "")) if hook
                           else "computed: ring allreduce 2(N-1)/N x fp32 gradient bytes"),
        "bytes_raw_per_step": hook["totals"]["bytes_raw_per_step"] if hook else ring_bytes,
        "exposed_comm_s_hook": hook["totals"].get("mean_exposed_comm_s") if hook else None,
        "launches_per_step": hook["totals"].get("launches_per_step") if hook else None,
        "hook_path": hook["totals"].get("path") if hook else None,  # "local": one host, buckets in place
        "fsdp_wire": args.fsdp_wire if args.fsdp else None,
        "residual_bytes": hook["totals"].get("residual_bytes") if hook else None,
        "threads_per_rank": torch.get_num_threads(), "device": str(device), "torch": torch.__version__,
    }
    if args.elastic:
        summary["membership"] = xirang.membership()
    if args.stats_dir:
        dump(os.path.join(args.stats_dir, f"{tag}{name}.steps.rank{rank}.json"),
             {"step_time_s": step_times, "local_loss": local_losses, "global_loss": losses})
        if hook is not None:
            dump(os.path.join(args.stats_dir, f"{tag}{name}.hook_stats.rank{rank}.json"), hook)
    if after is not None:
        summary.update(after(ddp, state))
    if rank == 0:
        metric = (f"held-out accuracy {100 * summary['heldout_accuracy']:.2f}%" if "heldout_accuracy" in summary
                  else f"held-out perplexity {summary['heldout_perplexity']:.3f}")
        log.info("[%s] done: final loss %.4f, %s, step %.2f ms", name, summary["final_loss"], metric, step_s * 1e3)
    return summary


def admit_spares(xirang: Any, model, opt, ddp: DDP, state: Any, step: int, args, device):
    """--elastic, at a step boundary on every live rank: admit waiting spares; if any joined, hand
    them the training state and build a new DDP over the grown group (survivors keep their hook
    residuals; spares start from zero)."""
    try:
        # DDP's constructor needs every rank: admit only when each dead rank has a spare.
        missing = dist.get_world_size() - len(xirang.membership()["live"])
        joined = xirang.admit_joiners(expect=max(1, missing))
    except xirang.MembershipChanged:  # a rank failed during the admission: try at the next one
        return ddp, state
    if not joined:
        return ddp, state
    xirang.sync_training_state(model, opt, step)
    hook_sd = state.state_dict() if state is not None else None
    del ddp, state
    gc.collect()  # the old DDP reducer's autograd hooks go with it
    ddp, state = make_ddp(model, args, device, xirang, hook_sd)
    if dist.get_rank() == min(xirang.membership()["live"]):
        print(f"step {step}: ranks {joined} joined; live ranks {xirang.membership()['live']}", file=sys.stderr, flush=True)
    return ddp, state


def log_elastic(xirang: Any, step: int, loss: Optional[float], live: List[int], rank: int) -> None:
    """--elastic --log-every: the live ranks' mean loss of their previous step (a spare that has not
    trained yet adds nothing), printed by the lowest live rank; one allreduce."""
    t = torch.tensor([loss or 0.0, 0.0 if loss is None else 1.0], dtype=torch.float64)
    xirang.retry_on_membership_change(lambda: dist.all_reduce(t), t)
    if rank == min(live) and t[1] > 0:
        print(f"step {step}: loss {float(t[0] / t[1]):.4f}  live ranks {live}  epoch {xirang.membership()['epoch']}",
              file=sys.stderr, flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    p = build_parser()
    args = check_args(p, p.parse_args(argv))
    if args.hook != "none" and args.backend != "xirang":
        p.error(f"--hook {args.hook} runs on xirang's process group: use --backend xirang")
    launch = setup(args)
    device = device_of(args, launch)
    data = make_data(args.task, args.data, args.corpus_bytes, args.context)
    write_summary(train(args, launch, data, device), args, launch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
