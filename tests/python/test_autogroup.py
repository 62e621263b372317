"""Tests of the comm hook's ``layers_per_group="auto"`` (issue #14, item 3).

- the pieces against hand-computed values: the per-operation alpha-beta fit, the FIFO timeline,
  the prediction and the choice (launch-bound -> one big group, bandwidth-bound behind a long
  backward -> one layer per group, ties -> the larger size);
- world size 1 in this process (gloo + the stand-in ``allreduce_ef`` of hook_workers): the
  calibration schedule, regrouping with residuals carried by name (the error-feedback invariant
  holds across it), the INFO log, stats, state_dict and pickling keep the choice;
- two ranks: the real backend (same choice on both ranks, replicas bitwise equal, the invariant
  within 1e-5 across the regroups) and the exact stand-in (outputs = the plain average to fp32
  rounding at every step, before, during and after calibration).
"""

import logging
import math
import os
import pickle
import sys
import tempfile
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hook_workers as hw  # noqa: E402
from test_hook import REAL_KINDS, ws1_group  # noqa: E402,F401  (the world-size-1 gloo group fixture)

hooks = hw.load_hooks()
ag = hooks.autogroup


def test_fit_per_op_recovers_alpha_beta():
    from xirang.sim import fit_per_op

    alpha, beta = 150e-6, 1 / 2.5e9  # 150 us per operation, 2.5 GB/s
    g = torch.Generator().manual_seed(0)
    rows = []
    for b in (64 << 10, 256 << 10, 1 << 20, 4 << 20):
        for _ in range(5):
            noise = 1 + 0.01 * (torch.rand((), generator=g).item() - 0.5)
            rows.append((b, (alpha + beta * b) * noise))
    a, bt = fit_per_op(rows)
    assert a == pytest.approx(alpha, rel=0.05) and bt == pytest.approx(beta, rel=0.01)
    # exact rows: exact fit
    a, bt = fit_per_op([(b, alpha + beta * b) for b in (1e4, 1e5, 1e6)])
    assert a == pytest.approx(alpha, rel=1e-9) and bt == pytest.approx(beta, rel=1e-9)
    # negative intercept is pinned to 0, beta through the origin: sum(xy)/sum(xx)
    rows = [(1.0, 0.5), (2.0, 2.5)]
    assert fit_per_op(rows) == (0.0, pytest.approx((0.5 + 5.0) / 5.0))
    # clamp_alpha=False (auto's fit): the exact line, negative intercept kept
    assert fit_per_op(rows, clamp_alpha=False) == (pytest.approx(-1.5), pytest.approx(2.0))
    # negative slope: beta 0, alpha the mean
    assert fit_per_op([(1.0, 3.0), (2.0, 1.0)]) == (pytest.approx(2.0), 0.0)
    # one size: inseparable, all in beta (mean T/B); size 0 only: all in alpha
    assert fit_per_op([(10.0, 1.0), (10.0, 3.0)]) == (0.0, pytest.approx(0.2))
    assert fit_per_op([(0.0, 1.0), (0.0, 3.0)]) == (pytest.approx(2.0), 0.0)
    with pytest.raises(ValueError):
        fit_per_op([])
    with pytest.raises(ValueError):
        fit_per_op([(1.0, float("nan"))])


def test_serial_queue_by_hand():
    from xirang.sim.timeline import exposed_comm, serial_queue

    units = [(1.0, 2.0), (1.5, 1.0), (10.0, 0.5)]  # 1 -> 3, 3 -> 4, 10 -> 10.5
    assert serial_queue(units) == (10.5, 3.5)
    assert exposed_comm(units, 10.0) == (0.5, 3.5)
    assert exposed_comm(units, 11.0) == (0.0, 3.5)
    assert exposed_comm([], 1.0) == (0.0, 0.0)
    # 3x slower before t = 4: the first op (ready 0, 1 s of work) takes 3 s; the second (ready 0,
    # 2 s) starts at 3, does 1/3 s of work by 4, the other 5/3 s after: ends at 17/3
    assert serial_queue([(0.0, 1.0), (0.0, 2.0)], 4.0, 3.0) == (pytest.approx(17 / 3), pytest.approx(17 / 3))
    assert exposed_comm([(0.0, 1.0), (0.0, 2.0)], 4.0, 3.0) == (pytest.approx(5 / 3), pytest.approx(17 / 3))
    assert serial_queue([(5.0, 1.0)], 4.0, 3.0) == (6.0, 1.0)  # after the slow part: unchanged


