"""The report at scale, and rank files that hold nothing (found by a new user).

- ``analyze._assign_steps`` (seq -> step of the primary group's records) scanned every step's span
  for each record: quadratic in the number of steps (45,000 records per rank took 36 s, 180,000
  did not finish in 120 s). Its result is checked here against that straightforward algorithm,
  kept below as the reference, on generated inputs, and ~100k records are analysed in bounded
  time.
- A stats directory whose rank<N>.jsonl files are all empty said "no rank<N>.jsonl files".
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from typing import Dict, List, Tuple

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


# ====================================================================== the reference
def _grank(r: dict) -> int:
    v = r.get("group_rank")
    if v is None:
        v = r.get("global_rank", 0)
    return int(v)


def reference_assign_steps(pg_recs: List[dict]) -> Tuple[str, Dict[int, int]]:
    """The quadratic algorithm (``_assign_steps`` before its binary search, written out here): per rank in
    rank order, records sorted by seq; a hook record (``group_id`` >= 0) whose group was already
    seen in the current step starts a new step, whose span runs from its seq to the last hook
    record's seq of the step; each seq not assigned yet takes the first span holding it, found
    by scanning all of them."""
    by_rank: Dict[int, List[dict]] = {}
    for r in pg_recs:
        if int(r.get("seq", 0) or 0) > 0:
            by_rank.setdefault(_grank(r), []).append(r)
    hook = any(isinstance(r.get("group_id"), int) and r["group_id"] >= 0 for r in pg_recs)
    seq_step: Dict[int, int] = {}
    if not hook:
        seqs = sorted({int(r["seq"]) for lst in by_rank.values() for r in lst})
        return "ops", {s: i for i, s in enumerate(seqs)}
    for rank in sorted(by_rank):
        lst = sorted(by_rank[rank], key=lambda r: int(r["seq"]))
        step, seen, spans = -1, set(), []
        for r in lst:
            gid = r.get("group_id", -1)
            if isinstance(gid, int) and gid >= 0:
                if step < 0 or gid in seen:
                    step += 1
                    seen = set()
                    spans.append([int(r["seq"]), int(r["seq"])])
                seen.add(gid)
                spans[step][1] = int(r["seq"])
        for r in lst:
            s = int(r["seq"])
            if s in seq_step:
                continue
            for i, (a, b) in enumerate(spans):
                if a <= s <= b:
                    seq_step[s] = i
                    break
    return "hook", seq_step


# ====================================================================== generated inputs
def _rec(rank: int, seq, gid=-1, t=None, **kw) -> dict:
    r = {"run_id": "", "pg": "0", "group_rank": rank, "global_rank": rank, "world_size": 2, "seq": seq,
         "op": "allreduce_bf16_ef" if isinstance(gid, int) and gid >= 0 else "all_reduce", "group_id": gid,
         "label": f"l{gid}" if isinstance(gid, int) and gid >= 0 else "", "t_enqueue": 0.1 * (seq or 0) if t is None
         else t, "queued_s": 0.0, "encode_s": 0.001, "scatter_reduce_s": 0.002, "allgather_s": 0.003,
         "decode_s": 0.001, "total_s": 0.01, "ok": True, "peers": []}
    r.update(kw)
    return r


def _random_case(rng: random.Random) -> List[dict]:
    """Records of 1-3 ranks: a loose step structure (hook groups repeating, in any launch order),
    other operations before the first span, between spans and on their ends, repeated seqs, equal
    timestamps, seq 0 / None / missing (not counted), group_id -1 / missing, ranks that lack some
    seqs or have extra ones, a record without group_rank; shuffled."""
    recs = []
    n_groups = rng.randint(1, 4)
    for rank in range(rng.randint(1, 3)):
        seq = rng.randint(0, 3)  # records before the first span: non-hook ops at low seqs
        for s in range(1, seq + 1):
            recs.append(_rec(rank, s, -1))
        for _ in range(rng.randint(0, 6)):  # steps
            order = list(range(n_groups))
            rng.shuffle(order)
            for gid in order[:rng.randint(1, n_groups)]:
                seq += rng.choice((0, 1, 1, 1, 2))  # 0: a repeated seq (another record of that seq)
                recs.append(_rec(rank, seq, gid, t=rng.choice((None, 1.0))))
                if rng.random() < 0.3:  # an op sharing the boundary seq, or between two hook ops
                    recs.append(_rec(rank, seq + rng.choice((0, 1)), -1, t=1.0))
            if rng.random() < 0.4:  # between spans
                seq += 1
                recs.append(_rec(rank, seq, -1))
        for _ in range(rng.randint(0, 2)):  # after the last span
            seq += 1
            recs.append(_rec(rank, seq, -1))
        if rng.random() < 0.3:
            recs.append(_rec(rank, 0, -1))  # p2p: seq 0
            recs.append(_rec(rank, None, -1))
            r = _rec(rank, 1, -1)
            del r["seq"]
            recs.append(r)
        if rng.random() < 0.3:
            r = _rec(rank, rng.randint(1, seq + 1), -1)
            del r["group_id"]
            recs.append(r)
        if rng.random() < 0.2:
            r = _rec(rank, rng.randint(1, seq + 1), rng.randrange(n_groups))
            del r["group_rank"]  # group rank from global_rank
            recs.append(r)
    if recs and rng.random() < 0.3:  # a rank without some seqs
        recs = [r for r in recs if not (r["global_rank"] == 0 and rng.random() < 0.3)]
    rng.shuffle(recs)
    return recs


# ====================================================================== tests
def test_assign_steps_equals_the_reference_on_hand_made_cases():
    from xirang.report.analyze import _assign_steps

    cases = {
        "empty": [],
        "ops only, unsorted, repeated seq": [_rec(0, 3), _rec(1, 1), _rec(0, 1), _rec(0, 3), _rec(1, 0)],
        # step 0 = seqs 2..4, step 1 = 6..7; seq 1 is before the first span, 5 between, 8 after
        "before, between and after spans": [_rec(0, 1), _rec(0, 2, 0), _rec(0, 3), _rec(0, 4, 1),
                                            _rec(0, 5), _rec(0, 6, 0), _rec(0, 7, 1), _rec(0, 8)],
        # a step that starts at the seq the previous one ends at (a repeated seq): the first span
        "touching spans": [_rec(0, 2, 0), _rec(0, 5, 1), _rec(0, 5, 0), _rec(0, 5), _rec(0, 6, 1)],
        # rank 1 starts its steps at other seqs: seqs rank 0 left unassigned take rank 1's steps
        "two ranks": [_rec(1, 1, 0), _rec(1, 2, 0), _rec(1, 3, 0), _rec(0, 2, 0), _rec(0, 3, 1),
                      _rec(0, 5, 0), _rec(1, 4), _rec(0, 4), _rec(1, 6, 1)],
        "equal timestamps": [_rec(0, s, s % 2, t=5.0) for s in (4, 1, 3, 2, 6, 5)],
    }
    want = {
        "empty": ("ops", {}),
        "ops only, unsorted, repeated seq": ("ops", {1: 0, 3: 1}),
        "before, between and after spans": ("hook", {2: 0, 3: 0, 4: 0, 6: 1, 7: 1}),
        "touching spans": ("hook", {2: 0, 5: 0, 6: 1}),
        "two ranks": ("hook", {2: 0, 3: 0, 5: 1, 1: 0, 4: 2, 6: 2}),
        "equal timestamps": ("hook", {1: 0, 2: 0, 3: 1, 4: 1, 5: 2, 6: 2}),
    }
    for name, recs in cases.items():
        assert reference_assign_steps(recs) == want[name], name  # the reference itself, by hand
        assert _assign_steps(recs) == want[name], name


def test_assign_steps_equals_the_reference_on_random_inputs():
    from xirang.report.analyze import _assign_steps

    rng = random.Random(20261206)
    n_hook = 0
    for i in range(3000):
        recs = _random_case(rng)
        want = reference_assign_steps(recs)
        n_hook += want[0] == "hook"
        assert _assign_steps(recs) == want, f"case {i}: {json.dumps(recs)[:2000]}"
    assert n_hook > 2000  # most cases have steps


def _scale_records(n_steps: int, ranks: int = 2) -> List[dict]:
    """``ranks`` x ``n_steps`` steps of one hook group (a model in one layer group) followed by
    another operation (between steps: it belongs to none): 2 records per step and rank, in file
    order (rank after rank). Step k is seq 2k + 1."""
    recs = []
    for rank in range(ranks):
        for k in range(n_steps):
            recs.append(_rec(rank, 2 * k + 1, 0))
            recs.append(_rec(rank, 2 * k + 2, -1))
    return recs


def test_analyze_scales_to_100k_records():
    """~100k records (2 ranks x 25,000 steps): analysed in bounded time. A guard against the
    quadratic blow-up (the old per-record scan of the steps made about 1.6 x 10^9 comparisons
    here: over a minute), not a speed claim: timings live in benchmarks. Run in a child process
    so that a regression fails within its timeout instead of holding the suite."""
    n_steps = 25_000
    code = (
        "import json, sys, time\n"
        f"sys.path.insert(0, {HERE!r})\n"
        "from test_report_scale import _scale_records\n"
        "from xirang.report import analyze\n"
        "from xirang.report.analyze import _assign_steps\n"
        f"recs = _scale_records({n_steps})\n"
        "t0 = time.perf_counter()\n"
        "a = analyze(recs)\n"
        "s = time.perf_counter() - t0\n"
        f"ok = _assign_steps(recs) == ('hook', {{2 * k + 1: k for k in range({n_steps})}})\n"
        "print(json.dumps({'s': s, 'n': len(recs), 'steps': a['steps'], 'mode': a['mode'], 'map_ok': ok,"
        " 'groups': [g['key'] for g in a['groups']]}))\n"
    )
    limit = 30.0
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=limit + 60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"analyze() of {2 * 2 * n_steps} records did not finish in {limit + 60:.0f} s")
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["n"] == 2 * 2 * n_steps
    assert res["mode"] == "hook" and res["steps"] == n_steps and res["map_ok"], res
    assert res["groups"] == ["group 0"], res  # the other operations lie between steps
    assert res["s"] < limit, f"analyze() of {res['n']} records took {res['s']:.1f} s (limit {limit:.0f} s)"


def _report(path, tmp_path):
    return subprocess.run([sys.executable, "-m", "xirang.report", str(path), "-o", str(tmp_path / "r.html")],
                          capture_output=True, text=True, timeout=120)


def test_empty_rank_files_are_named(tmp_path):
    """Found by a new user: an empty rank0.jsonl made `python -m xirang.report DIR` say
    "no rank<N>.jsonl files", which is false: the message names the files and says they hold
    no records."""
    from xirang.report.cli import main

    one = tmp_path / "one"
    one.mkdir()
    (one / "rank0.jsonl").write_bytes(b"")
    p = _report(one, tmp_path)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines() == [
        f"xirang.report: no records in {one}: rank0.jsonl holds no records (the file is empty) "
        "(expected rank<N>.jsonl written with XIRANG_STATS_DIR)"], p.stderr
    assert not (tmp_path / "r.html").exists()

    def why(d) -> str:
        with pytest.raises(SystemExit) as e:
            main([str(d), "-o", str(tmp_path / "m.html")])
        return str(e.value)

    two = tmp_path / "two"
    two.mkdir()
    for r in (0, 1):
        (two / f"rank{r}.jsonl").write_bytes(b"")
    assert "2 rank files hold no records (the files are empty): rank0.jsonl, rank1.jsonl" in why(two)
    assert "no rank<N>.jsonl files" not in why(two)
    (two / "rank1.jsonl").write_text("\n  \n")  # blank lines only
    assert "2 rank files hold no records (empty, or blank lines only): rank0.jsonl, rank1.jsonl" in why(two)
    many = tmp_path / "many"
    many.mkdir()
    for r in range(10):
        (many / f"rank{r}.jsonl").write_bytes(b"")
    assert ("10 rank files hold no records (the files are empty): rank0.jsonl, rank1.jsonl, rank2.jsonl, "
            "rank3.jsonl, rank4.jsonl, rank5.jsonl, rank6.jsonl, rank7.jsonl, ...") in why(many)
    # an empty file next to one of garbage: both named
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "rank0.jsonl").write_bytes(b"")
    (mixed / "rank1.jsonl").write_text("{not json\n")
    msg = why(mixed)
    assert "rank1.jsonl: 1 of 1 lines unreadable" in msg and "rank0.jsonl holds no records (the file is empty)" in msg
    # unchanged: an empty directory, and an empty file next to a file with records (the report is
    # made; the missing rank is named as before)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"no records in {empty}: no rank<N>.jsonl files" in why(empty)
    part = tmp_path / "part"
    part.mkdir()
    (part / "rank0.jsonl").write_bytes(b"")
    (part / "rank1.jsonl").write_text(json.dumps(_rec(1, 1, 0)) + "\n")
    from xirang.report.cli import build

    _, a, warns = build(str(part))
    assert a["run"]["records"] == 1
    assert warns == ["no records from 1 of 2 ranks (0) in '(no run id)' (rank<N>.jsonl missing or empty): "
                     "the figures cover the other ranks only"], warns


def test_a_stray_line_does_not_hide_the_run(tmp_path):
    """Found by a new user: one incomplete line (`{"op": "all_reduce"}`, no run id, no seq) appended
    to a real rank0.jsonl became a run of its own, "(no run id)", which the report showed by
    default with 0 operations. The default is now the last run with a collective in it."""
    from xirang.report.cli import build

    d = tmp_path / "stats"
    d.mkdir()
    recs = [dict(r, run_id="run-a") for r in _scale_records(5)]
    for rank in (0, 1):
        lines = [json.dumps(r) for r in recs if r["global_rank"] == rank]
        if rank == 0:
            lines.append(json.dumps({"op": "all_reduce"}))
        (d / f"rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    chosen, a, warns = build(str(d))
    assert len(chosen) == len(recs) and a["steps"] == 5, (len(chosen), a["steps"])
    assert any("2 runs in the input" in w and "showing 'run-a'" in w for w in warns), warns
    chosen, _, _ = build(str(d), run="(no run id)")  # still there when asked for
    assert chosen == [{"op": "all_reduce", "global_rank": 0}]
    # a later run of point-to-point operations only (seq 0) is a real run: the default
    p2p = dict(_rec(0, 0, -1), run_id="run-b", op="send")
    with open(d / "rank0.jsonl", "a") as f:
        f.write(json.dumps(p2p) + "\n" + json.dumps({"op": "all_reduce"}) + "\n")
    chosen, _, warns = build(str(d))
    assert chosen == [p2p], chosen
    assert any("showing 'run-b'" in w for w in warns), warns
