"""Names, constants and the two tools (ip, tc) every part of the emulated cluster uses."""
from __future__ import annotations

import os
import subprocess
from typing import Optional

BASE = "xrc"  # every object this package creates starts with it (namespaces, links)
IFNAME = "xeth0"  # the host's interface inside its namespace
DELAYQ = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "delayq.py")  # NFQUEUE delay line
NFQUEUE_NUM = 0  # netfilter queue of the delay line (queues are per namespace)
UPLINK_QUEUE = "5ms"  # rack uplink queue, as tc tbf latency (see the package docstring)


class ClusterUnavailable(RuntimeError):
    """The machine does not allow what the cluster needs (namespaces, veth, bridges, tc)."""


def ip(*args: str, check: bool = True, ns: Optional[str] = None) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc={p.returncode}): {p.stderr.strip()}")
    return p


def tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} failed (rc={p.returncode}): {p.stderr.strip()}")
    return p


def pid_tag(pid: int) -> str:
    """5 base-36 characters from the pid (pids < 36**5 = 60M are exact): names stay <= 15 chars."""
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    for _ in range(5):
        pid, d = divmod(pid, 36)
        out = digits[d] + out
    return out


def tag_pid(tag: str) -> int:
    return int(tag, 36)


def seconds(t: str) -> float:
    """'1ms', '500us', '0.002s' -> seconds."""
    return float(half_time(t)[:-2]) * 2e-6


def half_time(t: str) -> str:
    t = t.strip()
    for suf, mult in (("us", 1), ("ms", 1000), ("s", 1_000_000)):
        if t.endswith(suf):
            try:
                v = float(t[: -len(suf)]) * mult
                return f"{v / 2:g}us"
            except ValueError:
                break
    raise ValueError(f"cannot parse delay {t!r} (e.g. 1ms, 500us)")