def _backward(n, per_layer_s):
    """Layer l (forward order) is handed at (n - l) x per_layer_s: backward runs last to first."""
    return [(n - l) * per_layer_s for l in range(n)], n * per_layer_s


def test_predict_exposed_by_hand():
    # 4 layers ready at 4, 3, 2, 1 ms (layer 3 first), backward ends at 4 ms; each layer 1000 B
    ready, end = _backward(4, 1e-3)
    alpha, beta = 0.5e-3, 1e-6  # a layer's op: 0.5 + 1 = 1.5 ms
    # g=1: ops at 1 (->2.5), 2 (->4), 3 (->5.5), 4 (->7): exposed 3 ms
    assert ag.predict_exposed(ready, [1000] * 4, end, alpha, beta, 1) == pytest.approx(3e-3)
    # g=2: [2,3] ready at 2 ms, 2.5 ms -> 4.5; [0,1] ready at 4, 2.5 ms -> 7: exposed 3 ms
    assert ag.predict_exposed(ready, [1000] * 4, end, alpha, beta, 2) == pytest.approx(3e-3)
    # g=4: one op at 4 ms of 0.5 + 4 = 4.5 ms
    assert ag.predict_exposed(ready, [1000] * 4, end, alpha, beta, 4) == pytest.approx(4.5e-3)
    # a negative alpha: a cost below floor_s is floor_s (g=1: each op max(0.25 ms, -0.5 + 0.6) -> 0.25 ms
    # from 1, 2, 3, 4 ms: exposed 0.25 ms; without the floor, 0.1 ms)
    assert ag.predict_exposed(ready, [600] * 4, end, -0.5e-3, beta, 1, floor_s=0.25e-3) == pytest.approx(0.25e-3)
    assert ag.predict_exposed(ready, [600] * 4, end, -0.5e-3, beta, 1) == pytest.approx(0.1e-3)
    # the group of parameters in no layer (ready at 0.5 ms, 500 B: 1 ms) queues first
    assert ag.predict_exposed(ready, [1000] * 4, end, alpha, beta, 4, extra=(0.5e-3, 500)) == pytest.approx(4.5e-3)
    assert ag.predict_exposed(ready, [1000] * 4, end, alpha, beta, 4, extra=(4e-3, 500)) == pytest.approx(5.5e-3)
    # the tail after the last operation (0.1 ms + 100 ns/B of the group launched last): g=4, its
    # 4000 B: + 0.5 ms; g=1, layer 0's 1000 B: + 0.2 ms; not part of exposed or total
    tail = (1e-4, 1e-7)
    assert ag.predict_exposed(ready, [1000] * 4, end, alpha, beta, 4, tail=tail) == pytest.approx(5e-3)
    assert ag.predict_exposed(ready, [1000] * 4, end, alpha, beta, 1, tail=tail, with_total=True) == (
        pytest.approx(3.2e-3), pytest.approx(3e-3), pytest.approx(6e-3))


def test_choose_launch_bound_picks_large_groups():
    n = 16
    ready, end = _backward(n, 0.1e-3)  # backward 1.6 ms
    alpha, beta = 1e-3, 1e-12  # 1 ms per launch, bytes nearly free
    preds = {g: ag.predict_exposed(ready, [1e4] * n, end, alpha, beta, g) for g in range(1, n + 1)}
    # one group: ready at the end of backward, exposed = one launch
    assert preds[n] == pytest.approx(alpha + beta * 16e4)
    # one layer per group: 16 launches back to back from 0.1 ms: exposed 16 - 1.5 = 14.5 ms
    assert preds[1] == pytest.approx(16 * alpha + 16 * beta * 1e4 - 1.5e-3)
    assert ag.choose(preds) == n


