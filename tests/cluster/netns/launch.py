"""Running a job on the cluster: rank placement, ranks started directly (launch) or one torchrun
agent per host (launch_torchrun), each with a rendezvous store served in the root namespace."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from typing import Optional, Sequence

from .cluster import Cluster, Host
from .reap import reap


def placement(cluster: Cluster, ranks_per_host: int, mode: str = "roundrobin") -> list[Host]:
    """Host of every rank. 'block': ranks r*rph..r*rph+rph-1 on host r (hosts rack by rack, what
    torchrun with --node-rank in rack order does). 'roundrobin': consecutive ranks alternate racks,
    then hosts inside a rack, then slots (rank r -> rack r % R, host (r // R) % H, slot r // (R*H))."""
    R, H = cluster.racks, cluster.hosts_per_rack
    ws = R * H * ranks_per_host
    if mode == "block":
        return [cluster.hosts[r // ranks_per_host] for r in range(ws)]
    if mode == "roundrobin":
        return [cluster.hosts_in_rack(r % R)[(r // R) % H] for r in range(ws)]
    raise ValueError(f"placement must be block or roundrobin, got {mode!r}")


@dataclasses.dataclass
class RankResult:
    rank: int
    host: str
    returncode: Optional[int]
    log: str


def launch(cluster: Cluster, argv: Sequence[str], ranks_per_host: int = 1, mode: str = "roundrobin",
           env: Optional[dict] = None, timeout: float = 300.0, log_dir: Optional[str] = None,
           store_timeout: float = 120.0) -> list[RankResult]:
    """Run argv as every rank (RANK/WORLD_SIZE/... in the environment) and wait for all of them.

    A TCPStore served here (root namespace, on the core bridge's address) is the rendezvous.
    Returns per-rank results; raises RuntimeError (with the logs' tails) when a rank fails or the
    timeout passes. All ranks are killed before it returns or raises.
    """
    import datetime

    import torch.distributed as dist

    hosts = placement(cluster, ranks_per_host, mode)
    ws = len(hosts)
    store = dist.TCPStore("0.0.0.0", 0, world_size=None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=store_timeout))
    log_dir = log_dir or cluster._tmp
    os.makedirs(log_dir, exist_ok=True)
    procs, logs = [], []
    local_count: dict = {}
    try:
        for r, h in enumerate(hosts):
            lr = local_count.get(h.ns, 0)
            local_count[h.ns] = lr + 1
            path = os.path.join(log_dir, f"rank{r}.log")
            logs.append(path)
            f = open(path, "w")
            renv = {
                "RANK": r, "WORLD_SIZE": ws, "LOCAL_RANK": lr, "LOCAL_WORLD_SIZE": ranks_per_host,
                "GROUP_RANK": h.index, "MASTER_ADDR": cluster.store_addr, "MASTER_PORT": store.port,
                "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1",
                "XIRANG_TEST_RACK": h.rack,
            }
            renv.update(env or {})
            procs.append(cluster.popen(h, argv, renv, stdout=f, stderr=subprocess.STDOUT))
            f.close()
        deadline = time.monotonic() + timeout
        failed = None
        while True:
            rcs = [p.poll() for p in procs]
            bad = [r for r, rc in enumerate(rcs) if rc not in (None, 0)]
            if bad and failed is None:
                failed = bad
                deadline = min(deadline, time.monotonic() + 10.0)  # others get 10 s to notice
            if all(rc is not None for rc in rcs):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        rcs = [p.poll() for p in procs]
        why = "timed out" if any(rc is None for rc in rcs) and not failed else f"ranks {failed or []} failed"
        return _results([(r, hosts[r].ns) for r in range(ws)], rcs, logs, f"launch {why}; rc per rank",
                        lambda x: f"rank {x.rank} on {x.host}")
    finally:
        reap(procs)
        del store


def launch_torchrun(cluster: Cluster, argv: Sequence[str], nproc_per_host: int = 1, env: Optional[dict] = None,
                    timeout: float = 300.0, log_dir: Optional[str] = None) -> list[RankResult]:
    """One torchrun agent per host (its namespace), c10d rendezvous on a TCPStore served here in
    the root namespace (`--rdzv-conf is_host=false`: every agent is a client of it). Node ranks
    follow the agents' arrival, so which rank lands where is torchrun's choice; the workers read
    their placement from XIRANG_HOST. argv is the training script and its arguments. Returns
    one RankResult per host (the agent's log, workers' output included); raises RuntimeError
    when an agent fails or the timeout passes; all agents are killed before it returns."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("0.0.0.0", 0, world_size=None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120), multi_tenant=True)
    log_dir = log_dir or cluster._tmp
    procs, logs = [], []
    try:
        for h in cluster.hosts:
            path = os.path.join(log_dir, f"agent{h.index}.log")
            logs.append(path)
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(cluster.hosts)}",
                   f"--nproc-per-node={nproc_per_host}", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint={cluster.store_addr}:{store.port}", f"--rdzv-id={cluster.prefix}",
                   "--rdzv-conf=is_host=false", "--max-restarts=0", "--monitor-interval=0.5",
                   f"--local-addr={h.ip}", *argv]
            with open(path, "w") as f:
                procs.append(cluster.popen(h, cmd, dict({"OMP_NUM_THREADS": "1"}, **(env or {})),
                                           stdout=f, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + 15.0)
            time.sleep(0.1)
        rcs = [p.poll() for p in procs]
        return _results([(h.index, h.ns) for h in cluster.hosts], rcs, logs,
                        "torchrun launch failed or timed out; rc per host", lambda x: f"agent on {x.host}")
    finally:
        reap(procs)
        del store


def _results(who: list, rcs: list, logs: list, failure: str, label) -> list[RankResult]:
    """One RankResult per (rank, host) in ``who`` with its log; RuntimeError ``failure rcs`` and the
    failed ones' log tails (each headed by ``label(result)``) when any return code is not 0."""
    results = [RankResult(r, host, rc, read_text(log)) for (r, host), rc, log in zip(who, rcs, logs)]
    if any(rc != 0 for rc in rcs):
        tails = "\n".join(f"--- {label(x)} rc={x.returncode}:\n{x.log[-3000:]}" for x in results if x.returncode != 0)
        raise RuntimeError(f"{failure} {rcs}\n{tails}")
    return results


def read_text(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""
