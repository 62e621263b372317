"""The hook's state: binding to a model, one synced step's bookkeeping, and the launches.

A synced step ends at the hook call that hands the last parameter requiring grad (or DDP's last
bucket); each layer group is launched, as one backend operation, in the call that hands its last
gradient.
"""
from __future__ import annotations

import logging
import statistics
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from .autogroup import CALIBRATION_STEPS, AutoGroup, StepSample, contention_at, op_seconds_python
from .checkpoint import Checkpointing
from .layout import Group, Slot, build_groups, check_sparse
from .stats import hook_stats

log = logging.getLogger("xirang")

#: Smallest fp32 matrix (elements) that goes through the compressed ring. Smaller tensors and
#: every 1-D tensor (biases, norm scales) go through the plain ring in their own dtype: they are
#: a tiny share of the bytes, and keeping them exact costs nothing measurable. 1024 elements =
#: 4 KiB of fp32; a 32x32 matrix is the smallest compressed square.
DEFAULT_MIN_COMPRESS_NUMEL = 1024

#: Wire formats of the compressed tensors and their bytes per element on the wire (the scales of
#: fp16 and int8, one fp32 per 1024-element segment, counted as 4/1024 byte per element).
WIRE_BYTES = {"bf16": 2.0, "fp16": 2.0 + 4.0 / 1024, "int8": 1.0 + 4.0 / 1024}


def _flush_copies(dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every pair (same shapes and dtypes) in one foreach call, then
    empties both lists: the per-parameter copies of packing and unpacking cost one dispatch."""
    if dst:
        torch._foreach_copy_(dst, src)
        dst.clear()
        src.clear()


def _used_map_index(ddp) -> Optional[Dict[int, int]]:
    """id(param) -> its index in DDP's used map (the reducer's parameter list: requires_grad,
    not ignored, shared ones once, in ``named_parameters`` order), or None when DDP keeps no
    reduced map (neither ``find_unused_parameters`` nor ``static_graph``)."""
    if ddp is None or not (getattr(ddp, "find_unused_parameters", False) or getattr(ddp, "static_graph", False)):
        return None
    ignore = getattr(ddp, "parameters_to_ignore", set())
    params = [p for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ignore]
    return {id(p): i for i, p in enumerate(params)}


def _backend_for(process_group: Optional[dist.ProcessGroup]) -> Any:
    """The xirang backend object serving CPU tensors of ``process_group`` (``None``: default).

    Raises ``TypeError`` when the group is not served by xirang (the message names the backend
    found), ``ImportError`` when the C++ extension is not built.
    """
    from xirang._backend import backend_for  # noqa: PLC0415  (lazy: the hook imports without the extension)

    return backend_for(process_group)


def _one_host(backend: Any) -> bool:
    """The group's live ranks (more than one) are all in this rank's shared-memory domain."""
    ring = backend.ring
    return len(ring) > 1 and set(backend.shm_ranks) >= set(ring)


class _GroupStep:
    """One group's progress within one synced step."""

    __slots__ = ("arrived", "handed", "early", "pack_dst", "pack_src", "done", "t_first", "t_ready", "t_launch", "t_done", "seq", "finite",
                 "launched", "event")

    def __init__(self):
        self.arrived = 0  # slots whose gradient is packed or marked early (ready when all are)
        self.handed = 0  # slots DDP has handed in buckets (the bucket order: when all are)
        self.early: List[Slot] = []  # slots ready before their bucket: packed from .grad at launch
        # Bucket gradients to pack at launch (views of the group's buffers, sources).
        self.pack_dst: List[torch.Tensor] = []
        self.pack_src: List[torch.Tensor] = []
        self.done: Optional[torch.futures.Future] = None
        self.t_first: Optional[float] = None
        self.t_ready: Optional[float] = None
        self.t_launch: Optional[float] = None
        self.t_done: Optional[float] = None
        self.seq: Optional[int] = None  # the backend operation's sequence number (calibration only)
        self.finite = True
        self.launched = False
        # CUDA: recorded when the group's op is done, on the stream its Future's callback ran on
        # (which waited for the op): the bucket's copies wait on it, whatever stream they run on.
        self.event: Optional[Any] = None


class _Step:
    def __init__(self, n_groups: int, calibrating: bool = False):
        self.groups = [_GroupStep() for _ in range(n_groups)]
        self.arrived_ids: set = set()  # handed in buckets
        self.early_ids: set = set()  # accumulated before their bucket (early launch)
        self.bucket_order: List[int] = []  # groups by the bucket call that handed their last slot
        self.order: List[int] = []  # the launch order of this step ([]: launch when ready)
        self.next_launch = 0  # groups order[:next_launch] are launched
        self.early_seen: Dict[int, Tuple[torch.Tensor, int]] = {}  # id(param) -> (.grad, its version)
        self.local = False  # local_average: DDP's buckets averaged in place
        self.folded: List[Tuple[Slot, torch.Tensor]] = []  # local: residuals added into bucket views
        self.local_ops = 0  # local: operations issued, bytes averaged (bucket buffers)
        self.local_bytes = 0
        self.t_first: Optional[float] = None
        # layers_per_group="auto" while calibrating: layer position (-1: params in no layer) ->
        # perf_counter time of the hook call that handed its last gradient so far.
        self.layer_t: Optional[Dict[int, float]] = {} if calibrating else None


