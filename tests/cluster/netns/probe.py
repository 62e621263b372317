"""What this machine allows: namespaces, veth, bridges and tc (probe), and how cross-rack latency
can be added (netem, else the NFQUEUE delay line); ping RTTs."""
from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import time
from typing import Optional, Sequence

from .base import BASE, DELAYQ, NFQUEUE_NUM, ip, pid_tag, tc
from .reap import reap


def probe() -> tuple[bool, str]:
    """(True, "") when namespaces, veth pairs, bridges and tc tbf can be created here, else
    (False, why). Creates and deletes a throw-away namespace and links."""
    for tool in ("ip", "tc"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode != 0:
            return False, f"`{tool}` (iproute2) is not installed"
    tag = f"{BASE}{pid_tag(os.getpid())}"
    ns, a, b = f"{tag}p", f"{tag}pa", f"{tag}pb"
    try:
        p = ip("netns", "add", ns, check=False)
        if p.returncode != 0:
            return False, f"`ip netns add` is not permitted here: {p.stderr.strip()}"
        for args, what in (
            (("link", "add", a, "type", "veth", "peer", "name", b), "veth pairs"),
            (("link", "add", f"{tag}pc", "type", "bridge"), "bridges"),
            (("link", "set", b, "netns", ns), "moving a link into a namespace"),
        ):
            p = ip(*args, check=False)
            if p.returncode != 0:
                return False, f"cannot create {what}: {p.stderr.strip()}"
        p = tc("qdisc", "add", "dev", a, "root", "tbf", "rate", "100mbit", "burst", "64kb",
                "latency", "20ms", check=False)
        if p.returncode != 0:
            return False, f"tc tbf is not available: {p.stderr.strip()}"
        return True, ""
    finally:
        ip("link", "del", a, check=False)
        ip("link", "del", f"{tag}pc", check=False)
        ip("netns", "del", ns, check=False)


def netem_available() -> bool:
    tag = f"{BASE}{pid_tag(os.getpid())}"
    a, b = f"{tag}qa", f"{tag}qb"
    try:
        if ip("link", "add", a, "type", "veth", "peer", "name", b, check=False).returncode != 0:
            return False
        return tc("qdisc", "add", "dev", a, "root", "netem", "delay", "1ms", check=False).returncode == 0
    finally:
        ip("link", "del", a, check=False)


def start_delayq(argv_prefix: Sequence[str], delay: str, popen=subprocess.Popen,
                  timeout: float = 15.0) -> tuple[subprocess.Popen, str]:
    """Start delayq.py (after argv_prefix, e.g. `ip netns exec NS`) and wait for its "ready".
    Returns (process, "") or (process, why) when it did not get ready (the caller kills it)."""
    pr = popen([*argv_prefix, sys.executable, DELAYQ, "--queue", str(NFQUEUE_NUM), "--delay", delay],
               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    line = ""
    while time.monotonic() < deadline:
        r, _, _ = select.select([pr.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not r:
            break
        line = pr.stdout.readline()
        if not line or line.strip() == "ready":
            break
    if line.strip() == "ready":
        return pr, ""
    if pr.poll() is None:
        pr.kill()
    rest = pr.communicate(timeout=10)[0] if pr.stdout else ""
    return pr, ((line + rest).strip() or f"no 'ready' within {timeout:g} s (rc={pr.returncode})")


def nfqueue_available() -> tuple[bool, str]:
    """(True, "") when the userspace delay line works here: iptables with the NFQUEUE target in a
    network namespace and delayq.py binding a netfilter queue; else (False, why). Uses a
    throw-away namespace."""
    if shutil.which("iptables") is None:
        return False, "`iptables` is not installed (apt-get install iptables)"
    if not os.path.exists(DELAYQ):
        return False, f"{DELAYQ} is missing"
    ns = f"{BASE}{pid_tag(os.getpid())}q"
    pr = None
    try:
        p = ip("netns", "add", ns, check=False)
        if p.returncode != 0:
            return False, f"`ip netns add` failed: {p.stderr.strip()}"
        pr, why = start_delayq(["ip", "netns", "exec", ns], "1ms")
        if why:
            return False, f"delayq.py cannot bind a netfilter queue: {why}"
        p = subprocess.run(["ip", "netns", "exec", ns, "iptables", "-w", "-A", "OUTPUT", "-m", "iprange",
                            "--dst-range", "127.0.0.2-127.0.0.3", "-j", "NFQUEUE", "--queue-num",
                            str(NFQUEUE_NUM)], capture_output=True, text=True, timeout=30)
        if p.returncode != 0:
            return False, f"iptables NFQUEUE rule refused: {p.stderr.strip()}"
        return True, ""
    finally:
        if pr is not None:
            reap([pr])
        ip("netns", "del", ns, check=False)


def delay_method() -> tuple[Optional[str], str]:
    """How this machine can add cross-rack latency: ("netem", ""), ("nfqueue", why netem is not
    used) or (None, why nothing works)."""
    if netem_available():
        return "netem", ""
    ok, why = nfqueue_available()
    if ok:
        return "nfqueue", "sch_netem is not available in this kernel"
    return None, f"sch_netem is not available in this kernel, and the NFQUEUE delay line neither: {why}"


def ping_rtt_ms(ns: str, ip: str, count: int = 10, interval: float = 0.02) -> Optional[dict]:
    """min/avg/max/mdev of `ping` from namespace ns to ip (ms), None without ping or on failure."""
    if shutil.which("ping") is None:
        return None
    p = subprocess.run(["ip", "netns", "exec", ns, "ping", "-q", "-n", "-c", str(count), "-i", str(interval),
                        "-W", "2", ip], capture_output=True, text=True, timeout=30 + count * interval)
    for line in p.stdout.splitlines():
        if "min/avg/max" in line:
            vals = line.split("=")[1].split()[0].split("/")
            return dict(zip(("min", "avg", "max", "mdev"), map(float, vals)))
    return None