def test_choose_bandwidth_bound_long_backward_picks_small_groups():
    n = 8
    ready, end = _backward(n, 2e-3)  # a layer every 2 ms, backward 16 ms
    alpha, beta = 1e-6, 1e-9  # 1 MB per layer: 1 ms each, launches nearly free
    preds = {g: ag.predict_exposed(ready, [1e6] * n, end, alpha, beta, g) for g in range(1, n + 1)}
    # g=1: every op done before the next layer is ready; the last (layer 0) runs 16 -> 17 ms
    assert preds[1] == pytest.approx(alpha + 1e-3)
    # g=2: the last group (layers 0, 1) is ready at 16 ms and takes 2 ms
    assert preds[2] == pytest.approx(alpha + 2e-3)
    assert preds[8] == pytest.approx(alpha + 8e-3)
    assert ag.choose(preds) == 1


def test_contention_blends_toward_total_and_is_measured():
    n = 8
    ready, end = _backward(n, 2e-3)
    alpha, beta = 1e-6, 1e-9
    p, exposed, total = ag.predict_exposed(ready, [1e6] * n, end, alpha, beta, 1, with_total=True)
    assert (p, exposed) == (pytest.approx(alpha + 1e-3), pytest.approx(alpha + 1e-3))
    assert total == pytest.approx(n * (alpha + 1e-3))
    # one shared core (k = 1): every second of communication counts, hidden or not
    assert ag.predict_exposed(ready, [1e6] * n, end, alpha, beta, 1, contention=1.0) == pytest.approx(total)
    assert ag.predict_exposed(ready, [1e6] * n, end, alpha, beta, 1, contention=0.25) == pytest.approx(
        0.75 * exposed + 0.25 * total)
    preds = {g: ag.predict_exposed(ready, [1e6] * n, end, alpha, beta, g, contention=1.0) for g in range(1, n + 1)}
    assert ag.choose(preds) == n  # the fewest launches (bytes are the same at every g)

    # measure(): alpha, beta from the ops, readiness from the one-group steps, contention from how
    # much longer backward ran at one layer per group: 0.4 x the 7 ms communicated before its end
    k_true = 0.4
    a = ag.AutoGroup(4)
    ops1 = [(1e6, alpha + beta * 1e6)] * n
    opsn = [(8e6, alpha + beta * 8e6)]
    grown = end + k_true * (total - exposed)
    for gsz, bwd, ops in ((1, grown, ops1), (n, end, opsn), (1, grown, ops1), (n, end, opsn)):
        a.samples.append(ag.StepSample(gsz, ready if gsz == n else [t * 1.3 for t in ready], None, bwd, ops, 0.0))
    m = a.measure([1e6] * n, None)
    assert m["alpha"] == pytest.approx(alpha, rel=1e-6, abs=1e-12) and m["beta"] == pytest.approx(beta, rel=1e-6)
    assert m["ready_s"] == pytest.approx(ready) and m["bwd_end_s"] == pytest.approx(end)
    assert m["contention"] == pytest.approx(k_true)
    assert m["predictions"][1] == pytest.approx((1 - k_true) * exposed + k_true * total)
    assert a.group_size_for_next(n) == n and ag.calibration_group_size(1, n) == n  # 1, 8, 3, 1, [8]
    # operations that ran after backward (alone) are fitted when they have two sizes: the slower
    # ones beside backward (here 3x) are then left out
    for smp in a.samples:
        smp.ops_after = list(smp.ops[-1:])
        smp.ops = [(b, 3 * t) for b, t in smp.ops[:-1]] + smp.ops[-1:]
    m = a.measure([1e6] * n, None)
    assert m["alpha"] == pytest.approx(alpha, rel=1e-6, abs=1e-12) and m["beta"] == pytest.approx(beta, rel=1e-6)
    # of each size the median: one slow operation after backward (waiting for the peer) is ignored
    a.samples[0].ops_after = [(1e6, 0.5)] + a.samples[0].ops_after
    m = a.measure([1e6] * n, None)
    assert m["alpha"] == pytest.approx(alpha, rel=1e-6, abs=1e-12) and m["beta"] == pytest.approx(beta, rel=1e-6)
    assert ag.median_per_size([(2.0, 3.0), (1.0, 5.0), (2.0, 1.0), (2.0, 2.0)]) == [(1.0, 5.0), (2.0, 2.0)]
    assert m["slowdown"] == 1.0  # no operation known to have run beside backward
    # operations beside backward 2.5x slower than the fit (median of 2, 2.5, 3): slowdown 2.5, and
    # the prediction is the slowed timeline's
    c1 = alpha + beta * 1e6
    a.samples[0].ops_beside = [(1e6, 2 * c1), (1e6, 2.5 * c1), (1e6, 3 * c1)]
    m = a.measure([1e6] * n, None)
    assert m["slowdown"] == pytest.approx(2.5)
    p1, e1, t1 = ag.predict_exposed(ready, [1e6] * n, end, alpha, beta, 1, with_total=True, slowdown=2.5)
    assert t1 > total and m["predictions"][1] == pytest.approx((1 - m["contention"]) * e1 + m["contention"] * t1)


