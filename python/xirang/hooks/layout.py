"""Where every gradient goes: layer groups, and each parameter's slot in its group's packed buffers.

Packing follows parameter order (``root.named_parameters()``), never DDP's bucket order, so a
bucket rebuild or a checkpoint restore leaves every group's packing unchanged.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .layers import default_layers, warn_if_coarse


class Slot:
    """Where one parameter's gradient lives in its group's packed buffers."""

    __slots__ = ("fqn", "param", "group", "kind", "dtype", "offset", "numel", "order", "layer", "view")

    def __init__(self, fqn, param, group, kind, dtype, offset, numel, order, layer=-1):
        self.fqn = fqn
        self.param = param
        self.group = group
        self.kind = kind  # "ef" (compressed ring) or "plain"
        self.dtype = dtype
        self.offset = offset
        self.numel = numel
        self.order = order  # index in root.named_parameters()
        self.layer = layer  # position among the layers with parameters; -1: in no layer
        self.view: Optional[torch.Tensor] = None  # [numel] view of its group buffer (ensure_buffers)


class Group:
    """A run of consecutive layers reduced by one backend operation."""

    def __init__(self, index: int, layer_names: List[str]):
        self.index = index
        self.layer_names = layer_names
        self.slots: List[Slot] = []  # parameter order
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

    @property
    def device(self) -> torch.device:
        """The device of the group's parameters, where its buffers and residual live (CUDA
        gradients are packed, checked and reduced on their GPU: no host copy in the hook).
        ``ValueError`` when the group's parameters are on several devices."""
        devs = {s.param.device for s in self.slots}
        if len(devs) > 1:
            raise ValueError(
                f"layer group {self.index} ({', '.join(self.layer_names)}) has parameters on "
                f"{sorted(str(d) for d in devs)}: the hook packs a group on one device; pass layers= "
                "so that no group spans devices"
            )
        return next(iter(devs)) if devs else torch.device("cpu")

    def release(self) -> None:
        """Drop the buffers and residual (a group replaced by a regroup: its slots and it refer to
        each other, so without this they would wait for Python's cycle collector, a set of
        buffers per calibration regroup)."""
        self.ef_buf = self.residual = self.staged = None
        self.plain_bufs = {}
        for s in self.slots:
            s.view = None

    def ensure_buffers(self) -> None:
        """Allocate the packed buffers (fp32 ``[ef_numel]`` input/output, residual and staging;
        one ``[n]`` buffer per plain dtype) on :attr:`device` if not yet there; a restored
        residual is kept (moved to the device)."""
        if (self.ef_numel and self.ef_buf is None) or len(self.plain_bufs) < len(self.plain_numel):
            dev = self.device  # only when allocating: this runs for every group of every step
        if self.ef_numel and self.ef_buf is None:
            self.ef_buf = torch.empty(self.ef_numel, dtype=torch.float32, device=dev)
            if self.residual is None:
                self.residual = torch.zeros(self.ef_numel, dtype=torch.float32, device=dev)
            elif self.residual.device != dev:
                self.residual = self.residual.to(dev)
            self.staged = torch.zeros(self.ef_numel, dtype=torch.float32, device=dev)
        for dt, n in self.plain_numel.items():
            if dt not in self.plain_bufs:
                self.plain_bufs[dt] = torch.empty(n, dtype=dt, device=dev)
        for s in self.slots:
            if s.view is None:
                buf = self.ef_buf if s.kind == "ef" else self.plain_bufs[s.dtype]
                s.view = buf[s.offset : s.offset + s.numel]

    def all_finite(self) -> bool:
        """Whether every floating element of the packed buffers is finite.

        A sum is NaN or inf when any element is (one pass, no [n] bool tensor: ~35x cheaper than
        ``isfinite().all()`` on 2 MiB); only a non-finite sum, which an overflow of finite values
        can also give, is settled by the exact check."""
        for b in [self.ef_buf, *self.plain_bufs.values()]:
            if b is None or not b.is_floating_point() or b.numel() == 0:
                continue
            if not bool(torch.isfinite(b.sum())) and not bool(torch.isfinite(b).all()):
                return False
        return True


