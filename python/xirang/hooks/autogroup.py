"""``layers_per_group="auto"``: measure the first synced steps, predict every group size's exposed
communication with the simulator's model, agree on one across ranks, keep it.

The plan (:class:`AutoGroup`, driven by the hook's state):

1. Calibration. The state starts with one layer per group. DDP's first synced step (one big
   bucket: every gradient arrives at the end) is not measured. The next ``calibration_steps``
   synced steps take turns at one layer per group, all layers in one group, and a middle size
   ``m = round(sqrt(n))`` (1, n, m, 1, n, m; 1, n, 1, n where ``n < 3``): the operations have at
   least two sizes even when every layer has the same size, the one-group steps run backward with
   no communication beside it (their one operation starts at its end), and the contention below
   is measured where launches are many (1) and where they are few (m).
   Per step the state records, in seconds from the step's first hook call (from the end of the
   step-start work there: reading the last step's records, a regroup, allocating the groups'
   buffers; it is calibration's own cost, not backward's): when each layer's last
   gradient was handed to the hook (its group can launch no earlier; the latest of these is the
   end of backward); per operation its bytes (computed from the group's element counts: what the
   ring sends per rank, as ``stats()`` counts them) and its seconds in the queue: the Python-side
   service time (completion minus the later of launch and the previous completion: the backend's
   work plus the hook's completion callbacks on the communication thread, which hold up the next
   operation too), at least the backend's record's ``total_s`` (found by the operation's sequence
   number; the record alone misses the callbacks: on loopback it read 2-3x less).
2. Fit. ``T = alpha + beta B`` per operation, least squares (:func:`xirang.sim.fit_per_op`; alpha
   s per operation, beta s per byte >= 0) over the calibration operations that started
   after the end of backward (they ran alone: an operation beside backward may be slowed by it,
   which the contention below accounts for), or over all of them if those have fewer than two
   sizes; of each size the median (:func:`median_per_size`: every size weighs the same, and a
   few slow operations, preempted or waiting for a late peer, do not pull the fit; the waits of
   typical operations stay in, as each operation is a point where the ranks meet). Alpha may
   come out negative where big operations are slower per byte than small ones (the GPT-2-shaped
   model on the emulated cluster without cross-rack delay fitted -10 ms per operation); pinned
   to 0 it would make every group size look the same there. The line is used between the sizes
   measured (one layer to all of them); no operation is predicted cheaper than the cheapest one
   measured (the median of its size).
3. Prediction, for every candidate ``g`` in 1..n_layers (:func:`predict_exposed`): layers are
   handed at their times in the fastest one-group step (backward alone; noise only slows steps
   down, so of each kind the fastest is taken), a group is ready at the latest of its layers',
   its operation costs ``alpha + beta x bytes``, at least the cheapest measured; operations run
   one at a time in launch order (:func:`xirang.sim.timeline.exposed_comm`, the simulator's timeline);
   exposed = end of the last operation - end of backward, never below 0. The simulator assumes
   compute and communication do not slow each other; where they share CPU cores (loopback, CPU
   tensors: the ring's copies and reductions run on the cores backward uses) they do, both ways,
   and the calibration measures both. An operation beside backward runs ``slowdown`` (>= 1) times
   slower: the median, over the operations that ran beside backward all along, of their seconds
   over the fit's (the timeline slows them until the end of backward). And the prediction is
   ``(1 - k) exposed + k total`` (:func:`blend`): ``k`` in [0, 1] is the measured contention, the
   seconds backward grew per second of communication beside it, at each calibrated size ``s``
   below n: (end of the fastest backward at ``s`` - end of the fastest alone) / the predicted
   communication before the end of backward at ``s`` (total - exposed); a size between two
   calibrated ones takes their values' interpolation in log g (:func:`contention_at`). ``k = 0``:
   separate resources (a GPU and its copy engines), the plain timeline; ``k = 1``: one shared
   core, every second of communication costs a second of step whether hidden or not. (On the
   emulated cluster, 4 ranks on 2 cores with a 1 ms delay line across racks, k came out 1 at both
   sizes; there the middle size's operations mattered to the fit: with two sizes it gave alpha
   0.94 ms per operation, with three 0.33 ms, and auto chose 24 and 18 layers per group on the
   same run's samples.) Last, the tail: the step ends a while after its last operation
   (copying back the DDP buckets that waited on its group, committing residuals: work no later
   operation hides),
   measured in every calibration step against the bytes of the operation that finished last and
   fitted the same way (``tail = a + b x bytes``, both >= 0); each size's prediction adds the
   tail of the group it launches last. Where one group is last at every size (parameters in no
   layer that are ready last, e.g. a tied embedding) the tail is the same at every size and
   changes no choice. Without it, one group for the model (all its bytes copied back after the
   last operation: 10 ms on the emulated cluster's 24-block model) looked as fast as a few layers
   per group, and auto took it: 5.4-5.9% slower than the best size there in three runs.
4. Choice (:func:`choose`): the smallest prediction; predictions within ``max(TIE_REL x best,
   TIE_ABS_S)`` of it count as ties and the largest such ``g`` wins (fewer launches, less
   CPU). Group rank 0 decides and broadcasts ``(g, predicted exposed s)`` over the process group
   at the first hook call of the next synced step, where every rank is (same step count);
   everyone regroups to ``g`` before packing that step and keeps it. The choice and every
   candidate's prediction are logged at INFO on logger ``"xirang"``; ``stats()["autogroup"]``
   reports them with the measured exposed communication since.
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

#: Synced steps measured after DDP's first one (default of ``calibration_steps``): twice each of
#: the three calibration sizes (:func:`calibration_group_size`).
CALIBRATION_STEPS = 6
#: Predictions within max(TIE_REL x best, TIE_ABS_S) seconds of the best are ties (largest g wins).
TIE_REL = 0.02
TIE_ABS_S = 20e-6


def middle_group_size(n_layers: int) -> Optional[int]:
    """The middle calibration size: ``round(sqrt(n_layers))`` when it lies strictly between 1 and
    ``n_layers`` (``n_layers >= 3``), else None."""
    m = int(round(math.sqrt(n_layers)))
    return m if 1 < m < n_layers else None


def calibration_group_size(index: int, n_layers: int) -> int:
    """Layers per group of measured calibration step ``index`` (0-based): 1, n_layers, the middle
    size (:func:`middle_group_size`), 1, n_layers, ...; 1, n_layers, 1, ... where there is no
    middle size."""
    m = middle_group_size(n_layers)
    sizes = (1, n_layers) if m is None else (1, n_layers, m)
    return sizes[index % len(sizes)]


def contention_at(g: int, measured: Dict[int, float]) -> float:
    """The contention (k of :func:`blend`) used for ``g`` layers per group, from ``measured``
    (calibrated size -> k): the nearest measured sizes' in log g, linear between them, the end
    values beyond them (0 where nothing was measured)."""
    if not measured:
        return 0.0
    sizes = sorted(measured)
    if g <= sizes[0]:
        return measured[sizes[0]]
    if g >= sizes[-1]:
        return measured[sizes[-1]]
    hi = min(s for s in sizes if s >= g)
    lo = max(s for s in sizes if s <= g)
    if hi == lo:
        return measured[lo]
    w = (math.log(g) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return (1 - w) * measured[lo] + w * measured[hi]


def blend(exposed_s: float, total_s: float, contention: float) -> float:
    """``(1 - k) exposed + k total`` (s): the step time communication costs when each second of it
    beside backward slows backward by ``k`` seconds (first order: exposed + k x the overlapped
    part, which is total - exposed on a FIFO queue)."""
    return (1.0 - contention) * exposed_s + contention * total_s


def op_cost(alpha: float, beta: float, nbytes: float, floor_s: float = 0.0) -> float:
    """One operation's predicted seconds: ``alpha + beta x nbytes``, at least ``floor_s`` (>= 0)."""
    return max(floor_s, alpha + beta * nbytes)