class BF16ErrorFeedbackState(Checkpointing):
    r"""State of :func:`bf16_error_feedback_hook`: layer groups, residuals, counters, stats.

    Args:
        model: the ``DistributedDataParallel`` wrapper, or the plain module it wraps (or will
            wrap: Lightning builds DDP itself). Parameter names are taken without DDP's
            ``module.`` prefix.
        layers_per_group: consecutive layers per group, i.e. per backend call. Typical: 8
            (a few dozen groups for a large transformer: enough overlap, few launches); 1 reduces
            each layer on its own (most overlap, most launches); ``None`` puts the whole model in
            one group (no overlap, one launch); ``"auto"`` measures the first synced steps and
            picks the size with the least predicted exposed communication, then keeps it (see
            :mod:`xirang.hooks.autogroup` and ``stats()["autogroup"]``). A positive ``int``,
            ``None`` or ``"auto"`` (``TypeError`` for another type, ``bool`` included;
            ``ValueError`` below 1 or for another string).
        auto_calibration_steps: with ``layers_per_group="auto"``: synced steps measured after
            DDP's first one before choosing (an int >= 2, default 6; taking turns at one layer
            per group, all layers in one group and ``round(sqrt(layers))``). The choice is made, agreed
            (group rank 0 decides, a broadcast over ``process_group``) and applied at the first
            hook call of the step after them, on every rank.
        layers: override of the layer list (modules, in the order they count). Default:
            :func:`default_layers` (one layer per block: GPT-2's ``transformer.h.i``, Llama's
            ``model.layers.i``, BERT's ``encoder.layer.i``, a ResNet's ``layerK.j``, ...). A tied
            parameter belongs to the first layer holding it; parameters in no layer form one
            extra group, the last. TypeError for something other than a sequence of modules,
            ValueError for a module that holds none of the model's parameters.
        min_compress_numel: fp32 tensors with ``ndim >= 2`` and at least this many elements
            go through the compressed ring; the rest go through the plain ring in their own
            dtype (fp64 stays fp64, bf16/fp16 are not compressed again). Default
            :data:`DEFAULT_MIN_COMPRESS_NUMEL` (1024).
        process_group: the group to reduce over. Default: the DDP wrapper's group, else the
            default group. It must be served by xirang (``TypeError`` otherwise, raised here if
            the group exists already, else at the first hook call).
        error_feedback: ``False`` never commits residuals (plain bf16 ring, for ablations).
        measure_readiness: register a post-accumulate-grad hook on every parameter to time
            true group readiness (one Python call per parameter per backward, ~1 us each);
            early launch stands on these hooks.
        early_launch: reduce a group as soon as backward has accumulated its gradients, before
            DDP hands their bucket (see "Early launch" below; needs ``measure_readiness`` and a
            DDP wrapper). ``False``: launch from buckets only. Turn it off when another
            post-accumulate-grad hook rewrites ``.grad`` after xirang's (the hook raises a
            ``RuntimeError`` naming the parameter if it sees that).
        local_average: when every rank of the group shares this rank's shared memory
            (``backend.shm_ranks`` covers the group: one host, ``XIRANG_TRANSPORT_LOCAL`` auto or
            shm), average each DDP bucket in place with one backend operation, as DDP's own
            allreduce does, instead of packing layer groups: there the group operation is the
            exact fp32 average anyway (no wire format, residuals 0), and packing, unpacking and
            the finiteness check are pure cost (measured, 24-block model, WS=2 on 2 cores: 29.2
            ms per step with groups against 20.2 for an in-place bucket average and 19.9 for
            DDP without a hook). Residuals left by an earlier multi-host run or a checkpoint are
            added into the bucket (x + N r, then averaged) and zeroed once the step's output is
            finite (a parameter unused on every rank keeps its residual for a later step).
            Records and profiler ranges then carry DDP's bucket index as ``group_id``
            and a ``bucket <k>:`` label; ``stats()["totals"]["path"]`` says ``"local"``. The
            path is chosen at each step's first hook call or early-launch mark, whichever comes
            first (so a change of this setting, or of the group's hosts, takes effect at the next
            step). Every rank must pass the same value. ``False``: always layer groups.
            On this path ``layers_per_group="auto"`` calibrates nothing (there is no group to
            size; an INFO line says so), and ``skipped_steps`` counts only non-finite steps
            that had folded residuals to keep (nothing else is committed; no finiteness pass
            runs). A one-rank group has no shared-memory peers and keeps the layer-group path,
            wire rounding and error feedback included: the hook is for multi-rank training.
        wire: the compressed tensors' wire format, each with complete error feedback
            (``ValueError`` for another value):

            * ``"bf16"`` (default): the BF16 ring, 2 bytes per element, one rounding per hop,
              each fed back.
            * ``"fp16"``: IEEE fp16 codes with one power-of-two fp32 scale per 1024 elements
              (so large gradients cannot overflow fp16, horovod#1699, and small ones keep 11
              bits): ~2 bytes per element.
            * ``"int8"``: int8 codes with one fp32 scale (absmax / 127) per 1024 elements, ~0.25x
              of fp32's bytes; an inf/NaN element is sent as NaN.

            fp16 and int8 run the direct form (each rank sends every chunk straight to its
            owner, the owner sums the N contributions in fp32 and rounds once, an allgather of
            the rounded chunks follows): only the sender's and the owner's roundings occur,
            both kept in the residuals. Every rank must pass the same ``wire``. On CUDA
            gradients every format runs the codec's device kernels (host-staged or NCCL), except
            where the backend mirrors them in host memory (ranks sharing a host, elastic mode,
            ``XIRANG_CUDA_TRANSPORT=mirror``): there the CPU codec runs.

    Memory: per compressed element 12 bytes on top of the gradient (residual 4, staging 4,
    packed buffer 4, all fp32); per plain element one packed copy in its dtype. Residuals are
    allocated (zeros) at the first hook call. ``stats()["totals"]["residual_bytes"]`` reports
    residual + staging.

    Residuals are keyed by fully qualified parameter name and packed in parameter order, never
    bucket order: DDP's bucket rebuild after iteration 1 and a checkpoint restore leave every
    group's packing, chunk ownership and summation order unchanged.

    Early launch: a group is reduced as soon as backward has accumulated all its gradients
    (``measure_readiness``'s post-accumulate-grad hooks, in a backward whose forward ran outside
    ``no_sync``), before DDP hands the bucket that holds them: with DDP's default 25 MiB buckets
    the model's first layers would otherwise wait for the end of backward. Launches follow the
    order in which the previous two steps' buckets completed the groups (identical on every rank,
    as DDP's bucket layout is), so ranks that launch early and ranks that wait for buckets (a rank
    in ``join``) issue the same sequence; a group that is ready before its predecessors waits for
    them. Until that order is learned (DDP's first steps, and after a regroup) groups launch from
    buckets. Every rank must pass the same ``early_launch``.

    Step semantics: a synced step ends at the hook call that hands the last parameter requiring
    grad (or DDP's last bucket). Residual updates are staged by the backend and committed when
    the step's last group completes, only if every group's output is finite; otherwise every
    residual stays as it was (the non-finite output lets AMP's ``GradScaler`` skip the step).
    A parameter that DDP finds unused on every rank (``find_unused_parameters``) gets no output
    (DDP leaves its ``.grad`` alone), so its residual keeps the value it had before the step;
    unless its ``.grad`` is DDP's bucket view (``gradient_as_bucket_view`` with gradients kept
    between steps, ``zero_grad(set_to_none=False)``), which holds the output anyway.
    """

    def __init__(
        self,
        model: nn.Module,
        layers_per_group: Optional[int] = 8,
        layers: Optional[Sequence[nn.Module]] = None,
        min_compress_numel: int = DEFAULT_MIN_COMPRESS_NUMEL,
        process_group: Optional[dist.ProcessGroup] = None,
        error_feedback: bool = True,
        measure_readiness: bool = True,
        wire: str = "bf16",
        auto_calibration_steps: int = CALIBRATION_STEPS,
        early_launch: bool = True,
        local_average: bool = True,
    ):
        if isinstance(layers_per_group, str):
            if layers_per_group != "auto":
                raise ValueError(f"layers_per_group must be a positive int or None (or 'auto'), got "
                                 f"{layers_per_group!r}")
        elif layers_per_group is not None:
            if isinstance(layers_per_group, bool) or not isinstance(layers_per_group, int):
                raise TypeError(f"layers_per_group must be a positive int or None (or 'auto'), got "
                                f"{type(layers_per_group).__name__} {layers_per_group!r}")
            if layers_per_group < 1:
                raise ValueError(f"layers_per_group must be a positive int or None (or 'auto'), got "
                                 f"{layers_per_group!r}")
        if not isinstance(wire, str) or wire not in WIRE_BYTES:
            raise ValueError(f"wire must be one of {', '.join(map(repr, WIRE_BYTES))}, got {wire!r}")
        if isinstance(min_compress_numel, bool) or not isinstance(min_compress_numel, int) or min_compress_numel < 1:
            raise ValueError(f"min_compress_numel must be an int >= 1, got {min_compress_numel!r}")
        self.layers_per_group: Union[int, None, str] = layers_per_group
        self._auto: Optional[AutoGroup] = (AutoGroup(auto_calibration_steps) if layers_per_group == "auto"
                                           else None)
        self.min_compress_numel = min_compress_numel
        self.wire = wire
        self.error_feedback = bool(error_feedback)
        self.measure_readiness = bool(measure_readiness)
        self.early_launch = bool(early_launch)
        self.local_average = bool(local_average)
        if layers is not None and (isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__")):
            raise TypeError(f"layers= must be a sequence of nn.Module (e.g. [*model.blocks]), got "
                            f"{type(layers).__name__}")
        self._user_layers = list(layers) if layers is not None else None
        self.process_group = process_group
        self._init_runtime()
        self.bind(model, process_group)

    def _init_runtime(self) -> None:
        """Everything but the settings: no model bound, no backend, counters at zero."""
        self._root: Optional[nn.Module] = None
        self._ddp = None
        self._backend = None
        self._auto_lpg = 1  # layers per group of the current "auto" calibration step
        self._slots: Dict[int, Slot] = {}
        self._groups: List[Group] = []
        self._expected: set = set()
        self._step: Optional[_Step] = None
        self._ready_handles: List[Any] = []
        self._ready_on = False  # _ready_handles registered (measure_readiness, not on the local path)
        self._warned_flush = False
        self._exposed_s = 0.0
        self._sum_exposed_s = 0.0
        self._t_last_hook_return: Optional[float] = None
        self._t_step_end: Optional[float] = None  # perf_counter s at the end of the last synced step
        self._pending_residuals: Optional[Dict[str, torch.Tensor]] = None
        self._pending_meta: Optional[Dict[str, Any]] = None
        # Early launch: the launch order learned from the last step's buckets ([] until one
        # completed), and whether the last forward of the DDP wrapper will sync its backward.
        self._order: List[int] = []
        self._last_bucket_order: List[int] = []
        self._armed = False
        self._early_ok = True  # False once a gradient was seen accumulated twice in one backward
        self._seen_now: set = set()  # params accumulated in this backward (since the last forward)
        self._fwd_handle: Any = None
        # local_average: whether the open (or last) step averages DDP's buckets in place, whether a
        # residual may be nonzero (then folded into the next local step), and bucket labels.
        self._local = False
        self._residuals_dirty = False
        self._local_labels: Dict[Tuple[int, int], str] = {}
        self._local_last = (0, 0)  # the last local step's operations and bucket bytes
        self._warned_local = False
        self._warned_view = False
        # Residual updates of the last synced step that hold only if DDP delivered the output to
        # .grad, which it does not for a parameter unused on every rank (see _settle): the groups
        # whose residuals were committed (the old ones are their `staged` buffers until the next
        # launch) and, local path, (slot, residual before the fold); and the parameters' indices
        # in DDP's used map.
        self._unsettled: Optional[Tuple[List[Group], List[Tuple[Slot, torch.Tensor]]]] = None
        self._ddp_index: Optional[Dict[int, int]] = None
        self.steps = 0
        self.skipped_steps = 0
        self.world_size: Optional[int] = None
        self.ring_order: Optional[Tuple[int, ...]] = None

    # -- binding ----------------------------------------------------------------------------

    def bind(self, model: nn.Module, process_group: Optional[dist.ProcessGroup] = None) -> None:
        """(Re)attach to ``model``: build the layer groups. Needed after unpickling a state."""
        if model is None:
            return
        ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else None
        root = ddp.module if ddp is not None else model
        if process_group is None:
            process_group = self.process_group
        if process_group is None and ddp is not None:
            process_group = ddp.process_group
        self.process_group = process_group
        check_sparse(root, ddp)
        self._ready_hooks(False)
        if self._fwd_handle is not None:
            self._fwd_handle.remove()
            self._fwd_handle = None
        self._order = self._last_bucket_order = []
        self._root = root
        self._ddp = ddp
        self._unsettled = None
        self._ddp_index = _used_map_index(ddp)
        one_host = False  # then the groups serve no step: no warning about their cut
        if self.local_average and dist.is_available() and dist.is_initialized():
            try:
                one_host = _one_host(_backend_for(process_group))
            except (TypeError, ImportError):
                pass  # _resolve_backend below raises it
        self._build_groups(root, ddp, warn=not one_host)
        if ddp is not None and (self.measure_readiness or self._ddp_index is not None):
            self._fwd_handle = ddp.register_forward_hook(_ArmEarly(self))
        self._ready_hooks(True)
        self._backend = None
        if dist.is_available() and dist.is_initialized():
            self._resolve_backend()

    def _ready_hooks(self, want: bool) -> None:
        """Register (``want``, with ``measure_readiness``) or remove the post-accumulate-grad
        hooks (``_ReadyMark``) on the bound model's parameters. The local path removes them: it
        reads no stamp, and each costs a Python call per parameter per backward, ``no_sync``
        steps included. Registered again at a step's first bucket, the hooks missed this
        backward's earlier gradients, so that step launches no group early."""
        want = want and self.measure_readiness
        if want == self._ready_on:
            return
        for h in self._ready_handles:
            h.remove()
        self._ready_handles = []
        self._ready_on = want
        if not want:
            return
        for key, s in self._slots.items():
            if hasattr(s.param, "register_post_accumulate_grad_hook"):
                self._ready_handles.append(s.param.register_post_accumulate_grad_hook(_ReadyMark(self, key)))
        self._armed = False

    def group_size(self) -> Optional[int]:
        """Layers per group in use now: the fixed setting, or with ``"auto"`` the choice (the
        calibration step's size before it)."""
        if self._auto is None:
            return self.layers_per_group  # type: ignore[return-value]
        return self._auto.chosen if self._auto.decided else self._auto_lpg

    def _build_groups(self, root: nn.Module, ddp, warn: bool = True) -> None:
        self._slots, self._groups = build_groups(root, ddp, self._user_layers, self.group_size(),
                                                 self.min_compress_numel, warn=warn)
        self._expected = set(self._slots)
        self._n_layers = len({s.layer for s in self._slots.values() if s.layer >= 0})

    def _regroup(self, layers_per_group: int) -> None:
        """Rebuild the groups at ``layers_per_group`` between steps. Each compressed parameter's
        residual (keyed by name) is moved into its new group's packing, none lost or doubled;
        the per-group stats restart with the new groups."""
        res = {k: v.detach().clone() for k, v in self.residuals.items()}
        ready = {key: s.group.grad_ready_t for key, s in self._slots.items()}
        old = self._groups
        if self._auto is not None and not self._auto.decided:
            self._auto_lpg = layers_per_group
        self._build_groups(self._root, self._ddp, warn=False)
        self._order = self._last_bucket_order = []  # the new groups' order is learned from their buckets
        for key, s in self._slots.items():  # grad-ready stamps of this backward so far
            t = ready.get(key)
            if t is not None and (s.group.grad_ready_t is None or t > s.group.grad_ready_t):
                s.group.grad_ready_t = t
        self._put_residuals(res)
        for g in old:
            g.release()

    def _resolve_backend(self) -> None:
        pg = self.process_group
        self._backend = _backend_for(pg)
        self.world_size = dist.get_world_size(pg)
        self.ring_order = tuple(int(r) for r in self._backend.ring)  # group ranks in ring order
        if self._pending_meta is not None:
            self._apply_loaded(self._pending_meta, self._pending_residuals or {})
            self._pending_meta = None
            self._pending_residuals = None

    @property
    def residuals(self) -> Dict[str, torch.Tensor]:
        """fqn -> this rank's residual (fp32 view, shape of the parameter) of compressed tensors.

        Views into the live buffers; empty before the first step (residuals start at zero).
        """
        self._settle()
        out = {}
        for g in self._groups:
            if g.residual is None:
                continue
            for s in g.slots:
                if s.kind == "ef":
                    out[s.fqn] = g.residual[s.offset : s.offset + s.numel].view(s.param.shape)
        return out

    @property
    def groups(self) -> List[Dict[str, Any]]:
        """The layer groups: index, layer names, parameter names (parameter order) by path."""
        return [
            {
                "group": g.index,
                "layers": list(g.layer_names),
                "params": [s.fqn for s in g.slots],
                "compressed": [s.fqn for s in g.slots if s.kind == "ef"],
                "plain": [s.fqn for s in g.slots if s.kind == "plain"],
            }
            for g in self._groups
        ]

    # -- the hook body ----------------------------------------------------------------------

    def _auto_busy(self) -> bool:
        """layers_per_group="auto" is calibrating, or has a calibration step still to take in."""
        return self._auto is not None and (not self._auto.decided or self._auto.pending is not None)

    def _launch_order(self) -> List[int]:
        """The launch order of a step starting now ([]: launch each group when ready, from buckets)."""
        if not self.early_launch or len(self._order) != len(self._groups) or self._auto_busy():
            return []
        return self._order

    def _new_step(self, t0: float) -> _Step:
        """Starts a synced step's bookkeeping at its first hook call (bucket or early mark), at
        ``t0`` (perf_counter s); while "auto" calibrates, at the end of its step-start work
        instead (``step.t_first``: the caller's time origin from here on)."""
        self._unsettled = None  # _settle ran at this step's forward, or cannot run here (see there)
        if self._auto_busy():
            self._auto_step_start()
            # The groups' buffers, new after a regroup, are allocated and written here too (first
            # touch of fresh pages: ~15 ms per 6 MB on a 2-core VM), not at each group's first
            # hook call or in its operation's packing, where the one big operation of an
            # all-layers step paid them and the reused buffers of later steps do not. The step's time origin comes after all that work (with reading the last
            # step's records, tens of ms), which holds up the rest of this backward: timed from
            # before it, every later layer would look that much later than the first in the
            # calibration samples, and auto would see a backward that is not there.
            for g in self._groups:
                g.ensure_buffers()
                for buf in (g.ef_buf, *g.plain_bufs.values()):
                    if buf is not None:
                        buf.zero_()  # first touch here, not in the operation's packing (counted as its cost)
            t0 = time.perf_counter()
        calibrating = self._auto is not None and not self._auto.decided
        step = self._step = _Step(len(self._groups), calibrating)
        step.t_first = t0
        step.order = self._launch_order()
        return step

    def _open_group(self, step: _Step, g: Group, t0: float) -> _GroupStep:
        gs = step.groups[g.index]
        if gs.t_first is None:
            gs.t_first = t0
            gs.done = torch.futures.Future()
            g.ensure_buffers()
        return gs

    def _group_ready(self, step: _Step, g: Group, gs: _GroupStep, t0: float) -> None:
        """All of g's slots are packed or marked early: launch it, or, in a step with a launch
        order, every group of the order whose turn has come."""
        gs.t_ready = t0
        if not step.order:
            self._launch(g, gs)
            return
        while step.next_launch < len(step.order):
            nxt = step.order[step.next_launch]
            ng, ngs = self._groups[nxt], step.groups[nxt]
            if not ngs.launched:
                if ngs.t_first is None or ngs.arrived < len(ng.slots):
                    return
                self._launch(ng, ngs)
            step.next_launch += 1

    def _early_mark(self, s: Slot) -> None:
        """Post-accumulate-grad hook of a slot's parameter (early launch, see the class doc)."""
        if not (self._armed and self.early_launch and self._early_ok and self._backend is not None):
            return
        grad = s.param.grad
        step = self._step
        pid = id(s.param)
        if step is not None and pid in step.early_ids:
            raise RuntimeError(
                f"bf16_error_feedback_hook: the gradient of {s.fqn} was accumulated twice in one backward "
                "after an early launch had read it (reentrant checkpointing?); pass early_launch=False")
        twice = pid in self._seen_now
        self._seen_now.add(pid)
        if twice:  # accumulated twice in one backward (reentrant checkpointing): never read .grad early
            self._early_ok = False
            log.info("xirang hook: early launch off on this rank: the gradient of %s is accumulated more than "
                     "once per backward", s.fqn)
            return
        if not (step.order if step is not None else self._launch_order()) or grad is None \
                or grad.dtype != s.dtype or grad.layout != torch.strided:
            return  # still learning the order (or a step without one), or a gradient DDP would convert
        if grad._base is not None or not s.param.is_contiguous():
            # .grad is DDP's bucket view (gradient_as_bucket_view, kept across steps): the views of
            # a bucket share one version counter, so a later rewrite of this .grad could not be
            # told from a sibling's accumulation. A parameter that is not contiguous (channels_last,
            # a transposed weight): DDP's bucket holds its gradient in the parameter's memory order
            # and hands the hook a contiguous view of it, so the bucket path packs memory order,
            # while .grad would pack logical order. Either way its group waits for the bucket.
            if not self._warned_view:
                self._warned_view = True
                log.info("xirang hook: %s is reduced from its DDP bucket, not early: %s", s.fqn,
                         "its .grad is a view of the bucket (gradient_as_bucket_view with zero_grad(set_to_none=False))"
                         if grad._base is not None else "the parameter is not contiguous (e.g. channels_last)")
            return
        t0 = time.perf_counter()
        if step is None:
            if self._all_local():  # this step takes the local path: its first bucket call opens it
                self._local = True  # (and drops these hooks: not from inside one of them)
                return
            step = self._new_step(t0)
            t0 = step.t_first
        if pid in step.arrived_ids:
            return
        g = s.group
        gs = self._open_group(step, g, t0)
        step.early_ids.add(pid)
        step.early_seen[pid] = (grad, grad._version)
        gs.early.append(s)
        gs.arrived += 1
        if gs.arrived == len(g.slots):
            self._group_ready(step, g, gs, t0)

    def _on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        t0 = time.perf_counter()
        if self._root is None:
            raise RuntimeError(
                "BF16ErrorFeedbackState is not bound to a model (it was unpickled): "
                "call state.bind(model) before training"
            )
        if self._backend is None:
            self._resolve_backend()
        step = self._step
        if step is None or step.local:  # a step's path is chosen at its first hook call
            if step is None:
                self._local = self._all_local()
                self._ready_hooks(not self._local)
            if self._local:
                return self._on_bucket_local(bucket, t0)
        params = bucket.parameters()
        if step is not None and any(id(p) in step.arrived_ids for p in params):
            warnings.warn(
                "bf16_error_feedback_hook: a parameter arrived twice in one step (was the previous "
                "backward interrupted?); starting a new step and discarding the old one",
                RuntimeWarning,
                stacklevel=2,
            )
            step = None
        if step is None:
            step = self._new_step(t0)
            t0 = step.t_first
        grads = bucket.gradients()
        if len(grads) != len(params):
            raise RuntimeError(f"bucket has {len(params)} parameters but {len(grads)} gradients")

        parts: Dict[int, List[Tuple[Slot, torch.Tensor]]] = {}
        # Packing copies are the launch's (see _launch): a group starts as soon as DDP has handed
        # its last gradient.
        for p, grad in zip(params, grads):
            s = self._slots.get(id(p))
            if s is None:
                raise RuntimeError(
                    "bf16_error_feedback_hook: DDP handed a parameter the state does not know "
                    f"(shape {tuple(p.shape)}); build the state from the model DDP wraps"
                )
            if grad.dtype != s.dtype:
                raise RuntimeError(
                    f"gradient of {s.fqn} is {grad.dtype}, expected {s.dtype}: "
                    "rebuild the state after changing parameter dtypes"
                )
            g = s.group
            gs = self._open_group(step, g, t0)
            if step.layer_t is not None:
                step.layer_t[s.layer] = t0
            parts.setdefault(g.index, []).append((s, grad))
            step.arrived_ids.add(id(p))
            seen = step.early_seen.pop(id(p), None)
            if seen is not None:  # packed from .grad at launch: it must be what DDP hands now
                old, version = seen
                if old._version != version or not (p.grad is old or torch.equal(old, grad)):
                    raise RuntimeError(
                        f"bf16_error_feedback_hook: the gradient of {s.fqn} changed after its early launch "
                        "read it (another post-accumulate-grad hook?); pass early_launch=False")
            else:
                gs.pack_dst.append(s.view)
                gs.pack_src.append(grad.reshape(-1))
                gs.arrived += 1
                if gs.arrived == len(g.slots):
                    # Launch as soon as the group's last gradient is handed, before the rest of the
                    # bucket: the order follows the bucket's parameter order, which DDP makes
                    # identical on every rank.
                    self._group_ready(step, g, gs, t0)
            gs.handed += 1
            if gs.handed == len(g.slots):
                step.bucket_order.append(g.index)

        step_end = bool(bucket.is_last()) or len(step.arrived_ids) >= len(self._expected)
        if step_end:
            flush = [
                i for i, gs in enumerate(step.groups)
                if gs.t_first is not None and not gs.launched and gs.arrived < len(self._groups[i].slots)
            ]
            if flush and not self._warned_flush:
                self._warned_flush = True
                warnings.warn(
                    "bf16_error_feedback_hook: groups "
                    f"{flush} were incomplete at DDP's last bucket (parameters the state expected "
                    "were not handed); reducing them as they are",
                    RuntimeWarning,
                    stacklevel=2,
                )
            rest = [i for i in step.order if i < len(step.groups)] + list(range(len(step.groups)))
            for gi in rest:
                gs = step.groups[gi]
                if gs.t_first is not None and not gs.launched:
                    gs.t_ready = t0
                    self._launch(self._groups[gi], gs)
            # The launch order of the next step: this step's bucket order (DDP's layout, the same
            # on every rank) once two steps after DDP's first agree on it (DDP rebuilds its buckets
            # after the first step, with static_graph after the second).
            bo = step.bucket_order if len(step.bucket_order) == len(self._groups) and self.steps > 0 else []
            self._order = bo if bo == self._last_bucket_order else []
            self._last_bucket_order = bo

        deps_idx = sorted(parts)
        if step_end:
            deps_idx = [i for i, gs in enumerate(step.groups) if gs.launched]
            self._step = None
        deps = [step.groups[i].done for i in deps_idx]
        buf = bucket.buffer()
        done = torch.futures.collect_all(deps)
        end = step if step_end else None
        if buf.is_cuda:
            # DDP waits on this Future with its stream: a CUDA Future, completed after the copies
            # into the bucket, makes that stream wait for them (a plain .then would not).
            gsteps = [step.groups[i] for i in deps_idx]
            fut = torch.futures.Future(devices=[buf.device])

            def _fin(f: torch.futures.Future) -> None:
                try:
                    for gs in gsteps:
                        if gs.event is not None:
                            torch.cuda.current_stream(buf.device).wait_event(gs.event)
                    fut.set_result(self._finish_bucket(f, buf, parts, end))
                except BaseException as e:  # noqa: BLE001  (handed to DDP's wait)
                    fut.set_exception(e)

            done.add_done_callback(_fin)
        else:
            fut = done.then(lambda f: self._finish_bucket(f, buf, parts, end))
        self._t_last_hook_return = time.perf_counter()
        return fut

    # -- local_average: every rank on one host ------------------------------------------------

    def _all_local(self) -> bool:
        """``local_average`` applies: the group's live ranks (more than one) are all in this rank's
        shared-memory domain, where the group operation is the exact fp32 average."""
        return self.local_average and self._backend is not None and _one_host(self._backend)

    def _on_bucket_local(self, bucket: dist.GradBucket, t0: float) -> torch.futures.Future:
        """One backend operation averaging ``bucket.buffer()`` in place (see ``local_average``);
        a residual that may be nonzero is added first (x + N r, so the average owes nothing)."""
        step = self._step
        if step is None:
            if not self._warned_local:
                self._warned_local = True
                log.info("xirang hook: all %d ranks share this host's memory: averaging DDP's buckets in place "
                         "(local_average; the exact fp32 average, no wire format)%s", len(self._backend.ring),
                         "; layers_per_group='auto' has nothing to choose here" if self._auto is not None else "")
            self._unsettled = None  # as in _new_step
            step = self._step = _Step(0)
            step.local = True
            step.t_first = t0
            if self._residuals_dirty:  # one look at the residuals, then only after a change
                self._residuals_dirty = self.error_feedback and any(
                    bool(g.residual.any()) for g in self._groups if g.residual is not None)
        buf = bucket.buffer()
        if self._residuals_dirty:
            n = len(self._backend.ring)
            for p, grad in zip(bucket.parameters(), bucket.gradients()):
                s = self._slots.get(id(p))
                if s is not None and s.kind == "ef" and s.group.residual is not None:
                    grad.add_(s.group.residual[s.offset : s.offset + s.numel].view(grad.shape), alpha=n)
                    step.folded.append((s, grad))
        key = (bucket.index(), buf.numel())
        label = self._local_labels.get(key)
        if label is None:
            ps = [self._slots[id(p)].fqn for p in bucket.parameters() if id(p) in self._slots]
            label = self._local_labels[key] = (f"bucket {bucket.index()}: {ps[0]} .. {ps[-1]} ({len(ps)} tensors)"
                                               if ps else f"bucket {bucket.index()}")
        work = self._backend.allreduce_ef(*(torch.empty(0) for _ in range(3)), bucket.index(), label=label,
                                          plain=[buf], wire=self.wire)
        step.local_ops += 1
        step.local_bytes += buf.numel() * buf.element_size()
        last = bool(bucket.is_last())
        if last:
            self._step = None
        fut = work.get_future().then(lambda f: self._finish_local(f, buf, step if last else None))
        self._t_last_hook_return = time.perf_counter()
        return fut

    def _finish_local(self, f: torch.futures.Future, buf: torch.Tensor, step: Optional[_Step]) -> torch.Tensor:
        try:
            f.value()  # re-raises the operation's error
        except RuntimeError as e:
            raise self._hinted(e) from e
        if step is None:
            return buf
        if step.folded:  # the folded residuals are owed no more once the step's output is finite
            if all(bool(torch.isfinite(g).all()) for _, g in step.folded):
                kept = []
                for s, _ in step.folded:
                    r = s.group.residual[s.offset : s.offset + s.numel]
                    if self._ddp_index is not None:
                        kept.append((s, r.clone()))
                    r.zero_()
                self._unsettled = ([], kept) if kept else None
            else:
                self.skipped_steps += 1
        self._local_last = (step.local_ops, step.local_bytes)
        self._end_step()
        return buf

    def _launch(self, g: Group, gs: _GroupStep) -> None:
        gs.launched = True
        # The group's packing: slots marked early from their .grad, the others from their bucket.
        # On the host the op copies them on the communication thread (record: pack_s), off the
        # autograd thread; CUDA gradients here, with one foreach copy on the current stream.
        dst = [x.view for x in gs.early] + gs.pack_dst
        src = [x.param.grad.reshape(-1) for x in gs.early] + gs.pack_src
        gs.early, gs.pack_dst, gs.pack_src = [], [], []
        if dst and dst[0].is_cuda:  # packed here: the op's pack_into is for CPU tensors
            _flush_copies(dst, src)
            dst, src = [], []
        gs.t_launch = time.perf_counter()
        try:
            # One backend operation per group: the compressed ring for the matrices, then the
            # plain average of the group's other tensors in their own dtype.
            plain = [g.plain_bufs[dt] for dt in sorted(g.plain_bufs, key=str)]
            ef = (g.ef_buf, g.residual, g.staged) if g.ef_numel else tuple(torch.empty(0) for _ in range(3))
            work = self._backend.allreduce_ef(*ef, g.index, label=", ".join(g.layer_names), plain=plain,
                                              wire=self.wire, pack_into=dst, pack_from=src)
            if self._step is not None and self._step.layer_t is not None:  # calibrating: find its record
                gs.seq = getattr(self._backend, "sequence_number", None)
            fut = work.get_future()
        except BaseException as e:
            gs.done.set_exception(e)
            raise
        g.launches_total += 1
        g.delay_bucket_s = gs.t_launch - gs.t_ready
        g.delay_first_bucket_s = gs.t_launch - gs.t_first
        g.sum_delay_bucket_s += g.delay_bucket_s
        if g.grad_ready_t is not None:
            g.delay_grad_ready_s = max(0.0, gs.t_launch - g.grad_ready_t)
            g.sum_delay_grad_ready_s += g.delay_grad_ready_s
            g.n_delay_grad_ready += 1
        else:  # no stamp this step (join's zero buckets, measure_readiness=False)
            g.delay_grad_ready_s = None
        g.grad_ready_t = None
        fut.add_done_callback(lambda f: self._group_done(g, gs, f))

    def _group_done(self, g: Group, gs: _GroupStep, f: torch.futures.Future) -> None:
        try:
            f.value()  # re-raises the operation's error
            gs.t_done = time.perf_counter()
            b = g.ef_buf if g.ef_buf is not None else next(iter(g.plain_bufs.values()), None)
            if b is not None and b.is_cuda:
                gs.event = torch.cuda.Event()
                gs.event.record(torch.cuda.current_stream(b.device))  # it waited for the op's results
            gs.finite = g.all_finite()
            g.comm_s = gs.t_done - gs.t_launch
            g.sum_comm_s += g.comm_s
        except BaseException as e:  # noqa: BLE001  (handed to the futures DDP waits on)
            gs.done.set_exception(self._hinted(e) if isinstance(e, RuntimeError) else e)
            return
        gs.done.set_result(True)

    def _hinted(self, e: RuntimeError) -> RuntimeError:
        """``e``, or when the ranks' operations did not match, ``e`` with the likely cause named:
        ranks that pass different ``local_average`` (or ``wire``) run different operations."""
        msg = str(e)
        if type(e) is not RuntimeError or "mismatch" not in msg.lower():  # a subclass keeps its type
            return e
        return RuntimeError(f"{msg} (the hook's settings on this rank: local_average={self.local_average}, "
                            f"wire={self.wire!r}, this step's path: {'local' if self._local else 'groups'}; every rank "
                            "must pass the same local_average, wire and layers)")

    def _finish_bucket(self, f, buf: torch.Tensor, parts, step: Optional[_Step]) -> torch.Tensor:
        for x in f.value():
            x.value()  # re-raises a group's error
        dst: List[torch.Tensor] = []
        src: List[torch.Tensor] = []
        for lst in parts.values():
            for s, grad in lst:
                dst.append(grad)
                src.append(s.view.view(grad.shape))
        _flush_copies(dst, src)
        if step is not None:
            self._commit(step)
        return buf

    def _end_step(self, launched: Sequence[Group] = ()) -> None:
        """What ends every synced step, on either path: launch counts, the step count, the
        exposed time (last hook return -> now)."""
        self._armed = False  # the next backward reads .grad early only after a new forward
        for g in self._groups:
            g.launches_last_step = 0
        for g in launched:
            g.launches_last_step = 1
        self.steps += 1
        self._t_step_end = time.perf_counter()
        if self._t_last_hook_return is not None:
            self._exposed_s = max(0.0, self._t_step_end - self._t_last_hook_return)
            self._sum_exposed_s += self._exposed_s

    def _settle(self) -> None:
        """Undo the last synced step's residual update for the parameters DDP found unused on
        every rank: DDP leaves their ``.grad`` untouched, so the output that paid a residual
        (groups: the encoded x + r; local: the folded N r) never reached the optimizer, and the
        residual is owed still. Reads DDP's reduced used map (``find_unused_parameters`` /
        ``static_graph`` only: otherwise DDP requires every parameter to be used), which is final
        once backward has returned and which cannot be read inside DDP's hook (the reducer holds
        its lock there): so this runs at the DDP wrapper's next forward (``_ArmEarly``) and
        when residuals are read, and a step that starts unsettled drops the undo."""
        kept, self._unsettled = self._unsettled, None
        if not kept or self._ddp_index is None or self._ddp is None:
            return
        try:
            used = self._ddp.reducer._get_local_used_map()
        except (AttributeError, RuntimeError):  # a torch without the map: nothing to learn
            return
        if used.numel() != len(self._ddp_index):
            return
        used = used.tolist()
        if 0 not in used:
            return
        groups, folded = kept
        pairs = [(s, g.staged) for g in groups for s in g.slots if s.kind == "ef"] + folded
        views = bool(getattr(self._ddp, "gradient_as_bucket_view", False))
        for s, old in pairs:
            i = self._ddp_index.get(id(s.param))
            if i is None or used[i] != 0:
                continue
            g = s.param.grad
            if views and g is not None and g._base is not None:  # .grad is the bucket view: it got the output
                continue
            if old is s.group.staged:  # the group's whole old residual buffer
                old = old[s.offset : s.offset + s.numel]
            s.group.residual[s.offset : s.offset + s.numel].copy_(old)
            self._residuals_dirty = True

    def _commit(self, step: _Step) -> None:
        launched = [(self._groups[i], gs) for i, gs in enumerate(step.groups) if gs.launched]
        finite = all(gs.finite for _, gs in launched)
        if finite and self.error_feedback:
            for g, _ in launched:
                if g.ef_numel:
                    g.residual, g.staged = g.staged, g.residual
                    self._residuals_dirty = True
            if self._ddp_index is not None:  # the old residuals are the staged buffers, until _settle
                self._unsettled = ([g for g, _ in launched if g.ef_numel], [])
        if not finite:
            self.skipped_steps += 1
        self._end_step([g for g, _ in launched])
        a = self._auto
        if a is not None:
            if a.decided:
                a.record_after(self._exposed_s)
            elif step.layer_t is not None:
                a.seen_steps += 1
                if a.seen_steps > 1:  # DDP's first synced step (one big bucket) is not measured
                    a.pending = {"step": step, "groups": [g for g, _ in launched],
                                 "group_size": self._auto_lpg,
                                 "t_end": self._t_last_hook_return, "exposed_s": self._exposed_s,
                                 "t_step_end": self._t_step_end}

    # -- layers_per_group="auto" ------------------------------------------------------------

    def _auto_step_start(self) -> None:
        """At the first hook call of a synced step, before packing: turn the last calibration
        step into a sample (its operations' records are in by now), then either choose (all
        ranks, same step) or set the next calibration step's group size."""
        a = self._auto
        if a.pending is not None:
            a.samples.append(self._auto_sample(a.pending))
            a.pending = None
        if a.decided:
            return
        if self._n_layers <= 1:  # nothing to choose: the same groups at any size
            a.chosen, a.source, a.predictions = 1, "trivial", {}
            log.info("xirang hook: layers_per_group='auto': %d layer(s), 1 layer per group", self._n_layers)
            return
        if a.ready_to_decide():
            self._auto_decide()
            return
        want = a.group_size_for_next(self._n_layers) if a.seen_steps >= 1 else 1
        if want != self._auto_lpg:
            self._regroup(want)

    def _bytes_of(self, slots) -> float:
        """Bytes one rank sends for ``slots`` in one operation, as ``stats()`` counts them:
        (2 per compressed element, itemsize per plain element) x 2(N-1)/N."""
        n = self.world_size or 1
        ring = 2.0 * (n - 1) / n
        return sum((2 if s.kind == "ef" else s.param.element_size()) * s.numel for s in slots) * ring

    def _auto_sample(self, p: Dict[str, Any]) -> StepSample:
        step, groups = p["step"], p["groups"]
        t0 = step.t_first
        order = sorted(groups, key=lambda g: step.groups[g.index].t_launch)
        seqs = {step.groups[g.index].seq for g in order}
        recs: Dict[int, Dict[str, Any]] = {}
        if None not in seqs and hasattr(self._backend, "records"):
            recs = {r["seq"]: r for r in self._backend.records() if r["seq"] in seqs and r.get("ok", True)}
        py = op_seconds_python([(step.groups[g.index].t_launch, step.groups[g.index].t_done) for g in order])
        # The end of backward: the last hook call that handed a gradient (its start), not its
        # return: the operation it launches competes with the rest of that call for the CPU.
        t_end = max(step.layer_t.values(), default=p["t_end"])
        ops, after, beside = [], [], []
        from_records = True
        for g, t_py in zip(order, py):
            r = recs.get(step.groups[g.index].seq)
            if r is None:
                from_records = False
            # The queue's cost of the operation: its Python-side service time (the backend's
            # work plus the hook's completion callbacks on the communication thread and their
            # waits for the GIL, which hold up the next operation too), at least its record's.
            op = (self._bytes_of(g.slots), max(t_py, float(r["total_s"])) if r is not None else t_py)
            ops.append(op)
            if step.groups[g.index].t_done - op[1] >= t_end:  # started after backward's end
                after.append(op)
            elif step.groups[g.index].t_done <= t_end:  # ran beside backward all along
                beside.append(op)
        src = "records+python" if from_records else "python"
        self._auto.source = src if self._auto.source in (None, src) else "python"
        # The tail: the end of the step (its last bucket copied back into the gradients, the
        # residuals committed) after the operation that finished last, against that group's bytes
        tail = None
        if order and p.get("t_step_end") is not None:
            last = max(order, key=lambda g: step.groups[g.index].t_done)
            tail = (self._bytes_of(last.slots), max(0.0, p["t_step_end"] - step.groups[last.index].t_done))
        layer_t: List[Optional[float]] = [None] * self._n_layers
        for layer, t in step.layer_t.items():
            if 0 <= layer < self._n_layers:
                layer_t[layer] = t - t0
        extra = step.layer_t.get(-1)
        return StepSample(p["group_size"], layer_t, None if extra is None else extra - t0, t_end - t0, ops,
                          p["exposed_s"], after, beside, tail)

    def _auto_decide(self) -> None:
        a = self._auto
        by_layer: List[List[Slot]] = [[] for _ in range(self._n_layers)]
        rest: List[Slot] = []
        for s in self._slots.values():
            (by_layer[s.layer] if s.layer >= 0 else rest).append(s)
        m = a.measure([self._bytes_of(x) for x in by_layer], self._bytes_of(rest) if rest else None)
        g, pred = m["choice"], m["predictions"][m["choice"]]
        mine = g
        pg = self.process_group
        if (self.world_size or 1) > 1:  # group rank 0 decides; every rank is here, at the same step
            t = torch.tensor([float(g), float(pred)], dtype=torch.float64)
            src = 0 if pg is None else dist.get_global_rank(pg, 0)
            dist.broadcast(t, src=src, group=pg)
            g, pred = int(t[0].item()), float(t[1].item())
        a.chosen, a.predicted_exposed_s = g, pred
        a.predictions, a.alpha_s, a.beta_s_per_byte = m["predictions"], m["alpha"], m["beta"]
        # the contention of the size in use (rank 0's choice), from this rank's measurements
        a.contention, a.slowdown = contention_at(g, m["contention_by_size"]), m["slowdown"]
        a.contention_by_size, a.tail = dict(m["contention_by_size"]), m["tail"]
        cands = ", ".join(f"{k}: {v * 1e3:.3f}" for k, v in sorted(m["predictions"].items()))
        who = "rank 0's choice" if g == mine else f"rank 0's choice; this rank's was {mine}"
        me = dist.get_rank(pg) if (self.world_size or 1) > 1 else 0
        n_ops = sum(len(s.ops) for s in a.samples)
        exposed_cal = statistics.median([s.exposed_s for s in a.samples])
        log.info("xirang hook: layers_per_group='auto' chose %d layers per group (%s; predicted exposed "
                 "communication %.3f ms, rank 0's; rank %d's fit over %d operations of %d steps (%s): alpha %.1f us per "
                 "operation, beta %.3g s/B, contention %.2f (by calibrated size: %s), slowdown beside backward "
                 "%.2f; tail after the last operation %.1f us + %.3g s/B; measured "
                 "exposed at calibration %.3f ms). "
                 "Predicted exposed ms by layers per group: %s", g, who, pred * 1e3, me, n_ops, len(a.samples),
                 a.source, m["alpha"] * 1e6, m["beta"], a.contention,
                 ", ".join(f"{k}: {v:.2f}" for k, v in sorted(m["contention_by_size"].items())), m["slowdown"],
                 m["tail"][0] * 1e6, m["tail"][1], exposed_cal * 1e3,
                 cands)
        self._regroup(g)

    # -- stats ------------------------------------------------------------------------------

    def stats(self) -> Dict[str, Any]:
        """Per-group view of the hook's communication (this rank, Python side).

        Returns ``{"groups": [...], "totals": {...}}``. Each group: ``group``, ``layers``,
        ``numel_compressed``, ``numel_plain`` (dtype name -> elements), ``launches_per_step``
        (last step; one launch = one group's reduction: one ``allreduce_ef`` backend operation,
        which also averages the group's plain tensors), ``launches_total``, ``collectives_per_step``
        (backend operations: one per launch),
        ``bytes_raw_per_step`` (what fp32/own-dtype ring allreduce would send: itemsize x numel
        x 2(N-1)/N), ``bytes_wire_per_step`` (compressed: :data:`WIRE_BYTES` of ``wire`` per
        element x 2(N-1)/N),
        ``launch_delay_s`` (hook call that completed the group -> launch; ~0 by construction),
        ``launch_delay_from_grad_ready_s`` (last gradient of the group accumulated -> launch;
        the real delay behind readiness, bounded by the time to fill the rest of its bucket),
        ``first_bucket_to_launch_s``, ``comm_s`` (launch -> completion), their ``mean_*``
        counterparts, and ``residual_bytes`` (residual + staging). ``totals`` sums bytes,
        launches and residual bytes and adds ``exposed_comm_s``: last hook return -> the
        step's last group done, an estimate of how long DDP waits on communication.
        ``autogroup``: None unless ``layers_per_group="auto"``; then ``decided``,
        ``layers_per_group`` (the choice, None while calibrating), ``calibration_steps`` and
        ``calibration_steps_measured``, ``restored`` (from a checkpoint), ``alpha_s`` (s per
        operation), ``beta_s_per_byte``, ``contention`` (0..1, the chosen size's),
        ``contention_by_size`` (calibrated size -> k), ``slowdown`` (>= 1), ``tail_s`` and
        ``tail_s_per_byte`` (the step's end after its last operation: s + s/B of that
        operation's bytes), ``source``
        ("records+python" or "python"), ``predicted_exposed_comm_s`` (rank 0's, for the choice),
        ``measured_exposed_comm_s`` (mean ``exposed_comm_s`` of the steps since the choice), ``steps_since_choice`` and
        ``predictions_s`` (g -> predicted s, this rank's). After a regroup the per-group figures
        start again with the new groups. ``totals["path"]``: ``"groups"``, or ``"local"`` while
        ``local_average`` averages DDP's buckets in place (then the per-group launches are 0 and
        ``totals`` counts the buckets' operations and their fp32 bytes, 2(N-1)/N x bucket bytes).
        """
        out = hook_stats(self._groups, self.world_size or 1, self._exposed_s, self._sum_exposed_s, self.steps,
                         self.skipped_steps, WIRE_BYTES[self.wire])
        tot = out["totals"]
        # Before the first step: the path that step will take.
        local = self._local if self.steps or self.skipped_steps else self._all_local()
        tot["path"] = "local" if local else "groups"
        if local:
            n = len(self._backend.ring)
            tot["launches_per_step"] = tot["collectives_per_step"] = self._local_last[0]
            tot["bytes_raw_per_step"] = tot["bytes_wire_per_step"] = self._local_last[1] * 2.0 * (n - 1) / n
        out["autogroup"] = self._auto.report() if self._auto is not None else None
        return out


class _ReadyMark:
    """Post-accumulate-grad hook: stamps the time a group's gradient last grew (the parameter's
    group now: ``"auto"`` regroups between steps)."""

    __slots__ = ("state", "key")

    def __init__(self, state: BF16ErrorFeedbackState, key: int):
        self.state = state
        self.key = key

    def __call__(self, _param: torch.Tensor) -> None:
        if self.state._local:  # local_average: no groups to time or launch
            return
        s = self.state._slots.get(self.key)
        if s is not None:
            s.group.grad_ready_t = time.perf_counter()
            self.state._early_mark(s)


class _ArmEarly:
    """Forward hook of the DDP wrapper: the last synced step's residuals are settled (see
    ``_settle``); the next backward syncs (early launch may read .grad) when this forward ran
    with grad enabled outside ``no_sync``."""

    __slots__ = ("state",)

    def __init__(self, state: BF16ErrorFeedbackState):
        self.state = state

    def __call__(self, module: nn.Module, _args: Any, _out: Any) -> None:
        st = self.state
        st._settle()
        st._armed = bool(torch.is_grad_enabled() and getattr(module, "require_backward_grad_sync", False))
        st._seen_now = set()
        if st._armed and st._step is not None:  # a step is open only inside a backward
            warnings.warn("bf16_error_feedback_hook: the previous backward did not finish its step (interrupted?); "
                          "discarding it", RuntimeWarning, stacklevel=2)
            st._step = None
