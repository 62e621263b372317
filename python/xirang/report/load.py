"""Reading records: rank<N>.jsonl files, or xirang.stats(gather=True)'s result; cutting them into runs."""
from __future__ import annotations

import errno
import glob
import json
import math
import os
import re
from typing import Any, Dict, List, Tuple

from .records import rank_of


#: Fields the analysis reads as integers (a record's own; ``pg``, ``label``... are text).
_INT_FIELDS = ("seq", "global_rank", "group_rank", "world_size", "group_id", "numel", "epoch")


#: Ranges of the fields that sums and rank lists are made of: beyond them a record is garbled
#: (1e308 seconds made the sums infinite; a world size of 10^12 a rank list of that length).
_RANGES = {"global_rank": (0, 1 << 24), "group_rank": (0, 1 << 24), "world_size": (1, 1 << 24),
           "group_id": (-1, 1 << 31), "seq": (0, 1 << 62), "numel": (0, 1 << 62), "epoch": (0, 1 << 62)}
_MAX_SECONDS = 1e6  # an operation's phase (11 days)
_MAX_ABS = 1e15  # any number, nested ones included (timestamps are ~1e9)


_FLOAT, _INT, _STR = float, int, str
#: field name -> (expected type: "" any, "an integer", "a number", "text or an integer"; low; high)
_KINDS: Dict[str, Tuple[str, Any, Any]] = {}


def _kind(k: str) -> Tuple[str, Any, Any]:
    kind = _KINDS.get(k)
    if kind is None:
        want = ("an integer" if k in _INT_FIELDS or k.startswith("bytes_") else
                "a number" if k.endswith("_s") or k == "t_enqueue" else
                "text or an integer" if k in ("run_id", "pg") else "")
        low, high = _RANGES.get(k, (0, 1 << 62) if k.startswith("bytes_") else (None, None))
        if want == "a number" and k != "t_enqueue":
            low, high = 0, _MAX_SECONDS
        kind = (want, low, high)
        if len(_KINDS) < 4096:  # field names come from the files: a bounded cache
            _KINDS[k] = kind
    return kind


def _magnitude(v: Any) -> int:
    """0: every number in ``v`` (nested ones too) is finite and within _MAX_ABS; 1: one is not
    finite; 2: one is finite but beyond _MAX_ABS (a non-finite one anywhere counts first)."""
    t = type(v)
    if t is _FLOAT:
        return 0 if -_MAX_ABS <= v <= _MAX_ABS else 2 if math.isfinite(v) else 1
    if t is _INT:  # exact: a huge int does not convert to float
        return 0 if -_MAX_ABS <= v <= _MAX_ABS else 2
    if t is dict or t is list:
        worst = 0
        for x in (v.values() if t is dict else v):
            m = _magnitude(x)
            if m == 1:
                return 1
            worst = max(worst, m)
        return worst
    return 0


def _field_problem(r: dict) -> str:
    """Why an operation record cannot be analysed (a field of the wrong type, a non-finite number
    anywhere: the HTML embeds the records as JSON; a number out of its range: a negative duration,
    byte count or rank, a world size above 2^24, any magnitude above 1e15), or "" when it can.
    ``r`` is a JSON object as json.loads gives it (exact int, float, str, bool, None, list, dict)."""
    if type(r["op"]) is not _STR:
        return f"field 'op' is {type(r['op']).__name__}, expected text"
    for k, v in r.items():
        if v is None:
            continue
        want, low, high = _kind(k)
        t = type(v)
        if want and not ((want == "an integer" and t is _INT) or (want == "a number" and (t is _INT or t is _FLOAT))
                         or (want == "text or an integer" and (t is _STR or t is _INT))):
            return f"field {k!r} is {json.dumps(v)[:40]}, expected {want}"
        m = _magnitude(v)
        if m == 1:
            return f"field {k!r} holds a non-finite number"
        if m == 2:
            return f"field {k!r} holds a number beyond {_MAX_ABS:g} in magnitude"
        if low is not None and not low <= v <= high:
            return f"field {k!r} is {v!r}, expected {low} to {high:g}"
    return ""


