#!/usr/bin/env python3
"""Elastic mode: how long the survivors take to go on after a rank (or a host) dies.

    python3 benchmarks/elastic.py                      # loopback WS 2..8 x 3 trials, then the emulated cluster (~1.5 min)
    python3 benchmarks/elastic.py --ws 4,8 --trials 10 --size 16M --markdown --json /tmp/el.json
    sudo python3 benchmarks/elastic.py --no-loopback --cluster-modes kill,cut

A trial: WS ranks with XIRANG_ELASTIC=1 rendezvous on a c10d TCPStore served by this process (so
the store outlives every rank), run `--warmup` float32 SUM allreduces of `--size` (checked), say
"ready" and go on issuing allreduces back to back; this process waits a random 0.05-0.3 s (so the
kill lands inside an allreduce), takes t_kill = time.time(), SIGKILLs the victim(s) and writes
t_kill to the store. Every survivor goes on like a plain training loop: an allreduce that raises
xirang.MembershipChanged is reissued with its input restored (`_retrying` in
tests/python/test_elastic.py); the first allreduce whose result is the sum of the inputs of the
new live ranks (every rank contributes rank+1) is "the next collective", and its completion time
(time.time() on the survivor, same clock) is compared with t_kill. Fresh ranks for every trial.

Columns (per trial the slowest survivor, then median / max over the trials):
    detect -> new ring   xirang.membership()['last_recovery_s']: from the moment a survivor
                         noticed the failure (a broken connection, a missed heartbeat, a report
                         in the store) to its rebuilt ring
    of which agreement   membership()['last_agreement_s']: agreeing through the store on the
                         live ranks (it waits for the dead ranks' heartbeats to go stale:
                         XIRANG_HEARTBEAT_S, default 1.0 s)
    kill -> op raised    t_kill to the MembershipChanged of the op in flight (survivors whose op
                         raised; an op can also complete before the failure is noticed)
    failure -> next allreduce done
                         t_kill to the completion of the first allreduce on the new ring, on every
                         survivor: detection + agreement + rebuild + one reissued allreduce of --size
    allreduce ms         median time of one allreduce before the failure, slowest rank

Where:
    loopback    every rank on 127.0.0.1 (2 shared cores here: read the absolute values with the load
                average printed); the victim rotates over WS-1, WS//2 and 0 (rank 0 included)
    cluster     tests/cluster/netns: 2 racks x 2 hosts (network namespaces, rack uplinks 200 Mbit/s
                with tc tbf, 1 ms one way across racks), 1 and 2 ranks per host, ranks placed round-robin
                across racks; the victim is a whole host: every rank on it is SIGKILLed at once
                (mode `kill`: a process crash, the host's kernel still closes the connections) or,
                with mode `cut`, the host's link goes down first and then its ranks are killed (a host
                that vanishes: no FIN/RST, the survivors see only missed heartbeats). Needs root;
                skipped with the reason where namespaces are unavailable. Measured here: `kill` is
                noticed at once (a closed connection), `cut` only after XIRANG_HEARTBEAT_S of
                silence, and the agreement then waits for the stale heartbeats once more, so a
                vanished host costs about 2 x XIRANG_HEARTBEAT_S before the reissued op.

Ranks are forked from a fork server that imported torch once (`multiprocessing` forkserver with
preload), so a trial costs no torch import; on the cluster a forked rank enters its host's network
namespace with setns(2) before it connects. (benchmarks/_ranks.py's run_ranks is not used for the
ranks: it hosts the store in rank 0 and treats a rank that exits as a failure of the job.)
`XIRANG_*` knobs in the environment reach the ranks (e.g. XIRANG_HEARTBEAT_S=0.5).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
CLUSTER_DIR = os.path.join(os.path.dirname(HERE), "tests", "cluster")

MiB = 1 << 20


def parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("B").removesuffix("I")
    for suf, m in (("K", 1 << 10), ("M", MiB), ("G", 1 << 30)):
        if s.endswith(suf):
            return int(float(s[:-1]) * m)
    return int(s)


def fmt_bytes(n: int) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------- one rank (forked)
def _setns(name: str) -> None:
    """Move this (single-threaded, freshly forked) process into network namespace `name`."""
    import ctypes

    CLONE_NEWNET = 0x40000000
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"setns({name}): {os.strerror(e)}")
    finally:
        os.close(fd)


def rank_main(rank: int, ws: int, addr: str, port: int, prefix: str, cfg: dict, netns: str | None,
              env: dict) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    if cfg.get("log_dir"):  # the ranks' xirang warnings (failure noticed, ring rebuilt) go to a file
        fd = os.open(os.path.join(cfg["log_dir"], f"{prefix}.rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    if netns:
        _setns(netns)
    os.environ.update({k: str(v) for k, v in env.items()})
    store = None
    try:
        import xirang

        torch.set_num_threads(1)
        base = dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=cfg["timeout"]))
        store = dist.PrefixStore(prefix, base)
        dist.init_process_group("xirang", store=dist.PrefixStore("pg", store), rank=rank, world_size=ws,
                                timeout=datetime.timedelta(seconds=cfg["op_timeout"]))
        n = cfg["size"] // 4
        t = torch.empty(n)
        full = float(ws * (ws + 1) // 2)
        times = []
        for _ in range(cfg["warmup"]):
            t.fill_(rank + 1)
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
            if t[0].item() != full or t[-1].item() != full:
                raise RuntimeError(f"rank {rank}: warmup allreduce gave {t[0].item()}, want {full}")
        store.set(f"ready/{rank}", "1")
        deadline = time.monotonic() + cfg["trial_timeout"]
        raised_at, tries, ops = None, 0, 0
        while True:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank}: no allreduce completed on a new ring within {cfg['trial_timeout']} s")
            t.fill_(rank + 1)
            t0 = time.perf_counter()
            try:
                dist.all_reduce(t)
            except xirang.MembershipChanged:
                if raised_at is None:
                    raised_at = time.time()
                tries += 1
                continue  # the input is restored by the fill at the top
            t_done = time.time()
            ops += 1
            m = xirang.membership()
            want = float(sum(r + 1 for r in m["live"]))
            if m["epoch"] >= 1 and t[0].item() == want and t[-1].item() == want:
                if not torch.all(t == want):
                    raise RuntimeError(f"rank {rank}: allreduce on the new ring is wrong (want {want})")
                break
            if m["epoch"] == 0:
                times.append(time.perf_counter() - t0)
        res = dict(rank=rank, t_done=t_done, raised_at=raised_at, tries=tries, ops=ops,
                   op_s=statistics.median(times), membership=dict(m))
        store.set(f"res/{rank}", json.dumps(res))
        dist.destroy_process_group()
    except BaseException:
        if store is not None:
            try:
                store.set(f"err/{rank}", traceback.format_exc())
            except Exception:
                pass
        raise


# ---------------------------------------------------------------- the driver side
class Launcher:
    """Forks ranks from a fork server that has torch and xirang imported."""

    def __init__(self):
        import multiprocessing as mp

        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["torch", "torch.distributed", "xirang"])

    def start(self, *args):
        p = self.ctx.Process(target=rank_main, args=args, daemon=True)
        p.start()
        return p


def run_trial(launcher, store, tag: str, ws: int, victims: list, cfg: dict, placement=None,
              on_kill=None) -> dict:
    """One trial. placement: per rank (netns name, env) on the cluster, None on loopback.
    Returns the per-survivor results and t_kill."""
    import torch.distributed as dist

    ps = dist.PrefixStore(tag, store)
    addr = cfg["store_addr"]
    procs = []
    try:
        for r in range(ws):
            ns, env = placement[r] if placement else (None, {})
            procs.append(launcher.start(r, ws, addr, store.port, tag, cfg, ns, env))
        deadline = time.monotonic() + cfg["timeout"]

        def check_errors(ranks):
            for r in ranks:
                if ps.check([f"err/{r}"]):
                    raise RuntimeError(f"{tag}: rank {r} failed:\n{ps.get(f'err/{r}').decode()}")
                if procs[r].exitcode not in (None, 0):
                    raise RuntimeError(f"{tag}: rank {r} exited with {procs[r].exitcode}")

        while not ps.check([f"ready/{r}" for r in range(ws)]):
            check_errors(range(ws))
            if time.monotonic() > deadline:
                raise RuntimeError(f"{tag}: ranks not ready within {cfg['timeout']} s")
            time.sleep(0.02)
        time.sleep(cfg["rng"].uniform(0.05, 0.3))
        t_kill = time.time()
        if on_kill:
            on_kill("before")  # cut: the host's link goes down first
        for r in victims:
            os.kill(procs[r].pid, 9)
        ps.set("kill_ts", repr(t_kill))
        survivors = [r for r in range(ws) if r not in victims]
        deadline = time.monotonic() + cfg["trial_timeout"] + 10
        while not ps.check([f"res/{r}" for r in survivors]):
            check_errors(survivors)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{tag}: survivors did not report within {cfg['trial_timeout']} s")
            time.sleep(0.02)
        res = {r: json.loads(ps.get(f"res/{r}").decode()) for r in survivors}
        return dict(t_kill=t_kill, res=res, survivors=survivors, victims=victims)
    finally:
        if on_kill:
            on_kill("after")
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def summarize(where: str, ws: int, killed: str, trials: list, size: int) -> dict:
    per = []
    for tr in trials:
        res, tk = tr["res"], tr["t_kill"]
        per.append(dict(
            recovery=max(d["membership"]["last_recovery_s"] for d in res.values()),
            agreement=max(d["membership"]["last_agreement_s"] for d in res.values()),
            raised=max((d["raised_at"] - tk for d in res.values() if d["raised_at"] is not None), default=None),
            total=max(d["t_done"] - tk for d in res.values()),
            op_ms=max(d["op_s"] for d in res.values()) * 1e3,
            victims=tr["victims"],
            epoch=max(d["membership"]["epoch"] for d in res.values()),
        ))

    def stat(k):
        v = [p[k] for p in per if p[k] is not None]
        return (statistics.median(v), max(v)) if v else (None, None)

    return dict(where=where, ws=ws, killed=killed, size=size, trials=len(per), per_trial=per,
                recovery=stat("recovery"), agreement=stat("agreement"), raised=stat("raised"),
                total=stat("total"), op_ms=statistics.median(p["op_ms"] for p in per))


def _mm(v) -> str:
    return "-" if v[0] is None else f"{v[0]:.2f} / {v[1]:.2f}"


HDR = (f"{'where':<9} {'WS':>3} {'killed':<24} {'n':>2} {'size':>7} {'ar ms':>7} | {'detect->ring s':>13} "
       f"{'agreement s':>13} {'kill->raised s':>14} {'kill->next done s':>17} | goal<2s")


def fmt_row(r: dict) -> str:
    goal = "yes" if r["total"][1] is not None and r["total"][1] < 2.0 else "no"
    return (f"{r['where']:<9} {r['ws']:>3} {r['killed']:<24} {r['trials']:>2} {fmt_bytes(r['size']):>7} "
            f"{r['op_ms']:>7.1f} | {_mm(r['recovery']):>13} {_mm(r['agreement']):>13} {_mm(r['raised']):>14} "
            f"{_mm(r['total']):>17} | {goal}")


def markdown(rows: list) -> str:
    out = ["| where | WS | killed | trials | size | allreduce ms (before) | detect -> new ring s (median / max) "
           "| of which agreement s | kill -> op raised s | failure -> next allreduce done s | max < 2 s |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        goal = "yes" if r["total"][1] is not None and r["total"][1] < 2.0 else "no"
        out.append(f"| {r['where']} | {r['ws']} | {r['killed']} | {r['trials']} | {fmt_bytes(r['size'])} | "
                   f"{r['op_ms']:.1f} | {_mm(r['recovery'])} | {_mm(r['agreement'])} | {_mm(r['raised'])} | "
                   f"{_mm(r['total'])} | {goal} |")
    return "\n".join(out)


def run_loopback(launcher, store, cfg, wss, trials, emit) -> list:
    rows = []
    for ws in wss:
        done = []
        for k in range(trials):
            victim = [ws - 1, ws // 2, 0][k % 3]
            try:
                tr = run_trial(launcher, store, f"lo{ws}t{k}", ws, [victim], cfg)
            except RuntimeError as e:
                print(f"# FAILED: {e}", file=sys.stderr, flush=True)
                continue
            done.append(tr)
            if cfg["verbose"]:
                print(f"#   WS={ws} trial {k}: killed rank {victim}: " + _trial_line(tr), flush=True)
        if done:
            rows.append(summarize("loopback", ws, "1 rank (rotating)", done, cfg["size"]))
            emit(rows[-1])
    return rows


def _trial_line(tr) -> str:
    s = summarize("", 0, "", [tr], 0)["per_trial"][0]
    raised = "-" if s["raised"] is None else f"{s['raised']:.3f}"
    return (f"recovery {s['recovery']:.3f} s (agreement {s['agreement']:.3f}), op raised {raised} s and "
            f"next allreduce done {s['total']:.3f} s after the kill, epoch {s['epoch']}")


def run_cluster(launcher, cfg, rphs, modes, trials, emit) -> tuple[list, str]:
    """Rows measured on the emulated cluster, and its description ("" if unavailable: then why)."""
    sys.path.insert(0, CLUSTER_DIR)
    import datetime

    import torch.distributed as dist

    import netns

    if os.geteuid() != 0:
        return [], "skipped: the emulated cluster needs root (CAP_NET_ADMIN)"
    ok, why = netns.probe()
    if not ok:
        return [], f"skipped: emulated cluster unavailable: {why}"
    rows = []
    cluster = netns.Cluster(racks=2, hosts_per_rack=2, rate=cfg["rate"], delay=cfg["delay"])
    try:
        cluster.up()
        desc = cluster.describe()
        print(f"# cluster: {desc}", flush=True)
        store = dist.TCPStore("0.0.0.0", 0, world_size=None, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=cfg["timeout"]))
        ccfg = dict(cfg, store_addr=cluster.store_addr)
        for rph in rphs:
            hosts = netns.placement(cluster, rph, "roundrobin")
            ws = len(hosts)
            placement = []
            for r, h in enumerate(hosts):
                env = dict(cluster.host_env(h))
                placement.append((h.ns, env))
            for mode in modes:
                done = []
                for k in range(trials):
                    host = cluster.hosts[[3, 1, 0, 2][k % 4]]
                    victims = [r for r in range(ws) if hosts[r].ns == host.ns]

                    def on_kill(when, host=host):
                        if mode == "cut":
                            state = "down" if when == "before" else "up"
                            subprocess.run(["ip", "netns", "exec", host.ns, "ip", "link", "set", host.ifname, state],
                                           check=True, timeout=30)

                    try:
                        tr = run_trial(launcher, store, f"c{rph}{mode}t{k}", ws, victims, ccfg, placement,
                                       on_kill=on_kill)
                    except RuntimeError as e:
                        print(f"# FAILED: {e}", file=sys.stderr, flush=True)
                        continue
                    done.append(tr)
                    if cfg["verbose"]:
                        print(f"#   cluster WS={ws} {mode} host {host.ns} (ranks {victims}) trial {k}: "
                              + _trial_line(tr), flush=True)
                if done:
                    what = f"1 host = {rph} rank{'s' if rph > 1 else ''} ({mode})"
                    rows.append(summarize("cluster", ws, what, done, cfg["size"]))
                    emit(rows[-1])
        del store
        return rows, desc
    finally:
        cluster.down()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ws", default="2,3,4,5,6,7,8", help="loopback world sizes (default 2..8)")
    ap.add_argument("--trials", type=int, default=3, help="kills per world size / configuration (default 3)")
    ap.add_argument("--size", default="4M", help="allreduce size, float32 (default 4M)")
    ap.add_argument("--warmup", type=int, default=3, help="checked allreduces before the ranks say ready")
    ap.add_argument("--no-loopback", dest="loopback", action="store_false")
    ap.add_argument("--no-cluster", dest="cluster", action="store_false",
                    help="skip the emulated-cluster rows (they need root; default: run them where possible)")
    ap.add_argument("--cluster-ranks-per-host", default="1,2", help="emulated cluster: ranks per host (default 1,2)")
    ap.add_argument("--cluster-modes", default="kill,cut",
                    help="kill (SIGKILL every rank of the host) and/or cut (its link down first), default both")
    ap.add_argument("--rate", default="200mbit", help="emulated cluster: rack uplink rate")
    ap.add_argument("--delay", default="1ms", help="emulated cluster: one-way cross-rack latency")
    ap.add_argument("--timeout", type=float, default=120, help="bound on a trial's start-up, seconds")
    ap.add_argument("--trial-timeout", type=float, default=60, help="bound on the survivors' recovery, seconds")
    ap.add_argument("--op-timeout", type=float, default=120, help="the group's timeout, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", help="where the ranks' output goes (default: a new temporary directory)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--markdown", action="store_true", help="also print a markdown table")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every trial")
    a = ap.parse_args(argv)

    import datetime

    import torch.distributed as dist

    from _ranks import machine_info

    os.environ["XIRANG_ELASTIC"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg = dict(size=parse_size(a.size), warmup=a.warmup, timeout=a.timeout, trial_timeout=a.trial_timeout,
               op_timeout=a.op_timeout, rng=random.Random(a.seed), verbose=a.verbose, rate=a.rate or None,
               delay=a.delay or None, store_addr="127.0.0.1",
               log_dir=a.log_dir or tempfile.mkdtemp(prefix="xirang_elastic_bench_"))
    os.makedirs(cfg["log_dir"], exist_ok=True)
    wss = [int(x) for x in a.ws.split(",") if x.strip()]
    if wss and min(wss) < 2:
        ap.error("--ws: world sizes must be >= 2")
    info = machine_info()
    t_start = time.monotonic()
    print(f"# xirang elastic recovery benchmark: {info.get('cpu', '?')}, {info['cpus']} CPUs, "
          f"load {tuple(round(x, 2) for x in info.get('loadavg', ()))}, torch {info.get('torch')}, "
          f"size {fmt_bytes(cfg['size'])} float32, {a.trials} trials, env {info['env']}", flush=True)
    print("# times: seconds, median / max over trials of the slowest survivor; failure = SIGKILL by this process;"
          f" ranks' output: {cfg['log_dir']}", flush=True)
    print(HDR, flush=True)
    launcher = Launcher()
    rows = []
    emit = lambda r: print(fmt_row(r), flush=True)  # noqa: E731
    if a.loopback and wss:
        store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=a.timeout))
        rows += run_loopback(launcher, store, cfg, wss, a.trials, emit)
        del store
    cluster_desc = ""
    if a.cluster:
        rphs = [int(x) for x in a.cluster_ranks_per_host.split(",") if x.strip()]
        modes = [m.strip() for m in a.cluster_modes.split(",") if m.strip()]
        if any(m not in ("kill", "cut") for m in modes):
            ap.error("--cluster-modes: kill and/or cut")
        crows, cluster_desc = run_cluster(launcher, cfg, rphs, modes, a.trials, emit)
        rows += crows
        if not crows:
            print(f"# cluster: {cluster_desc}", flush=True)
    info["loadavg_end"] = os.getloadavg()
    print(f"# load average at end: {tuple(round(x, 2) for x in info['loadavg_end'])}; "
          f"{time.monotonic() - t_start:.0f} s", flush=True)
    if a.markdown and rows:
        print()
        print(markdown(rows))
    if a.json:
        cfg_out = {k: v for k, v in cfg.items() if k != "rng"}
        with open(a.json, "w") as f:
            json.dump({"machine": info, "config": cfg_out, "cluster": cluster_desc, "rows": rows}, f, indent=1)
    want = len(wss) * bool(a.loopback)
    return 0 if len([r for r in rows if r["where"] == "loopback"]) == want else 1


if __name__ == "__main__":
    sys.exit(main())
