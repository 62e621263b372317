#!/usr/bin/env python3
"""FSDP2 convergence and bytes: examples/train.py --fsdp with the reduce-scatter in fp32, and in
bf16 and int8 (per-segment scales) each without and with error feedback (xirang.fsdp.compress),
one after the other in one torchrun job, same seed and batches; rank 0 prints a table.

    torchrun --nproc_per_node=2 benchmarks/fsdp.py --task text --steps 300
    torchrun --nproc_per_node=2 benchmarks/fsdp.py --task text --steps 100 --wires fp32,bf16
    torchrun --nproc_per_node=2 benchmarks/fsdp.py --task text --steps 200 --wires fp32,int8-noef,int8
    sudo python3 tests/cluster/netns --ranks-per-host 1 -- .venv/bin/python benchmarks/fsdp.py \
        --task text --steps 12 --warmup-steps 2 --width 384 --depth 6 --wires fp32,bf16,int8
                                       # the emulated cluster: 2 racks x 2 hosts, slow uplinks

Every flag of examples/train.py applies to all runs (not --fsdp-wire, --hook, --save, --resume,
--elastic). Rows: final loss (mean of the last 20 steps' global loss), held-out perplexity (per
byte; text) or accuracy (digits) and its ratio to the fp32 run's, step time (slowest rank, mean
after --warmup-steps), reduce-scatter bytes this rank sends per step (xirang.fsdp's stats(): the
all-gathers of parameters, identical in every run, are not counted), residual bytes per rank.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import train  # noqa: E402  (examples/train.py)
from launch import device_of, setup, write_summary  # noqa: E402
from tasks import make_data  # noqa: E402

WIRES = ("fp32", "bf16-noef", "bf16", "int8-noef", "int8")


def table(runs: List[Dict[str, Any]]) -> str:
    base = runs[0]
    text = "heldout_perplexity" in base
    metric = "heldout_perplexity" if text else "heldout_accuracy"
    head = ("reduce-scatter", "final loss", "held-out ppl" if text else "held-out acc",
            f"vs {base['fsdp_wire']}", "step ms", "RS bytes/step", f"vs {base['fsdp_wire']}", "residual bytes")
    rows = []
    for r in runs:
        m = r[metric]
        rows.append((r["fsdp_wire"], f"{r['final_loss']:.4f}", f"{m:.4f}" if text else f"{100 * m:.2f}%",
                     f"{m / base[metric]:.4f}x" if text else f"{100 * (m - base[metric]):+.2f} pt",
                     f"{r['step_time_s'] * 1e3:.0f}", f"{r['bytes_wire_per_step']:,}",
                     f"{r['bytes_wire_per_step'] / base['bytes_wire_per_step']:.3f}x", f"{r['residual_bytes'] or 0:,}"))
    w = [max(len(x[i]) for x in rows + [head]) for i in range(len(head))]
    line = "  ".join("-" * x for x in w)
    out = [line, "  ".join(h.ljust(w[i]) if i == 0 else h.rjust(w[i]) for i, h in enumerate(head)), line]
    out += ["  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(x)) for x in rows]
    out.append(line)
    out.append(f"task {base['task']}, FSDP2 world size {base['world_size']}, seed {base['seed']}, {base['steps']} steps, "
               f"{base['parameters']:,} parameters, backend {base['backend']}; bytes: payload this rank sends in the "
               "reduce-scatters of one step (all-gathers not counted); step times share 2 loaded cores: not a speed claim.")
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    p = train.build_parser()
    p.description = __doc__.split("\n\n")[0]
    p.add_argument("--wires", default=",".join(WIRES), help="comma-separated --fsdp-wire values; the first is the baseline")
    args = train.check_args(p, p.parse_args(argv + ["--fsdp"] if argv is not None else sys.argv[1:] + ["--fsdp"]))
    wires = [w for w in args.wires.split(",") if w]
    bad = [w for w in wires if w not in WIRES]
    if bad or not wires:
        p.error(f"--wires: choose from {', '.join(WIRES)}; got {args.wires!r}")
    launch = setup(args)
    device = device_of(args, launch)
    data = make_data(args.task, args.data, args.corpus_bytes, args.context)
    runs = []
    for i, w in enumerate(wires):
        args.fsdp_wire = w
        runs.append(train.train(args, launch, data, device, tag=f"run{i + 1}-"))
    if launch.rank == 0:
        print("\n" + table(runs) + "\n", flush=True)
    write_summary({"runs": runs}, args, launch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