def load_records(path: str) -> Tuple[List[dict], List[str]]:
    """Records from ``path`` (a directory of rank<N>.jsonl, or one .jsonl file), in file order
    (files sorted by rank number). Returns (records, warnings).

    A line that is not a JSON object with an ``"op"`` field (not JSON, a truncated last line,
    another program's log), or whose fields have the wrong types or hold NaN / infinity, is
    skipped and counted: one warning per file names how many of its
    lines were unreadable and the first few of them. Blank lines are ignored.
    Bytes that are not UTF-8 are read as U+FFFD (such a line is then usually unreadable JSON).
    When a directory's files yield no record at all, a warning also names those that hold no
    line (empty, or blank lines only), so that the caller can say the files are there but empty.
    Raises FileNotFoundError when ``path`` does not exist, OSError when a file cannot be read.
    """
    if os.path.isdir(path):
        files = glob.glob(os.path.join(path, "rank*.jsonl"))

        def key(f):
            m = re.search(r"rank(\d+)\.jsonl$", f)
            return (int(m.group(1)) if m else 1 << 30, f)

        files.sort(key=key)
    elif os.path.exists(path):
        files = [path]
    else:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    recs: List[dict] = []
    warns: List[str] = []
    no_lines: List[Tuple[str, bool]] = []  # (file name, whether it holds blank lines) of files without a line
    for f in files:
        lines = 0
        i = 0
        bad: List[str] = []
        with open(f, encoding="utf-8", errors="replace") as fh:
            for i, line in enumerate(fh, 1):
                line = line.strip()
                if not line:
                    continue
                lines += 1
                try:
                    r = json.loads(line)
                except json.JSONDecodeError as e:
                    bad.append(f"line {i}: {e.msg}")
                    continue
                if not isinstance(r, dict) or "op" not in r:
                    bad.append(f"line {i}: not an operation record")
                    continue
                why = _field_problem(r)
                if why:
                    bad.append(f"line {i}: {why}")
                    continue
                if "global_rank" not in r:
                    m = re.search(r"rank(\d+)\.jsonl$", f)
                    if m:
                        r["global_rank"] = int(m.group(1))
                recs.append(r)
        if bad:
            more = f"; {len(bad) - 3} more" if len(bad) > 3 else ""
            warns.append(f"{os.path.basename(f)}: {len(bad)} of {lines} lines unreadable, skipped "
                         f"({'; '.join(bad[:3])}{more})")
        if lines == 0:
            no_lines.append((os.path.basename(f), i > 0))
    if not recs and no_lines and os.path.isdir(path):
        names = ", ".join(n for n, _ in no_lines[:8]) + (", ..." if len(no_lines) > 8 else "")
        blank = any(b for _, b in no_lines)
        if len(no_lines) == 1:
            what = "blank lines only" if blank else "the file is empty"
            warns.append(f"{names} holds no records ({what})")
        else:
            what = "empty, or blank lines only" if blank else "the files are empty"
            warns.append(f"{len(no_lines)} rank files hold no records ({what}): {names}")
    return recs, warns


def from_gathered(per_rank: List[List[dict]], pg: str = "") -> List[dict]:
    """Flatten ``xirang.stats(gather=True)``'s result (index = group rank) into report records."""
    out = []
    ws = len(per_rank)
    for r, lst in enumerate(per_rank or []):
        for rec in lst or []:
            d = dict(rec)
            d.setdefault("group_rank", r)
            d.setdefault("global_rank", r)
            d.setdefault("world_size", ws)
            d.setdefault("pg", pg)
            d.setdefault("run_id", "")
            out.append(d)
    return out


def split_runs(records: List[dict]) -> List[Tuple[str, List[dict]]]:
    """[(run name, records)] in order of first appearance."""
    session: Dict[tuple, int] = {}
    last_seq: Dict[tuple, int] = {}
    runs: Dict[tuple, List[dict]] = {}
    for r in records:
        rid = r.get("run_id") or ""
        k = (rank_of(r), rid, r.get("pg", ""))
        seq = int(r.get("seq", 0) or 0)
        if seq > 0:  # point-to-point sends carry seq 0
            if k in last_seq and seq <= last_seq[k]:
                session[k] = session.get(k, 0) + 1
            last_seq[k] = seq
        runs.setdefault((rid, session.get(k, 0)), []).append(r)
    out = []
    n_sessions: Dict[str, int] = {}
    for rid, s in runs:
        n_sessions[rid] = max(n_sessions.get(rid, 0), s + 1)
    for (rid, s), lst in runs.items():
        name = rid or "(no run id)"
        if n_sessions[rid] > 1:
            name += f" #{s + 1}"
        out.append((name, lst))
    return out
