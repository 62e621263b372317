"""What the report knows of an operation record: its phases, its ranks, its numbers."""
from __future__ import annotations

PHASES = ("queued_s", "encode_s", "scatter_reduce_s", "allgather_s", "decode_s")
BUSY_PHASES = ("encode_s", "scatter_reduce_s", "allgather_s", "decode_s")
STACK = PHASES + ("unattributed_s",)


def rank_of(r: dict) -> int:
    """The record's global rank (else its group rank)."""
    v = r.get("global_rank")
    if v is None:
        v = r.get("group_rank", 0)
    return int(v)


def grank(r: dict) -> int:
    """The record's group rank (else its global rank)."""
    v = r.get("group_rank")
    if v is None:
        v = r.get("global_rank", 0)
    return int(v)


def num(r: dict, k: str) -> float:
    """Field k as a float; 0.0 when absent, null, a bool or not a number."""
    v = r.get(k)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def unattributed(r: dict) -> float:
    """total_s minus the four busy phases (bookkeeping, copies), never negative."""
    return max(0.0, num(r, "total_s") - sum(num(r, p) for p in BUSY_PHASES))
