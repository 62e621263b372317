"""`python -m xirang.report DIR`: the dashboard file, and the summary (or the analysis as JSON) on stdout."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

from .analyze import analyze
from .html import render_html
from .load import load_records, split_runs

DESCRIPTION = "Communication latency breakdown: a self-contained HTML dashboard from xirang's operation records."


def build(path: str, run: Optional[str] = None) -> Tuple[List[dict], Dict[str, Any], List[str]]:
    """(records of the run shown, analysis, warnings) for a stats directory or .jsonl file."""
    recs, warns = load_records(path)
    if not recs:
        why = "; ".join(warns) if warns else (
            "no rank<N>.jsonl files" if os.path.isdir(path) else "the file is empty")
        raise SystemExit(f"xirang.report: no records in {path}: {why} "
                         "(expected rank<N>.jsonl written with XIRANG_STATS_DIR)")
    runs = split_runs(recs)
    names = [n for n, _ in runs]
    if run is None:
        # the last run with an operation xirang recorded (every record it writes has a seq; 0 for
        # point-to-point): a stray line (a truncated or hand-made record, no seq) appended to a
        # file is a "run" of its own, and must not hide the real one
        name, chosen = next(((n, lst) for n, lst in reversed(runs)
                             if any(isinstance(r.get("seq"), int) for r in lst)), runs[-1])
    else:
        hit = [(n, lst) for n, lst in runs if n == run or n.split(" #")[0] == run]
        if not hit and run.lstrip("-").isdigit() and -len(runs) <= int(run) < len(runs):
            hit = [runs[int(run)]]
        if not hit:
            raise SystemExit(f"xirang.report: no run {run!r}; runs: {', '.join(names)}")
        name, chosen = hit[-1]
    if len(runs) > 1:
        warns.append(f"{len(runs)} runs in the input ({', '.join(names)}); showing {name!r} (--run to choose)")
    if os.path.isdir(path):
        ws = max((r["world_size"] for r in chosen if r.get("pg") == "0" and isinstance(r.get("world_size"), int)),
                 default=0)
        present = {r.get("global_rank") for r in chosen}
        n_missing = ws - sum(1 for g in present if isinstance(g, int) and 0 <= g < ws)
        if n_missing:
            first = []  # found within len(present) + 8 steps, whatever the world size
            for g in range(ws):
                if g not in present:
                    first.append(str(g))
                    if len(first) == 8:
                        break
            more = ", ..." if n_missing > len(first) else ""
            warns.append(f"no records from {n_missing} of {ws} ranks ({', '.join(first)}{more}) in {name!r} "
                         "(rank<N>.jsonl missing or empty): the figures cover the other ranks only")
    return chosen, analyze(chosen, names, name), warns


def _fail(msg: str) -> int:
    print(f"xirang.report: {msg}", file=sys.stderr)
    return 1


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m xirang.report", description=DESCRIPTION)
    ap.add_argument("dir", help="XIRANG_STATS_DIR of a run (rank<N>.jsonl files), or one .jsonl file")
    ap.add_argument("-o", "--output", default="xirang-report.html", help="HTML file to write")
    ap.add_argument("--run", default=None, help="run to show (run id, 'id #k', or index; default: the last)")
    ap.add_argument("--json", action="store_true", help="print the analysis as JSON instead of the summary")
    args = ap.parse_args(argv)
    try:
        recs, a, warns = build(args.dir, args.run)
    except OSError as e:  # one line naming the path, not a traceback
        return _fail(f"cannot read {e.filename or args.dir}: {e.strerror or e}")
    for w in warns:
        print(f"xirang.report: {w}", file=sys.stderr)
    page = render_html(recs, a)
    try:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as e:
        return _fail(f"cannot write {args.output}: {e.strerror or e}")
    if args.json:
        print(json.dumps(a, indent=1))
    else:
        print("\n".join(a["summary"]))
        print(f"written: {args.output}")
    return 0
