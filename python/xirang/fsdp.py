"""FSDP2 (``torch.distributed.fsdp.fully_shard``): a compressed reduce-scatter with fp32
accumulation and error feedback.

    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    comp = xirang.fsdp.compress(model)          # bf16 on the wire, fp32 sums, error feedback
    ...
    ckpt = {"model": ..., "xirang_fsdp": comp.state_dict()}

Per FSDP parameter group, each backward's reduce-scatter becomes (rank r, world size N, FSDP's
padded flat input ``x`` of ``N * S`` elements, chunk ``j`` = ``x[j*S:(j+1)*S]`` for owner ``j``):

1. ``c = x + e`` in fp32 (``e``: this rank's residual, same layout as ``x``, zeros at first);
2. ``q = bf16(c)`` (round to nearest even), ``e <- c - fp32(q)`` (exact in fp32);
3. ``all_to_all_single`` of ``q``: chunk ``j`` goes to rank ``j`` (per rank ``2 (N-1) S`` bytes
   sent, the bytes of a bf16 ring reduce-scatter);
4. the owner decodes each received chunk to fp32 and sums them in fp32 in rank order 0..N-1,
   divides the sum once by N (or by the user's gradient divide factor) in fp32, and writes the
   output (fp32: as is; a 16-bit reduce dtype: rounded once).

``wire="int8"`` replaces step 2: each chunk is cut into segments of :data:`SEGMENT` (128)
elements from its start (the last one short when ``S`` is not a multiple), each with an fp32
``scale = absmax / 127`` of its finite elements; ``code = round_half_even(c / scale)`` in
[-127, 127]; ``e <- c - code * scale`` (exactly what the owner decodes); chunk ``j`` goes as one
uint8 block of its ``S`` codes and its ``ceil(S / 128)`` scales (one ``all_to_all_single``:
``(N-1) (S + 4 ceil(S / 128))`` bytes sent per rank, ~0.258x of fp32). An inf/NaN element
gets code -128 (decoded as NaN by the owner) and no say in its segment's scale; its residual
restarts from 0, as on the bf16 path.

The same scheme as VeOmni's ``FP32ReduceScatterWithLowPrecisionTransport`` (bf16 all-to-all,
fp32 sum at the owner) with sender-side error feedback added as in xirang's DDP hook
(:mod:`xirang.hooks`) and CGX / DeepSpeed's ``worker_error``: every rounding error is fed back
into the next step's input, so that the sum over steps of what the owners received equals the sum
of the true gradients minus the current residuals (it telescopes).

HSDP: on FSDP's native 2-D mesh the shard dimension is compressed as above (dividing by shard x
replicate size) and FSDP's all-reduce over the replicas sums; with ``compress(...,
replicate_group=g)`` on a 1-D shard mesh an all-reduce hook averages over the replicas with
xirang's error-feedback allreduce in the same wire format (bf16, or int8 with one scale per 1024
elements; see :func:`compress`).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger("xirang")

_WIRES = ("bf16", "int8", "fp32")
_RESIDUAL_DTYPES = (torch.float32, torch.bfloat16)

try:  # torch >= 2.9 (custom FSDP2 comms, pytorch#155189)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
except ImportError:  # pragma: no cover  (older torch: compress() raises, the module still imports)
    FSDPModule = None

    class _ReduceScatterBase:  # type: ignore[no-redef]
        pass


def _rank(group: Optional[dist.ProcessGroup]) -> int:
    try:
        return dist.get_rank(group)
    except Exception:  # noqa: BLE001  (no group yet: name rank -1 rather than fail while failing)
        return -1


# int8 wire: each owner's chunk is cut into segments of SEGMENT elements, one fp32 scale each.
# 128 elements per scale: the scale costs 4 / 128 byte per element (3.1% on top of the 1-byte
# codes, wire ~0.258x of fp32), and one large element (the absmax) coarsens only 127 neighbours.
# FSDP's flat buffer puts every parameter of a group side by side (weights, biases, norm scales),
# so a segment mixes tensors whose gradients differ by orders of magnitude; with 1024-element
# segments the small ones rounded to 0 and waited in the residual, and training drifted (text
# task, 300 steps, WS=2, int8 + EF: 1.103x / 1.494x fp32's perplexity at seeds 0 / 1; with 256:
# 1.058x at seed 1; with 128: 1.018x / 1.010x; with 64: 1.015x at seed 1; 2026-12-02). Segments start at each
# chunk's first element (the chunk is what an owner receives), so a chunk whose length is not a
# multiple of SEGMENT ends with a short segment. Codes and scales travel in one packed uint8
# buffer and one all_to_all_single (not two calls): one latency per group and step, one Work for
# async_op, and a chunk's codes and scales cannot be paired wrongly.
SEGMENT = 128
_NONFINITE_CODE = -128  # codes are clamped to [-127, 127]: -128 flags an inf/NaN element


def int8_chunk_bytes(s: int) -> int:
    """Bytes of one owner's int8 chunk of ``s`` elements: ``s`` codes + 4 per segment."""
    return s + 4 * (-(-s // SEGMENT))


def _int8_encode(c: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``c`` (2-D ``[N, s]`` fp32, row ``j`` = owner ``j``'s chunk) to the int8 wire.

    Per segment of :data:`SEGMENT` elements (the last one of a row short when ``s`` is not a
    multiple): ``scale = absmax / 127`` in fp32 over the segment's finite elements (0 for an
    all-zero or all-non-finite segment: all codes 0); ``code = round_half_even(c / scale)``
    clamped to [-127, 127]; an inf/NaN element gets code -128 (decoded as NaN) and does not
    enter its segment's scale.

    Returns ``(packed, decoded)``: ``packed`` 1-D uint8 ``[N * int8_chunk_bytes(s)]``, row ``j``
    = its ``s`` int8 codes then its ``ceil(s / SEGMENT)`` fp32 scales (little-endian bytes), what
    ``all_to_all_single`` sends to owner ``j``; ``decoded`` ``[N, s]`` fp32 = ``code * scale`` (0
    for flagged elements), bitwise what :func:`_int8_decode` yields for the finite codes.
    """
    ws, s = c.shape
    nseg = -(-s // SEGMENT)
    pad = nseg * SEGMENT - s
    v = (torch.nn.functional.pad(c, (0, pad)) if pad else c).view(ws, nseg, SEGMENT)
    fin = torch.isfinite(v)
    scale = torch.where(fin, v.abs(), 0.0).amax(dim=-1).div_(127.0)  # [N, nseg] fp32
    sc = scale.unsqueeze(-1)
    q = torch.where(sc > 0, v / torch.where(sc > 0, sc, 1.0), 0.0).round_().clamp_(-127, 127)
    q = torch.where(fin, q, float(_NONFINITE_CODE))
    codes = q.to(torch.int8)
    dec = q.mul_(sc).masked_fill_(~fin, 0.0)  # code * scale (the owner's product), 0 where flagged
    packed = torch.empty(ws, s + 4 * nseg, dtype=torch.uint8, device=c.device)
    packed[:, :s] = codes.view(ws, -1)[:, :s].view(torch.uint8)
    packed[:, s:] = scale.view(torch.uint8)
    return packed.view(-1), dec.view(ws, -1)[:, :s]


def _int8_decode(recv: torch.Tensor, s: int) -> torch.Tensor:
    """The received int8 chunks (2-D uint8 ``[N, int8_chunk_bytes(s)]``) decoded to fp32
    ``[N, s]``: ``code * scale`` of the code's segment; code -128 -> NaN (a sender's inf/NaN)."""
    ws = recv.shape[0]
    nseg = -(-s // SEGMENT)
    codes = recv[:, :s].contiguous().view(torch.int8)
    scale = recv[:, s:].contiguous().view(torch.float32)  # [N, nseg]
    out = codes.float().mul_(scale.repeat_interleave(SEGMENT, dim=1)[:, :s])
    return out.masked_fill_(codes == _NONFINITE_CODE, float("nan"))


class XirangReduceScatter(_ReduceScatterBase):
    """FSDP2 ``ReduceScatter`` comm of one FSDP parameter group (see the module docstring).

    Made by :func:`compress`; FSDP calls ``allocate`` and ``__call__``.

    Attributes:
        name: the FSDP module(s) of the group, by fully qualified name relative to the module
            given to :func:`compress` (``+``-joined for the list form ``fully_shard([a, b])``;
            ``<root>`` for that module itself, the model's root or the submodule passed).
        wire: ``"bf16"``, ``"int8"`` (per-segment scales) or ``"fp32"`` (no compression: the
            input's own dtype on the wire).
        error_feedback: whether residuals are kept (``wire="bf16"`` or ``"int8"``).
        divide_factor: the user's gradient divide factor taken over at :func:`compress`, or
            ``None`` (the mean: divide by ``mean_over``).
        mean_over: the number of ranks the mean is over: the reduce-scatter group's size N, times
            the replicate size R under HSDP (FSDP's all-reduce over the replicas then sums);
            ``None``: the size of the group passed to the call.
        residual: this rank's residual, 1-D ``[N * S]`` in ``residual_dtype`` (the layout of
            FSDP's padded reduce-scatter input when every parameter of the group that requires
            grad has a gradient), or ``None`` (no error feedback, or world size 1). A backward
            where only some of them have one (FSDP then reduce-scatters those only) reads and
            updates their parts of it, and the others' parts wait for their next gradient.
    """

    def __init__(self, name: str, param_group: Any, wire: str, error_feedback: bool,
                 residual_dtype: torch.dtype, divide_factor: Optional[float], mean_over: Optional[int] = None):
        self.name = name
        self._param_group = param_group
        self.wire = wire
        self.error_feedback = bool(error_feedback) and wire != "fp32"
        self.residual_dtype = residual_dtype
        self.divide_factor = divide_factor
        self.user_factor = divide_factor  # the factor the user asked for (compress() sets it)
        self.mean_over = mean_over
        self.residual: Optional[torch.Tensor] = None
        # Set by the param group's wrapped post_backward (_track_reduced_params) while FSDP reduces:
        # the indices in fsdp_params of the parameters the reduce-scatter input holds; None: unknown.
        self._holding: Optional[Tuple[int, ...]] = None
        self._sub: Optional[Tuple[torch.Tensor, torch.Tensor, int, int]] = None  # this call's _sub_layout
        self._sub_cache: Dict[Any, Tuple[torch.Tensor, torch.Tensor, int, int]] = {}
        # HSDP with compress(replicate_group=...): the all-reduce hook's state (see all_reduce_hook)
        self.replicate_group: Optional[dist.ProcessGroup] = None
        self.replicate_residual: Optional[torch.Tensor] = None
        self._replicate_staged: Optional[torch.Tensor] = None
        # int8 without error feedback: (zeros, r_out), [S] fp32 each: the residual read, and where
        # the op writes the one dropped
        self._replicate_scratch: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.replicate_bytes_wire_last = 0
        self.replicate_bytes_raw_last = 0
        self.calls = 0
        self.resets = 0
        self.bytes_wire_last = 0
        self.bytes_raw_last = 0
        self.bytes_wire_total = 0
        self.bytes_raw_total = 0

    # -- the Comm protocol ------------------------------------------------------------------

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A fresh ``torch.empty(size, dtype=dtype, device=device)`` (FSDP's input and output)."""
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any = dist.ReduceOp.SUM, async_op: bool = False) -> Optional[dist.Work]:
        """Reduce-scatter ``input_tensor`` (1-D ``[N * S]``) into ``output_tensor`` (1-D ``[S]``).

        ``op`` must be SUM (what FSDP passes after :func:`compress`; the scaling is ours).
        Synchronous with ``async_op=False`` (FSDP's call; returns ``None``); with
        ``async_op=True`` returns a ``dist.Work`` whose ``wait()`` returns once the output is
        written. Runs on the current stream (FSDP's reduce-scatter stream on CUDA).

        Raises ``RuntimeError`` naming the rank, the op and the mismatch: a non-SUM ``op``; FSDP
        settings changed after :func:`compress`; an input that is not ``N`` times the output;
        tensors on a device the group's backend does not serve. Nothing is sent then, and the
        residual is left as it was.
        """
        ws = group.size()
        rank = _rank(group)
        where = f"xirang.fsdp: rank {rank}, reduce_scatter of {self.name!r}"
        self._check(where, output_tensor, input_tensor, group, op, ws)
        n = input_tensor.numel()
        self._sub = sub = self._sub_layout(ws, n, input_tensor.device)
        if self.error_feedback and (self.residual is None or self.residual.device != input_tensor.device
                                    or self.residual.numel() != (n if sub is None else sub[2])):
            if self.residual is not None:
                self._reset(f"the reduce-scatter input has {n} elements on {input_tensor.device}, the residual "
                            f"{self.residual.numel()} on {self.residual.device} (the parameter group or world "
                            "size changed)")
            self.residual = torch.zeros(n if sub is None else sub[2], dtype=self.residual_dtype,
                                        device=input_tensor.device)

        if self.error_feedback and sub is not None:  # only some parameters: their parts of the residual
            full = self.residual
            self.residual = full[sub[0]]
            try:
                wire = self._encode(input_tensor, ws)
            finally:
                full[sub[0]] = self.residual
                self.residual = full
        else:
            wire = self._encode(input_tensor, ws)
        recv = torch.empty_like(wire)
        self.calls += 1
        self.bytes_wire_last = (ws - 1) * (wire.numel() // ws) * wire.element_size()
        self.bytes_raw_last = (ws - 1) * (n // ws) * input_tensor.element_size()
        self.bytes_wire_total += self.bytes_wire_last
        self.bytes_raw_total += self.bytes_raw_last
        if not async_op:
            dist.all_to_all_single(recv, wire, group=group)
            self._decode(recv, output_tensor, ws)
            return None
        work = dist.all_to_all_single(recv, wire, group=group, async_op=True)

        def finish(fut: torch.futures.Future) -> List[torch.Tensor]:
            fut.value()  # re-raises the all-to-all's error
            self._decode(recv, output_tensor, ws)
            return [output_tensor]

        return torch._C._distributed_c10d._create_work_from_future(work.get_future().then(finish))

    # -- the steps --------------------------------------------------------------------------

    def _sub_layout(self, ws: int, n: int,
                    device: torch.device) -> Optional[Tuple[torch.Tensor, torch.Tensor, int, int]]:
        """Where a reduce-scatter input of ``n`` elements that holds only some of the group's
        parameters (``_holding``, in ``fsdp_params`` order, each a padded shard per rank) lies in
        the full layout (every parameter requiring grad): ``(idx_in, idx_out, N * S_full, S_full)``,
        index tensors into the ``[N * S_full]`` residual and the ``[S_full]`` replicate residual. ``None``
        when the input holds all of them, or which it holds is unknown or disagrees with ``n``
        (then the input's own layout applies, as before)."""
        held, pg = self._holding, self._param_group
        if held is None or pg is None:
            return None
        sizes = _reduced_sizes(pg)
        full = list(sizes)
        if list(held) == full or not set(held) <= set(full):
            return None
        if ws * sum(sizes[i] for i in held) != n:
            return None
        key = (tuple(held), ws, device)
        if key not in self._sub_cache:
            offset, off = {}, 0
            for i in full:
                offset[i] = off
                off += sizes[i]
            idx_out = torch.cat([torch.arange(offset[i], offset[i] + sizes[i]) for i in held])
            idx_in = (torch.arange(ws).unsqueeze(1) * off + idx_out.unsqueeze(0)).reshape(-1)
            self._sub_cache[key] = (idx_in.to(device), idx_out.to(device), ws * off, off)
        return self._sub_cache[key]

    def _check(self, where: str, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, op: Any,
               ws: int) -> None:
        if op != dist.ReduceOp.SUM:
            raise RuntimeError(f"{where}: op must be SUM (xirang applies the scaling), got {op}; "
                               "were FSDP's reduction settings changed after xirang.fsdp.compress()?")
        pg = self._param_group
        if pg is not None and (pg.gradient_divide_factor != 1.0 or not pg.force_sum_reduction_for_comms):
            raise RuntimeError(
                f"{where}: the FSDP module's gradient divide factor ({pg.gradient_divide_factor}) or forced SUM "
                f"({pg.force_sum_reduction_for_comms}) was changed after xirang.fsdp.compress() set 1.0 and True; "
                "call xirang.fsdp.compress() again after changing them (it takes the factor over)")
        if not inp.is_floating_point() or not out.is_floating_point():
            raise RuntimeError(f"{where}: floating-point tensors expected, got input {inp.dtype}, output {out.dtype}")
        if self.wire != "fp32" and inp.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise RuntimeError(f"{where}: wire={self.wire!r} takes fp32, bf16 or fp16 inputs, got {inp.dtype} "
                               "(use wire='fp32' for it)")
        if inp.dim() != 1 or out.dim() != 1 or not inp.is_contiguous() or not out.is_contiguous():
            raise RuntimeError(f"{where}: contiguous 1-D tensors expected, got input {tuple(inp.shape)}, "
                               f"output {tuple(out.shape)}")
        if inp.numel() != ws * out.numel():
            raise RuntimeError(f"{where}: the input has {inp.numel()} elements, expected world size {ws} x the "
                               f"output's {out.numel()}")
        if inp.device != out.device:
            raise RuntimeError(f"{where}: input on {inp.device}, output on {out.device}")
        try:
            be = group._get_backend(inp.device)
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"{where}: tensors on {inp.device}, which the group's backend "
                               f"({dist.get_backend(group)!r}) does not serve: {e}") from None
        if inp.is_cuda:
            from ._backend import load_C  # noqa: PLC0415

            C = load_C()
            xr = be if isinstance(be, C.ProcessGroupXirang) else getattr(be, "wrapped_pg", None)
            if isinstance(xr, C.ProcessGroupXirang) and not C.CUDA_BUILT:
                raise RuntimeError(f"{where}: got CUDA tensors, but the CUDA path is not built in this xirang "
                                   "(build_info()['cuda'] is None); use CPU tensors or 'cpu:xirang,cuda:nccl'")

    def _encode(self, x: torch.Tensor, ws: int) -> torch.Tensor:
        """What goes on the wire, 1-D of ``ws`` equal chunks (chunk ``j`` for owner ``j``);
        updates the residual (error feedback). fp32: ``x`` itself; bf16: ``[N * S]`` bf16;
        int8: ``[N * (S + 4 * ceil(S / SEGMENT))]`` uint8 (:func:`_int8_encode`)."""
        if self.wire == "fp32":
            return x
        r = self.residual if self.error_feedback else None
        if r is not None and r.dtype == torch.float32:
            c = r.add_(x)  # c = x + e in place, fp32 (a 16-bit x is decoded exactly)
        elif r is not None:  # bf16 residual: c in a fp32 temporary, e rounded to bf16 when stored
            c = x.float().add_(r)
        else:
            c = x
        if self.wire == "bf16":
            q = c.to(torch.bfloat16)
            if r is not None:
                if c is r:
                    r.sub_(q)  # e = c - fp32(q): exact in fp32
                else:
                    r.copy_(c.sub_(q))
        else:
            cv = c.view(ws, -1)
            q, dec = _int8_encode(cv if cv.dtype == torch.float32 else cv.float())
            if r is not None:  # e = c - decoded(code): exactly what the owner decodes (the difference is exact)
                if c is r:
                    r.view(ws, -1).sub_(dec)
                else:  # c: this call's fp32 temporary
                    r.view(ws, -1).copy_(cv.sub_(dec))
        if r is not None:
            # An element whose c is inf/NaN, or finite beyond bf16's range (q = +-inf), would leave a
            # non-finite residual that poisons every later step: it restarts from 0.
            torch.nan_to_num_(r, nan=0.0, posinf=0.0, neginf=0.0)  # one pass, no device sync
        return q

    def _chunks(self, recv: torch.Tensor, ws: int, n_out: int) -> List[torch.Tensor]:
        """The received chunks, rank order, each ``[n_out]`` in a dtype the sum takes exactly (int8:
        decoded to fp32)."""
        if self.wire != "int8":
            return list(recv.view(ws, -1))
        return list(_int8_decode(recv.view(ws, -1), n_out))

    def _decode(self, recv: torch.Tensor, out: torch.Tensor, ws: int) -> None:
        """out = (sum over ranks, in rank order, of the received chunks, in fp32) / divisor."""
        chunks = self._chunks(recv, ws, out.numel())
        acc_dtype = torch.float64 if torch.float64 in (chunks[0].dtype, out.dtype) else torch.float32
        acc = out if out.dtype == acc_dtype else torch.empty(out.shape, dtype=acc_dtype, device=out.device)
        acc.copy_(chunks[0])
        for j in range(1, ws):
            acc.add_(chunks[j])
        if self.divide_factor is not None:
            acc.div_(float(self.divide_factor))
        else:
            acc.div_(float(self.mean_over or ws))
        if acc is not out:
            out.copy_(acc)

    def all_reduce_hook(self, reduce_output: torch.Tensor) -> None:
        """FSDP all-reduce hook (``set_all_reduce_hook``): the mean over ``replicate_group`` of
        this rank's reduce-scatter output (1-D ``[S]``), in place.

        fp32 output with ``wire="bf16"`` or ``"int8"`` and error feedback: xirang's error-feedback
        allreduce in that wire format (``allreduce_ef``, the DDP hook's operation: bf16 on the
        compressed ring, or int8 codes with one fp32 scale per 1024 elements in the direct form;
        fp32 sums, the residual ``replicate_residual`` of ``[S]`` fp32, committed only when the
        result is finite). ``wire="int8"`` without error feedback: the same operation with a zero
        residual every step (nothing carried over). ``wire="bf16"`` without error feedback: an AVG
        all-reduce of the output rounded to bf16 (xirang sums 16-bit inputs in fp32 and rounds
        once). Otherwise (``wire="fp32"``, a bf16 output, or a non-contiguous int8 one) an AVG
        all-reduce in the output's dtype. Raises ``TypeError`` when the group is not served by
        xirang for the compressed paths.
        """
        from .hooks.state import WIRE_BYTES  # noqa: PLC0415

        g = self.replicate_group
        r = g.size()
        n = reduce_output.numel()
        self.replicate_bytes_raw_last = 2 * (r - 1) * n * reduce_output.element_size() // r
        fp32 = reduce_output.dtype == torch.float32 and reduce_output.is_contiguous()
        if self.wire == "fp32" or reduce_output.dtype == torch.bfloat16 or (self.wire == "int8" and not fp32):
            self.replicate_bytes_wire_last = self.replicate_bytes_raw_last
            dist.all_reduce(reduce_output, op=dist.ReduceOp.AVG, group=g)
            return
        self.replicate_bytes_wire_last = int(2 * (r - 1) * n * WIRE_BYTES[self.wire]) // r
        if self.wire == "bf16" and (not self.error_feedback or not fp32):
            q = reduce_output.to(torch.bfloat16)
            dist.all_reduce(q, op=dist.ReduceOp.AVG, group=g)
            reduce_output.copy_(q)
            return
        from ._backend import backend_for  # noqa: PLC0415

        if not self.error_feedback:  # int8 without error feedback: r_in = 0 each step, r_out dropped
            if self._replicate_scratch is None or self._replicate_scratch[0].numel() != n:
                self._replicate_scratch = tuple(torch.zeros(n, dtype=torch.float32, device=reduce_output.device)
                                                for _ in range(2))
            zero, scratch = self._replicate_scratch
            backend_for(g).allreduce_ef(reduce_output, zero, scratch, -1, label=f"fsdp replicate {self.name}",
                                        wire=self.wire).wait()
            return
        sub = self._sub if self._holding is not None else None
        if sub is not None and self.replicate_residual is not None and self.replicate_residual.numel() == sub[3]:
            # only some parameters (see __call__): their parts of the residual, the rest kept
            r_in = self.replicate_residual[sub[1]]
            r_out = torch.zeros_like(r_in)
        else:
            if self.replicate_residual is None or self.replicate_residual.numel() != n:
                if self.replicate_residual is not None:
                    self._reset(f"the replicate all-reduce has {n} elements, the residual "
                                f"{self.replicate_residual.numel()}")
                self.replicate_residual = torch.zeros(n, dtype=torch.float32, device=reduce_output.device)
            if self._replicate_staged is None or self._replicate_staged.numel() != n:
                self._replicate_staged = torch.zeros_like(self.replicate_residual)
            sub, r_in, r_out = None, self.replicate_residual, self._replicate_staged
        backend_for(g).allreduce_ef(reduce_output, r_in, r_out, -1, label=f"fsdp replicate {self.name}",
                                    wire=self.wire).wait()
        if bool(torch.isfinite(reduce_output).all()):  # commit the new residual
            if sub is not None:
                self.replicate_residual[sub[1]] = r_out
            else:
                self.replicate_residual, self._replicate_staged = r_out, r_in

    def _reset(self, why: str) -> None:
        self.resets += 1
        log.warning("xirang.fsdp: residual of %r reset to zero: %s", self.name, why)
        for t in (self.residual, self.replicate_residual):
            if t is not None:
                t.zero_()


class FSDPCompressor:
    """What :func:`compress` returns: the comm of each FSDP parameter group, stats, checkpoints.

    Attributes:
        comms: name -> :class:`XirangReduceScatter`, in module order.
        world_size: the size of the reduce-scatter group (the mesh's shard dimension).
        replicate_size: the HSDP replicate dimension's size (1 without HSDP).
        rank: this process's global rank (the checkpoint keys carry it).
    """

    def __init__(self, comms: Dict[str, XirangReduceScatter], world_size: int, rank: int,
                 wire: str, error_feedback: bool, residual_dtype: torch.dtype, replicate_size: int = 1):
        self.comms = comms
        self.world_size = world_size
        self.replicate_size = replicate_size
        self.rank = rank
        self.wire = wire
        self.error_feedback = error_feedback
        self.residual_dtype = residual_dtype

    @property
    def residuals(self) -> Dict[str, torch.Tensor]:
        """name -> this rank's live reduce-scatter residual (1-D ``[N * S]``), and
        ``name + ".replicate"`` -> the replicate all-reduce's (1-D ``[S]``, with
        ``replicate_group``); only groups that have one."""
        out = {}
        for k, c in self.comms.items():
            if c.residual is not None:
                out[k] = c.residual
            if c.replicate_residual is not None:
                out[k + ".replicate"] = c.replicate_residual
        return out

    def stats(self) -> Dict[str, Any]:
        """This rank's view: ``{"groups": [...], "totals": {...}}``.

        Each group: ``name``, ``calls`` (reduce-scatters so far), ``bytes_wire_last`` (payload
        bytes this rank sent in its last call: ``(N-1) x S x`` the wire's itemsize, for int8
        ``(N-1) x (S + 4 ceil(S / SEGMENT))``; its own chunk is not sent), ``bytes_raw_last`` (the same in the input's dtype: what FSDP's own
        reduce-scatter would send), their ``*_total`` sums, ``residual_bytes`` (bytes of the
        residual: ``N x S x`` 4 for fp32, 2 for bf16; 0 without error feedback),
        ``residual_resets`` (resets to zero: world size or shape changes, loads, ``reset()``).
        ``replicate_bytes_wire_last`` / ``replicate_bytes_raw_last``: the replicate all-reduce's
        (``replicate_group``; ``2 (R-1)/R x S x`` bytes per element: the wire's (2 for bf16,
        1 + 4/1024 for int8's codes and scales) vs the output's dtype; 0 without it); ``residual_bytes`` includes its residual and staging buffer
        (``S x 4`` each, the staging allocated at the first call).
        ``totals``: ``bytes_wire_per_step`` and ``bytes_raw_per_step`` (sums of the groups' last
        calls: one step's bytes when every group reduce-scatters once a step), the same two for
        the replicate all-reduce (``replicate_*``), ``residual_bytes``, ``calls``.
        """
        groups = []
        for name, c in self.comms.items():
            groups.append({
                "name": name,
                "calls": c.calls,
                "bytes_wire_last": c.bytes_wire_last,
                "bytes_raw_last": c.bytes_raw_last,
                "bytes_wire_total": c.bytes_wire_total,
                "bytes_raw_total": c.bytes_raw_total,
                "residual_bytes": sum(t.numel() * t.element_size()
                                      for t in (c.residual, c.replicate_residual, c._replicate_staged)
                                      if t is not None),
                "replicate_bytes_wire_last": c.replicate_bytes_wire_last,
                "replicate_bytes_raw_last": c.replicate_bytes_raw_last,
                "residual_resets": c.resets,
            })
        totals = {
            "bytes_wire_per_step": sum(g["bytes_wire_last"] for g in groups),
            "bytes_raw_per_step": sum(g["bytes_raw_last"] for g in groups),
            "replicate_bytes_wire_per_step": sum(g["replicate_bytes_wire_last"] for g in groups),
            "replicate_bytes_raw_per_step": sum(g["replicate_bytes_raw_last"] for g in groups),
            "residual_bytes": sum(g["residual_bytes"] for g in groups),
            "calls": sum(g["calls"] for g in groups),
        }
        return {"groups": groups, "totals": totals}

    # -- checkpoints ------------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return f"rank{self.rank}.{name}"

    def state_dict(self) -> Dict[str, Any]:
        """``{"world_size": N, "replicate_size": R, "wire": ..., "residuals": {"rank<r>.<name>": tensor}}``.

        Plain tensors (this rank's residuals, the live buffers: copy them to keep a snapshot)
        and plain values, so ``torch.save`` and ``torch.distributed.checkpoint`` (DCP) take it.
        Residuals differ across ranks, so each key carries the rank (DCP would otherwise keep
        one rank's copy of an equal key); ``r`` is the global rank. Groups without a residual have
        no entry.
        """
        return {
            "world_size": self.world_size,
            "replicate_size": self.replicate_size,
            "wire": self.wire,
            "residuals": {self._key(k): t for k, t in self.residuals.items()},
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore this rank's residuals bitwise from :meth:`state_dict`'s output.

        Resets (to zero, with a WARNING on logger ``xirang`` naming the group and why) instead
        of loading when the checkpoint's world size differs, when a group's residual is missing,
        or when its shape differs (the parameter group changed), and also when the checkpoint was
        saved with another wire format (its residuals hold another rounding's errors).

        Everything is checked before anything changes: ``TypeError`` for a value that is not such
        a dict (a dict with ``"residuals"`` a dict of tensors, integer sizes); ``ValueError``
        naming the key for a residual holding NaN or infinity (the next step's gradients would be
        non-finite).
        """
        def bad_type(what: str) -> TypeError:
            return TypeError(f"xirang.fsdp: load_state_dict expects FSDPCompressor.state_dict()'s dict, {what}")

        if not isinstance(state_dict, dict) or "residuals" not in state_dict:
            raise bad_type(f"got {type(state_dict).__name__}" + (
                " without 'residuals'" if isinstance(state_dict, dict) else ""))
        res = state_dict["residuals"]
        if not isinstance(res, dict) or not all(isinstance(v, torch.Tensor) for v in res.values()):
            raise bad_type(f"got residuals of type {type(res).__name__}" + (
                "" if not isinstance(res, dict) else " holding " + ", ".join(
                    sorted({type(v).__name__ for v in res.values() if not isinstance(v, torch.Tensor)}))))
        sizes = {k: state_dict.get(k, d) for k, d in (("world_size", -1), ("replicate_size", 1))}
        for k, v in sizes.items():
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad_type(f"got {k} {v!r}")
        for k, v in res.items():
            if not bool(torch.isfinite(v).all()):
                raise ValueError(f"xirang.fsdp: load_state_dict: residual {k!r} holds non-finite values (NaN or "
                                 "infinity: the next step's gradients would be non-finite); nothing was loaded")
        saved_ws, saved_rs = sizes["world_size"], sizes["replicate_size"]
        saved_wire = state_dict.get("wire", self.wire)
        for name, c in self.comms.items():
            live = [(k, t) for k, t in ((name, c.residual), (name + ".replicate", c.replicate_residual))
                    if t is not None]
            if not live:
                continue
            if saved_ws != self.world_size:
                c._reset(f"the checkpoint is from world size {saved_ws}, this run has {self.world_size}")
                continue
            if saved_rs != self.replicate_size:
                c._reset(f"the checkpoint is from replicate size {saved_rs}, this run has {self.replicate_size}")
                continue
            if saved_wire != self.wire:
                c._reset(f"the checkpoint was saved with wire={saved_wire!r}, this run has wire={self.wire!r}")
                continue
            saved = [(res.get(self._key(k)), t) for k, t in live]
            bad = [f"the checkpoint has no residual {self._key(k)!r}" for (k, _), (s, _) in zip(live, saved) if s is None]
            bad += [f"the checkpoint's residual has shape {tuple(s.shape)}, the parameter group needs "
                    f"{tuple(t.shape)} (the parameter group changed)" for s, t in saved
                    if s is not None and tuple(s.shape) != tuple(t.shape)]
            if bad:
                c._reset("; ".join(bad))
                continue
            for s, t in saved:
                t.copy_(s)

    def reset(self) -> None:
        """Zero every residual (logged)."""
        for c in self.comms.values():
            if c.residual is not None:
                c._reset("reset() called")


def _fsdp_groups(module: nn.Module) -> List[Tuple[str, Any, Any]]:
    """(name, an FSDPModule of the state, its param group) per distinct FSDP state, in module order."""
    seen: Dict[int, List[Any]] = {}
    order: List[int] = []
    for fqn, m in module.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        st = m._get_fsdp_state()
        if id(st) not in seen:
            seen[id(st)] = [st, [], m]
            order.append(id(st))
        seen[id(st)][1].append(fqn or "<root>")
    out = []
    for k in order:
        st, names, first = seen[k]
        groups = list(st._fsdp_param_groups)
        if len(groups) > 1:
            raise ValueError(f"xirang.fsdp.compress: {'+'.join(names)} has {len(groups)} parameter groups "
                             "(per-parameter meshes); one custom reduce-scatter per module is supported")
        if groups:
            out.append(("+".join(names), first, groups[0]))
    return out


def _reduced_sizes(pg: Any) -> Dict[int, int]:
    """index in ``pg.fsdp_params`` -> padded shard size (elements) of every parameter that requires
    grad, in order: the full layout of the group's reduce-scatter (one such run per rank) and of
    its output."""
    return {i: fp.padded_sharded_param_size.numel() for i, fp in enumerate(pg.fsdp_params)
            if fp.sharded_param.requires_grad}


def _params_with_grad(pg: Any) -> Tuple[int, ...]:
    """Indices in ``pg.fsdp_params`` of the parameters FSDP2's ``FSDPParamGroup.post_backward``
    is about to reduce-scatter (torch 2.11-2.14: an accumulated gradient, a gradient, or, with
    ``reduce_scatter_unused_params``, any parameter requiring grad)."""
    unused = bool(getattr(pg, "reduce_scatter_unused_params", False))
    held = []
    for i, fp in enumerate(pg.fsdp_params):
        if not hasattr(fp, "_unsharded_param"):
            continue
        if (fp.unsharded_accumulated_grad is not None or fp.unsharded_param.grad is not None
                or (unused and fp.unsharded_param.requires_grad)):
            held.append(i)
    return tuple(held)


def _track_reduced_params(pg: Any) -> None:
    """Wraps ``pg.post_backward`` (once, as an instance attribute: FSDP looks it up at each call)
    so that while it runs the group's xirang comm knows which parameters its reduce-scatter input
    holds (:func:`_params_with_grad`): a backward where some parameters have no gradient sends the
    others only, and their residual parts must not be confused with the missing ones' (same
    element count, other parameters)."""
    if getattr(pg, "_xirang_post_backward", None) is not None:
        return
    orig = pg.post_backward

    def post_backward(*args: Any, **kwargs: Any) -> Any:
        comm = getattr(pg, "_reduce_scatter_comm", None)
        if isinstance(comm, XirangReduceScatter):
            comm._holding = _params_with_grad(pg)
        try:
            return orig(*args, **kwargs)
        finally:
            if isinstance(comm, XirangReduceScatter):
                comm._holding = None

    pg._xirang_post_backward = orig
    pg.post_backward = post_backward


def compress(module: nn.Module, wire: str = "bf16", error_feedback: bool = True,
             residual_dtype: torch.dtype = torch.float32,
             replicate_group: Optional[dist.ProcessGroup] = None) -> FSDPCompressor:
    r"""Make every FSDP parameter group under ``module`` reduce-scatter through xirang's scheme.

    For each distinct FSDP state (an ``FSDPModule``, or the modules of one list-form
    ``fully_shard([a, b])`` call), this installs an :class:`XirangReduceScatter` with
    ``set_custom_reduce_scatter`` and sets ``set_gradient_divide_factor(1.0)`` and
    ``set_force_sum_reduction_for_comms(True)``, so FSDP passes SUM and scales nothing: xirang
    divides the fp32 sum once, by the reduce-scatter group's size N (the mean), or by the factor
    the user set with ``set_gradient_divide_factor(f)`` before this call (then ``sum / f``).
    This also avoids FSDP's ``PREMUL_SUM`` on bf16 reduce-scatters (pytorch#157485). Call it
    after ``fully_shard`` and before the first backward; calling it again rebuilds the comms
    (residuals restart from zero; the factor taken over earlier is kept unless a new one was set
    with ``set_gradient_divide_factor`` since).

    Args:
        module: the root of an FSDP2 tree (``fully_shard`` applied to it or to submodules).
        wire: ``"bf16"`` (default; the module docstring's scheme), ``"int8"`` (int8 codes with
            an fp32 scale per :data:`SEGMENT` (128) elements: ~0.258x of fp32's bytes, error at most
            half a segment's scale per rank and step before feedback) or ``"fp32"`` (no
            compression: the input in its own dtype on the wire, the same fp32 sum; for
            ablations and as the exact reference).
        error_feedback: keep residuals (default). ``False``: plain bf16 / int8 rounding (for
            ablations). Ignored with ``wire="fp32"``. A ``bool`` (``TypeError`` otherwise: the
            string ``"no"`` would be true).
        residual_dtype: ``torch.float32`` (default) or ``torch.bfloat16``. Memory per rank:
            the residual has the size of FSDP's padded reduce-scatter input, i.e. the unsharded
            gradient of every group: 4 bytes per element for fp32, 2 for bf16 (on top of FSDP's
            sharded state: O(model) per rank, which erodes FSDP's memory saving). A bf16
            residual is itself rounded when stored (at most 2^-8 of the residual, which is at
            most 2^-8 of the compensated gradient: 2^-16 of it): that much of each step's
            rounding error is lost, so the telescoping sum holds only to that error per step.
        replicate_group: HSDP with a compressed replicate dimension: ``fully_shard`` on the
            shard dimension only (a 1-D mesh, e.g. ``mesh["shard"]``) and pass the replicate
            dimension's group here (``mesh["replicate"].get_group()``, served by xirang). Each
            group's reduce-scatter then divides by N only and an all-reduce hook
            (:meth:`XirangReduceScatter.all_reduce_hook`, ``set_all_reduce_hook``) averages the
            output over the R replicas with xirang's error-feedback allreduce in ``wire``'s format
            (bf16, or int8 with one fp32 scale per 1024 elements; residual and staging ``S x 4``
            bytes each per rank; a user factor f becomes ``sum / f`` overall). The
            parameters' shards are broadcast from the replicate group's rank 0 here, so the
            replicas start equal. ``None`` (default): no replicate dimension, or FSDP's native
            HSDP (below).

    Native HSDP (``fully_shard`` on a 2-D replicate x shard mesh): the reduce-scatter over the
    shard dimension (size N) is compressed and divides by N x R (or by the user's factor);
    FSDP's own all-reduce over the R replicas then sums in the reduce dtype, uncompressed (FSDP2
    runs a user all-reduce hook only after its own all-reduce there). To compress the replicate
    dimension as well, use ``replicate_group`` on a 1-D shard mesh.

    World size 1 (or a shard dimension of size 1): FSDP skips the reduce-scatter (it copies,
    dividing by its own factor); the comm is installed but FSDP's settings are left as they are
    and no residual is kept.

    Returns:
        an :class:`FSDPCompressor` (keep it for ``stats()`` and checkpoints).

    Raises:
        ValueError: bad ``wire`` / ``residual_dtype``, no FSDP module under ``module``, a
            module with several parameter groups, ``replicate_group`` with a 2-D mesh or a
            shard dimension of size 1. TypeError: ``module`` not an ``nn.Module``,
            ``error_feedback`` not a ``bool``, ``replicate_group`` not a ProcessGroup, or not
            served by xirang with ``wire="bf16"`` or ``"int8"`` (checked here, before anything
            changes, not at the first backward). NotImplementedError: a replicate-only mesh
            (``replicate()``: no reduce-scatter). ImportError: a torch without FSDP2 custom comms (< 2.9).
    """
    if FSDPModule is None:
        raise ImportError("xirang.fsdp needs torch >= 2.9 (FSDP2's set_custom_reduce_scatter)")
    if not isinstance(module, nn.Module):
        raise TypeError(f"xirang.fsdp.compress: module must be an nn.Module (the fully_shard model), "
                        f"got {type(module).__name__}")
    if not isinstance(error_feedback, bool):  # bool("no") is True: a string would turn it on
        raise TypeError(f"xirang.fsdp.compress: error_feedback must be True or False, "
                        f"got {type(error_feedback).__name__} {error_feedback!r}")
    if replicate_group is not None and not isinstance(replicate_group, dist.ProcessGroup):
        raise TypeError(f"xirang.fsdp.compress: replicate_group must be a torch.distributed ProcessGroup or None, "
                        f"got {type(replicate_group).__name__}")
    if not isinstance(wire, str) or wire not in _WIRES:
        raise ValueError(f"xirang.fsdp.compress: wire must be one of {_WIRES}, got {wire!r}")
    if residual_dtype not in _RESIDUAL_DTYPES:
        raise ValueError(f"xirang.fsdp.compress: residual_dtype must be torch.float32 or torch.bfloat16, "
                         f"got {residual_dtype!r}")
    groups = _fsdp_groups(module)
    if not groups:
        raise ValueError("xirang.fsdp.compress: no FSDP module (fully_shard) under the module given")
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo  # noqa: PLC0415

    sizes = set()
    for name, _st, pg in groups:
        mi = pg.mesh_info
        if not isinstance(mi, FSDPMeshInfo):
            raise NotImplementedError(f"xirang.fsdp.compress: {name} uses a {type(mi).__name__} (a replicate-only "
                                      "mesh: no reduce-scatter); use a shard or HSDP mesh")
        rep = mi.replicate_mesh_size if isinstance(mi, DDPMeshInfo) else 1  # HSDPMeshInfo is both
        sizes.add((pg._reduce_scatter_process_group.size(), rep))
    if len(sizes) != 1:
        raise ValueError(f"xirang.fsdp.compress: the FSDP modules' (shard, replicate) sizes differ: {sorted(sizes)}")
    ws, rep = sizes.pop()
    rank = _rank(None)
    if replicate_group is not None:
        if ws == 1:
            raise ValueError("xirang.fsdp.compress: replicate_group needs a shard dimension of size > 1 "
                             "(at 1 FSDP skips the reduce-scatter and the hook); use DDP over the replicas")
        if rep != 1:
            raise ValueError("xirang.fsdp.compress: replicate_group goes with fully_shard on a 1-D shard mesh; "
                             "this module is on a 2-D (native HSDP) mesh")
        rep = replicate_group.size()
        if wire in ("bf16", "int8"):  # the all-reduce hook runs xirang's compressed all-reduce
            from ._backend import backend_for  # noqa: PLC0415

            try:
                backend_for(replicate_group)
            except TypeError as e:  # now, not in the middle of the first backward
                raise TypeError(f"xirang.fsdp.compress: replicate_group must be served by the xirang backend "
                                f"with wire={wire!r} (its replicate all-reduce is xirang's compressed one; "
                                f"wire='fp32' takes any backend): {e}") from None
        with torch.no_grad():  # the replicas start equal (FSDP broadcasts nothing across them)
            for _name, _st, pg in groups:
                for fp in pg.fsdp_params:
                    dist.broadcast(fp.sharded_param.to_local(), group=replicate_group, group_src=0)

    comms: Dict[str, XirangReduceScatter] = {}
    for name, st_module, pg in groups:
        old = pg._reduce_scatter_comm
        # Compressed before: keep the factor taken over then, unless the user set a new one since
        # (the group's factor is no longer the 1.0 compress() set).
        if isinstance(old, XirangReduceScatter) and pg.gradient_divide_factor == 1.0:
            factor = old.user_factor
        else:
            factor = pg.gradient_divide_factor
        if factor is not None and not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
            raise ValueError(f"xirang.fsdp.compress: {name}'s gradient divide factor must be a positive number, "
                             f"got {factor!r}")
        if replicate_group is not None:  # the hook's all-reduce averages over the R replicas
            comm = XirangReduceScatter(name, pg, wire, error_feedback, residual_dtype,
                                       None if factor is None else float(factor) / rep, mean_over=ws)
            comm.replicate_group = replicate_group
        else:
            comm = XirangReduceScatter(name, pg, wire, error_feedback, residual_dtype,
                                       None if factor is None else float(factor), mean_over=ws * rep)
        comm.user_factor = None if factor is None else float(factor)
        if comm.error_feedback and ws > 1:
            n = ws * sum(_reduced_sizes(pg).values())
            comm.residual = torch.zeros(n, dtype=residual_dtype, device=pg.device)
        else:
            comm.error_feedback = comm.error_feedback and ws > 1
        st_module.set_custom_reduce_scatter(comm)
        _track_reduced_params(pg)
        if getattr(getattr(pg, "_all_reduce_hook", None), "__self__", None) is old:
            pg._all_reduce_hook = None  # an earlier compress(replicate_group=...)'s hook goes with its comm
        if replicate_group is not None:
            if comm.wire in ("bf16", "int8") and comm.error_feedback:
                n_out = sum(_reduced_sizes(pg).values())
                comm.replicate_residual = torch.zeros(n_out, dtype=torch.float32, device=pg.device)
            st_module.set_all_reduce_hook(comm.all_reduce_hook)
        if ws > 1:
            st_module.set_gradient_divide_factor(1.0)
            st_module.set_force_sum_reduction_for_comms(True)
        comms[name] = comm
    return FSDPCompressor(comms, ws, rank, wire, bool(error_feedback) and wire != "fp32", residual_dtype, rep)
