"""Elastic mode (#8) on the emulated cluster, under torchrun: a whole host dies mid-run.

2 racks x 2 hosts (network namespaces, tests/cluster/netns: rack uplinks 200 Mbit/s, 1 ms one
way across racks) x 2 ranks per host. One torchrun agent per host, static rendezvous:

    torchrun --nnodes=4 --node-rank=i --nproc-per-node=2 --rdzv-backend=static
             --master-addr=<core address> --master-port=<port of the store this test serves>

The c10d store lives in this process (root namespace), so it outlives every host. Static
rendezvous makes node 0's agent a TCPStore *server* (`is_master = rank == 0`), but the server
binds the port inside node 0's own namespace, where nothing connects to it: the agent's own
client, the other agents and every worker (TORCHELASTIC_USE_AGENT_STORE=True, MASTER_ADDR /
MASTER_PORT = --master-addr/--master-port) all connect to <core address>:<port>, i.e. to this
process's store. So the host that dies here is node 0 itself (group ranks 0 and 1), the one that
would hold the store in a plain static torchrun job: the job survives because the store is not
really there. (On real machines, with --master-addr = node 0's own address, node 0's agent
*is* the store and its death ends the job: host the store elsewhere, as here.)

Every process of that host (its torchrun agent and both workers; not the host's NFQUEUE delay
line, which is part of the emulated network) is SIGKILLed while the ranks run 4 MiB allreduces.
The six survivors must finish all their iterations with the right values (each result equals the
sum of the inputs of the ranks live for that op: before the failure all 8, after it the 6;
an op interrupted by the failure raises xirang.MembershipChanged and is reissued, as
`_retrying` in test_elastic.py does), agree on every op, and exit 0.

torchrun's exit barrier: an agent whose workers succeeded waits in `_exit_barrier` for every
agent (store_util.barrier on "<run_id>/torchelastic/agent/terminal_state", exit_barrier_timeout
300 s, not settable from the command line) and would sit there 300 s for the dead one, then
log the timeout and still exit 0. The test checks in at that barrier on the dead agent's behalf
(one `add` on the store it serves), so the survivors' agents exit at once with their workers'
status: rc 0 of an agent = every local worker exited 0.

    sudo python3 -m pytest tests/python/test_elastic_cluster.py -q -s

This file is also the workers' script (torchrun runs it; see `worker_main`).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CLUSTER_DIR = os.path.join(os.path.dirname(HERE), "cluster")

RACKS, HOSTS_PER_RACK, NPROC = 2, 2, 2
ITERS, KILL_AT = 36, 6  # the host dies once every rank has started iteration KILL_AT
NUMEL = 1 << 20  # 4 MiB of float32 per allreduce (~0.3 s per op on this cluster)
DEAD_NODE = 0  # torchrun node rank (= host index) that dies
WALL_S = 240.0  # bound on the whole job, start-up included


# ---------------------------------------------------------------- the workers (under torchrun)
def _base(i: int):
    import torch

    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(-1000, 1000, (NUMEL,), generator=g).float()


def worker_main() -> int:
    """One rank: ITERS allreduces of base_i * (rank + 1), each checked against
    base_i * sum(r + 1 for r in live) (exact in fp32)."""
    import datetime

    import torch
    import torch.distributed as dist

    import xirang

    torch.set_num_threads(1)
    out = os.environ["XIRANG_TEST_OUT"]
    dist.init_process_group("xirang", timeout=datetime.timedelta(seconds=120))
    me = dist.get_rank()
    recs = []
    t_start = time.time()
    for i in range(ITERS):
        if i == KILL_AT:
            open(os.path.join(out, f"reached.{me}"), "w").close()
        base = _base(i)
        live_before = xirang.membership()["live"]
        x = base * float(me + 1)
        saved = x.clone()
        tries = 0
        while True:
            try:
                dist.all_reduce(x)
                break
            except xirang.MembershipChanged:  # interrupted by the failure: restore, reissue
                tries += 1
                x.copy_(saved)
                if tries > 5:
                    raise
        live_after = xirang.membership()["live"]
        matched = None
        for live in (live_after, live_before):  # an op can complete on the old ring just before the change
            if torch.equal(x, base * float(sum(r + 1 for r in live))):
                matched = live
                break
        recs.append(dict(i=i, tries=tries, live=matched, t=time.time()))
    m = xirang.membership()
    res = dict(rank=me, host=os.environ.get("XIRANG_HOST"), local_rank=int(os.environ["LOCAL_RANK"]),
               group_rank=int(os.environ.get("GROUP_RANK", "-1")), membership=m, recs=recs, t_start=t_start,
               t_end=time.time(), store=f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
               agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE"))
    tmp = os.path.join(out, f".result.{me}.tmp")
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.rename(tmp, os.path.join(out, f"result.{me}.json"))
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- the test
if __name__ != "__main__":
    import pytest

    pytestmark = [pytest.mark.xirang_only, pytest.mark.dedicated, pytest.mark.slow]


def _cluster_or_skip():
    import pytest

    sys.path.insert(0, CLUSTER_DIR)
    import netns

    if os.geteuid() != 0:
        pytest.skip("emulated cluster needs root (CAP_NET_ADMIN) for `ip netns add`")
    ok, why = netns.probe()
    if not ok:
        pytest.skip(f"emulated cluster unavailable: {why}")
    p = subprocess.run([sys.executable, "-c", "import torch.distributed, xirang"], capture_output=True, text=True,
                       timeout=120)
    if p.returncode != 0:
        if "ImportError" in p.stderr or "ModuleNotFoundError" in p.stderr:
            if os.environ.get("XIRANG_TEST_REQUIRE") == "1":
                pytest.fail(f"xirang required but import failed: {p.stderr[-2000:]}")
            pytest.skip("xirang._C not built")
        pytest.fail(f"import xirang failed: {p.stderr[-2000:]}")
    return netns


def _ns_pids(ns: str) -> list:
    p = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    return [int(t) for t in p.stdout.split() if t.isdigit()]


def _tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def test_host_dies_under_torchrun():
    import datetime

    import torch.distributed as dist

    netns = _cluster_or_skip()
    out = tempfile.mkdtemp(prefix="xrel_cluster_")
    os.chmod(out, 0o777)
    cluster = netns.Cluster(racks=RACKS, hosts_per_rack=HOSTS_PER_RACK, rate="200mbit", delay="1ms")
    prefix = cluster.prefix
    H, ws = RACKS * HOSTS_PER_RACK, RACKS * HOSTS_PER_RACK * NPROC
    dead_ranks = [DEAD_NODE * NPROC + j for j in range(NPROC)]
    survivors = [r for r in range(ws) if r not in dead_ranks]
    agents, logs = [], []
    store = None
    t0 = time.monotonic()
    try:
        cluster.up()
        print(cluster.describe())
        store = dist.TCPStore("0.0.0.0", 0, world_size=None, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=120))
        run_id = f"{prefix}run"
        for h in cluster.hosts:
            log = os.path.join(out, f"agent{h.index}.log")
            logs.append(log)
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={H}", f"--node-rank={h.index}",
                   f"--nproc-per-node={NPROC}", "--rdzv-backend=static", f"--master-addr={cluster.store_addr}",
                   f"--master-port={store.port}", f"--rdzv-id={run_id}", "--max-restarts=0",
                   "--monitor-interval=0.2", os.path.abspath(__file__)]
            env = {"XIRANG_ELASTIC": "1", "XIRANG_HEARTBEAT_S": "1.0", "XIRANG_TEST_OUT": out,
                   "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            with open(log, "w") as f:
                agents.append(cluster.popen(h, cmd, env, stdout=f, stderr=subprocess.STDOUT))
        deadline = t0 + WALL_S

        def check_agents(what, skip=()):
            bad = {i: p.poll() for i, p in enumerate(agents) if i not in skip and p.poll() not in (None, 0)}
            assert not bad, f"{what}: agents exited {bad}\n" + "\n".join(
                f"--- agent {i}:\n{_tail(logs[i])}" for i in bad)

        # every rank reached iteration KILL_AT (its allreduces are running), then the host dies
        while not all(os.path.exists(os.path.join(out, f"reached.{r}")) for r in range(ws)):
            check_agents("before the kill")
            assert time.monotonic() < deadline, "ranks did not reach the kill point\n" + "\n".join(
                f"--- agent {i}:\n{_tail(p)}" for i, p in enumerate(logs))
            time.sleep(0.02)
        dead = cluster.hosts[DEAD_NODE]
        if shutil.which("ss"):  # node 0's agent did start a store server, in its own namespace
            lst = subprocess.run(["ip", "netns", "exec", dead.ns, "ss", "-ltnH", f"sport = :{store.port}"],
                                 capture_output=True, text=True, timeout=30).stdout
            print(f"listening on port {store.port} inside {dead.ns} (node 0's agent, unused): {lst.strip()!r}")
        keep = {p.pid for p in cluster._delay_procs}  # the emulated network, not the host
        victims = [pid for pid in _ns_pids(dead.ns) if pid not in keep]
        assert agents[DEAD_NODE].pid in victims
        t_kill = time.time()
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        print(f"killed host {dead.ns} (node rank {DEAD_NODE}, ranks {dead_ranks}): pids {victims}")
        # torchrun's exit barrier: check in for the dead agent so the others do not wait 300 s
        ps = dist.PrefixStore(run_id, store)
        key = "torchelastic/agent/terminal_state"
        if ps.add(key + "/num_members", 1) == H:
            ps.set(key + "/last_member", "<val_ignored>")

        while any(agents[i].poll() is None for i in range(H) if i != DEAD_NODE):
            check_agents("after the kill", skip=(DEAD_NODE,))
            assert time.monotonic() < deadline, f"surviving agents still running after {WALL_S} s\n" + "\n".join(
                f"--- agent {i}:\n{_tail(p)}" for i, p in enumerate(logs))
            time.sleep(0.1)
        check_agents("at the end", skip=(DEAD_NODE,))
        assert agents[DEAD_NODE].poll() == -signal.SIGKILL
        res = {}
        for r in survivors:
            with open(os.path.join(out, f"result.{r}.json")) as f:
                res[r] = json.load(f)
        elapsed = time.monotonic() - t0
    finally:
        cluster.down()  # kills the agents (started through cluster.popen) and their ranks
        del store
        shutil.rmtree(out, ignore_errors=True)
    assert netns.leftovers(prefix) == [], "namespaces/links left behind"

    by_ns = {h.ns: h for h in cluster.hosts}
    for r in survivors:
        d, m = res[r], res[r]["membership"]
        h = by_ns[d["host"]]
        assert h.index == r // NPROC, (r, d["host"])  # static rendezvous: rank = node rank * nproc + local
        assert d["store"] == f"{cluster.store_addr}:{d['store'].rsplit(':', 1)[1]}" and d["agent_store"] == "True"
        assert m["live"] == survivors, (r, m)
        assert m["epoch"] >= 1 and m["recoveries"] == m["epoch"], (r, m)
        assert len(d["recs"]) == ITERS
        bad = [x for x in d["recs"] if x["live"] is None]
        assert not bad, f"rank {r}: wrong allreduce results at iterations {[x['i'] for x in bad]}"
        assert all(x["live"] == list(range(ws)) for x in d["recs"][:KILL_AT]), f"rank {r}: {d['recs'][:KILL_AT]}"
        assert d["recs"][-1]["live"] == survivors
    # the survivors agree on every op: which ranks it summed and whether it had to be reissued
    seqs = {r: [(x["live"], x["tries"]) for x in res[r]["recs"]] for r in survivors}
    assert len({json.dumps(s) for s in seqs.values()}) == 1, seqs
    first_new = next(x for x in res[survivors[0]]["recs"] if x["live"] == survivors)
    done = max(next(x["t"] for x in res[r]["recs"] if x["live"] == survivors) for r in survivors)
    m = res[survivors[0]]["membership"]
    print(f"survivors {survivors}: epoch {m['epoch']}, recovery {m['last_recovery_s']:.3f} s (agreement "
          f"{m['last_agreement_s']:.3f} s), first op on the new ring: iteration {first_new['i']} "
          f"(reissued {first_new['tries']}x), kill -> that op done on every survivor {done - t_kill:.2f} s; "
          f"reason: {m.get('last_failure')!r}; whole test {elapsed:.0f} s")
    assert done - t_kill < 30.0


if __name__ == "__main__":
    sys.exit(worker_main())
