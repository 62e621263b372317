"""The one reaper: killing what the cluster started, and removing what is left of clusters."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Iterable

from .base import BASE, ip, pid_tag, tag_pid


def reap(procs: Iterable[subprocess.Popen], timeout: float = 10.0) -> None:
    """SIGKILL each live process's process group (the process alone if it has none of its own),
    then wait for every one, at most ``timeout`` seconds each."""
    procs = list(procs)
    for pr in procs:
        if pr.poll() is None:
            try:
                os.killpg(pr.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                try:
                    pr.kill()
                except ProcessLookupError:
                    pass
    for pr in procs:
        try:
            pr.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass


def list_namespaces() -> list[str]:
    p = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def list_links() -> list[str]:
    p = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30)
    out = []
    for line in p.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            out.append(parts[1].strip().split("@")[0])
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(verbose: bool = True) -> list[str]:
    """Delete namespaces and links named BASE+tag whose creator pid (from the tag) is dead."""
    removed = []
    mine = pid_tag(os.getpid())
    for kind, names in (("netns", list_namespaces()), ("link", list_links())):
        for name in names:
            if not name.startswith(BASE) or len(name) < len(BASE) + 5:
                continue
            tag = name[len(BASE):len(BASE) + 5]
            try:
                pid = tag_pid(tag)
            except ValueError:
                continue
            if tag == mine or _pid_alive(pid):
                continue
            if kind == "netns":
                kill_ns_pids(name)
                ip("netns", "del", name, check=False)
            else:
                ip("link", "del", name, check=False)
            removed.append(name)
            if verbose:
                print(f"netns: removed stale {kind} {name}", file=sys.stderr)
    return removed


def kill_ns_pids(ns: str) -> None:
    p = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    for tok in p.stdout.split():
        try:
            os.kill(int(tok), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass


def leftovers(prefix: str) -> list[str]:
    """Namespaces and links whose name contains ``prefix`` (a cluster's objects still there)."""
    return [n for n in list_namespaces() + list_links() if prefix in n]