def predict_exposed(ready_s: Sequence[float], layer_bytes: Sequence[float], bwd_end_s: float,
                    alpha: float, beta: float, g: int,
                    extra: Optional[Tuple[float, float]] = None, contention: float = 0.0,
                    with_total: bool = False, slowdown: float = 1.0, floor_s: float = 0.0,
                    tail: Tuple[float, float] = (0.0, 0.0)):
    """Predicted exposed communication (s) of one step at ``g`` layers per group.

    ``ready_s[l]``: seconds at which layer ``l`` (forward order) can launch; ``layer_bytes[l]``:
    bytes its operation sends; ``extra``: ``(ready_s, bytes)`` of the group of parameters in no
    layer, always its own group. Groups are runs of ``g`` consecutive layers, ready at the latest
    of their layers, costing :func:`op_cost` (s); launched in order of readiness, run one at a time (:func:`xirang.sim.timeline.exposed_comm`; ``slowdown`` times slower before
    ``bwd_end_s``); exposed past ``bwd_end_s``, then
    :func:`blend` ed with the total by ``contention`` (0: the plain timeline); plus the tail
    ``tail[0] + tail[1] x bytes`` of the operation launched last (s, s/B: the step's work after
    its last operation, copying its group back into the gradients, exposed whatever ``g``; not in
    ``exposed`` or ``total``). ``with_total``: return ``(prediction, exposed, total)``.
    """
    from xirang.sim.timeline import exposed_comm  # noqa: PLC0415  (lazy: hooks load without sim)

    units = []
    n = len(ready_s)
    for start in range(0, n, g):
        nbytes = sum(layer_bytes[start:start + g])
        units.append((max(ready_s[start:start + g]), op_cost(alpha, beta, nbytes, floor_s), nbytes))
    if extra is not None:
        units.append((extra[0], op_cost(alpha, beta, extra[1], floor_s), extra[1]))
    units.sort(key=lambda u: u[0])  # launch order: readiness (stable for equal times)
    exposed, total = exposed_comm([u[:2] for u in units], bwd_end_s, slowdown)
    pred = blend(exposed, total, contention) + op_cost(tail[0], tail[1], units[-1][2] if units else 0.0)
    return (pred, exposed, total) if with_total else pred


