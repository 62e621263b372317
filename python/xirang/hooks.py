"""BF16 error-feedback DDP communication hook, reduced one layer group at a time.

One line turns it on::

    state = xirang.register_comm_hook(ddp_model, layers_per_group=8)

or, equivalently::

    state = xirang.hooks.BF16ErrorFeedbackState(ddp_model, layers_per_group=8)
    ddp_model.register_comm_hook(state, xirang.hooks.bf16_error_feedback_hook)

The hook is thin: it maps DDP's buckets onto *layer groups*, packs each group's gradients in
parameter order and issues one backend operation per group (``allreduce_ef`` of the xirang
process group: bf16 on the wire, fp32 accumulation at every hop, every rounding fed back into
this rank's residual). Encoding, the ring and decoding run in C++ on the backend's
communication thread, so backward keeps computing while earlier groups are on the wire.

The math, for one group with packed fp32 gradients ``x_i`` (shape ``[n]``) on rank ``i`` of
``N`` and residual ``r_i`` (``[n]``, fp32)::

    y   = decode(ring_bf16(x_i + r_i))      # ~= sum_i (x_i + r_i) / N, bitwise equal on all ranks
    r_i <- the sum of the rounding errors rank i made this step (first encode, hops, final)

so that, summed over steps ``t``, ``sum_t y_t + sum_i r_i = sum_t sum_i x_i,t / N`` up to fp32
rounding: nothing is lost, it is only delayed.

The backend must be xirang's: ``xirang._backend_for(process_group)`` raises a ``TypeError``
naming the backend it found otherwise.
"""


import logging
import math
import threading
import time
import warnings
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "BF16ErrorFeedbackState",
    "bf16_error_feedback_hook",
    "register_comm_hook",
    "DEFAULT_MIN_COMPRESS_NUMEL",
]

logger = logging.getLogger(__name__)

#: Smallest fp32 matrix (elements) that goes through the compressed ring. Smaller tensors and
#: every 1-D tensor (biases, norm scales) go through the plain ring in their own dtype: they are
#: a tiny share of the bytes, and keeping them exact costs nothing measurable. 1024 elements =
#: 4 KiB of fp32; a 32x32 matrix is the smallest compressed square.
DEFAULT_MIN_COMPRESS_NUMEL = 1024

_STATE_DICT_VERSION = 1
_DDP_PREFIX = "module."
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _backend_for(process_group: Optional[dist.ProcessGroup]) -> Any:
    """The xirang backend object serving CPU tensors of ``process_group`` (``None``: default).

    Raises ``TypeError`` when the group is not served by xirang (the message names the backend
    found), ``ImportError`` when the C++ extension is not built.
    """
    import xirang  # noqa: PLC0415  (lazy: hooks.py must import without the extension)

    fn = getattr(xirang, "_backend_for", None)
    if fn is None:
        from xirang import _C  # noqa: PLC0415

        fn = _C._backend_for
    return fn(process_group)


# ---------------------------------------------------------------------------------------------
# Layer mapping
# ---------------------------------------------------------------------------------------------