def test_link_bound_big_operations_slower_per_byte_pick_small_groups():
    """Big operations slower per byte than small ones (a link that drops or queues long bursts):
    24 equal layers, backward 9 ms alone and 23 ms beside one-layer-per-group communication; a
    one-layer operation 8.4 ms, the one 24-layer operation 215 ms (7% more than 24 x 8.4). The fit
    keeps its negative alpha (-0.58 ms per operation), so fewer, bigger operations predict slower,
    and the small sizes win. Pinned to 0, alpha would make every size predict the same total under
    the contention measured (1: a second of communication beside backward costs a second), and the
    tie rule would take 24. (The numbers are an emulated-cluster run's whose big operation also
    paid its buffer's first-touch page faults, since fixed; the GPT-2-shaped model there fitted
    alpha -10 ms, more than that cost explains.)"""
    n, lb = 24, 198144.0
    ready, end = _backward(n, 9e-3 / n)
    each = 23e-3
    c1, cn = 8.4e-3, 215e-3
    a = ag.AutoGroup(4)
    for gsz in (1, n, 1, n):
        if gsz == 1:
            smp = ag.StepSample(1, [t * each / end for t in ready], None, each, [(lb, c1)] * n, 0.19,
                                ops_after=[(lb, c1)] * (n - 3), ops_beside=[])
        else:
            smp = ag.StepSample(n, ready, None, end, [(n * lb, cn)], cn, ops_after=[(n * lb, cn)], ops_beside=[])
        a.samples.append(smp)
    m = a.measure([lb] * n, None)
    beta = (cn - c1) / ((n - 1) * lb)
    assert m["beta"] == pytest.approx(beta) and m["alpha"] == pytest.approx(c1 - beta * lb) and m["alpha"] < -0.5e-3
    assert m["contention"] == 1.0
    p = m["predictions"]
    assert m["choice"] == 1 and p[1] < p[2] < p[4] < p[8] < p[n]
    assert p[n] - p[1] == pytest.approx((n - 1) * -m["alpha"], rel=0.05)


def test_calibration_sizes_and_contention_by_size():
    # 1, n, round(sqrt(n)) in turn; no middle size below n = 3
    assert [ag.calibration_group_size(i, 24) for i in range(7)] == [1, 24, 5, 1, 24, 5, 1]
    assert [ag.calibration_group_size(i, 8) for i in range(3)] == [1, 8, 3]
    assert [ag.calibration_group_size(i, 3) for i in range(3)] == [1, 3, 2]
    assert [ag.calibration_group_size(i, 2) for i in range(3)] == [1, 2, 1]
    assert ag.middle_group_size(2) is None and ag.middle_group_size(15) == 4
    # k between calibrated sizes: linear in log g; the end values beyond them
    ks = {1: 1.0, 4: 0.2}
    assert ag.contention_at(1, ks) == 1.0 and ag.contention_at(4, ks) == 0.2 and ag.contention_at(24, ks) == 0.2
    assert ag.contention_at(2, ks) == pytest.approx(0.6)  # halfway from 1 to 4 in log g
    assert ag.contention_at(3, {1: 0.5}) == 0.5 and ag.contention_at(3, {}) == 0.0