def choose(predictions: Dict[int, float]) -> int:
    """The ``g`` of the smallest prediction; within ``max(TIE_REL x best, TIE_ABS_S)`` of it, the
    largest ``g``."""
    best = min(predictions.values())
    tol = max(TIE_REL * best, TIE_ABS_S)
    return max(g for g, p in predictions.items() if p <= best + tol)


class StepSample:
    """One calibration step at ``group_size`` layers per group: per-layer hand times and end of
    backward (s from the step's first hook call), the operations' ``(bytes, seconds)`` (all of
    them, those that started after the end of backward: alone on the CPU, and those that ended
    before it: beside backward all along), the measured
    exposed communication (s) and the tail ``(bytes, seconds)``: the end of the step (copies back
    into the gradients, the residual commit) after the operation that finished last, and that
    operation's bytes (None: not measured)."""

    __slots__ = ("group_size", "layer_t", "extra_t", "bwd_end_s", "ops", "exposed_s", "ops_after",
                 "ops_beside", "tail")

    def __init__(self, group_size: int, layer_t: List[Optional[float]], extra_t: Optional[float],
                 bwd_end_s: float, ops: List[Tuple[float, float]], exposed_s: float,
                 ops_after: Optional[List[Tuple[float, float]]] = None,
                 ops_beside: Optional[List[Tuple[float, float]]] = None,
                 tail: Optional[Tuple[float, float]] = None):
        self.group_size = group_size
        self.layer_t = layer_t
        self.extra_t = extra_t
        self.bwd_end_s = bwd_end_s
        self.ops = ops
        self.ops_after = ops_after  # the ops that started after the end of backward (None: unknown)
        self.ops_beside = ops_beside  # the ops that ended before it: all of it beside backward
        self.exposed_s = exposed_s
        self.tail = tail


