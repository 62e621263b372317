"""The command line: ``sudo python3 tests/cluster/netns ...`` (see the package docstring)."""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Optional, Sequence

from . import __doc__ as DOC
from .base import UPLINK_QUEUE
from .cluster import Cluster
from .launch import launch
from .measure import measure
from .probe import delay_method, netem_available, nfqueue_available, probe
from .reap import cleanup_stale


def add_cluster_args(ap: argparse.ArgumentParser, ranks_per_host: int = 1) -> None:
    """The cluster's shape and links: --racks, --hosts-per-rack, --ranks-per-host, --placement,
    --rate, --delay, --queue (what Cluster() and launch() take)."""
    ap.add_argument("--racks", type=int, default=2)
    ap.add_argument("--hosts-per-rack", type=int, default=2)
    ap.add_argument("--ranks-per-host", type=int, default=ranks_per_host)
    ap.add_argument("--placement", default="roundrobin", choices=("roundrobin", "block"))
    ap.add_argument("--rate", default="200mbit", help="rack uplink rate, each direction (tc tbf), '' for none")
    ap.add_argument("--delay", default="1ms", help="one-way cross-rack latency (netem, else the NFQUEUE "
                    "delay line delayq.py), '' for none")
    ap.add_argument("--queue", default=UPLINK_QUEUE, help="uplink queue, as tc tbf latency (the time a full queue "
                    "takes to drain at --rate)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cluster_args(ap)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--probe", action="store_true")
    ap.add_argument("--measure", action="store_true", help="bring the cluster up, print ping RTT and TCP "
                    "throughput same-rack and cross-rack, tear it down")
    ap.add_argument("--cleanup-stale", action="store_true")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.probe:
        ok, why = probe()
        print("namespaces: ok" if ok else f"namespaces: unavailable: {why}")
        print(f"netem: {'ok' if netem_available() else 'unavailable'}")
        nq, why = nfqueue_available()
        print(f"nfqueue delay line: {'ok' if nq else 'unavailable: ' + why}")
        method, why = delay_method()
        print(f"latency: {method or 'none'}{' (' + why + ')' if why else ''}")
        return 0 if ok else 1
    if a.cleanup_stale:
        cleanup_stale()
        return 0
    if a.measure:
        with Cluster(a.racks, a.hosts_per_rack, a.rate or None, a.delay or None, queue_latency=a.queue) as c:
            print(c.describe())
            for line in measure(c):
                print(line, flush=True)
        return 0
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("give a command after --")
    with Cluster(a.racks, a.hosts_per_rack, a.rate or None, a.delay or None, queue_latency=a.queue) as c:
        print(c.describe(), file=sys.stderr)
        try:
            res = launch(c, cmd, a.ranks_per_host, a.placement, timeout=a.timeout)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1
        for r in res:
            sys.stdout.write(f"--- rank {r.rank} ({r.host})\n{r.log}")
    print("cluster: " + shlex.join(cmd) + " done; cleaned up", file=sys.stderr)
    return 0