def test_per_launch_cost_at_one_layer_does_not_stand_for_every_size():
    """The emulated cluster's case (4 ranks on 2 cores, 1 ms across racks; numbers of a run there):
    24 equal layers, backward 10 ms alone; operations cost 0.9 ms + 49 ns/B (a layer's 8.3 ms).
    Beside 24 one-layer operations backward grew 23 ms, more than the 10 ms of communication
    predicted beside it: k at 1 is clamped to 1 (a cost per launch, not per second). Beside 5
    five-layer operations it grew 1 ms: k at 5 is 0.1. With k = 1 for every size, overlap is
    worth nothing and one group for the model wins; with k measured at the middle size, the sizes
    from 5 up blend with it, and the middle size beats one group by the backward it hides."""
    n, lb = 24, 198144.0
    ready, end = _backward(n, 10e-3 / n)
    alpha, beta = 0.9e-3, 49e-9
    cost = lambda nb: alpha + beta * nb  # noqa: E731
    m = ag.middle_group_size(n)
    a = ag.AutoGroup(6)
    for gsz in (1, n, m, 1, n, m):
        nops = -(-n // gsz)
        ops = [(gsz * lb, cost(gsz * lb))] * nops
        bwd = {1: end + 23e-3, n: end, m: end + 1e-3}[gsz]
        a.samples.append(ag.StepSample(gsz, [t * bwd / end for t in ready], None, bwd, ops, 0.2,
                                       ops_after=ops[-2:] if gsz < n else ops, ops_beside=[]))
    mm = a.measure([lb] * n, None)
    assert mm["alpha"] == pytest.approx(alpha) and mm["beta"] == pytest.approx(beta)
    ks = mm["contention_by_size"]
    assert ks[1] == 1.0
    _, e5, t5 = ag.predict_exposed(ready, [lb] * n, end, alpha, beta, m, with_total=True)
    assert ks[m] == pytest.approx(1e-3 / (t5 - e5))
    p = mm["predictions"]
    assert p[m] == pytest.approx(ag.blend(e5, t5, ks[m]))
    assert p[n] == pytest.approx(end * 0 + cost(n * lb))  # one group: all exposed, whatever k
    assert mm["choice"] < n and p[mm["choice"]] < p[n] - 5e-3
    # the same samples with k at 1 standing for every size (no middle step): one group wins
    a.samples = [s for s in a.samples if s.group_size != m]
    assert a.measure([lb] * n, None)["choice"] == n


def test_tail_after_the_last_operation_counts_against_one_big_group():
    """The emulated cluster again (a run there): operations 0.33 ms + 45.7 ns/B, contention 1 at
    one layer per group and at the middle size (every second of communication beside backward cost
    a second of backward), so with the same bytes at every size the fewest operations win; but the
    step ends 0.58 ms + 2 ns/B of the last operation's group after it (copying it back into the
    gradients, committing residuals): 10 ms after one 4.75 MB group, 1 ms after a five-layer one.
    Measured, one group for the model was 4.7% slower than 3 layers per group there."""
    n, lb = 24, 198144.0
    ready, end = _backward(n, 10e-3 / n)
    alpha, beta = 0.33e-3, 45.7e-9
    ta, tb = 0.58e-3, 2e-9
    cost = lambda nb: alpha + beta * nb  # noqa: E731
    m = ag.middle_group_size(n)
    a = ag.AutoGroup(6)
    for gsz in (1, n, m, 1, n, m):
        ops = [(gsz * lb, cost(gsz * lb))] * -(-n // gsz)
        _, e, t = ag.predict_exposed(ready, [lb] * n, end, alpha, beta, gsz, with_total=True)
        a.samples.append(ag.StepSample(gsz, ready, None, end + (t - e), ops, e, ops_after=ops[-2:] if gsz < n else ops,
                                       ops_beside=[], tail=(gsz * lb, ta + tb * gsz * lb)))
    mm = a.measure([lb] * n, None)
    assert mm["tail"] == (pytest.approx(ta), pytest.approx(tb))
    assert mm["contention_by_size"] == {1: 1.0, m: 1.0}
    p = mm["predictions"]
    assert p[n] == pytest.approx(cost(n * lb) + ta + tb * n * lb)
    # five layers per group: 4 operations' alpha more, 19 layers' tail less (6.2 ms)
    assert p[m] - p[n] == pytest.approx((n // m + 1 - 1) * alpha - tb * (n - m) * lb)
    assert mm["choice"] < n and p[mm["choice"]] < p[n] and p[m] < p[n] - 5e-3
    # without the tail measured: the fewest operations win
    for smp in a.samples:
        smp.tail = None
    mm = a.measure([lb] * n, None)
    assert mm["tail"] == (0.0, 0.0) and mm["choice"] == n


def test_choose_ties_go_to_the_larger_group():
    assert ag.choose({1: 0.0, 2: 0.0, 4: 1e-3}) == 2
    assert ag.choose({1: 1e-3, 2: 1e-3 * (1 + ag.TIE_REL / 2), 3: 2e-3}) == 2
    assert ag.choose({1: 1e-3, 2: 1.1e-3}) == 1


@pytest.mark.parametrize("bad,exc", [("Auto", ValueError), ("8", ValueError), ("", ValueError),
                                     (0, ValueError), (-2, ValueError), (True, TypeError), (2.5, TypeError)])
def test_bad_values_raise(bad, exc):
    with pytest.raises(exc, match=r"layers_per_group must be a positive int or None"):
        hooks.BF16ErrorFeedbackState(hw.TinyLM(), layers_per_group=bad)


def test_bad_calibration_steps_raise():
    for bad in (1, 0, True, 2.0):
        with pytest.raises(ValueError, match="calibration_steps must be an int >= 2"):
            hooks.BF16ErrorFeedbackState(hw.TinyLM(), layers_per_group="auto", auto_calibration_steps=bad)


def test_ws1_calibrate_regroup_invariant_log_checkpoint(ws1_group, caplog):
    """TinyLM (8 layers + the root-level ``pos``): calibrating (6 steps after DDP's first) at 1,
    8, 3, 1, 8, 3 layers per group, then the choice; the
    rounding stand-in's error-feedback invariant sum_t y_t + r = sum_t x_t holds across both
    regroups; the log, stats and the state_dict hold the choice."""
    ws1_group(False)
    torch.manual_seed(0)
    model = hw.TinyLM()
    ddp = DDP(model, bucket_cap_mb=0.004)
    state = hooks.register_comm_hook(ddp, layers_per_group="auto")
    assert state.group_size() == 1 and len(state.groups) == 9
    ef_names = [n for g in state.groups for n in g["compressed"]]
    params = dict(model.named_parameters())
    sum_x = {n: torch.zeros_like(params[n], dtype=torch.float64) for n in ef_names}
    sum_y = {n: torch.zeros_like(params[n], dtype=torch.float64) for n in ef_names}
    sizes = []
    with caplog.at_level(logging.INFO, logger="xirang"):
        for step in range(10):
            # gradients before the hook: the reference model's own backward
            ref = hw.TinyLM()
            ref.load_state_dict(model.state_dict())
            idx = hw.lm_batch(step, 0)
            hw.lm_loss(ref, idx).backward()
            hw.lm_loss(ddp, idx).backward()
            rp = dict(ref.named_parameters())
            for n in ef_names:
                sum_x[n] += rp[n].grad.double()
                sum_y[n] += params[n].grad.double()
            sizes.append((state.group_size(), len(state.groups)))
            model.zero_grad(set_to_none=True)
    st = state.stats()["autogroup"]
    g = st["layers_per_group"]
    assert sizes[:7] == [(1, 9), (1, 9), (8, 2), (3, 4), (1, 9), (8, 2), (3, 4)], sizes
    assert st["decided"] and sizes[7:] == [(g, 1 + -(-8 // g))] * 3
    assert sorted(st["contention_by_size"]) == [1, 3]
    assert st["tail_s"] >= 0 and st["tail_s_per_byte"] >= 0
    # every sample measured its tail (bytes 0 at world size 1: a ring of one sends nothing)
    assert all(smp.tail is not None and smp.tail[0] == 0.0 and smp.tail[1] >= 0 for smp in state._auto.samples)
    assert st["source"] == "python"  # the stand-in keeps no records
    assert sorted(st["predictions_s"]) == list(range(1, 9))
    assert g == ag.choose(st["predictions_s"])
    assert st["predicted_exposed_comm_s"] == st["predictions_s"][g] >= 0
    assert st["steps_since_choice"] == 3 and st["measured_exposed_comm_s"] >= 0
    assert math.isfinite(st["alpha_s"]) and st["beta_s_per_byte"] >= 0 and 0 <= st["contention"] <= 1
    msgs = [r.getMessage() for r in caplog.records if r.name == "xirang" and r.levelno == logging.INFO]
    assert any(f"chose {g} layers per group" in m and "1: " in m and "8: " in m for m in msgs), msgs
    # error feedback across the regroups: nothing lost, nothing doubled
    res = state.residuals
    for n in ef_names:
        lhs = sum_y[n] + res[n].double()
        err = (lhs - sum_x[n]).norm() / sum_x[n].abs().norm()
        assert err <= 1e-5, (n, float(err))
    assert any(res[n].abs().sum() > 0 for n in ef_names)

    # the state_dict keeps the choice; an "auto" state loading it regroups without calibrating
    sd = state.state_dict()
    assert sd["layers_per_group"] == "auto" and sd["autogroup"]["layers_per_group"] == g
    st2 = hooks.BF16ErrorFeedbackState(hw.TinyLM(), layers_per_group="auto")
    st2.load_state_dict(sd)
    fixed = hooks.BF16ErrorFeedbackState(hw.TinyLM(), layers_per_group=g)
    assert st2.group_size() == g and st2.groups == fixed.groups
    assert st2.stats()["autogroup"]["restored"] and st2.stats()["autogroup"]["decided"]
    r2 = st2.stats()["autogroup"]
    assert (r2["contention_by_size"], r2["tail_s"], r2["tail_s_per_byte"], r2["contention"]) == (
        st["contention_by_size"], st["tail_s"], st["tail_s_per_byte"], st["contention"])
    for n, t in st2.state_dict()["residuals"].items():
        assert torch.equal(t, sd["residuals"][n])
    # a fixed-size state loading it keeps its own size (residuals by name)
    fixed.load_state_dict(sd)
    assert fixed.group_size() == g and set(fixed.state_dict()["residuals"]) == set(sd["residuals"])
    st4 = hooks.BF16ErrorFeedbackState(hw.TinyLM(), layers_per_group=1)
    st4.load_state_dict(sd)
    assert st4.group_size() == 1 and len(st4.groups) == 9
    # pickling keeps it too
    st3 = pickle.loads(pickle.dumps(state))
    st3.bind(hw.TinyLM())
    assert st3.group_size() == g and st3.groups == fixed.groups
    for n, t in st3.residuals.items():
        assert torch.equal(t, sd["residuals"][n])


def test_ws1_calibration_times_start_after_the_step_start_work(ws1_group, monkeypatch):
    """The step-start work of a calibration step (reading the last step's records, a regroup)
    blocks the autograd thread at the step's first hook call; the sample's hand times and end of
    backward are timed from its end, so they do not charge it to the layers after the first (it
    read tens of ms late in long runs, and auto saw a late backward where there was none). Here
    it is made to take 1 s; TinyLM's whole backward takes milliseconds."""
    ws1_group(False)
    torch.manual_seed(0)
    model = hw.TinyLM()
    ddp = DDP(model, bucket_cap_mb=0.004)
    state = hooks.register_comm_hook(ddp, layers_per_group="auto")
    orig = type(state)._auto_step_start

    def slow_start(self):
        orig(self)
        time.sleep(1.0)

    monkeypatch.setattr(type(state), "_auto_step_start", slow_start)
    replaced = []
    for step in range(6):
        hw.lm_loss(ddp, hw.lm_batch(step, 0)).backward()
        model.zero_grad(set_to_none=True)
        replaced += [g for g in state._groups if g not in replaced]
    # the groups each regroup replaced hold no buffers (not left to the cycle collector)
    replaced = [g for g in replaced if g not in state._groups]
    assert len(replaced) >= 9 + 2 + 9
    assert all(g.ef_buf is None and g.residual is None and g.staged is None and not g.plain_bufs
               and all(s.view is None for s in g.slots) for g in replaced)
    assert all(g.ef_buf is not None for g in state._groups if g.ef_numel)
    samples = state._auto.samples
    assert len(samples) == 4
    for smp in samples:
        handed = [t for t in smp.layer_t if t is not None]
        assert len(handed) == 8 and min(handed) >= 0
        assert max(handed) < 0.5 and smp.bwd_end_s < 0.5, (smp.group_size, handed, smp.bwd_end_s)


def _blocks():
    return [[(64, 64), (64,)], [(48, 40)], [(64, 64), (10,)], [(40, 33)], [(32, 32), (32,)], [(64, 64)]]


def _run(kind, **cfg):
    with tempfile.TemporaryDirectory() as d:
        return hw.run_ranks("auto", 2, d, kind=kind, timeout=120, blocks=_blocks(), **cfg)


def test_ws2_exact_standin_outputs_are_the_average_through_calibration():
    recs = _run("fake", exact=True, steps=10)
    for t, (s0, s1) in enumerate(zip(recs[0]["steps"], recs[1]["steps"])):
        for y0, y1, x0, x1 in zip(s0["y"], s1["y"], s0["x"], s1["x"]):
            torch.testing.assert_close(y0, (x0 + x1) / 2, rtol=1e-6, atol=1e-7, msg=str(t))
            assert torch.equal(y0, y1)
    # calibration: DDP's first step, then 1, 6, 2, 1, 6, 2 layers per group; then the one choice
    sizes = [s["group_size"] for s in recs[0]["steps"]]
    g = recs[0]["stats"]["autogroup"]["layers_per_group"]
    assert sizes == [1, 1, 6, 2, 1, 6, 2, g, g, g], sizes
    assert recs[1]["stats"]["autogroup"]["layers_per_group"] == g


@pytest.mark.parametrize("kind", REAL_KINDS)
def test_ws2_real_same_choice_invariant_replicas(kind):
    steps = 12
    recs = _run(kind, steps=steps)
    a0, a1 = (r["stats"]["autogroup"] for r in recs)
    g = a0["layers_per_group"]
    assert a0["decided"] and a1["layers_per_group"] == g
    assert a0["predicted_exposed_comm_s"] == a1["predicted_exposed_comm_s"]  # rank 0's, broadcast
    assert a0["source"] == "records+python" and sorted(a0["predictions_s"]) == list(range(1, 7))
    assert g == ag.choose(a0["predictions_s"])
    for a in (a0, a1):  # the contention reported is the size in use's (rank 0's choice), on every rank
        assert a["contention"] == pytest.approx(ag.contention_at(g, a["contention_by_size"]))
    assert a0["steps_since_choice"] == steps - 7 and a0["measured_exposed_comm_s"] >= 0
    for r in recs:
        assert [s["group_size"] for s in r["steps"]] == [1, 1, 6, 2, 1, 6, 2] + [g] * (steps - 7)
        assert r["state_dict"]["autogroup"]["layers_per_group"] == g
        # each calibration step's tail: after an operation of a group's bytes (all 6 layers' at most)
        assert len(r["tails"]) == 6 and all(0 < b <= r["tails"][1][0] and t >= 0 for b, t in r["tails"])
        assert r["tails"][1][0] == max(b for b, _ in r["tails"])  # the one-group step: every layer
    names, N = recs[0]["names"], 2
    for k, name in enumerate(names):
        lhs = recs[0]["sum_y"][k].clone()
        for r in recs:
            if name in r["res"]:
                lhs += r["res"][name].double()
        rhs = sum(r["sum_x"][k] for r in recs) / N
        scale = sum(s["x"][k].double().abs() for r in recs for s in r["steps"]) / N
        err = (lhs - rhs).norm() / scale.norm()
        assert err <= 1e-5, (name, float(err))
    for t in range(steps):
        assert recs[0]["steps"][t]["y_hash"] == recs[1]["steps"][t]["y_hash"], t