def check_sparse(root: nn.Module, ddp) -> None:
    """ValueError when the model has sparse gradients (the hook packs dense buffers)."""
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


def _check_user_layers(layers, model_params: Dict[int, str]) -> None:
    """``layers=``: modules of the model, in the order they count. Raises TypeError for an
    element that is not an ``nn.Module`` (a name, a parameter) and ValueError for a module whose
    parameters are none of the model's (another model's module: its parameters would silently
    go to the group of parameters in no layer), or for an empty list (use layers_per_group=None
    for one group)."""
    if len(layers) == 0:
        raise ValueError("layers= is empty: pass the model's layer modules (layers_per_group=None makes one group)")
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"layers[{i}] is a {type(layer).__name__}, not an nn.Module: pass the "
                            f"model's layer modules, e.g. layers=[*model.blocks]")
        ps = list(layer.parameters())
        if ps and not any(id(p) in model_params for p in ps):
            raise ValueError(f"layers[{i}] ({type(layer).__name__}) holds none of the model's "
                             f"parameters: pass modules of the model the hook is registered on")


def build_groups(root: nn.Module, ddp, user_layers: Optional[Sequence[nn.Module]],
                 layers_per_group: Optional[int], min_compress_numel: int,
                 warn: bool = True) -> Tuple[Dict[int, Slot], List[Group]]:
    """The layer groups of ``root`` and every trained parameter's slot (keyed by ``id(param)``).

    Parameters DDP ignores or that do not require grad get no slot. A tied parameter belongs to
    the first layer holding it; parameters in no layer form one extra group, the last. fp32
    tensors with ``ndim >= 2`` and at least ``min_compress_numel`` elements are compressed
    ("ef"), the rest packed per dtype ("plain"). ``warn``: log :func:`warn_if_coarse`'s warning
    when the default layers are too coarse (off for a rebuild of the same model).
    """
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
    layers = user_layers if user_layers is not None else default_layers(root)
    if user_layers is not None:
        _check_user_layers(layers, names)

    owner: Dict[int, int] = {}  # id(param) -> layer position (among layers with params)
    layer_params: List[List[nn.Parameter]] = []
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

    lpg = layers_per_group or max(1, len(layer_list))
    group_members: List[Tuple[List[str], List[nn.Parameter]]] = []
    for start in range(0, len(layer_list), lpg):
        ls = layer_list[start : start + lpg]
        ps = [p for ps_ in layer_params[start : start + lpg] for p in ps_]
        group_members.append(([mod_names.get(id(m), type(m).__name__) for m in ls], ps))
    if rest:
        group_members.append((["<params in no layer>"], rest))
    if warn and user_layers is None and layers_per_group is not None:
        warn_if_coarse(layer_list, layer_params, len(group_members), mod_names)

    slots: Dict[int, Slot] = {}
    groups: List[Group] = []
    for gi, (lnames, ps) in enumerate(group_members):
        g = Group(gi, lnames)
        ps = sorted(ps, key=lambda p: order[id(p)])
        for p in ps:
            compress = (
                p.dtype == torch.float32
                and p.dim() >= 2
                and p.numel() >= min_compress_numel
            )
            if compress:
                s = Slot(names[id(p)], p, g, "ef", p.dtype, g.ef_numel, p.numel(), order[id(p)],
                         owner.get(id(p), -1))
                g.ef_numel += p.numel()
            else:
                off = g.plain_numel.get(p.dtype, 0)
                s = Slot(names[id(p)], p, g, "plain", p.dtype, off, p.numel(), order[id(p)],
                         owner.get(id(p), -1))
                g.plain_numel[p.dtype] = off + p.numel()
            g.slots.append(s)
            slots[id(p)] = s
        groups.append(g)
    return slots, groups
