"""The DDP comm hook function and the one-line registration.

No ``from __future__ import annotations`` here: DDP checks the hook's annotations
(``bucket: dist.GradBucket``) as objects.
"""
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from .state import BF16ErrorFeedbackState


def bf16_error_feedback_hook(
    state: BF16ErrorFeedbackState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    r"""DDP comm hook: average gradients with 16- or 8-bit codes on the wire (``state.wire``: bf16
    by default, fp16 or int8 with per-segment scales) and complete error feedback.

    Per call, for ``bucket`` (flat 1-D ``bucket.buffer()``, one dtype, this rank's un-averaged
    gradients):

    1. Each parameter's gradient is to be copied into its layer group's packed buffers, at an
       offset fixed by parameter order: compressed tensors (fp32, ``ndim >= 2``, ``numel >=
       min_compress_numel``) into one fp32 buffer ``[n_ef]``, the rest into one buffer per
       dtype. On the host the group's operation does these copies on the communication thread
       (``pack_into`` / ``pack_from``; its record's ``pack_s``), off the autograd thread; CUDA
       gradients are copied on their device at the launch.
    2. Every group whose last parameter arrived in this call is launched as one backend
       operation, ``backend.allreduce_ef(buf, residual, staged, group_id, label=..., plain=[...],
       wire=state.wire)`` (fp32 ``[n_ef]`` each; it writes the average over ranks decoded from the
       wire format, bitwise equal on all ranks, into ``buf`` and the new residual into ``staged``,
       then averages each plain buffer in its own dtype). Buckets belonging to one group are thereby coalesced; a bucket
       spanning several groups (DDP's first iteration: one big bucket) is split.
    3. The returned future completes once every group overlapping ``bucket`` is done; its
       value is ``bucket.buffer()`` with the averages written in place. The step's last
       bucket's future also commits (staging -> residual, a pointer swap) if every group's
       output was finite.

    With a hook DDP does not divide by the world size: this hook averages. Every step
    (iteration 1's big bucket included) has one launch per group. From DDP's fourth synced step
    on (``early_launch=True``, the default; see :class:`BF16ErrorFeedbackState`) a group is
    launched from the post-accumulate-grad hook of its last gradient, in the order the buckets
    completed the groups in the previous steps, packed from the parameters' ``.grad``; before
    that, or with ``early_launch=False``, in the hook call of the bucket holding the group's
    last gradient, i.e. at most one bucket after the group is ready (then choose
    ``bucket_cap_mb`` at most ~1/8 of a group's fp32 gradient bytes: with DDP's default 25 MiB
    every group waits for the end of backward). Measured on a 24-block 256x256 model, groups
    of 8 blocks, DDP's default buckets, 2 ranks: the first two groups launched 3 and 8 ms after
    backward's first gradient instead of 14 and 17 ms.

    When every rank of the group shares this rank's host (``state.local_average``, the default,
    and ``backend.shm_ranks`` covering the group), the group operation would be the exact fp32
    average over shared memory, so the hook instead averages ``bucket.buffer()`` in place with one
    backend operation per bucket, as DDP's own allreduce does: no packing, no residuals (any left
    from a restore are added in once), ``stats()["totals"]["path"] == "local"``.

    Returns:
        ``torch.futures.Future[torch.Tensor]`` holding ``bucket.buffer()``.
    """
    return state._on_bucket(bucket)


def register_comm_hook(
    ddp_model: nn.parallel.DistributedDataParallel,
    layers_per_group: Union[int, None, str] = 8,
    **kwargs: Any,
) -> BF16ErrorFeedbackState:
    """Build a :class:`BF16ErrorFeedbackState` for ``ddp_model`` and register the hook.

    ``layers_per_group``: an int, ``None`` (one group) or ``"auto"`` (measured and chosen during
    the first synced steps, see :mod:`xirang.hooks.autogroup`). ``kwargs`` go to the state
    (``wire``, ``layers``, ``min_compress_numel``, ``process_group``, ``error_feedback``,
    ``auto_calibration_steps``, ...).
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
