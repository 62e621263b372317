#!/usr/bin/env python3
"""Convergence and cost, side by side: the gloo baseline and xirang + the BF16 error-feedback hook
train examples/train.py's task in one torchrun job, with the same seed; rank 0 prints a table.

    torchrun --nproc_per_node=2 benchmarks/train_compare.py                  # digits: gloo vs xirang+bf16-ef
    torchrun --nproc_per_node=2 benchmarks/train_compare.py --task text
    torchrun --nproc_per_node=2 benchmarks/train_compare.py --compare-with gloo:none

Every flag of examples/train.py applies to both trainings (except --backend, --hook, --save,
--resume and --elastic), which run one after the other, each in a fresh process group.
Rows: final loss (mean of the last 20 steps' global loss), held-out accuracy or perplexity, step
time (slowest rank, mean after --warmup-steps), bytes on the wire per rank and step, and exposed
communication measured on --probe-steps extra steps after training: mean time of forward+backward
with gradient sync minus forward+backward inside ``ddp.no_sync()``, i.e. the time backward waits
on communication, clamped at 0 (with the hook also the hook's own estimate). The JSON summary
holds both runs' summaries and the verdicts.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import train  # noqa: E402  (examples/train.py)
from launch import Launch, device_of, import_xirang, setup, slowest, sync, write_summary  # noqa: E402
from tasks import make_data, task_loss  # noqa: E402


def probe_exposed_comm(args: argparse.Namespace, ddp: DDP, data: Any, launch: Launch,
                       device: torch.device) -> float:
    """Mean (forward+backward with gradient sync) - (forward+backward inside no_sync()), over
    --probe-steps alternating pairs on fresh batches, gradients discarded, no optimizer step.
    Reported by the slowest rank. This is the time backward waits on communication."""
    k = args.probe_steps
    synced, local = [], []
    for i in range(k):
        x, y = data.batch(args.seed + 1, args.steps + i, launch.rank, launch.world, args.batch_size)
        x, y = x.to(device), y.to(device)
        for use_sync in (False, True):
            ddp.zero_grad(set_to_none=True)
            ctx = contextlib.nullcontext() if use_sync else ddp.no_sync()
            sync(device)
            t0 = time.perf_counter()
            with ctx:
                task_loss(args.task, ddp(x), y).backward()
            sync(device)
            (synced if use_sync else local).append(time.perf_counter() - t0)
    ddp.zero_grad(set_to_none=True)
    # drop the first pair (warm-up of the no_sync path)
    d = float(np.mean(synced[1:] or synced)) - float(np.mean(local[1:] or local))
    return slowest(max(0.0, d), device)


def _fmt_bytes(b: Optional[float]) -> str:
    if b is None:
        return "n/a"
    return f"{b / 1024:,.1f} KiB"


def _fmt_ms(s: Optional[float]) -> str:
    return "n/a" if s is None else f"{s * 1e3:.2f} ms"


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    if a is None or b is None or a == 0:
        return "n/a"
    return f"{b / a:.3f}x"


def comparison(base: Dict[str, Any], other: Dict[str, Any]) -> Tuple[str, Dict[str, Any]]:
    """The side-by-side table (text) and its verdicts (dict): the loss within 2% (or 0.02) of the
    baseline's, the held-out accuracy within 1 point."""
    rows = [("final loss (mean of last 20 steps)", f"{base['final_loss']:.4f}",
             f"{other['final_loss']:.4f}",
             f"{other['final_loss'] - base['final_loss']:+.4f}")]
    verdict: Dict[str, Any] = {}
    dl = abs(other["final_loss"] - base["final_loss"])
    verdict["loss_within_tolerance"] = bool(dl <= max(0.02, 0.02 * abs(base["final_loss"])))
    if "heldout_accuracy" in base:
        a, b = 100 * base["heldout_accuracy"], 100 * other["heldout_accuracy"]
        rows.append(("held-out accuracy", f"{a:.2f}%", f"{b:.2f}%", f"{b - a:+.2f} pt"))
        verdict["accuracy_within_1pt"] = bool(abs(b - a) <= 1.0 + 1e-9)
    else:
        a, b = base["heldout_perplexity"], other["heldout_perplexity"]
        rows.append(("held-out perplexity (per byte)", f"{a:.3f}", f"{b:.3f}", _ratio(a, b)))
    rows.append(("step time (slowest rank, mean)", _fmt_ms(base["step_time_s"]),
                 _fmt_ms(other["step_time_s"]), _ratio(base["step_time_s"], other["step_time_s"])))
    rows.append(("bytes on the wire per step per rank", _fmt_bytes(base["bytes_wire_per_step"]),
                 _fmt_bytes(other["bytes_wire_per_step"]),
                 _ratio(base["bytes_wire_per_step"], other["bytes_wire_per_step"])))
    rows.append(("exposed comm per step (probe)", _fmt_ms(base["exposed_comm_s_probe"]),
                 _fmt_ms(other["exposed_comm_s_probe"]),
                 _ratio(base["exposed_comm_s_probe"], other["exposed_comm_s_probe"])))
    if other.get("exposed_comm_s_hook") is not None:
        rows.append(("exposed comm per step (hook stats)", "-", _fmt_ms(other["exposed_comm_s_hook"]), ""))
    if other.get("launches_per_step") is not None:
        rows.append(("hook launches per step", "-", f"{other['launches_per_step']:g}", ""))

    head = ("", base["config"] + " (baseline)", other["config"], "diff / ratio")
    w = [max(len(r[i]) for r in rows + [head]) for i in range(4)]
    line = "  ".join("-" * x for x in w)
    out = [line, "  ".join(h.ljust(w[i]) if i == 0 else h.rjust(w[i]) for i, h in enumerate(head)), line]
    for r in rows:
        out.append("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)))
    out.append(line)
    out.append(f"task {base['task']}, world size {base['world_size']}, seed {base['seed']}, "
               f"{base['steps']} steps, {base['layers']} layers in groups of "
               f"{base['layers_per_group']}, {base['parameters']:,} parameters")
    out.append(f"bytes: baseline {base['bytes_wire_how']}; {other['config']}: "
               f"{other['bytes_wire_how']}.")
    out.append("exposed comm (probe): mean of forward+backward with gradient sync minus the same "
               "inside ddp.no_sync(), over extra steps after training; slowest rank.")
    out.append("NOTE: on loopback all ranks share this machine's CPU cores and memory bandwidth, so "
               "the time ratios are not a speed claim; speed claims come from the emulated cluster "
               "(benchmarks/topology.py). Bytes on the wire and accuracy carry over.")
    verdict_s = ", ".join(f"{k}={v}" for k, v in verdict.items())
    out.append(f"convergence check (loss within 2% or 0.02, accuracy within 1 pt): {verdict_s}")
    return "\n".join(out), verdict


def main(argv: Optional[List[str]] = None) -> int:
    p = train.build_parser()
    p.description = __doc__.split("\n\n")[0]
    p.add_argument("--compare-with", default="xirang:bf16-ef", metavar="BACKEND:HOOK",
                   help="the second configuration (the first is gloo:none)")
    p.add_argument("--probe-steps", type=int, default=10,
                   help="extra steps after training to measure exposed communication (0 = skip)")
    args = train.check_args(p, p.parse_args(argv))
    if args.save or args.resume or args.elastic:
        p.error("--save, --resume and --elastic take a single configuration: use examples/train.py")
    if ":" not in args.compare_with:
        p.error("--compare-with takes BACKEND:HOOK, e.g. xirang:bf16-ef")
    backend, hook = args.compare_with.split(":", 1)
    if backend == "xirang" or hook != "none":
        import_xirang(f"the second run ({args.compare_with})")  # fail before the baseline
    launch = setup(args)
    device = device_of(args, launch)
    data = make_data(args.task, args.data, args.corpus_bytes, args.context)

    def probe(ddp: DDP, state: Any) -> Dict[str, Any]:
        return {"exposed_comm_s_probe": probe_exposed_comm(args, ddp, data, launch, device)
                if args.probe_steps > 0 else None}

    runs = []
    for i, (b, h) in enumerate((("gloo", "none"), (backend, hook))):
        args.backend, args.hook = b, h
        runs.append(train.train(args, launch, data, device, tag=f"run{i + 1}-", after=probe))
    table, verdict = comparison(runs[0], runs[1])
    if launch.rank == 0:
        print("\n" + table + "\n", flush=True)
    write_summary({"runs": runs, "comparison": verdict}, args, launch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
