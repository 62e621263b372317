"""xirang: a torch.distributed backend ("xirang") and a DDP comm hook that sends BF16 on the
wire with fp32 accumulation and complete error feedback, reduced per group of layers while
backward runs.

    import xirang, torch.distributed as dist
    dist.init_process_group("xirang")              # under torchrun
    state = xirang.register_comm_hook(ddp_model)   # BF16 + error feedback, 8 layers a group
    comp = xirang.fsdp.compress(fsdp_model)        # FSDP2: bf16 reduce-scatter + error feedback

`import xirang` registers the backend once per process (devices cpu and cuda); an entry point
in `torch.backends` does the same during `import torch`, without loading the extension.
"""
from __future__ import annotations

from . import _build_info
from ._backend import Options, TorchVersionMismatch, backend_for as _backend_for
from ._entry import register as _register
from .elastic import admit_joiners, membership, on_membership_change, retry_on_membership_change, sync_training_state

__version__ = _build_info.XIRANG_VERSION

_register()


def build_info() -> dict:
    """What this xirang was built with.

    Returns a dict: xirang (version), torch (the version built against), torch_running,
    cuda (CUDA version of the CUDA path, None when not built), nccl (the version of the
    libnccl.so.2 xirang loaded at run time, e.g. '2.27.3'; None before a group with
    XIRANG_CUDA_TRANSPORT=nccl, or the first CUDA collective of a group with auto, loaded it, and in a
    build without the CUDA path; torch's own is
    torch.cuda.nccl.version()),
    compiler, codec (SIMD path in use: 'avx512bf16', 'avx2' or 'scalar').
    Raises TorchVersionMismatch if the running torch differs from the one built against.
    """
    import torch

    from ._backend import load_C

    C = load_C()
    return {
        "xirang": _build_info.XIRANG_VERSION,
        "torch": _build_info.TORCH_VERSION,
        "torch_running": torch.__version__,
        "cuda": _build_info.CUDA,
        "nccl": C.nccl_version(),
        "compiler": C.COMPILER,
        "codec": C.codec_path(),
    }


def env_knobs() -> list:
    """Every XIRANG_* environment knob as (name, default, help, type, read), as declared in csrc/core/env.cc.

    type: 'string', 'int', 'float' or 'bool'; read: when it is read ('process': at first use,
    then cached; 'group': at each group creation; 'op': at each operation; 'call': at each call
    of the function its help names).
    """
    from ._backend import load_C

    return [tuple(k) for k in load_C().env_knobs()]


def stats(process_group=None, gather: bool = False):
    """This rank's operation records on `process_group` (default group), oldest first.

    Each record is a dict: seq, op, algorithm, group_id (the hook's layer group, -1 otherwise),
    label (the group's layer names), dtype, numel, bytes_raw, bytes_wire (payload bytes this rank
    sent; headers excluded), bytes_tcp and bytes_shm (of them, over TCP sockets / written into the
    same-host shared memory, XIRANG_TRANSPORT_LOCAL), bytes_cross_host, bytes_cross_rack, t_enqueue,
    queued_s, pack_s (the hook's op: its gradients copied into the group's buffers), encode_s,
    scatter_reduce_s, allgather_s, decode_s, total_s (seconds), ok, on_caller (True: a small
    synchronous operation that found the group idle ran on the caller's own thread, see
    XIRANG_SMALL_BYTES), engine ("host" for CPU tensors; CUDA tensors: "mirror" (pinned host mirrors
    and the CPU engine), "staged" (device kernels, the bytes sent staged through pinned memory) or
    "nccl"), peers, exposed_wait_s.

    exposed_wait_s: seconds the caller's threads spent blocked in ``Work.wait()`` on the operation
    (the exposed part of its communication), as of this call; None while no ``Work.wait()`` has
    begun. Counted: ``work.wait()`` and the synchronous collectives (``async_op=False``, which call
    it; for one that ran on the caller's thread, all of its time). Not counted:
    ``work.get_future().wait()`` and so DDP's wait on comm-hook futures at the end of backward (the
    report estimates those), ``is_completed()`` polling, and on CUDA the stream wait (the CPU does
    not block). Two threads waiting on one Work count twice.
    The JSON lines (``XIRANG_STATS_DIR``) are written when the operation completes and carry what
    was known then: the blocked time up to completion if a caller was already waiting (short of
    the wake-up, microseconds), else null, also for a wait that begins later.
    Groups created with ``XIRANG_STATS=0`` keep no records (an empty list).

    gather=True: a collective over `process_group` (every rank must call it); group rank 0 gets a
    list indexed by group rank of each rank's records (taken before the gather, so the gather's
    own operations are not in them), the other ranks get None.
    """
    recs = list(_backend_for(process_group).records())
    if not gather:
        return recs
    import torch.distributed as dist

    rank = dist.get_rank(process_group)
    out = [None] * dist.get_world_size(process_group) if rank == 0 else None
    dst = 0 if process_group is None else dist.get_global_rank(process_group, 0)
    dist.gather_object(recs, out, dst=dst, group=process_group)
    return out


def __dir__():
    return sorted(list(globals()) + ["MembershipChanged", "fsdp"])


def __getattr__(name):
    # xirang.MembershipChanged lives in the extension; load it only when asked for.
    if name == "MembershipChanged":
        from ._backend import load_C

        return load_C().MembershipChanged
    if name == "fsdp":  # loaded on first use: it imports torch.distributed.fsdp
        import importlib

        return importlib.import_module(".fsdp", __name__)
    raise AttributeError(f"module 'xirang' has no attribute {name!r}")


from . import hooks  # noqa: E402  (pure Python over the backend; loads no extension)
from .hooks import register_comm_hook  # noqa: E402,F401

__all__ = [
    "Options",
    "TorchVersionMismatch",
    "MembershipChanged",
    "build_info",
    "env_knobs",
    "stats",
    "membership",
    "on_membership_change",
    "admit_joiners",
    "retry_on_membership_change",
    "sync_training_state",
    "register_comm_hook",
    "hooks",
    "fsdp",
]
