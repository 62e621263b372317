"""Elastic mode, the Python side: membership, callbacks, admitting spares, and copying the
training state to them.

A group created with ``XIRANG_ELASTIC=1`` (or ``xirang.Options(elastic=True)``) survives lost
ranks: the survivors agree through the c10d store on the live ranks, rebuild the ring without
the dead ones and go on; every operation that was in flight raises ``xirang.MembershipChanged``
on every survivor (the comm hook's own operation is retried on the new ring instead). A spare
started with ``XIRANG_JOIN=1`` and the dead rank's ``RANK`` waits in ``init_process_group``
until the live ranks call :func:`admit_joiners` at a step boundary; then every rank calls
:func:`sync_training_state` and builds a new DDP wrapper. See README "Elastic mode".
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch.distributed as dist

from ._backend import backend_for


def membership(process_group=None) -> dict:
    """Elastic membership of `process_group` (default group) as this rank sees it.

    Returns a dict: epoch (0 until the first change), live (group ranks in the ring, ascending),
    ring (live ranks in ring order), world_size (the group's size), recoveries (changes so far),
    last_recovery_s (seconds from noticing a failure to the rebuilt ring), last_agreement_s (of
    which the agreement through the store), last_failure (the reason recorded), source (after
    spares joined: the group rank whose training state they copy; -1 otherwise).
    """
    return dict(backend_for(process_group).membership())


def on_membership_change(fn: Optional[Callable[[dict], Any]], process_group=None) -> None:
    """Call ``fn(membership_dict)`` after every change of `process_group`'s ring (default group).

    fn runs on xirang's communication thread, with the GIL, before the group's next operation:
    keep it short (e.g. record the live ranks so the data loader re-shards at the next step) and
    issue no collectives from it. Its exceptions are reported as unraisable. ``None`` removes it.
    TypeError for something else that is not callable.
    """
    if fn is not None and not callable(fn):
        raise TypeError(f"on_membership_change: fn must be callable or None, got {type(fn).__name__}")
    backend_for(process_group).set_membership_callback(fn)


def admit_joiners(expect: int = 0, wait_s: float = 0.0, process_group=None) -> List[int]:
    """Collective over the live ranks, at a step boundary: admit the spares waiting to take
    dead ranks' places. Returns the group ranks that joined ([] when none was waiting).

    Spares are admitted only if at least ``expect`` are waiting (the lowest live rank waits up
    to ``wait_s`` seconds for them): DDP's constructor needs every rank of the group, so a
    trainer that rebuilds DDP passes the number of dead ranks. When ranks join, the ring grows
    back (a new epoch) and every rank, spares included, must then call
    :func:`sync_training_state` and build a new DDP wrapper. Raises MembershipChanged if a rank
    fails meanwhile; RuntimeError without elastic mode, or (on every rank, at once) when a rank
    issued another collective instead (it starts with a barrier over the live ranks).
    """
    be = backend_for(process_group)
    before = set(be.membership()["live"])
    be.admit_joiners(int(expect), float(wait_s)).wait()
    return sorted(set(be.membership()["live"]) - before)


def sync_training_state(model, optimizer=None, step: int = 0, process_group=None) -> int:
    """After spares joined, on every live rank: copy the model's parameters and buffers, the
    optimizer state and the step counter from ``membership()['source']`` (a rank that was
    live before) to every rank. Returns the step. The comm hook's residuals are not copied: a
    spare starts with zero residuals (build its hook state fresh; survivors keep theirs).
    """
    src_group_rank = membership(process_group)["source"]
    if src_group_rank < 0:
        raise RuntimeError("xirang.sync_training_state: no spare has joined this group (membership()['source'] is -1)")
    src = src_group_rank if process_group is None else dist.get_global_rank(process_group, src_group_rank)
    me = dist.get_rank(process_group)
    objs = [model.state_dict(), optimizer.state_dict() if optimizer is not None else None, int(step)] if me == src_group_rank else [None, None, None]
    dist.broadcast_object_list(objs, src=src, group=process_group)
    if me != src_group_rank:
        model.load_state_dict(objs[0])
        if optimizer is not None and objs[1] is not None:
            optimizer.load_state_dict(objs[1])
    return int(objs[2])


def retry_on_membership_change(fn: Callable[[], Any], *tensors, max_tries: int = 5) -> Any:
    """Run ``fn()`` (collectives that work in place on ``tensors``); when it raises
    MembershipChanged, restore the tensors from copies taken before the first try and run it
    again on the rebuilt ring (the comm hook does the same for its own operation). Returns
    fn's value. Raises the last MembershipChanged after ``max_tries`` tries, ValueError for a
    ``max_tries`` below 1 (before calling ``fn``).

    Only for operations that still make sense on the shrunken ring (allreduce, broadcast from a
    live root, barrier); their results then cover the live ranks only (AVG divides by their
    number).
    """
    from ._backend import load_C

    if isinstance(max_tries, bool) or not isinstance(max_tries, int) or max_tries < 1:
        raise ValueError(f"xirang.retry_on_membership_change: max_tries must be an int >= 1, got {max_tries!r}")
    changed = load_C().MembershipChanged
    saved = [t.clone() for t in tensors]
    for attempt in range(max_tries):
        try:
            return fn()
        except changed:
            if attempt == max_tries - 1:
                raise
            for t, s in zip(tensors, saved):
                t.copy_(s)
