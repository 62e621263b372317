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

The backend must be xirang's: building the state (with the group already created) or the first
hook call raises a ``TypeError`` naming the backend it found otherwise.

Modules: ``layers`` (which modules are the layers), ``layout`` (groups and packing), ``state``
(the state class: binding, steps, launches), ``stats``, ``checkpoint`` (state_dict, pickling),
``hook`` (the hook function and ``register_comm_hook``).
"""
from .hook import bf16_error_feedback_hook, register_comm_hook
from .layers import default_layers  # noqa: F401  (public: the layer finder the state uses by default)
from .state import DEFAULT_MIN_COMPRESS_NUMEL, BF16ErrorFeedbackState

__all__ = [
    "BF16ErrorFeedbackState",
    "bf16_error_feedback_hook",
    "register_comm_hook",
    "DEFAULT_MIN_COMPRESS_NUMEL",
]
