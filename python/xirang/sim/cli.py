"""`python -m xirang.sim`: one configuration, --paper, --recommend or --calibrate; tables or JSON."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from .args import add_args, build, check_args, settings
from .calibrate import calibrate
from .model import SettingsError
from .paper import paper, print_paper
from .recommend import print_recommend, recommend
from .table import table
from .timeline import OPTS, Config

DESCRIPTION = "Scale simulator: step time and communication cost of data-parallel gradient sync at scale."


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m xirang.sim", description=DESCRIPTION,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--paper", action="store_true",
                      help="check the claims of the published platform report on a 175B-parameter model on 128 "
                           "GPUs: each figure internally consistent? reproduced by the model (within 25%%)?")
    mode.add_argument("--recommend", action="store_true", help="which optimisations pay, 8..1024 GPUs")
    mode.add_argument("--calibrate", metavar="FILE", help="fit alpha/beta from benchmarks/allreduce.py JSON")
    p.add_argument("--backend", default="xirang", help="backend rows to use with --calibrate")
    p.add_argument("--cores", type=int, default=os.cpu_count(),
                   help="--calibrate: cores the measured ranks shared (ranks beyond it take turns: "
                        "time x ranks / cores); 0: a core per rank (plain alpha-beta)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    add_args(p)
    a = p.parse_args(argv)
    bad = check_args(a)
    if bad:
        p.error(bad)
    given = sys.argv[1:] if argv is None else list(argv)
    if a.recommend and any(x == "--gpus" or x.startswith("--gpus=") for x in given):
        p.error("--recommend runs every scale from 8 to 1024 GPUs: --gpus does not apply (drop it, or simulate "
                "one scale without --recommend)")
    try:
        return run_mode(a)
    except SettingsError as e:
        p.error(str(e))
    except OverflowError as e:
        p.error(f"the settings overflow the arithmetic ({e}): values this large are not physical")


def check_finite(d, where: str = "result") -> None:
    """Raise SettingsError naming the first inf/NaN number in d (nested dicts/lists): settings so
    extreme (e.g. --oversub 1e308) that the arithmetic overflows give no meaningful answer."""
    if isinstance(d, float) and not math.isfinite(d):
        raise SettingsError(f"the settings overflow the arithmetic: {where} = {d}; values this large are not physical")
    if isinstance(d, dict):
        for k, v in d.items():
            check_finite(v, f"{where}.{k}")
    elif isinstance(d, (list, tuple)):
        for i, v in enumerate(d):
            check_finite(v, f"{where}[{i}]")


def run_mode(a) -> int:
    if a.paper:
        d = paper(a)
        check_finite(d["runs"], "runs")
        print(json.dumps(d, indent=1)) if a.json else print_paper(d)
    elif a.recommend:
        d = recommend(a)
        check_finite(d["rows"], "rows")
        print(json.dumps(d, indent=1)) if a.json else print_recommend(d)
    elif a.calibrate:
        d = calibrate(a.calibrate, a.backend, a.cores or None)
        check_finite(d)
        if a.json:
            print(json.dumps(d, indent=1))
        else:
            bw = d["bandwidth_GBps"]
            print(f"alpha = {d['alpha_us']:.1f} us per ring step, beta = {d['beta_s_per_byte']:.3e} s/B "
                  f"({bw:.2f} GB/s), " + (f"ranks share {d['cores']} cores" if d["cores"] else "a core per rank (no sharing)"))
            print(table(d["rows"], ["ws", "bytes", "measured_s", "predicted_s", "error_pct"]))
            print("\npredicted for this machine:")
            print(table(d["predictions"], ["ws", "bytes", "predicted_s"]))
    else:
        s = build(a)
        cfg = Config.of([o for o in OPTS if getattr(a, o) or a.all], group=a.group, bucket_mb=a.bucket_mb)
        r = s.run(cfg)
        check_finite(r)
        if a.json:
            print(json.dumps({"settings": settings(s), "result": r}, indent=1))
        else:
            synced = f"{s.m.shard_params() / 1e9:.2f}B params synced per GPU" if s.dp > 1 else "nothing to sync (dp = 1)"
            print(f"{s.m.params / 1e9:.1f}B params, tp={s.m.tp} pp={s.m.pp}, {s.cl.gpus} GPUs, dp={s.dp}, {synced}")
            print(table([r], ["config", "launches", "allreduce_s", "total_comm_s", "exposed_comm_s", "compute_s",
                              "step_s", "tokens_per_s", "xrack_GB"]))
    return 0
