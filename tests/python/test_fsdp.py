"""xirang.fsdp (issue #15): FSDP2's reduce-scatter with bf16 or int8 (per-segment scales) on the
wire, fp32 sums, error feedback.

``w_*`` functions run on the ranks of an ``mp_pool`` pool (the xirang backend on CPU; FSDP2's
mesh is made from the pool's group); ``test_*`` functions rebuild every rank's batch in this
process and check the ranks' results against references computed here, from an unsharded copy
of the model (fp64 unless said otherwise), never from xirang's own code.
"""
from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mp_pool

pytestmark = pytest.mark.xirang_only

D_IN, D_H, D_OUT, BATCH = 6, 7, 5, 4  # 7 and 5 rows: FSDP pads them at world sizes 2 and 3
BF16_REL = 2.0 ** -8  # one bf16 rounding (relative), with margin for the fp32 sum


class Net(nn.Module):
    """Three linears and a (1,)-shaped scale (pytorch#144045); rows of 7 and 5 need padding."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(D_IN, D_H)
        self.l2 = nn.Linear(D_H, D_H)
        self.l3 = nn.Linear(D_H, D_OUT)
        self.scale = nn.Parameter(torch.full((1,), 1.5))

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x))))) * self.scale


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def batch(seed: int, step: int, rank: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000003 * seed + 7919 * step + rank)
    x = torch.randn(BATCH, D_IN, generator=g)
    y = torch.randn(BATCH, D_OUT, generator=g)
    return x.to(dtype), y.to(dtype)


def loss_of(out, y):
    return ((out - y) ** 2).mean()


def ref_grads(ws: int, step: int, seed: int = 0, dtype=torch.float64, factor=None):
    """(name -> reduced gradient over the ranks' batches, computed unsharded in ``dtype`` and
    reduced in fp64: the sum / ``factor``, default the mean; the ranks' own gradients)."""
    net = make_net(seed).to(dtype)
    per_rank = []
    for r in range(ws):
        net.zero_grad()
        x, y = batch(seed, step, r, dtype)
        loss_of(net(x), y).backward()
        per_rank.append({n: p.grad.detach().clone() for n, p in net.named_parameters()})
    out = {}
    for n in per_rank[0]:
        s = sum(g[n].double() for g in per_rank)
        out[n] = s / ws if factor is None else s / factor
    return out, per_rank


def abs_scale(per_rank, ws, factor=None):
    """name -> sum_r |g_r| / ws (or / factor): what a per-rank bf16 rounding error scales with
    (the reduced value itself can be far smaller where the ranks' gradients cancel)."""
    return {n: sum(g[n].double().abs() for g in per_rank) / (factor or ws) for n in per_rank[0]}


# ====================================================================== rank side
def _rank():
    return dist.get_rank(mp_pool.group())


def _mesh():
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(mp_pool.group(), "cpu")


def _shard(net, mesh, form="nested", mp=None):
    from torch.distributed.fsdp import fully_shard

    kw = {"mesh": mesh}
    if mp is not None:
        kw["mp_policy"] = mp
    if form == "nested":
        fully_shard(net.l1, **kw)
        fully_shard(net.l2, **kw)
    else:  # the list form: l1 and l2 share one FSDP state and parameter group
        fully_shard([net.l1, net.l2], **kw)
    fully_shard(net, **kw)
    return net


def _full_grads(net):
    return {n: p.grad.full_tensor().detach().clone() for n, p in net.named_parameters()}


def _local_grads(net):
    return {n: p.grad.to_local().detach().clone() for n, p in net.named_parameters()}


def _layouts(net, comp):
    """group name -> [(param name, unsharded shape)] in FSDP's reduce-scatter input order."""
    names = {id(p): n for n, p in net.named_parameters()}
    out = {}
    for name, c in comp.comms.items():
        pg = c._param_group
        out[name] = [(names[id(fp.sharded_param)], tuple(fp._orig_size)) for fp in pg.fsdp_params]
    return out


def w_grads(wire, ef, steps=1, form="nested", factor=None, mp_bf16=False, seed=0, residual_dtype=torch.float32):
    import xirang
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    torch.manual_seed(seed)
    net = make_net(seed)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if mp_bf16 else None
    _shard(net, _mesh(), form, mp)
    if factor is not None:
        for m in net.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(factor)
    comp = xirang.fsdp.compress(net, wire=wire, error_feedback=ef, residual_dtype=residual_dtype)
    res = []
    for t in range(steps):
        net.zero_grad(set_to_none=True)
        x, y = batch(seed, t, _rank())
        loss_of(net(x), y).backward()
        res.append(_full_grads(net))
    return {"grads": res, "stats": comp.stats(), "residuals": {k: v.clone() for k, v in comp.residuals.items()},
            "layouts": _layouts(net, comp)}


class Partial(nn.Module):
    """Parameters that only some steps use (FSDP2 then reduce-scatters those with a gradient): a and
    b of one size (another parameter's residual of the same element count must not be applied),
    c of another; loss = sum over the used ones of (p * g_p).sum(), so each gradient is g_p."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(5))
        self.b = nn.Parameter(torch.zeros(5))
        self.c = nn.Parameter(torch.zeros(3, 2))

    def forward(self, used, g):
        return sum((getattr(self, n) * g[n]).sum() for n in used)


PARTIAL_USE = [("a",), ("b",), ("a", "c"), ("b", "c"), ("a", "b", "c"), ("c",)]


def partial_grad(step, rank, name, shape):
    """Rank ``rank``'s gradient of parameter ``name`` at ``step``: values over five decades, so
    that every wire rounds and the residuals carry real mass."""
    g = torch.Generator().manual_seed(104729 * step + 7919 * rank + sum(map(ord, name)))
    return torch.randn(shape, generator=g) * 10.0 ** torch.randint(-3, 2, shape, generator=g)


def _partial_reference(steps, ws, shapes):
    """(name -> fp64 sum over the steps that used it of the true mean gradient over ``ws`` ranks,
    the largest |mean| element)."""
    ref_sum, scale = {}, 0.0
    for t in range(steps):
        for n in PARTIAL_USE[t % len(PARTIAL_USE)]:
            m = sum(partial_grad(t, r, n, shapes[n]).double() for r in range(ws)) / ws
            ref_sum[n] = ref_sum.get(n, 0) + m
            scale = max(scale, float(m.abs().max()))
    return ref_sum, scale


def _hsdp_mesh_over_tcp():
    """A (2 replicate, 2 shard) cpu mesh whose groups move bytes over TCP: on one host the default
    (auto) would run the replicate group's error-feedback op as an exact fp32 average over shared
    memory, and the compressed wire would go untested."""
    from torch.distributed.device_mesh import init_device_mesh

    saved = os.environ.get("XIRANG_TRANSPORT_LOCAL")
    os.environ["XIRANG_TRANSPORT_LOCAL"] = "tcp"
    try:
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    finally:
        if saved is None:
            del os.environ["XIRANG_TRANSPORT_LOCAL"]
        else:
            os.environ["XIRANG_TRANSPORT_LOCAL"] = saved


def w_partial(steps, wire):
    """Partial under one FSDP group, ``wire`` + EF: per parameter the fp64 sum of the applied full
    gradients, whether an unused one stayed without a gradient, the residuals and resets."""
    import xirang
    from torch.distributed.fsdp import fully_shard

    net = Partial()
    fully_shard(net, mesh=_mesh())
    comp = xirang.fsdp.compress(net, wire=wire, error_feedback=True)
    acc, none_ok = _partial_steps(net, steps)
    return {"applied_sum": acc, "none_ok": none_ok, "residuals": {k: v.clone() for k, v in comp.residuals.items()},
            "layouts": _layouts(net, comp), "stats": comp.stats()}


def _partial_steps(net, steps):
    """Runs ``steps`` backwards of Partial (this rank's gradients, PARTIAL_USE's parameters):
    (name -> fp64 sum of the applied full gradients, whether every unused one had none)."""
    acc, none_ok = {}, True
    for t in range(steps):
        used = PARTIAL_USE[t % len(PARTIAL_USE)]
        g = {n: partial_grad(t, _rank(), n, tuple(p.shape)) for n, p in net.named_parameters()}
        net.zero_grad(set_to_none=True)
        net(used, g).backward()
        for n, p in net.named_parameters():
            if n in used:
                acc[n] = acc.get(n, 0) + p.grad.full_tensor().double()
            else:
                none_ok = none_ok and p.grad is None
    return acc, none_ok


def w_partial_hsdp(steps, wire):
    """Partial on a (2 replicate, 2 shard) mesh through compress(replicate_group=...), ``wire`` +
    EF at both levels: per parameter the fp64 sum of the applied gradients, the shard residuals
    and the replicate residuals (this rank's), the mesh coordinate."""
    import xirang
    from torch.distributed.fsdp import fully_shard

    mesh = _hsdp_mesh_over_tcp()
    net = Partial()
    fully_shard(net, mesh=mesh["shard"])
    comp = xirang.fsdp.compress(net, wire=wire, error_feedback=True, replicate_group=mesh["replicate"].get_group())
    acc, _ = _partial_steps(net, steps)
    (name, c), = comp.comms.items()
    return {"applied_sum": acc, "shard": c.residual.clone(), "replicate": c.replicate_residual.clone(),
            "coord": tuple(mesh.get_coordinate()), "layouts": _layouts(net, comp), "name": name,
            "stats": comp.stats()}


def w_telescoping(steps, seed=0, wire="bf16"):
    """``wire`` + EF with fixed parameters and a fresh batch per step: per step's local grad shards
    summed in fp64, and the final residuals."""
    import xirang

    net = make_net(seed)
    _shard(net, _mesh())
    comp = xirang.fsdp.compress(net, wire=wire, error_feedback=True)
    acc = None
    for t in range(steps):
        net.zero_grad(set_to_none=True)
        x, y = batch(seed, t, _rank())
        loss_of(net(x), y).backward()
        g = {n: v.double() for n, v in _local_grads(net).items()}
        acc = g if acc is None else {n: acc[n] + g[n] for n in acc}
    return {"applied_sum": acc, "residuals": {k: v.clone() for k, v in comp.residuals.items()},
            "layouts": _layouts(net, comp)}


def w_fixed_batch(ef, steps, wire="bf16"):
    """The same batch every step (constant gradients): each step's applied full gradients."""
    import xirang

    net = make_net(0)
    _shard(net, _mesh())
    comp = xirang.fsdp.compress(net, wire=wire, error_feedback=ef)
    out = []
    x, y = batch(0, 0, _rank())
    for _ in range(steps):
        net.zero_grad(set_to_none=True)
        loss_of(net(x), y).backward()
        out.append(_full_grads(net))
    return {"grads": out, "stats": comp.stats(), "layouts": _layouts(net, comp)}


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _compressed_net():
    """make_net(0) sharded over the 1-D mesh and compressed (bf16 + error feedback): (net, comp,
    step), step(t) one backward of batch t."""
    import xirang

    net = make_net(0)
    _shard(net, _mesh())
    comp = xirang.fsdp.compress(net)

    def step(t):
        net.zero_grad(set_to_none=True)
        x, y = batch(0, t, _rank())
        loss_of(net(x), y).backward()

    return net, comp, step


def w_state_dict():
    net, comp, step = _compressed_net()

    for t in range(3):
        step(t)
    buf = io.BytesIO()
    torch.save(comp.state_dict(), buf)  # plain tensors: torch.save takes it
    saved = {k: v.clone() for k, v in comp.residuals.items()}
    step(3)
    changed = any(not torch.equal(saved[k], v) for k, v in comp.residuals.items())
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    comp.load_state_dict(sd)
    restored = all(torch.equal(saved[k].view(torch.int32), v.view(torch.int32)) for k, v in comp.residuals.items())

    cap = _Capture()
    lg = logging.getLogger("xirang")
    lg.addHandler(cap)
    try:
        bad_ws = dict(sd, world_size=sd["world_size"] + 1)
        comp.load_state_dict(bad_ws)
        zero_after_ws = all(int(torch.count_nonzero(v)) == 0 for v in comp.residuals.values())
        lines_ws = list(cap.lines)
        cap.lines.clear()
        comp.load_state_dict(sd)
        k0 = next(iter(sd["residuals"]))
        bad_shape = dict(sd, residuals=dict(sd["residuals"], **{k0: torch.zeros(3)}))
        comp.load_state_dict(bad_shape)
        lines_shape = list(cap.lines)
        zero_groups = [k for k, v in comp.residuals.items() if int(torch.count_nonzero(v)) == 0]
        # another wire format's residuals: reset with a warning naming both
        comp.load_state_dict(sd)
        cap.lines.clear()
        comp.load_state_dict(dict(sd, wire="int8"))
        lines_wire = list(cap.lines)
        zero_after_wire = all(int(torch.count_nonzero(v)) == 0 for v in comp.residuals.values())
        # wrong types: TypeError naming what, nothing loaded
        comp.load_state_dict(sd)
        before = {k: v.clone() for k, v in comp.residuals.items()}
        type_errors = []
        for bad in ({"residuals": 5}, dict(sd, world_size="x"), dict(sd, residuals={k0: "abc"}), [1]):
            try:
                comp.load_state_dict(bad)
                type_errors.append(None)
            except TypeError as e:
                type_errors.append(str(e))
        kept = all(torch.equal(comp.residuals[k], v) for k, v in before.items())
    finally:
        lg.removeHandler(cap)
    return {"changed": changed, "restored": restored, "keys": sorted(sd["residuals"]), "ws": sd["world_size"],
            "zero_after_ws": zero_after_ws, "lines_ws": lines_ws, "lines_shape": lines_shape,
            "zero_groups": zero_groups, "n_groups": len(comp.residuals), "lines_wire": lines_wire,
            "zero_after_wire": zero_after_wire, "type_errors": type_errors, "kept": kept}


def w_recompress():
    """compress(); the user sets a factor on l1; compress() again takes it over (l1: sum / 4,
    the rest: the mean), fp32 wire."""
    import xirang

    net = make_net(0)
    _shard(net, _mesh())
    xirang.fsdp.compress(net, wire="fp32")
    net.l1.set_gradient_divide_factor(4.0)
    comp = xirang.fsdp.compress(net, wire="fp32")
    x, y = batch(0, 0, _rank())
    loss_of(net(x), y).backward()
    return {"grads": _full_grads(net), "factors": {k: c.divide_factor for k, c in comp.comms.items()}}


def w_dcp(path):
    """The compressor's state_dict through torch.distributed.checkpoint (save, then load in place)."""
    import torch.distributed.checkpoint as dcp

    net, comp, step = _compressed_net()

    step(0)
    step(1)
    dcp.save({"xirang_fsdp": comp.state_dict()}, checkpoint_id=path)
    saved = {k: v.clone() for k, v in comp.residuals.items()}
    step(2)
    changed = any(not torch.equal(saved[k], v) for k, v in comp.residuals.items())
    sd = {"xirang_fsdp": comp.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    comp.load_state_dict(sd["xirang_fsdp"])
    return {"changed": changed,
            "restored": all(torch.equal(saved[k].view(torch.int32), v.view(torch.int32))
                            for k, v in comp.residuals.items())}


def w_errors():
    """Direct calls of a comm with bad input: each raises a RuntimeError, nothing hangs."""
    import xirang

    net = make_net(0)
    _shard(net, _mesh())
    comp = xirang.fsdp.compress(net)
    c = next(iter(comp.comms.values()))
    g = mp_pool.group()
    ws = dist.get_world_size(g)
    out = {}

    def cap(name, fn):
        r = mp_pool.capture(fn)
        out[name] = str(r) if isinstance(r, mp_pool.ExcInfo) and r.is_runtime_error else repr(r)

    before = c.residual.clone()
    cap("op", lambda: c(torch.zeros(2), torch.zeros(2 * ws), g, dist.ReduceOp.AVG))
    cap("size", lambda: c(torch.zeros(2), torch.zeros(2 * ws + 1), g, dist.ReduceOp.SUM))
    cap("device", lambda: c(torch.zeros(2, device="meta"), torch.zeros(2 * ws, device="meta"), g, dist.ReduceOp.SUM))
    cap("int", lambda: c(torch.zeros(2, dtype=torch.int32), torch.zeros(2 * ws, dtype=torch.int32), g,
                         dist.ReduceOp.SUM))
    out["residual_untouched"] = torch.equal(before, c.residual)
    # the user changes FSDP's factor after compress(): the next backward raises on every rank
    net.l1.set_gradient_divide_factor(4.0)
    x, y = batch(0, 0, _rank())
    cap("factor_changed", lambda: loss_of(net(x), y).backward())
    return out


def w_replicate_group_backend():
    """compress(replicate_group=<a gloo group>) per wire, on a fresh sharded net each: what it
    raised (or None) and whether a xirang comm got installed. The replicate group is this rank
    alone (a replicate dimension of size 1: its broadcast of the shards is valid, which the pool's
    gloo group over the shard ranks would not be)."""
    import xirang
    from xirang.fsdp import XirangReduceScatter, _fsdp_groups

    ws = dist.get_world_size(mp_pool.group())
    rep = [dist.new_group([r], backend="gloo") for r in range(ws)][_rank()]  # every rank makes every group
    out = {}
    for wire in ("bf16", "int8", "fp32"):
        net = make_net(0)
        _shard(net, _mesh())
        r = mp_pool.capture(xirang.fsdp.compress, net, wire=wire, replicate_group=rep)
        installed = [isinstance(pg._reduce_scatter_comm, XirangReduceScatter) for _, _, pg in _fsdp_groups(net)]
        out[wire] = {"error": str(r) if isinstance(r, mp_pool.ExcInfo) else None,
                     "type": r.type_name if isinstance(r, mp_pool.ExcInfo) else None,
                     "installed": installed}
    return out


def w_load_nonfinite():
    """load_state_dict of a checkpoint whose last residual holds a NaN / inf / -inf (also with
    another world size, which would reset): what each raised; whether the live residuals and the
    reset counts stayed as they were; then a finite load still restores."""
    net, comp, step = _compressed_net()

    step(0)
    step(1)
    sd = comp.state_dict()
    sd = dict(sd, residuals={k: v.clone() for k, v in sd["residuals"].items()})
    step(2)  # the live residuals move on: a partial load would show
    before = {k: v.clone() for k, v in comp.residuals.items()}
    resets = [c.resets for c in comp.comms.values()]
    last = list(sd["residuals"])[-1]  # checked last: groups before it would already be loaded
    errors, kept = {}, {}
    for label, value, ws_delta in (("nan", float("nan"), 0), ("inf", float("inf"), 0),
                                   ("-inf", float("-inf"), 0), ("nan+ws", float("nan"), 1)):
        bad = dict(sd["residuals"])
        bad[last] = bad[last].clone()
        bad[last][0] = value
        r = mp_pool.capture(comp.load_state_dict, dict(sd, residuals=bad, world_size=sd["world_size"] + ws_delta))
        errors[label] = f"{r.type_name}: {r.message}" if isinstance(r, mp_pool.ExcInfo) else None
        kept[label] = (all(torch.equal(before[k].view(torch.int32), v.view(torch.int32))
                           for k, v in comp.residuals.items())
                       and [c.resets for c in comp.comms.values()] == resets)
    comp.load_state_dict(sd)
    restored = all(torch.equal(sd["residuals"][comp._key(k)].view(torch.int32), v.view(torch.int32))
                   for k, v in comp.residuals.items())
    return {"errors": errors, "kept": kept, "last": last, "restored": restored, "changed": any(
        not torch.equal(before[k], sd["residuals"][comp._key(k)]) for k in before)}


def w_async():
    """async_op=True returns a Work; after wait() the output equals the synchronous call's."""
    import xirang

    net = make_net(0)
    _shard(net, _mesh())
    comp = xirang.fsdp.compress(net, wire="fp32")
    c = next(iter(comp.comms.values()))
    g = mp_pool.group()
    ws = dist.get_world_size(g)
    inp = torch.arange(3 * ws, dtype=torch.float32) * (_rank() + 1)
    o1, o2 = torch.empty(3), torch.empty(3)
    assert c(o1, inp, g, dist.ReduceOp.SUM) is None
    w = c(o2, inp, g, dist.ReduceOp.SUM, async_op=True)
    w.wait()
    return {"sync": o1, "async": o2, "is_work": isinstance(w, dist.Work)}


def w_hsdp(wire, steps=2):
    """HSDP on a 2 x 2 mesh (replicate x shard) made from the pool's group."""
    import xirang
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    net = make_net(0)
    _shard(net, mesh)
    comp = xirang.fsdp.compress(net, wire=wire)
    res = []
    for t in range(steps):
        net.zero_grad(set_to_none=True)
        x, y = batch(0, t, _rank())
        loss_of(net(x), y).backward()
        res.append(_full_grads(net))
    return {"grads": res, "sizes": (comp.world_size, comp.replicate_size), "stats": comp.stats(),
            "layouts": _layouts(net, comp)}


def w_hsdp_hook(wire, steps=2, ef=True):
    """HSDP with the replicate dimension through xirang: fully_shard on mesh["shard"], compress
    with replicate_group; replica 1's parameters start perturbed (compress broadcasts replica 0's)."""
    import xirang

    mesh = _hsdp_mesh_over_tcp()
    net = make_net(0)
    if mesh.get_coordinate()[0] != 0:
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)
    _shard(net, mesh["shard"])
    comp = xirang.fsdp.compress(net, wire=wire, error_feedback=ef, replicate_group=mesh["replicate"].get_group())
    res = []
    for t in range(steps):
        net.zero_grad(set_to_none=True)
        x, y = batch(0, t, _rank())
        loss_of(net(x), y).backward()
        res.append(_full_grads(net))
    sd = comp.state_dict()
    sd = dict(sd, residuals={k: v.clone() for k, v in sd["residuals"].items()})
    net.zero_grad(set_to_none=True)
    x, y = batch(0, steps, _rank())
    loss_of(net(x), y).backward()  # residuals move on
    comp.load_state_dict(sd)
    live = comp.state_dict()["residuals"]
    restored = all(torch.equal(v, live[k]) for k, v in sd["residuals"].items())
    rep_ops = [{k: r[k] for k in ("op", "algorithm", "numel", "bytes_wire", "bytes_tcp")} for r in xirang.stats(mesh["replicate"].get_group())
               if r["label"].startswith("fsdp replicate")]
    return {"grads": res, "sizes": (comp.world_size, comp.replicate_size), "stats": comp.stats(),
            "keys": sorted(sd["residuals"]), "restored": restored, "layouts": _layouts(net, comp),
            "rep_ops": rep_ops}


def w_nonfinite():
    """A compensated value beyond bf16's range (rounds to inf) or an inf input: that element's
    residual restarts from 0 instead of becoming -inf/NaN; the other elements are unaffected."""
    from xirang.fsdp import XirangReduceScatter

    g = mp_pool.group()
    ws = dist.get_world_size(g)
    c = XirangReduceScatter("direct", None, "bf16", True, torch.float32, None)
    inp = torch.full((4 * ws,), 1.0 + 2.0 ** -10)  # not a bf16 value: rounds to 1, a residual of +2^-10 each
    inp[0] = 3.4e38  # finite in fp32, past the largest bf16 (3.3895e38) by over half a ulp: rounds to +inf
    inp[1] = float("inf")
    out = torch.empty(4)
    c(out, inp, g, dist.ReduceOp.SUM)
    return {"residual": c.residual.clone(), "out": out}


def int8_direct_input(rank, ws, s):
    """Rank ``rank``'s input for :func:`w_int8_direct` (``[ws * s]`` fp32), rebuilt by the test:
    chunk 0's second segment zero on every rank (a zero segment), rank 0's chunk 1 with an inf
    in its first segment, a large value in every chunk's short last segment."""
    from xirang.fsdp import SEGMENT

    g = torch.Generator().manual_seed(4242 + rank)
    x = torch.randn(ws, s, generator=g) * (rank + 1)
    x[0, SEGMENT:2 * SEGMENT] = 0
    x[:, -5] = 40.0 * (rank + 1)
    if rank == 0:
        x[1, 3] = float("inf")
    return x.reshape(-1)


def w_int8_direct(s):
    """One int8 + EF reduce-scatter through a comm called directly, chunks of ``s`` elements."""
    from xirang.fsdp import XirangReduceScatter

    g = mp_pool.group()
    ws = dist.get_world_size(g)
    c = XirangReduceScatter("direct", None, "int8", True, torch.float32, None)
    out = torch.empty(s)
    c(out, int8_direct_input(_rank(), ws, s), g, dist.ReduceOp.SUM)
    return {"out": out, "residual": c.residual.clone(), "bytes_wire": c.bytes_wire_last, "bytes_raw": c.bytes_raw_last}


# ====================================================================== test side
def _assert_close(got, want, rtol, atol, what, scale=None):
    """|got - want| <= atol + rtol * scale elementwise (scale: |want| unless given)."""
    got, want = got.double(), want.double()
    err = (got - want).abs()
    bound = atol + rtol * (want.abs() if scale is None else scale)
    assert bool((err <= bound).all()), f"{what}: max err {float(err.max()):.3e}, worst excess " \
                                       f"{float((err - bound).max()):.3e}"


def _unpad(vec, layout, ws):
    """A residual vector in FSDP's padded [ws, shard] layout -> (name -> param-shaped tensor, pads)."""
    rows = vec.view(ws, -1)
    off = 0
    parts = {}
    pads = []
    for name, shape in layout:
        d0 = shape[0]
        inner = math.prod(shape[1:])
        c = -(-d0 // ws)
        seg = rows[:, off:off + c * inner].reshape(ws * c, *shape[1:])  # owner j holds rows j*c..(j+1)*c
        parts[name] = seg[:d0]
        pads.append(seg[d0:].reshape(-1))
        off += c * inner
    assert off == rows.shape[1], "layout does not cover the residual"
    return parts, torch.cat(pads) if pads else torch.zeros(0)


def _pad(grads, layout, ws):
    """The inverse of :func:`_unpad`: name -> param-shaped tensor -> FSDP's padded [ws * shard]
    layout (fp64, zeros in the padding)."""
    rows = [[] for _ in range(ws)]
    for name, shape in layout:
        d0, inner = shape[0], math.prod(shape[1:])
        c = -(-d0 // ws)
        full = torch.zeros(ws * c, inner, dtype=torch.float64)
        full[:d0] = grads[name].double().reshape(d0, inner)
        for j in range(ws):
            rows[j].append(full[j * c:(j + 1) * c].reshape(-1))
    return torch.cat([torch.cat(r) for r in rows])


def _seg_scales(rows, seg):
    """[ws, s] fp64 chunks -> per element its segment's absmax (finite values) / 127, [ws, s]:
    segments of ``seg`` elements from each chunk's start (the last one short)."""
    ws, s = rows.shape
    out = torch.empty_like(rows)
    for a in range(0, s, seg):
        blk = rows[:, a:a + seg]
        fin = torch.where(torch.isfinite(blk), blk.abs(), torch.zeros_like(blk))
        out[:, a:a + seg] = (fin.amax(dim=1, keepdim=True) / 127).expand_as(blk)
    return out


def _int8_bound(per_rank, layout, ws, seg):
    """name -> the int8 bound of the mean's error at a step whose residual is 0:
    sum over ranks of (the element's segment scale / 2), / ws."""
    acc = None
    for g in per_rank:
        sc = _seg_scales(_pad(g, layout, ws).view(ws, -1), seg).reshape(-1) / 2
        acc = sc if acc is None else acc + sc
    parts, _ = _unpad(acc / ws, layout, ws)
    return parts


@pytest.mark.parametrize("ws", [2, 3])
def test_fp32_wire_equals_unsharded(pool, ws):
    res = pool.run(w_grads, "fp32", True, steps=2)
    for t in range(2):
        want, _ = ref_grads(ws, t)
        for r, out in enumerate(res):
            for n, g in out["grads"][t].items():
                _assert_close(g, want[n], 1e-5, 1e-6, f"step {t} rank {r} {n}")
    st = res[0]["stats"]["totals"]
    n_elems = sum(math.prod(s) for lay in res[0]["layouts"].values() for _, s in lay)
    assert st["residual_bytes"] == 0 and st["bytes_wire_per_step"] == st["bytes_raw_per_step"]
    assert st["bytes_wire_per_step"] >= 4 * n_elems * (ws - 1) / ws  # padded: at least the ring's bytes


@pytest.mark.parametrize("ws", [2])
@pytest.mark.parametrize("mp_bf16", [False, True], ids=["fp32", "bf16-mp"])
def test_list_form_divide_factor(pool, ws, mp_bf16):
    f = 5.0
    res = pool.run(w_grads, "bf16", True, form="list", factor=f, mp_bf16=mp_bf16)
    assert "l1+l2" in res[0]["layouts"], res[0]["layouts"].keys()
    if mp_bf16:  # reference: the unsharded model run in bf16, the ranks' bf16 grads summed in fp64, / f
        want, per_rank = ref_grads(ws, 0, dtype=torch.bfloat16, factor=f)
        rtol = 4 * BF16_REL  # bf16 forward/backward on both sides, and our one rounding of the output
    else:
        want, per_rank = ref_grads(ws, 0, factor=f)
        rtol = BF16_REL
    scale = abs_scale(per_rank, ws, f)
    for r, out in enumerate(res):
        for n, g in out["grads"][0].items():
            _assert_close(g, want[n], rtol, 1e-4 if mp_bf16 else 1e-6, f"rank {r} {n} (sum/{f})", scale[n])
        mean, _ = ref_grads(ws, 0)
        g = out["grads"][0]["l3.weight"].double()
        assert (g - mean["l3.weight"] * ws / f).abs().max() < (g - mean["l3.weight"]).abs().max(), "not sum/f"


@pytest.mark.parametrize("ws", [1])
@pytest.mark.parametrize("factor", [None, 2.0])
def test_world_size_1(pool, ws, factor):
    res = pool.run(w_grads, "bf16", True, steps=2, factor=factor)
    for t in range(2):
        want, _ = ref_grads(1, t, factor=factor)
        for n, g in res[0]["grads"][t].items():
            _assert_close(g, want[n], 1e-5, 1e-7, f"ws=1 step {t} {n}")
    assert res[0]["grads"][0]["scale"].shape == (1,)
    assert res[0]["stats"]["totals"]["residual_bytes"] == 0  # FSDP skips the comm at world size 1


@pytest.mark.parametrize("ws", [2, 3])
def test_padding_never_leaks(pool, ws):
    steps = 4
    res = pool.run(w_grads, "bf16", True, steps=steps)
    for r, out in enumerate(res):
        assert out["residuals"], "no residual kept"
        for name, vec in out["residuals"].items():
            lay = out["layouts"][name]
            assert any(s[0] % ws for _, s in lay) or name == "<root>", f"{name}: no padded parameter"
            parts, pads = _unpad(vec, lay, ws)
            assert pads.numel() > 0 or not any(s[0] % ws for _, s in lay)
            assert int(torch.count_nonzero(pads)) == 0, f"rank {r} {name}: residual pad region not zero: {pads}"
            assert any(int(torch.count_nonzero(p)) for p in parts.values()), f"rank {r} {name}: residual all zero"
        prev = None
        for t in range(steps):
            want, per_rank = ref_grads(ws, t)
            scale = abs_scale(per_rank, ws)
            for n, g in out["grads"][t].items():
                assert g.shape == want[n].shape
                # applied - mean = mean_r (e_r[t-1] - e_r[t]): this step's rounding and the last
                # step's residual fed back, each at most 2^-8 of its compensated value
                both = scale[n] + (prev[n] if prev is not None else 0)
                _assert_close(g, want[n], 1.05 * BF16_REL, 1e-6, f"rank {r} step {t} {n}", both)
            prev = scale


@pytest.mark.parametrize("ws", [3])
@pytest.mark.parametrize("wire", ["bf16", "int8"])
def test_error_feedback_telescopes(pool, ws, wire):
    """Over T steps (``wire`` + error feedback): sum_t m_t - sum_t a_t == mean_r e_r (the residuals now), where m_t is the true
    mean gradient (fp64, unsharded), a_t the applied gradient (what the owners decoded and
    averaged), e_r rank r's residual. Both sides in fp64; the tolerance, 1e-5 of the largest
    |m_t| element over the steps, leaves room for the fp32 arithmetic of T steps (gradients
    computed and summed in fp32: ~2^-24 each) but not for one lost or double-counted bf16
    rounding (~2^-9 of a gradient; an int8 rounding is up to half a segment's scale, larger)."""
    T = 100
    res = pool.run(w_telescoping, T, wire=wire, timeout=120)
    ref_sum, scale = {}, 0.0
    for t in range(T):
        m, _ = ref_grads(ws, t)
        for n, v in m.items():
            ref_sum[n] = ref_sum.get(n, 0) + v
            scale = max(scale, float(v.abs().max()))
    applied = {n: torch.cat([res[r]["applied_sum"][n] for r in range(ws)]) for n in ref_sum}
    resid = {}
    for r in range(ws):
        for name, vec in res[r]["residuals"].items():
            parts, pads = _unpad(vec.double(), res[r]["layouts"][name], ws)
            assert int(torch.count_nonzero(pads)) == 0
            for n, p in parts.items():
                resid[n] = resid.get(n, 0) + p / ws
    assert set(resid) == set(ref_sum)
    worst = 0.0
    for n in ref_sum:
        lhs = ref_sum[n] - applied[n]
        err = float((lhs - resid[n]).abs().max())
        worst = max(worst, err)
        assert err <= 1e-5 * scale, f"{n}: |sum m - sum a - mean e| = {err:.3e} > 1e-5 x {scale:.3e}"
    # the check discriminates: the residual term itself is far above the tolerance
    assert max(float(v.abs().max()) for v in resid.values()) > 10 * 1e-5 * scale, "residuals too small to tell"


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("wire", ["bf16", "int8"])
def test_backwards_that_use_some_parameters_keep_each_ones_residual(pool, ws, wire):
    """FSDP2 reduce-scatters only the parameters with a gradient, so the input's layout changes
    from backward to backward, here with two parameters of one size (a, b): each parameter's
    residual goes with it, none is applied to another one's gradient, nothing is reset. Checked by
    the telescoping identity per parameter (sum of its true mean gradients over the steps that used
    it - sum of what was applied = the mean of its residual parts now, fp64, 1e-5 of the largest
    gradient), which a residual applied to the wrong parameter breaks by far more."""
    T = 24
    res = pool.run(w_partial, T, wire, timeout=120)
    shapes = {"a": (5,), "b": (5,), "c": (3, 2)}
    ref_sum, scale = _partial_reference(T, ws, shapes)
    resid = {}
    for r in range(ws):
        assert res[r]["none_ok"], f"rank {r}: an unused parameter got a gradient"
        for name, vec in res[r]["residuals"].items():
            parts, pads = _unpad(vec.double(), res[r]["layouts"][name], ws)
            assert int(torch.count_nonzero(pads)) == 0
            for n, p in parts.items():
                resid[n] = resid.get(n, 0) + p / ws
        assert [gr["residual_resets"] for gr in res[r]["stats"]["groups"]] == [0], res[r]["stats"]["groups"]
    for n in ref_sum:
        err = float((ref_sum[n] - res[0]["applied_sum"][n] - resid[n]).abs().max())
        assert err <= 1e-5 * scale, f"{wire} ws={ws} {n}: |sum m - sum a - mean e| = {err:.3e} > 1e-5 x {scale:.3e}"
        for r in range(1, ws):  # every rank applied the same
            assert torch.equal(res[r]["applied_sum"][n], res[0]["applied_sum"][n])
    assert max(float(v.abs().max()) for v in resid.values()) > 10 * 1e-5 * scale, "residuals too small to tell"


@pytest.mark.parametrize("ws", [4])
@pytest.mark.parametrize("wire", ["bf16", "int8"])
def test_hsdp_backwards_that_use_some_parameters_keep_each_ones_residuals(pool, ws, wire):
    """The same on a 2 x 2 HSDP mesh with the replicate all-reduce through xirang: both levels'
    residuals go with their parameters. Two-level telescoping per parameter (R replicas of N
    shards): sum_t m_t - sum_t a_t = (1 / RN) sum_r e_r + sum_replicas f, e_r rank r's shard
    residual (all owners' chunks), f a replica's replicate residuals (its owners' chunks side by
    side, in the mean's units), fp64, 1e-5 of the largest gradient."""
    T, R, N = 18, 2, 2
    res = pool.run(w_partial_hsdp, T, wire, timeout=120)
    shapes = {"a": (5,), "b": (5,), "c": (3, 2)}
    ref_sum, scale = _partial_reference(T, ws, shapes)
    lay = res[0]["layouts"][res[0]["name"]]
    resid = {n: 0 for n in shapes}
    for r in range(ws):
        parts, pads = _unpad(res[r]["shard"].double(), lay, N)
        assert int(torch.count_nonzero(pads)) == 0
        for n, v in parts.items():
            resid[n] = resid[n] + v / (R * N)
        assert [gr["residual_resets"] for gr in res[r]["stats"]["groups"]] == [0]
    for rep in range(R):
        owners = sorted((res[r]["coord"][1], r) for r in range(ws) if res[r]["coord"][0] == rep)
        parts, _ = _unpad(torch.cat([res[r]["replicate"].double() for _, r in owners]), lay, N)
        for n, v in parts.items():  # xirang's error-feedback allreduce keeps its residuals in the
            resid[n] = resid[n] + v  # mean's units (it scales its input by 1 / R first)
    for n in ref_sum:
        err = float((ref_sum[n] - res[0]["applied_sum"][n] - resid[n]).abs().max())
        assert err <= 1e-5 * scale, f"{wire} {n}: |sum m - sum a - residuals| = {err:.3e} > 1e-5 x {scale:.3e}"
        for r in range(1, ws):
            assert torch.equal(res[r]["applied_sum"][n], res[0]["applied_sum"][n])
    assert max(float(v.abs().max()) for v in resid.values()) > 10 * 1e-5 * scale, "residuals too small to tell"


@pytest.mark.parametrize("ws", [2])
def test_bf16_error_feedback_on_off(pool, ws):
    """Constant gradients (fixed parameters and batch) for T steps: without error feedback every
    step applies the same rounded mean, so the error of the running sum grows as T; with it the
    error stays bounded by the residual (half a bf16 ulp of the gradient)."""
    T = 16
    on = pool.run(w_fixed_batch, True, T)
    off = pool.run(w_fixed_batch, False, T)
    m, per_rank = ref_grads(ws, 0)
    scale = abs_scale(per_rank, ws)
    assert off[0]["stats"]["totals"]["residual_bytes"] == 0
    n_pad = on[0]["stats"]["totals"]["residual_bytes"] // 4
    assert n_pad >= sum(v.numel() for v in m.values())  # fp32 residual = padded unsharded gradient
    assert on[0]["stats"]["totals"]["bytes_wire_per_step"] * 2 == on[0]["stats"]["totals"]["bytes_raw_per_step"]
    for r in range(ws):
        for n in m:
            _assert_close(on[r]["grads"][0][n], m[n], BF16_REL, 1e-6, f"EF on, step 0, {n}", scale[n])
            _assert_close(off[r]["grads"][0][n], m[n], BF16_REL, 1e-6, f"EF off, step 0, {n}", scale[n])
            assert torch.equal(on[r]["grads"][0][n], off[r]["grads"][0][n])  # residual starts at 0
            for t in range(1, T):
                assert torch.equal(off[r]["grads"][t][n], off[r]["grads"][0][n])
    err_on = err_off = 0.0
    for n in m:
        s_on = sum(g[n].double() for g in on[0]["grads"])
        s_off = sum(g[n].double() for g in off[0]["grads"])
        e_on = float(((s_on - T * m[n]).abs() / (scale[n] + 1e-6)).max())
        e_off = float(((s_off - T * m[n]).abs() / (scale[n] + 1e-6)).max())
        assert e_on <= 2 * BF16_REL, f"{n}: EF on, running-sum error {e_on:.3e} not bounded"
        err_on, err_off = max(err_on, e_on), max(err_off, e_off)
    assert err_off > 4 * err_on, (err_on, err_off)


@pytest.mark.parametrize("ws", [2])
def test_state_dict_round_trip_and_reset(pool, ws):
    res = pool.run(w_state_dict)
    for r, out in enumerate(res):
        assert out["changed"] and out["restored"], out
        assert out["ws"] == ws and all(k.startswith(f"rank{r}.") for k in out["keys"]), out["keys"]
        assert out["zero_after_ws"]
        assert any("reset" in ln and f"world size {ws + 1}" in ln for ln in out["lines_ws"]), out["lines_ws"]
        assert len(out["lines_shape"]) == 1 and "shape (3,)" in out["lines_shape"][0], out["lines_shape"]
        assert len(out["zero_groups"]) == 1 and out["n_groups"] == 3
        assert out["zero_after_wire"] and len(out["lines_wire"]) == 3, out["lines_wire"]
        assert all("saved with wire='int8', this run has wire='bf16'" in ln for ln in out["lines_wire"])
        e = out["type_errors"]
        assert e[0] and "residuals of type int" in e[0], e
        assert e[1] and "world_size 'x'" in e[1], e
        assert e[2] and "residuals of type dict holding str" in e[2], e
        assert e[3] and "got list" in e[3], e
        assert out["kept"]


@pytest.mark.parametrize("ws", [2])
def test_state_dict_through_dcp(pool, ws, tmp_path):
    res = pool.run(w_dcp, str(tmp_path / "ckpt"))
    for out in res:
        assert out["changed"] and out["restored"], out


@pytest.mark.parametrize("ws", [2])
def test_bf16_residual(pool, ws):
    """residual_dtype=bf16: half the residual bytes; gradients within the fp32 residual's bound
    (the residual's own rounding adds at most 2^-8 of a residual, 2^-16 of a gradient)."""
    steps = 3
    res = pool.run(w_grads, "bf16", True, steps=steps, residual_dtype=torch.bfloat16)
    n = sum(math.prod(s) for _, s in sum(res[0]["layouts"].values(), []))
    assert res[0]["stats"]["totals"]["residual_bytes"] >= 2 * n
    assert res[0]["stats"]["totals"]["residual_bytes"] < 4 * n  # half of fp32's (padding aside)
    for r, out in enumerate(res):
        for name, vec in out["residuals"].items():
            assert vec.dtype == torch.bfloat16
            parts, pads = _unpad(vec, out["layouts"][name], ws)
            assert int(torch.count_nonzero(pads)) == 0
        prev = None
        for t in range(steps):
            want, per_rank = ref_grads(ws, t)
            scale = abs_scale(per_rank, ws)
            for nm, g in out["grads"][t].items():
                both = scale[nm] + (prev[nm] if prev is not None else 0)
                _assert_close(g, want[nm], 1.1 * BF16_REL, 1e-6, f"rank {r} step {t} {nm}", both)
            prev = scale


@pytest.mark.parametrize("ws", [2])
def test_errors_are_clear(pool, ws):
    res = pool.run(w_errors)
    for r, out in enumerate(res):
        assert f"rank {r}" in out["op"] and "op must be SUM" in out["op"], out["op"]
        assert "expected world size" in out["size"], out["size"]
        assert "meta" in out["device"] and "does not serve" in out["device"], out["device"]
        assert "floating-point" in out["int"], out["int"]
        assert out["residual_untouched"]
        assert "was changed after xirang.fsdp.compress()" in out["factor_changed"], out["factor_changed"]


@pytest.mark.parametrize("ws", [2])
def test_replicate_group_not_served_by_xirang_fails_at_compress(pool, ws):
    """bf16 and int8 run xirang's compressed all-reduce in the replicate hook: a gloo
    replicate_group is a TypeError at compress() naming the argument, the wire and the backend
    (int8 used to be accepted and to fail in the middle of the first backward), and nothing is
    installed; fp32 (a plain AVG all-reduce) takes any backend."""
    res = pool.run(w_replicate_group_backend)
    for r, out in enumerate(res):
        for wire in ("int8", "bf16"):
            e = out[wire]
            assert e["type"] == "TypeError", (r, wire, e)
            assert "xirang.fsdp.compress: replicate_group must be served by the xirang backend" in e["error"], e
            assert f"wire={wire!r}" in e["error"] and "got 'gloo'" in e["error"], e
            assert e["installed"] == [False, False, False], (r, wire, e)
        assert out["fp32"]["error"] is None and out["fp32"]["installed"] == [True, True, True], out["fp32"]


@pytest.mark.parametrize("ws", [2])
def test_load_state_dict_refuses_nonfinite_residuals(pool, ws):
    """A NaN or infinite residual in a checkpoint is a ValueError naming its key, raised before
    anything changes (no group loaded or reset, even when the world size differs); a finite
    checkpoint then loads bitwise."""
    res = pool.run(w_load_nonfinite)
    for r, out in enumerate(res):
        assert out["changed"], "the live residuals must differ from the checkpoint's for the test to see a load"
        for label, e in out["errors"].items():
            assert e is not None and e.startswith("ValueError: "), (r, label, e)
            assert f"residual {out['last']!r} holds non-finite values" in e, (r, label, e)
            assert out["kept"][label], (r, label)
        assert out["restored"]


@pytest.mark.parametrize("ws", [2])
def test_recompress_takes_a_new_factor(pool, ws):
    res = pool.run(w_recompress)
    mean, _ = ref_grads(ws, 0)
    summed, _ = ref_grads(ws, 0, factor=4.0)
    for r, out in enumerate(res):
        assert out["factors"] == {"l1": 4.0, "l2": None, "<root>": None}, out["factors"]
        for n, g in out["grads"].items():
            want = summed[n] if n.startswith("l1.") else mean[n]
            _assert_close(g, want, 1e-5, 1e-7, f"rank {r} {n}")


@pytest.mark.parametrize("ws", [2])
def test_async_op_returns_work(pool, ws):
    res = pool.run(w_async)
    for r, out in enumerate(res):
        assert out["is_work"]
        want = torch.arange(3 * ws, dtype=torch.float64).view(ws, 3)[r] * sum(range(1, ws + 1)) / ws
        assert torch.equal(out["sync"], out["async"])
        _assert_close(out["sync"], want, 1e-7, 0, f"rank {r}")


def _replicate_int8_bound(per_rank, rs_bound):
    """The int8 replicate all-reduce's share (2 replicas, error feedback, direct form) of a step's
    error, as a bound on the step's new residuals summed over the replicas (in mean units): each
    sender rounds s = x_k / 2 + r (half a step of its segment's absmax / 127) and each owner
    rounds the fp32 sum (half a step of its absmax / 127), so their sum is at most
    2 x A / 254 with A the largest |x_k| (replica k's shard mean, ranks 2k and 2k + 1, plus the
    reduce-scatter's error); 5% for the residual inside s. A step's error is this step's new
    residuals plus the previous step's (the invariant telescopes)."""
    a = max(float(((per_rank[2 * k][n].double() + per_rank[2 * k + 1][n].double()) / 2).abs().max())
            for k in range(2) for n in per_rank[0])
    a += max(float(b.max()) for b in rs_bound.values())
    return 1.05 * 2 * a / 254


def _check_hsdp_grads(res, ws, steps, wire, bf16_rel, replicate_int8=False):
    """Every rank's gradients of a (2, 2) HSDP run against the 4-rank mean, per step: fp32 to
    rounding; int8 within the shard layout's scale bound (_int8_bound divides by its ws, the
    shard size 2: / 2 more for 4 ranks) plus the previous step's (and with `replicate_int8` the
    replicate all-reduce's bound, :func:`_replicate_int8_bound`, this step's and the previous
    one's); bf16 within `bf16_rel` of the scale plus the previous step's (the residual carried
    over). Returns the last step's mean."""
    from xirang.fsdp import SEGMENT

    prev = None
    rep_prev = rep = 0.0
    for t in range(steps):
        want, per_rank = ref_grads(ws, t)
        scale = abs_scale(per_rank, ws)
        if wire == "int8":
            bound = {}
            for lay in res[0]["layouts"].values():
                bound.update({n: b / 2 for n, b in _int8_bound(per_rank, lay, 2, SEGMENT).items()})
            if replicate_int8:
                rep_prev, rep = rep, _replicate_int8_bound(
                    per_rank, {n: b + (prev[n] if prev is not None else 0) for n, b in bound.items()})
        for r, out in enumerate(res):
            for n, g in out["grads"][t].items():
                if wire == "fp32":
                    _assert_close(g, want[n], 1e-5, 1e-6, f"step {t} rank {r} {n}")
                elif wire == "int8":
                    b = (1.01 * (bound[n] + (prev[n] if prev is not None else 0)) + rep + rep_prev
                         + 1e-6 * scale[n] + 1e-8)
                    err = (g.double() - want[n]).abs()
                    assert bool((err <= b).all()), f"step {t} rank {r} {n}: max err {float(err.max()):.3e}"
                else:
                    both = scale[n] + (prev[n] if prev is not None else 0)
                    _assert_close(g, want[n], bf16_rel, 1e-6, f"step {t} rank {r} {n}", both)
        prev = bound if wire == "int8" else scale
    return want


@pytest.mark.parametrize("ws", [4])
@pytest.mark.parametrize("wire", ["bf16", "int8"])
def test_hsdp_2x2(pool, ws, wire):
    """HSDP: reduce-scatter over the shard dimension through xirang (divided by shard x replicate),
    FSDP's all-reduce over the replicas sums: the mean over all 4 ranks' batches (int8: within
    the scale bound of the 4 ranks, each rank's segments over its shard-dimension layout)."""
    steps = 2
    res = pool.run(w_hsdp, wire, steps, timeout=90)
    assert res[0]["sizes"] == (2, 2)
    want = _check_hsdp_grads(res, ws, steps, wire, bf16_rel=1.05 * BF16_REL)
    rb = res[0]["stats"]["totals"]["residual_bytes"]
    assert rb == 0 if wire == "fp32" else rb >= 4 * sum(v.numel() for v in want.values())


@pytest.mark.parametrize("ws", [4])
@pytest.mark.parametrize("wire,ef", [("fp32", True), ("bf16", True), ("bf16", False), ("int8", True),
                                     ("int8", False)],
                         ids=["fp32", "bf16", "bf16-noef", "int8", "int8-noef"])
def test_hsdp_replicate_hook_2x2(pool, ws, wire, ef):
    """HSDP through compress(replicate_group=...): the shard reduce-scatter divides by 2, the
    all-reduce hook averages over the 2 replicas (error feedback in the wire's format for bf16
    and int8; int8 without it: the same operation with a zero residual): the mean over all 4
    ranks' batches, from replica 0's parameters."""
    steps = 2
    res = pool.run(w_hsdp_hook, wire, steps, ef=ef, timeout=90)
    assert res[0]["sizes"] == (2, 2)
    if wire == "int8" and not ef:  # no residual carried: each step's error is that step's own
        from xirang.fsdp import SEGMENT

        for t in range(steps):
            want, per_rank = ref_grads(ws, t)
            bound = {}
            for lay in res[0]["layouts"].values():
                bound.update({n: b / 2 for n, b in _int8_bound(per_rank, lay, 2, SEGMENT).items()})
            rep = _replicate_int8_bound(per_rank, bound)
            scale = abs_scale(per_rank, ws)
            for r, out in enumerate(res):
                for n, g in out["grads"][t].items():
                    err = (g.double() - want[n]).abs()
                    assert bool((err <= 1.01 * bound[n] + rep + 1e-6 * scale[n] + 1e-8).all()), \
                        f"step {t} rank {r} {n}: max err {float(err.max()):.3e}"
    else:
        _check_hsdp_grads(res, ws, steps, wire, bf16_rel=2.1 * BF16_REL, replicate_int8=wire == "int8")
    tot = res[0]["stats"]["totals"]
    raw, wire_b = tot["replicate_bytes_raw_per_step"], tot["replicate_bytes_wire_per_step"]
    if wire == "fp32":
        assert wire_b == raw > 0
    else:  # bf16: half the fp32 bytes; int8: a quarter plus one fp32 scale per 1024 elements
        per_elem = 2.0 if wire == "bf16" else 1.0 + 4.0 / 1024
        assert raw > 0 and abs(wire_b / raw - per_elem / 4) < 2e-3, (wire_b, raw)
    if wire == "int8" or (wire == "bf16" and ef):
        # What the replicate group's op sent over TCP, from its records: 2 ranks, so each rank
        # sends the other's chunk to its owner and its own result to the other rank, i.e. both
        # chunks' blocks (bf16: 2 bytes an element; int8: codes + one fp32 scale per 1024).
        for r, out in enumerate(res):
            ops = out["rep_ops"]
            assert len(ops) == 3 * (steps + 1), ops  # 3 parameter groups, steps + the resumed one
            for o in ops:
                assert o["op"] == f"allreduce_{wire}_ef" and o["bytes_tcp"] == o["bytes_wire"], o
                halves = (o["numel"] - o["numel"] // 2, o["numel"] // 2)
                want = (2 * o["numel"] if wire == "bf16"
                        else sum(c + 4 * -(-c // 1024) for c in halves))
                assert o["bytes_wire"] == want, (r, o, want)
        for r, out in enumerate(res):
            has = any(k.endswith(".replicate") and k.startswith(f"rank{r}.") for k in out["keys"])
            assert has == ef and out["restored"], out["keys"]
        assert (tot["residual_bytes"] > 0) == ef


@pytest.mark.parametrize("ws", [2])
def test_nonfinite_does_not_poison_the_residual(pool, ws):
    res = pool.run(w_nonfinite)
    for r, out in enumerate(res):
        e = out["residual"]
        assert e[0] == 0 and e[1] == 0, e[:2]
        assert torch.equal(e[2:], torch.full((4 * ws - 2,), 2.0 ** -10)), e
        if r == 0:  # rank 0 owns chunk 0: the non-finite elements reach the output as inf
            assert math.isinf(float(out["out"][0])) and math.isinf(float(out["out"][1]))
        assert torch.equal(out["out"][2:], torch.ones(2)), out["out"]


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("rdt", [torch.float32, torch.bfloat16], ids=["fp32-res", "bf16-res"])
def test_int8_gradients_within_the_scale_bound(pool, ws, rdt):
    """int8 + EF, two steps: at step 0 (residual 0) every element of the applied mean within
    B_0 = sum_r scale_r / 2 / ws of the fp64 mean, the scales recomputed here from the ranks' fp64
    gradients in FSDP's padded layout; at step 1 within B_0 + B_1 (the residual fed back, the
    new rounding; 1% for the residual's share of the scale and a bf16 residual's rounding);
    wire bytes = (ws-1) x (s + 4 ceil(s / SEGMENT)) per group; FSDP's padding stays 0 in the residual."""
    from xirang.fsdp import SEGMENT

    res = pool.run(w_grads, "int8", True, steps=2, residual_dtype=rdt)
    st = res[0]["stats"]
    for grp in st["groups"]:
        lay = res[0]["layouts"][grp["name"]]
        s = sum(-(-sh[0] // ws) * math.prod(sh[1:]) for _, sh in lay)
        assert grp["bytes_wire_last"] == (ws - 1) * (s + 4 * (-(-s // SEGMENT))), grp
        assert grp["bytes_raw_last"] == (ws - 1) * s * 4, grp
        assert grp["residual_bytes"] == (4 if rdt == torch.float32 else 2) * ws * s, grp
    for r, out in enumerate(res):
        for name, vec in out["residuals"].items():
            assert vec.dtype == rdt
            parts, pads = _unpad(vec, out["layouts"][name], ws)
            assert int(torch.count_nonzero(pads)) == 0, f"rank {r} {name}: padding in the residual"
    worst, prev = 0.0, None
    for t in range(2):
        want, per_rank = ref_grads(ws, t)
        scale = abs_scale(per_rank, ws)
        bound = {}
        for lay in res[0]["layouts"].values():
            bound.update(_int8_bound(per_rank, lay, ws, SEGMENT))
        for r, out in enumerate(res):
            for n, g in out["grads"][t].items():
                err = (g.double() - want[n]).abs()
                b = (1.001 if prev is None else 1.01) * (bound[n] + (0 if prev is None else prev[n]))
                b = b + 1e-6 * scale[n] + 1e-8  # + the fp32 gradients' own error
                assert bool((err <= b).all()), \
                    f"step {t} rank {r} {n}: max err {float(err.max()):.3e}, bound {float(b.max()):.3e}"
                worst = max(worst, float((err / b).max()))
        prev = bound
    assert worst > 0.05, f"errors far below the int8 bound ({worst:.3f}): is it quantizing?"


@pytest.mark.parametrize("ws", [2])
@pytest.mark.parametrize("mp_bf16", [False, True], ids=["fp32", "bf16-mp"])
def test_int8_list_form_divide_factor(pool, ws, mp_bf16):
    """int8 with the list form and a divide factor f: sum / f within sum_r scale_r / 2 / f; with
    a bf16 reduce dtype the output is rounded once more (and forward/backward run in bf16 on both
    sides: the reference is the unsharded model in bf16)."""
    from xirang.fsdp import SEGMENT

    f = 5.0
    res = pool.run(w_grads, "int8", True, form="list", factor=f, mp_bf16=mp_bf16)
    want, per_rank = ref_grads(ws, 0, dtype=torch.bfloat16 if mp_bf16 else torch.float64, factor=f)
    scale = abs_scale(per_rank, ws, f)
    bound = {}
    for lay in res[0]["layouts"].values():
        bound.update({n: b * ws / f for n, b in _int8_bound(per_rank, lay, ws, SEGMENT).items()})
    rtol = 4 * BF16_REL if mp_bf16 else 1e-6
    for r, out in enumerate(res):
        for n, g in out["grads"][0].items():
            assert g.dtype == torch.float32
            err = (g.double() - want[n]).abs()
            b = 1.001 * bound[n] + rtol * (scale[n] + bound[n]) + 1e-6
            assert bool((err <= b).all()), f"rank {r} {n}: max err {float(err.max()):.3e}"

@pytest.mark.parametrize("ws", [2])
@pytest.mark.parametrize("s", [2 * 1024 + 300, 37])
def test_int8_segments_short_zero_nonfinite(pool, ws, s):
    """A direct int8 + EF reduce-scatter, chunks of s elements (3 segments, the last short; one
    short segment): the output is mean_r(x_r - e_r) (what the sender's residual says the owner
    decoded), within the scale bound of mean_r x_r; a zero segment is exactly 0 with zero
    residual; an inf reaches the owner as NaN, its residual is 0, and its segment's other
    elements keep the finite scale."""
    from xirang.fsdp import SEGMENT

    res = pool.run(w_int8_direct, s)
    xs = [int8_direct_input(r, ws, s).double() for r in range(ws)]
    scales = [_seg_scales(x.view(ws, s), SEGMENT) for x in xs]
    nseg = -(-s // SEGMENT)
    for r, out in enumerate(res):
        assert out["bytes_wire"] == (ws - 1) * (s + 4 * nseg) and out["bytes_raw"] == (ws - 1) * s * 4, out
        e = out["residual"].double().view(ws, s)
        assert bool((e.abs() <= scales[r] / 2 * (1 + 1e-6)).all()), "residual above half a scale"
        if r == 0:
            assert e[1, 3] == 0, "residual of the inf element"
        if s > SEGMENT:
            assert int(torch.count_nonzero(e[0, SEGMENT:2 * SEGMENT])) == 0
        got = out["out"].double()
        mean = sum(x.view(ws, s)[r] for x in xs) / ws
        bound = sum(sc[r] for sc in scales) / 2 / ws
        fin = torch.isfinite(mean)
        if r == 1:
            assert bool(torch.isnan(got[3])) and int((~fin).sum()) == 1 and not bool(fin[3])
            assert float(scales[0][1, 0]) < 1.0, "the inf entered the reference scale"
        assert bool(torch.isfinite(got[fin]).all())
        err = (got - mean)[fin].abs()
        assert bool((err <= bound[fin] * 1.001 + 1e-7).all()), f"rank {r}: max err {float(err.max()):.3e}"
        assert float(err.max()) > 0.05 * float(bound.max()), "no quantization error at all"
        decoded = sum(xs[q].view(ws, s)[r] - res[q]["residual"].double().view(ws, s)[r] for q in range(ws)) / ws
        assert bool(((got - decoded)[fin].abs() <= 1e-6 * (decoded[fin].abs() + 1)).all()), "owner != x - e"
        if r == 0 and s > SEGMENT:
            assert torch.equal(got[SEGMENT:2 * SEGMENT], torch.zeros(SEGMENT, dtype=torch.float64))


@pytest.mark.parametrize("ws", [2])
def test_int8_error_feedback_on_off(pool, ws):
    """Constant gradients for T steps, int8: without error feedback every step applies the same
    quantized mean (the running sum's error grows as T); with it the running sum stays within
    the one-step scale bound (the residual now)."""
    from xirang.fsdp import SEGMENT

    T = 16
    on = pool.run(w_fixed_batch, True, T, wire="int8")
    off = pool.run(w_fixed_batch, False, T, wire="int8")
    m, per_rank = ref_grads(ws, 0)
    scale = abs_scale(per_rank, ws)
    bound = {}
    for lay in on[0]["layouts"].values():
        bound.update(_int8_bound(per_rank, lay, ws, SEGMENT))
    assert off[0]["stats"]["totals"]["residual_bytes"] == 0 < on[0]["stats"]["totals"]["residual_bytes"]
    err_on = err_off = 0.0
    for n in m:
        b = 1.05 * bound[n] + 1e-6 * scale[n] + 1e-8
        for t in range(1, T):
            assert torch.equal(off[0]["grads"][t][n], off[0]["grads"][0][n])
        s_on = sum(g[n].double() for g in on[0]["grads"])
        s_off = sum(g[n].double() for g in off[0]["grads"])
        e_on = float(((s_on - T * m[n]).abs() / b).max())
        e_off = float(((s_off - T * m[n]).abs() / b).max())
        assert e_on <= 1.0, f"{n}: EF on, running-sum error {e_on:.3f} x the bound"
        err_on, err_off = max(err_on, e_on), max(err_off, e_off)
    assert err_off > 4 * err_on, (err_on, err_off)


def test_compress_rejects_bad_arguments():
    import xirang

    with pytest.raises(ValueError, match="wire must be one of"):
        xirang.fsdp.compress(nn.Linear(2, 2), wire="fp8")
    with pytest.raises(ValueError, match="residual_dtype"):
        xirang.fsdp.compress(nn.Linear(2, 2), residual_dtype=torch.float16)
    with pytest.raises(ValueError, match="no FSDP module"):
        xirang.fsdp.compress(nn.Linear(2, 2))
    # wrong types (a new user's finds: AttributeErrors from deep inside)
    with pytest.raises(TypeError, match="module must be an nn.Module .*, got str"):
        xirang.fsdp.compress("model")
    with pytest.raises(TypeError, match="replicate_group must be a torch.distributed ProcessGroup or None, got int"):
        xirang.fsdp.compress(nn.Linear(2, 2), replicate_group=5)
    with pytest.raises(ValueError, match="wire must be one of"):
        xirang.fsdp.compress(nn.Linear(2, 2), wire=["bf16"])


@pytest.mark.parametrize("value", ["no", "False", 0, 1, None, 1.0])
def test_compress_error_feedback_must_be_a_bool(value):
    """error_feedback="no" used to turn error feedback on (bool() of the string): anything but a
    bool is a TypeError naming the argument and the value, before the module is looked at."""
    import xirang

    with pytest.raises(TypeError, match=rf"error_feedback must be True or False, got {type(value).__name__} "
                                        rf"{re.escape(repr(value))}"):
        xirang.fsdp.compress(nn.Linear(2, 2), error_feedback=value)
    for ok in (True, False):  # bools pass on to the next check
        with pytest.raises(ValueError, match="no FSDP module"):
            xirang.fsdp.compress(nn.Linear(2, 2), error_feedback=ok)


@pytest.mark.dedicated
def test_benchmark_and_example_run(tmp_path):
    """benchmarks/fsdp.py (over examples/train.py --fsdp) under torchrun, 2 ranks, a small digits
    model: the bf16 run sends half the fp32 run's reduce-scatter bytes and trains as well."""
    from conftest import require_backend

    require_backend("xirang")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    summary = tmp_path / "s.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(root, "benchmarks", "fsdp.py"), "--task", "digits", "--depth", "2", "--steps", "8",
           "--warmup-steps", "2", "--no-progress", "--wires", "fp32,bf16", "--summary", str(summary)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"rc={p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    assert "reduce-scatter" in p.stdout and "bf16" in p.stdout, p.stdout[-2000:]
    with open(summary) as f:
        fp32, bf16 = json.load(f)["runs"]
    assert fp32["fsdp_wire"] == "fp32" and bf16["fsdp_wire"] == "bf16"
    assert bf16["bytes_wire_per_step"] * 2 == fp32["bytes_wire_per_step"] == bf16["bytes_raw_per_step"]
    assert fp32["residual_bytes"] == 0 and bf16["residual_bytes"] >= 4 * fp32["parameters"]
    assert abs(bf16["final_loss"] - fp32["final_loss"]) < 0.02 * fp32["final_loss"], (fp32, bf16)


@pytest.mark.dedicated
def test_gpu_fsdp_check_dry_run(tmp_path):
    """tests/gpu/check_fsdp.py (the GPU script's fsdp step) with --cpu: the same two parts on CPU
    tensors, so that the script itself is known to run and its bounds to hold where no GPU is."""
    from conftest import gpu_script_dry_run

    stdout, res = gpu_script_dry_run("check_fsdp.py", tmp_path, [2], "fsdp.json")
    assert res["ok"] and res["device"] == "cpu"
    for r in ("0", "1"):
        assert set(res["ranks"][r]["train"]) == {"fp32", "bf16", "int8"}
        assert all(v["ok"] for v in res["ranks"][r]["train"].values())
    assert stdout.count("PASS fsdp") == 6, stdout