class AutoGroup:
    """Calibration, choice and its record for one hook state (see the module's docstring).

    Attributes after the choice: ``chosen`` (layers per group), ``predicted_exposed_s`` (rank 0's
    prediction for it, s), ``predictions`` (g -> predicted exposed s, this rank's), ``alpha_s``
    (s per operation), ``beta_s_per_byte``, ``contention`` (k of :func:`blend` at the chosen
    size), ``contention_by_size`` (calibrated size -> k), ``tail`` (``(s, s/B)`` after the last
    operation), ``slowdown``,
    ``source`` ("records+python": Python-side service times floored by the records, or "python":
    no records; where the
    operations' seconds came from), ``restored`` (taken from a checkpoint, not measured).
    """

    def __init__(self, calibration_steps: int = CALIBRATION_STEPS):
        if (isinstance(calibration_steps, bool) or not isinstance(calibration_steps, int)
                or calibration_steps < 2):
            raise ValueError(f"calibration_steps must be an int >= 2, got {calibration_steps!r}")
        self.calibration_steps = calibration_steps
        self.seen_steps = 0  # synced steps committed in this process while calibrating
        self.samples: List[StepSample] = []
        self.pending: Optional[Dict[str, Any]] = None  # the last step, until its records are read
        self.chosen: Optional[int] = None
        self.predicted_exposed_s: Optional[float] = None
        self.predictions: Dict[int, float] = {}
        self.alpha_s: Optional[float] = None
        self.beta_s_per_byte: Optional[float] = None
        self.contention: Optional[float] = None
        self.contention_by_size: Dict[int, float] = {}
        self.tail: Optional[Tuple[float, float]] = None  # (s, s/B) after the last operation
        self.slowdown: Optional[float] = None
        self.source: Optional[str] = None
        self.restored = False
        self.sum_exposed_after_s = 0.0
        self.steps_after = 0

    @property
    def decided(self) -> bool:
        return self.chosen is not None

    def group_size_for_next(self, n_layers: int) -> int:
        """Layers per group of the next calibration step (:func:`calibration_group_size`)."""
        return calibration_group_size(len(self.samples), n_layers)

    def ready_to_decide(self) -> bool:
        return len(self.samples) >= self.calibration_steps

    def measure(self, layer_bytes: Sequence[float], extra_bytes: Optional[float]) -> Dict[str, Any]:
        """Fit and predict from the samples: ``{"alpha", "beta", "contention", "predictions",
        "choice", ...}`` (this rank's view; rank 0's choice is the one applied)."""
        from xirang.sim.calibrate import fit_per_op  # noqa: PLC0415

        n = len(layer_bytes)
        self._inputs = (list(layer_bytes), extra_bytes)  # for calibration_record()
        # The fit: operations that ran after backward (not slowed by it) when they have two sizes
        # at least; else every operation.
        after = [op for s in self.samples for op in (s.ops_after or [])]
        ops = after if len({b for b, _ in after}) >= 2 else [op for s in self.samples for op in s.ops]
        medians = median_per_size(ops)
        alpha, beta = fit_per_op(medians, clamp_alpha=False)
        # with a negative alpha the line reaches 0 at some size: no operation is predicted cheaper
        # than the cheapest one measured
        floor = min(t for _, t in medians)

        # Timing noise (preemption, the other ranks' load) only ever slows a step down: of each kind
        # of step the fastest backward is the one measured.
        alone = min((s for s in self.samples if s.group_size >= n), key=lambda s: s.bwd_end_s,
                    default=min(self.samples, key=lambda s: s.bwd_end_s))
        bwd_end = alone.bwd_end_s
        # a layer never handed (no gradient: unused) is launched at the end of the step
        ready = [bwd_end if alone.layer_t[i] is None else alone.layer_t[i] for i in range(n)]
        extra = None
        if extra_bytes is not None:
            extra = (bwd_end if alone.extra_t is None else alone.extra_t, extra_bytes)
        # slowdown: how much longer an operation took beside backward than the fit says it takes
        # alone (the median over the operations that ran beside backward all along; >= 1)
        ratios = [t / op_cost(alpha, beta, b, floor) for smp in self.samples for b, t in (smp.ops_beside or [])
                  if op_cost(alpha, beta, b, floor) > 0]
        slow = max(1.0, statistics.median(ratios)) if ratios else 1.0
        # contention at each calibrated size below n (1 and the middle one): how much longer
        # backward ran beside that size's communication, per second of it predicted before the end
        # of backward
        ks: Dict[int, float] = {}
        for size in sorted({s.group_size for s in self.samples if s.group_size < n}):
            grown = min(s.bwd_end_s for s in self.samples if s.group_size == size)
            _, exp_s, tot_s = predict_exposed(ready, layer_bytes, bwd_end, alpha, beta, size, extra,
                                              with_total=True, slowdown=slow, floor_s=floor)
            ks[size] = (min(1.0, max(0.0, (grown - bwd_end) / (tot_s - exp_s))) if tot_s - exp_s > 0
                        else 0.0)
        # the tail after the last operation against its bytes (alpha, beta >= 0; 0 if unmeasured)
        tails = [s.tail for s in self.samples if s.tail is not None]
        tail = fit_per_op(median_per_size(tails)) if tails else (0.0, 0.0)
        preds = {g: predict_exposed(ready, layer_bytes, bwd_end, alpha, beta, g, extra, contention_at(g, ks),
                                    slowdown=slow, floor_s=floor, tail=tail)
                 for g in range(1, max(1, n) + 1)}
        choice = choose(preds)
        return {"alpha": alpha, "beta": beta, "contention": contention_at(choice, ks), "contention_by_size": ks,
                "slowdown": slow, "tail": tail, "predictions": preds, "choice": choice, "ready_s": ready,
                "bwd_end_s": bwd_end}

    def calibration_record(self) -> Dict[str, Any]:
        """The calibration as measured, to replay the model offline (benchmarks' JSON):
        ``{"inputs": (layer bytes, extra bytes) or None before the choice, "samples": [{field:
        value} of each :class:`StepSample`]}`` (seconds, bytes)."""
        return {"inputs": getattr(self, "_inputs", None),
                "samples": [{k: getattr(smp, k) for k in smp.__slots__} for smp in self.samples]}

    def record_after(self, exposed_s: float) -> None:
        self.sum_exposed_after_s += exposed_s
        self.steps_after += 1

    def report(self) -> Dict[str, Any]:
        """What ``stats()["autogroup"]`` shows (seconds, bytes)."""
        return {
            "mode": "auto",
            "decided": self.decided,
            "layers_per_group": self.chosen,
            "calibration_steps": self.calibration_steps,
            "calibration_steps_measured": len(self.samples),
            "restored": self.restored,
            "alpha_s": self.alpha_s,
            "beta_s_per_byte": self.beta_s_per_byte,
            "contention": self.contention,
            "contention_by_size": dict(self.contention_by_size),
            "tail_s": None if self.tail is None else self.tail[0],
            "tail_s_per_byte": None if self.tail is None else self.tail[1],
            "slowdown": self.slowdown,
            "source": self.source,
            "predicted_exposed_comm_s": self.predicted_exposed_s,
            "measured_exposed_comm_s": (self.sum_exposed_after_s / self.steps_after
                                        if self.steps_after else None),
            "steps_since_choice": self.steps_after,
            "predictions_s": dict(self.predictions),
        }

    def to_dict(self) -> Optional[Dict[str, Any]]:
        """For the state_dict: the choice and its prediction (None while calibrating)."""
        if not self.decided:
            return None
        return {"layers_per_group": self.chosen, "predicted_exposed_comm_s": self.predicted_exposed_s,
                "alpha_s": self.alpha_s, "beta_s_per_byte": self.beta_s_per_byte,
                "contention": self.contention, "slowdown": self.slowdown,
                "contention_by_size": dict(self.contention_by_size),
                "tail": None if self.tail is None else list(self.tail),
                "predictions_s": dict(self.predictions), "source": self.source}

    def restore(self, d: Dict[str, Any]) -> None:
        g = d.get("layers_per_group")
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"hook state_dict: autogroup layers_per_group must be a positive int, got {g!r}")
        predictions = {int(k): float(v) for k, v in (d.get("predictions_s") or {}).items()}  # may raise: first
        by_size = {int(k): float(v) for k, v in (d.get("contention_by_size") or {}).items()}
        tail = d.get("tail")
        tail = None if tail is None else (float(tail[0]), float(tail[1]))
        self.chosen = g
        self.predicted_exposed_s = d.get("predicted_exposed_comm_s")
        self.alpha_s = d.get("alpha_s")
        self.beta_s_per_byte = d.get("beta_s_per_byte")
        self.contention = d.get("contention")
        self.slowdown = d.get("slowdown")
        self.predictions = predictions
        self.contention_by_size, self.tail = by_size, tail
        self.source = d.get("source")
        self.restored = True
        self.samples = []
        self.pending = None


def median_per_size(ops: Sequence[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """``(bytes, the median seconds seen at that size)`` for every distinct size in ``ops``."""
    by: Dict[float, List[float]] = {}
    for b, t in ops:
        by.setdefault(b, []).append(t)
    return sorted((b, statistics.median(ts)) for b, ts in by.items())


def op_seconds_python(launches: List[Tuple[float, float]]) -> List[float]:
    """Service seconds of operations run one at a time in launch order, from Python-side
    ``(t_launch, t_done)`` pairs (launch order): ``t_done - max(t_launch, previous t_done)``."""
    out, prev = [], -math.inf
    for t_launch, t_done in launches:
        out.append(max(0.0, t_done - max(t_launch, prev)))
        prev = max(prev, t_done)
    return out
