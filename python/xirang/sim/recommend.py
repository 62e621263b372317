"""--recommend: which optimisations pay at 8..1024 GPUs (all 32 subsets, leave-one-out)."""
from __future__ import annotations

import itertools

from .args import build, settings
from .model import SettingsError
from .table import table
from .timeline import OPTS, Config


def advice(g: int) -> set:
    return {"overlap"} if g <= 8 else ({"overlap", "bucketing"} if g <= 64 else set(OPTS))


def recommend(a) -> dict:
    out = []
    scales = [2**i for i in range(3, 11)]
    first = None  # the smallest scale that runs: its settings head the report
    for g in scales:
        try:
            s = build(a, g)
        except ValueError as e:
            out.append({"gpus": g, "skip": str(e)})
            continue
        if s.dp < 2:
            out.append({"gpus": g, "skip": "dp < 2: no gradient sync"})
            continue
        first = first or s
        runs = {frozenset(c): s.run(Config.of(c, group=a.group, bucket_mb=a.bucket_mb))
                for k in range(len(OPTS) + 1) for c in itertools.combinations(OPTS, k)}
        base, allr = runs[frozenset()], runs[frozenset(OPTS)]
        best = min(runs, key=lambda c: runs[c]["step_s"])
        pub = frozenset(advice(g))
        row = {"gpus": g, "dp": s.dp, "base_step_s": base["step_s"], "all_step_s": allr["step_s"],
               "speedup_all": base["step_s"] / allr["step_s"],
               "alone_pct": {o: 100 * (base["step_s"] / runs[frozenset([o])]["step_s"] - 1) for o in OPTS},
               "leave_one_out_pct": {o: 100 * (runs[frozenset(OPTS) - {o}]["step_s"] / allr["step_s"] - 1) for o in OPTS},
               "best": sorted(best, key=OPTS.index), "best_step_s": runs[best]["step_s"],
               "published": sorted(pub, key=OPTS.index), "published_step_s": runs[pub]["step_s"]}
        pays = [o for o in OPTS if row["leave_one_out_pct"][o] > 1.0]
        row["pays"] = pays
        row["verdict"] = ("confirm" if runs[pub]["step_s"] <= runs[best]["step_s"] * 1.02
                          else f"published set {100 * (runs[pub]['step_s'] / runs[best]['step_s'] - 1):.0f}% slower than the best")
        out.append(row)
    if first is None:
        raise SettingsError(f"--recommend: no scale in {scales[0]}..{scales[-1]} GPUs fits (tp x pp = {a.tp} x {a.pp}, "
                            f"{a.gpus_per_host} GPUs per host) with data parallelism >= 2: " + out[-1]["skip"])
    return {"settings": settings(first), "rows": out,
            "rule": "an optimisation 'pays' if removing it from the all-on set slows the step by > 1%; "
                    "'confirm' if the published set is within 2% of the best of all 32 subsets"}


def print_recommend(d: dict):
    m = d["settings"]["model"]
    print(f"Which optimisations pay: {d['settings']['params'] / 1e9:.1f}B params, tp={m['tp']} pp={m['pp']}; "
          f"{d['rule']}\n")
    rows = []
    for r in d["rows"]:
        if "skip" in r:
            rows.append({"gpus": r["gpus"], "verdict": r["skip"]})
            continue
        x = {"gpus": r["gpus"], "dp": r["dp"], "base_s": r["base_step_s"], "all_s": r["all_step_s"], "best_s": r["best_step_s"],
             "published_s": r["published_step_s"], "pays": ",".join(r["pays"]) or "-", "verdict": r["verdict"]}
        x.update({f"-{o}%": r["leave_one_out_pct"][o] for o in OPTS})
        rows.append(x)
    print(table(rows, ["gpus", "dp", "base_s", "all_s", "best_s", "published_s"] + [f"-{o}%" for o in OPTS] + ["pays", "verdict"]))
    print("\n-X% = slowdown when X is removed from all-on. best subsets:")
    for r in d["rows"]:
        if "best" in r:
            print(f"  {r['gpus']:5d} GPUs: best {'+'.join(r['best']) or 'none'}; published {'+'.join(r['published'])}")