def _has_params(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def _expand_containers(m: nn.Module) -> List[nn.Module]:
    """A ModuleList/Sequential/ModuleDict stands for its children (recursively)."""
    if isinstance(m, _CONTAINERS):
        out: List[nn.Module] = []
        for c in m.children():
            if _has_params(c):
                out.extend(_expand_containers(c))
        return out
    return [m]


def default_layers(root: nn.Module) -> List[nn.Module]:
    """The default layers of ``root``, in registration order.

    Single-child wrappers without parameters of their own are looked through. Then each
    top-level child that holds parameters is a layer, except containers (``ModuleList``,
    ``Sequential``, ``ModuleDict``), whose children are the layers (a ``ModuleList`` of
    transformer blocks gives one layer per block). If that yields fewer than two layers, the
    leaf modules with parameters are the layers instead.
    """
    m = root
    while True:
        kids = [c for c in m.children() if _has_params(c)]
        own = next(m.parameters(recurse=False), None) is not None
        if len(kids) == 1 and not own and not isinstance(kids[0], _CONTAINERS):
            m = kids[0]
            continue
        break
    layers: List[nn.Module] = []
    for c in kids:
        layers.extend(_expand_containers(c))
    if len(layers) < 2:
        layers = [
            x for x in root.modules() if next(x.parameters(recurse=False), None) is not None
        ]
    return layers


def _warn_if_coarse(root: nn.Module, layer_list: List[nn.Module], layer_params: List[List[nn.Parameter]],
                    n_groups: int, mod_names: Dict[int, str]) -> None:
    """WARNING on logger "xirang" when :func:`default_layers` cut ``root`` too coarsely for
    overlap: fewer than 2 groups, or one layer holding more than half the parameters (e.g. HF
    ``GPT2LMHeadModel``: its ``transformer`` is one layer; an ``nn.TransformerEncoder`` between an
    embedding and a head). Names the ``layers=`` argument, with the block list found inside the
    largest layer as the example."""
    sizes = [sum(p.numel() for p in ps) for ps in layer_params]
    total = sum(sizes)
    if total == 0:
        return
    big = max(range(len(sizes)), key=sizes.__getitem__)
    share = sizes[big] / total
    if n_groups >= 2 and share <= 0.5:
        return
    why = [f"{len(layer_list)} layer(s) in {n_groups} group(s)"]
    if share > 0.5:
        why.append(f"'{mod_names.get(id(layer_list[big]), '?')}' ({type(layer_list[big]).__name__}) "
                   f"holds {share:.0%} of the parameters")
    # The example: the container of blocks (ModuleList/Sequential of >= 2 parameterised children)
    # with the most parameters inside the largest layer, named from the model's root.
    best, best_n = None, 0
    for m in layer_list[big].modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and sum(_has_params(c) for c in m.children()) >= 2:
            n = sum(p.numel() for p in m.parameters())
            if n > best_n:
                best, best_n = m, n
    if best is not None and mod_names.get(id(best), "<root>") != "<root>":
        example = f"layers=[*model.{mod_names[id(best)]}]"
    else:
        example = "layers=[block_1, block_2, ...]"
    logging.getLogger("xirang").warning(
        "xirang hook: the default layer finder gave %s, so little or no communication overlaps "
        "backward. Pass the layers yourself, e.g. register_comm_hook(ddp, %s) (model = the module "
        "DDP wraps; parameters in no listed layer form one last group).", "; ".join(why), example)


class _Slot:
    """Where one parameter's gradient lives in its group's packed buffers."""

    __slots__ = ("fqn", "param", "group", "kind", "dtype", "offset", "numel", "order")

    def __init__(self, fqn, param, group, kind, dtype, offset, numel, order):
        self.fqn = fqn
        self.param = param
        self.group = group
        self.kind = kind  # "ef" (compressed ring) or "plain"
        self.dtype = dtype
        self.offset = offset
        self.numel = numel
        self.order = order  # index in root.named_parameters()


class _Group:
    """A run of consecutive layers reduced by one backend call (plus plain collectives)."""

    def __init__(self, index: int, layer_names: List[str]):
        self.index = index
        self.layer_names = layer_names
        self.slots: List[_Slot] = []  # parameter order
        self.ef_numel = 0
        self.plain_numel: Dict[torch.dtype, int] = {}
        # Buffers, allocated on first use: packed input/output, residual, staging.
        self.ef_buf: Optional[torch.Tensor] = None
        self.residual: Optional[torch.Tensor] = None
        self.staged: Optional[torch.Tensor] = None
        self.plain_bufs: Dict[torch.dtype, torch.Tensor] = {}
        # Stats (cumulative and last step).
        self.launches_total = 0
        self.launches_last_step = 0
        self.delay_bucket_s = 0.0
        self.delay_first_bucket_s = 0.0
        self.delay_grad_ready_s: Optional[float] = None
        self.comm_s = 0.0
        self.sum_delay_bucket_s = 0.0
        self.sum_delay_grad_ready_s = 0.0
        self.n_delay_grad_ready = 0
        self.sum_comm_s = 0.0
        self.grad_ready_t: Optional[float] = None  # written by post-accumulate-grad hooks


class _GroupStep:
    """One group's progress within one synced step."""

    __slots__ = ("arrived", "done", "t_first", "t_ready", "t_launch", "finite", "launched")

    def __init__(self):
        self.arrived = 0
        self.done: Optional[torch.futures.Future] = None
        self.t_first: Optional[float] = None
        self.t_ready: Optional[float] = None
        self.t_launch: Optional[float] = None
        self.finite = True
        self.launched = False


class _Step:
    def __init__(self, n_groups: int):
        self.groups = [_GroupStep() for _ in range(n_groups)]
        self.arrived_ids: set = set()
        self.t_first: Optional[float] = None


# ---------------------------------------------------------------------------------------------
# State
# ---------------------------------------------------------------------------------------------


class BF16ErrorFeedbackState:
    r"""State of :func:`bf16_error_feedback_hook`: layer groups, residuals, counters, stats.

    Args:
        model: the ``DistributedDataParallel`` wrapper, or the plain module it wraps (or will
            wrap: Lightning builds DDP itself). Parameter names are taken without DDP's
            ``module.`` prefix.
        layers_per_group: consecutive layers per group, i.e. per backend call. Typical: 8
            (a few dozen groups for a large transformer: enough overlap, few launches); 1 reduces
            each layer on its own (most overlap, most launches); ``None`` puts the whole model in
            one group (no overlap, one launch). A positive ``int`` (``TypeError`` for another type,
            ``bool`` included; ``ValueError`` below 1).
        layers: override of the layer list (modules, in the order they count). Default:
            :func:`default_layers` (top-level blocks with parameters; ``ModuleList``/
            ``Sequential`` containers stand for their children; else leaf modules). A tied
            parameter belongs to the first layer holding it; parameters in no layer form one
            extra group, the last.
        min_compress_numel: fp32 tensors with ``ndim >= 2`` and at least this many elements
            go through the compressed ring; the rest go through the plain ring in their own
            dtype (fp64 stays fp64, bf16/fp16 are not compressed again). Default
            :data:`DEFAULT_MIN_COMPRESS_NUMEL` (1024).
        process_group: the group to reduce over. Default: the DDP wrapper's group, else the
            default group. It must be served by xirang (``TypeError`` otherwise, raised here if
            the group exists already, else at the first hook call).
        error_feedback: ``False`` never commits residuals (plain bf16 ring, for ablations).
        measure_readiness: register a post-accumulate-grad hook on every parameter to time
            true group readiness (one Python call per parameter per backward, ~1 us each).

    Memory: per compressed element 12 bytes on top of the gradient (residual 4, staging 4,
    packed buffer 4, all fp32); per plain element one packed copy in its dtype. Residuals are
    allocated (zeros) at the first hook call. ``stats()["totals"]["residual_bytes"]`` reports
    residual + staging.

    Residuals are keyed by fully qualified parameter name and packed in parameter order, never
    bucket order: DDP's bucket rebuild after iteration 1 and a checkpoint restore leave every
    group's packing, chunk ownership and summation order unchanged.

    Step semantics: a synced step ends at the hook call that hands the last parameter requiring
    grad (or DDP's last bucket). Residual updates are staged by the backend and committed when
    the step's last group completes, only if every group's output is finite; otherwise every
    residual stays as it was (the non-finite output lets AMP's ``GradScaler`` skip the step).
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
    ):
        if layers_per_group is not None:
            if isinstance(layers_per_group, bool) or not isinstance(layers_per_group, int):
                raise TypeError(f"layers_per_group must be a positive int or None, got "
                                f"{type(layers_per_group).__name__} {layers_per_group!r}")
            if layers_per_group < 1:
                raise ValueError(f"layers_per_group must be a positive int or None, got {layers_per_group!r}")
        if not isinstance(min_compress_numel, int) or min_compress_numel < 1:
            raise ValueError(f"min_compress_numel must be an int >= 1, got {min_compress_numel!r}")
        self.layers_per_group = layers_per_group
        self.min_compress_numel = min_compress_numel
        self.error_feedback = bool(error_feedback)
        self.measure_readiness = bool(measure_readiness)
        self._user_layers = list(layers) if layers is not None else None
        self.process_group = process_group
        self._init_runtime()
        self._pending_residuals: Optional[Dict[str, torch.Tensor]] = None
        self._pending_meta: Optional[Dict[str, Any]] = None
        self.steps = 0
        self.skipped_steps = 0
        self.world_size: Optional[int] = None
        self.ring_order: Optional[Tuple[int, ...]] = None
        self.bind(model, process_group)

    def _init_runtime(self) -> None:
        self._root: Optional[nn.Module] = None
        self._backend = None
        self._slots: Dict[int, _Slot] = {}
        self._groups: List[_Group] = []
        self._expected: set = set()
        self._step: Optional[_Step] = None
        self._lock = threading.Lock()
        self._ready_handles: List[Any] = []
        self._warned_flush = False
        self._exposed_s = 0.0
        self._sum_exposed_s = 0.0
        self._t_last_hook_return: Optional[float] = None

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
        self._check_sparse(root, ddp)
        for h in self._ready_handles:
            h.remove()
        self._ready_handles = []
        self._root = root
        self._build_groups(root, ddp)
        self._backend = None
        if dist.is_available() and dist.is_initialized():
            self._resolve_backend()

    @staticmethod
    def _check_sparse(root: nn.Module, ddp) -> None:
        bad = [
            n
            for n, m in root.named_modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and getattr(m, "sparse", False)
        ]
        if ddp is not None and getattr(ddp, "_has_sparse_grads", False) or bad:
            raise ValueError(
                "bf16_error_feedback_hook does not support sparse gradients "
                f"(sparse embeddings: {bad or 'found by DDP'}); construct them with sparse=False "
                "or use DDP's default allreduce for this model"
            )

    def _build_groups(self, root: nn.Module, ddp) -> None:
        ignore = set(getattr(root, "_ddp_params_and_buffers_to_ignore", ()) or ())
        if ddp is not None:
            ignore |= set(getattr(ddp, "parameters_to_ignore", ()) or ())
        names: Dict[int, str] = {}
        order: Dict[int, int] = {}
        for i, (n, p) in enumerate(root.named_parameters()):
            names[id(p)] = n
            order[id(p)] = i
        wanted = {
            id(p)
            for n, p in root.named_parameters()
            if p.requires_grad and n not in ignore
        }
        mod_names = {id(m): (n or "<root>") for n, m in root.named_modules()}
        layers = self._user_layers if self._user_layers is not None else default_layers(root)

        owner: Dict[int, int] = {}  # id(param) -> layer position (among layers with params)
        layer_params: List[List[Tuple[int, nn.Parameter]]] = []
        layer_list: List[nn.Module] = []
        for layer in layers:
            mine = []
            for p in layer.parameters():
                if id(p) in wanted and id(p) not in owner:
                    mine.append(p)
            if not mine:
                continue
            for p in mine:
                owner[id(p)] = len(layer_list)
            layer_list.append(layer)
            layer_params.append(mine)
        rest = [p for _, p in root.named_parameters() if id(p) in wanted and id(p) not in owner]

        lpg = self.layers_per_group or max(1, len(layer_list))
        group_members: List[Tuple[List[str], List[nn.Parameter]]] = []
        for start in range(0, len(layer_list), lpg):
            ls = layer_list[start : start + lpg]
            ps = [p for ps_ in layer_params[start : start + lpg] for p in ps_]
            group_members.append(([mod_names.get(id(m), type(m).__name__) for m in ls], ps))
        if rest:
            group_members.append((["<params in no layer>"], rest))
        if self._user_layers is None and self.layers_per_group is not None:
            _warn_if_coarse(root, layer_list, layer_params, len(group_members), mod_names)

        self._slots = {}
        self._groups = []
        for gi, (lnames, ps) in enumerate(group_members):
            g = _Group(gi, lnames)
            ps = sorted(ps, key=lambda p: order[id(p)])
            for p in ps:
                compress = (
                    p.dtype == torch.float32
                    and p.dim() >= 2
                    and p.numel() >= self.min_compress_numel
                )
                if compress:
                    s = _Slot(names[id(p)], p, g, "ef", p.dtype, g.ef_numel, p.numel(), order[id(p)])
                    g.ef_numel += p.numel()
                else:
                    off = g.plain_numel.get(p.dtype, 0)
                    s = _Slot(names[id(p)], p, g, "plain", p.dtype, off, p.numel(), order[id(p)])
                    g.plain_numel[p.dtype] = off + p.numel()
                g.slots.append(s)
                self._slots[id(p)] = s
            self._groups.append(g)
        self._expected = set(self._slots)

        if self.measure_readiness:
            for s in self._slots.values():
                if hasattr(s.param, "register_post_accumulate_grad_hook"):
                    self._ready_handles.append(
                        s.param.register_post_accumulate_grad_hook(_ReadyMark(s.group))
                    )

    def _resolve_backend(self) -> None:
        pg = self.process_group
        self._backend = _backend_for(pg)
        ws = dist.get_world_size(pg)
        ranks = tuple(dist.get_process_group_ranks(pg)) if pg is not None else tuple(range(ws))
        ring = getattr(self._backend, "ring", None)  # ProcessGroupXirang.ring: ranks in ring order
        try:
            ring = tuple(int(r) for r in (ring() if callable(ring) else ring)) if ring is not None else None
        except Exception:  # noqa: BLE001  (an optional backend attribute; fall back to ranks)
            ring = None
        self.world_size = ws
        self.ring_order = ring if ring is not None else ranks
        if self._pending_meta is not None:
            self._apply_loaded(self._pending_meta, self._pending_residuals or {})
            self._pending_meta = None
            self._pending_residuals = None

    # -- buffers ----------------------------------------------------------------------------

    def _ensure_buffers(self, g: _Group) -> None:
        if g.ef_numel and g.ef_buf is None:
            g.ef_buf = torch.empty(g.ef_numel, dtype=torch.float32)
            if g.residual is None:
                g.residual = torch.zeros(g.ef_numel, dtype=torch.float32)
            g.staged = torch.zeros(g.ef_numel, dtype=torch.float32)
        for dt, n in g.plain_numel.items():
            if dt not in g.plain_bufs:
                g.plain_bufs[dt] = torch.empty(n, dtype=dt)

    @property
    def residuals(self) -> Dict[str, torch.Tensor]:
        """fqn -> this rank's residual (fp32 view, shape of the parameter) of compressed tensors.

        Views into the live buffers; empty before the first step (residuals start at zero).
        """
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
            step = self._step = _Step(len(self._groups))
            step.t_first = t0
        grads = bucket.gradients()
        if len(grads) != len(params):
            raise RuntimeError(f"bucket has {len(params)} parameters but {len(grads)} gradients")

        parts: Dict[int, List[Tuple[_Slot, torch.Tensor]]] = {}
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
            gs = step.groups[g.index]
            if gs.t_first is None:
                gs.t_first = t0
                gs.done = torch.futures.Future()
                self._ensure_buffers(g)
            dst = g.ef_buf if s.kind == "ef" else g.plain_bufs[s.dtype]
            dst[s.offset : s.offset + s.numel].copy_(grad.reshape(-1))
            parts.setdefault(g.index, []).append((s, grad))
            gs.arrived += 1
            step.arrived_ids.add(id(p))
            if gs.arrived == len(g.slots):
                # Launch as soon as the group's last gradient is packed, before packing the
                # rest of the bucket: the order follows the bucket's parameter order, which
                # DDP makes identical on every rank.
                gs.t_ready = t0
                self._launch(g, gs)

        step_end = bool(bucket.is_last()) or len(step.arrived_ids) >= len(self._expected)
        if step_end:
            flush = [
                i for i, gs in enumerate(step.groups) if gs.t_first is not None and not gs.launched
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
            for gi in flush:
                step.groups[gi].t_ready = t0
                self._launch(self._groups[gi], step.groups[gi])

        deps_idx = sorted(parts)
        if step_end:
            deps_idx = [i for i, gs in enumerate(step.groups) if gs.launched]
            self._step = None
        deps = [step.groups[i].done for i in deps_idx]
        buf = bucket.buffer()
        done = torch.futures.collect_all(deps)
        fut = done.then(lambda f: self._finish_bucket(f, buf, parts, step if step_end else None))
        self._t_last_hook_return = time.perf_counter()
        return fut

    def _launch(self, g: _Group, gs: _GroupStep) -> None:
        ws = self.world_size
        futs: List[torch.futures.Future] = []
        gs.launched = True
        gs.t_launch = time.perf_counter()
        try:
            # One backend operation per group: the compressed ring for the matrices, then the
            # plain average of the group's other tensors in their own dtype.
            plain = [g.plain_bufs[dt] for dt in sorted(g.plain_bufs, key=str)]
            if type(self._backend).__module__.startswith("xirang."):
                ef = (g.ef_buf, g.residual, g.staged) if g.ef_numel else tuple(torch.empty(0) for _ in range(3))
                work = self._backend.allreduce_ef(
                    *ef, g.index, label=", ".join(g.layer_names), plain=plain
                )
                futs.append(work.get_future())
            else:  # test stand-ins: the compressed op alone, plain tensors through torch
                if g.ef_numel:
                    futs.append(self._backend.allreduce_ef(g.ef_buf, g.residual, g.staged, g.index).get_future())
                for b in plain:
                    if ws > 1:
                        b.div_(ws)
                        work = dist.all_reduce(b, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True)
                        futs.append(work.get_future())
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
        all_f = torch.futures.collect_all(futs)
        all_f.add_done_callback(lambda f: self._group_done(g, gs, f))

    def _group_done(self, g: _Group, gs: _GroupStep, f: torch.futures.Future) -> None:
        try:
            for x in f.value():
                x.value()
            finite = True
            if g.ef_buf is not None:
                finite = bool(torch.isfinite(g.ef_buf).all())
            for b in g.plain_bufs.values():
                if finite and b.is_floating_point():
                    finite = bool(torch.isfinite(b).all())
            gs.finite = finite
            g.comm_s = time.perf_counter() - gs.t_launch
            g.sum_comm_s += g.comm_s
        except BaseException as e:  # noqa: BLE001  (handed to the futures DDP waits on)
            gs.done.set_exception(e)
            return
        gs.done.set_result(True)

    def _finish_bucket(self, f, buf: torch.Tensor, parts, step: Optional[_Step]) -> torch.Tensor:
        for x in f.value():
            x.value()  # re-raises a group's error
        for gi, lst in parts.items():
            g = self._groups[gi]
            for s, grad in lst:
                src = g.ef_buf if s.kind == "ef" else g.plain_bufs[s.dtype]
                grad.copy_(src[s.offset : s.offset + s.numel].view(grad.shape))
        if step is not None:
            self._commit(step)
        return buf

    def _commit(self, step: _Step) -> None:
        launched = [(self._groups[i], gs) for i, gs in enumerate(step.groups) if gs.launched]
        finite = all(gs.finite for _, gs in launched)
        if finite and self.error_feedback:
            for g, _ in launched:
                if g.ef_numel:
                    g.residual, g.staged = g.staged, g.residual
        if not finite:
            self.skipped_steps += 1
        for g in self._groups:
            g.launches_last_step = 0
        for g, _ in launched:
            g.launches_last_step = 1
        self.steps += 1
        if self._t_last_hook_return is not None:
            self._exposed_s = max(0.0, time.perf_counter() - self._t_last_hook_return)
            self._sum_exposed_s += self._exposed_s

    # -- stats ------------------------------------------------------------------------------

    def stats(self) -> Dict[str, Any]:
        """Per-group view of the hook's communication (this rank, Python side).

        Returns ``{"groups": [...], "totals": {...}}``. Each group: ``group``, ``layers``,
        ``numel_compressed``, ``numel_plain`` (dtype name -> elements), ``launches_per_step``
        (last step; one launch = one group's reduction: one ``allreduce_ef`` backend operation,
        which also averages the group's plain tensors), ``launches_total``, ``collectives_per_step``
        (backend operations; equal to launches with the xirang backend),
        ``bytes_raw_per_step`` (what fp32/own-dtype ring allreduce would send: itemsize x numel
        x 2(N-1)/N), ``bytes_wire_per_step`` (compressed: 2 bytes per element x 2(N-1)/N),
        ``launch_delay_s`` (hook call that completed the group -> launch; ~0 by construction),
        ``launch_delay_from_grad_ready_s`` (last gradient of the group accumulated -> launch;
        the real delay behind readiness, bounded by the time to fill the rest of its bucket),
        ``first_bucket_to_launch_s``, ``comm_s`` (launch -> completion), their ``mean_*``
        counterparts, and ``residual_bytes`` (residual + staging). ``totals`` sums bytes,
        launches and residual bytes and adds ``exposed_comm_s``: last hook return -> the
        step's last group done, an estimate of how long DDP waits on communication.
        """
        n = self.world_size or 1
        ring = 2.0 * (n - 1) / n
        groups = []
        tot = {"bytes_raw_per_step": 0.0, "bytes_wire_per_step": 0.0, "launches_per_step": 0,
               "collectives_per_step": 0, "residual_bytes": 0}
        for g in self._groups:
            raw = 4 * g.ef_numel * ring
            wire = 2 * g.ef_numel * ring
            for dt, k in g.plain_numel.items():
                item = torch.empty((), dtype=dt).element_size()
                raw += item * k * ring
                wire += item * k * ring
            res_bytes = sum(
                t.numel() * t.element_size() for t in (g.residual, g.staged) if t is not None
            )
            real = type(self._backend).__module__.startswith("xirang.")
            colls = 1 if real else (1 if g.ef_numel else 0) + len(g.plain_numel)
            nl = max(1, g.launches_total)
            rec = {
                "group": g.index,
                "layers": list(g.layer_names),
                "numel_compressed": g.ef_numel,
                "numel_plain": {str(dt).replace("torch.", ""): k for dt, k in g.plain_numel.items()},
                "launches_per_step": g.launches_last_step,
                "launches_total": g.launches_total,
                "collectives_per_step": colls * g.launches_last_step,
                "bytes_raw_per_step": raw * g.launches_last_step,
                "bytes_wire_per_step": wire * g.launches_last_step,
                "launch_delay_s": g.delay_bucket_s,
                "launch_delay_from_grad_ready_s": g.delay_grad_ready_s,
                "first_bucket_to_launch_s": g.delay_first_bucket_s,
                "comm_s": g.comm_s,
                "mean_launch_delay_s": g.sum_delay_bucket_s / nl,
                "mean_launch_delay_from_grad_ready_s": (
                    g.sum_delay_grad_ready_s / g.n_delay_grad_ready if g.n_delay_grad_ready else None
                ),
                "mean_comm_s": g.sum_comm_s / nl,
                "residual_bytes": res_bytes,
            }
            groups.append(rec)
            for k in ("bytes_raw_per_step", "bytes_wire_per_step", "launches_per_step",
                      "collectives_per_step", "residual_bytes"):
                tot[k] += rec[k]
        tot["exposed_comm_s"] = self._exposed_s
        tot["mean_exposed_comm_s"] = self._sum_exposed_s / max(1, self.steps)
        tot["steps"] = self.steps
        tot["skipped_steps"] = self.skipped_steps
        tot["groups"] = len(self._groups)
        return {"groups": groups, "totals": tot}

    # -- checkpointing ----------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """This rank's residuals (fqn -> fp32 tensor, cloned) and counters; no process group.

        Every rank saves its own. Keys: ``version``, ``world_size``, ``ring_order``,
        ``layers_per_group``, ``min_compress_numel``, ``error_feedback``, ``steps``,
        ``skipped_steps``, ``residuals``.
        """
        res = {k: v.detach().clone() for k, v in self.residuals.items()}
        if self._pending_residuals is not None and not res:
            res = {k: v.clone() for k, v in self._pending_residuals.items()}
        return {
            "version": _STATE_DICT_VERSION,
            "world_size": self.world_size,
            "ring_order": list(self.ring_order) if self.ring_order is not None else None,
            "layers_per_group": self.layers_per_group,
            "min_compress_numel": self.min_compress_numel,
            "error_feedback": self.error_feedback,
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "residuals": res,
        }

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore residuals and counters saved by :meth:`state_dict` on this rank.

        A different world size or ring order resets residuals to zero with a warning (a
        residual belongs to the hops its rank made). Residuals of parameters that are not
        compressed here are ignored with a warning; a shape mismatch raises ``ValueError``.
        """
        if sd.get("version") != _STATE_DICT_VERSION:
            raise ValueError(f"unsupported hook state_dict version {sd.get('version')!r}")
        self.steps = int(sd.get("steps", 0))
        self.skipped_steps = int(sd.get("skipped_steps", 0))
        meta = {"world_size": sd.get("world_size"), "ring_order": sd.get("ring_order")}
        residuals = dict(sd.get("residuals", {}))
        if self.world_size is None:
            self._pending_meta, self._pending_residuals = meta, residuals
            return
        self._apply_loaded(meta, residuals)

    def _apply_loaded(self, meta: Dict[str, Any], residuals: Dict[str, torch.Tensor]) -> None:
        saved_ws, saved_ring = meta.get("world_size"), meta.get("ring_order")
        same = saved_ws is None or (
            saved_ws == self.world_size
            and (saved_ring is None or tuple(saved_ring) == tuple(self.ring_order or ()))
        )
        for g in self._groups:  # residuals restart at zero unless restored below
            if g.residual is not None:
                g.residual.zero_()
        if not same:
            warnings.warn(
                f"hook state saved with world size {saved_ws} / ring order {saved_ring}, "
                f"loaded with {self.world_size} / {list(self.ring_order or ())}: residuals reset "
                "to zero",
                UserWarning,
                stacklevel=3,
            )
            return
        by_fqn = {s.fqn: s for s in self._slots.values()}
        unknown = []
        for fqn, t in residuals.items():
            s = by_fqn.get(fqn)
            if s is None or s.kind != "ef":
                unknown.append(fqn)
                continue
            if t.numel() != s.numel:
                raise ValueError(
                    f"residual for {fqn} has {t.numel()} elements, parameter has {s.numel}"
                )
            g = s.group
            if g.residual is None:
                g.residual = torch.zeros(g.ef_numel, dtype=torch.float32)
            g.residual[s.offset : s.offset + s.numel].copy_(t.reshape(-1))
        if unknown:
            warnings.warn(
                f"ignored residuals of parameters not compressed by this state: {unknown[:5]}"
                + (" ..." if len(unknown) > 5 else ""),
                UserWarning,
                stacklevel=3,
            )

    def __getstate__(self) -> Dict[str, Any]:
        return {
            "layers_per_group": self.layers_per_group,
            "min_compress_numel": self.min_compress_numel,
            "error_feedback": self.error_feedback,
            "measure_readiness": self.measure_readiness,
            "state_dict": self.state_dict(),
        }

    def __setstate__(self, d: Dict[str, Any]) -> None:
        """Unpickled states hold residuals and counters only: call :meth:`bind` with the model."""
        self.layers_per_group = d["layers_per_group"]
        self.min_compress_numel = d["min_compress_numel"]
        self.error_feedback = d["error_feedback"]
        self.measure_readiness = d["measure_readiness"]
        self._user_layers = None
        self.process_group = None
        self._init_runtime()
        self.steps = 0
        self.skipped_steps = 0
        self.world_size = None
        self.ring_order = None
        self._pending_meta = None
        self._pending_residuals = None
        self.load_state_dict(d["state_dict"])


class _ReadyMark:
    """Post-accumulate-grad hook: stamps the time a group's gradient last grew."""

    __slots__ = ("group",)

    def __init__(self, group: _Group):
        self.group = group

    def __call__(self, _param: torch.Tensor) -> None:
        self.group.grad_ready_t = time.perf_counter()


# ---------------------------------------------------------------------------------------------
# The hook
# ---------------------------------------------------------------------------------------------


def bf16_error_feedback_hook(
    state: BF16ErrorFeedbackState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    r"""DDP comm hook: average gradients with bf16 on the wire and complete error feedback.

    Per call, for ``bucket`` (flat 1-D ``bucket.buffer()``, one dtype, this rank's un-averaged
    gradients):

    1. Each parameter's gradient is copied into its layer group's packed buffers, at an offset
       fixed by parameter order: compressed tensors (fp32, ``ndim >= 2``, ``numel >=
       min_compress_numel``) into one fp32 buffer ``[n_ef]``, the rest into one buffer per
       dtype.
    2. Every group whose last parameter arrived in this call is launched: one
       ``backend.allreduce_ef(buf, residual, staged, group_id)`` (fp32 ``[n_ef]`` each; the op
       returns the average over ranks decoded from bf16, bitwise equal on all ranks, and
       writes the new residual into ``staged``) and one plain ``SUM`` allreduce per other
       dtype (pre-divided by the world size, so no overflow). Buckets belonging to one group
       are thereby coalesced; a bucket spanning several groups (DDP's first iteration: one big
       bucket) is split.
    3. The returned future completes once every group overlapping ``bucket`` is done; its
       value is ``bucket.buffer()`` with the averages written in place. The step's last
       bucket's future also commits (staging -> residual, a pointer swap) if every group's
       output was finite.

    With a hook DDP does not divide by the world size: this hook averages. Every step
    (iteration 1's big bucket included) has one launch per group, issued in the hook call of
    the bucket holding the group's last gradient, i.e. at most one bucket after the group is
    ready. Choose ``bucket_cap_mb`` at most ~1/8 of a group's fp32 gradient bytes. Measured
    (2 ranks on 2 shared loaded cores, 24 blocks of 256x256, groups of 8 blocks = 2 MiB,
    stand-in op): median delay from the group's last gradient to launch 33-47 ms with the
    default 25 MiB (one bucket: everything waits for the end of backward), 10-20 ms at 4, 0.1-6
    ms at 1, 0.1-0.35 ms at 0.25; from the readiness hook call to launch, 0.04-0.3 ms.

    Returns:
        ``torch.futures.Future[torch.Tensor]`` holding ``bucket.buffer()``.
    """
    return state._on_bucket(bucket)


def register_comm_hook(
    ddp_model: nn.parallel.DistributedDataParallel,
    layers_per_group: Optional[int] = 8,
    **kwargs: Any,
) -> BF16ErrorFeedbackState:
    """Build a :class:`BF16ErrorFeedbackState` for ``ddp_model`` and register the hook.

    ``kwargs`` go to the state (``layers``, ``min_compress_numel``, ``process_group``, ...).
    Must be called before the first backward. Returns the state (keep it for ``stats()`` and
    checkpoints).
    """
    if not isinstance(ddp_model, nn.parallel.DistributedDataParallel):
        raise TypeError(
            "register_comm_hook needs the DistributedDataParallel wrapper; for a plain module "
            "build BF16ErrorFeedbackState(module) and hand it to your framework's DDP strategy"
        )
    state = BF16ErrorFeedbackState(ddp_model, layers_per_group=layers_per_group, **kwargs)
    ddp_model.register_comm_hook(state, bf16_error_feedback_hook)
    return state
