#!/usr/bin/env python3
"""An emulated multi-host, multi-rack cluster on one Linux machine (network namespaces).

    hosts   one network namespace each (<prefix>h<i>), interface `xeth0` with 10.A.B.(10+i)/24
    racks   one Linux bridge each in the root namespace (<prefix>r<k>); a host's veth peer is a
            port of its rack's bridge (intra-rack traffic: unlimited)
    core    one bridge (<prefix>c) joining the racks, with the root namespace's address 10.A.B.1:
            the rendezvous store (c10d TCPStore) runs there, reachable from every host
    uplink  one veth pair per rack, rack bridge <-> core bridge (<prefix>u<k> on the rack side,
            <prefix>U<k> on the core side); both directions shaped with `tc` tbf at --rate, with a
            shallow queue, --queue (tbf latency, default 5 ms: 125 KB at 200 Mbit/s, about 2.5 x the
            cross-rack bandwidth-delay product), as on a data-centre switch port. With a deep queue
            (50 ms, 25 x BDP) two-way ring traffic oscillated: one direction's queue full (300-750
            KB) while the other direction ran at 30-80 Mbit/s for up to a second, its ACKs waiting
            behind that data; BBR, this kernel's congestion control, caps data in flight at about
            2 x bandwidth x minimum RTT, so an RTT inflated by the reverse queue caps its rate (the
            two-way traffic effect, Zhang, Shenker & Clark, SIGCOMM 1991). Measured, two 4-rank
            rings allreducing 32 MiB each at once across both uplinks (200 Mbit/s): 4.3-5.8 s per op
            with 50 ms (46 ops, 7 runs), 4.3-4.5 s with 5 ms (18 ops, 2 runs), 4.2 s for an even
            split. The price of the shallow queue: drops. A rank-order ring's 1 MiB allreduce (four
            flows each way per uplink) retransmits 100-400 segments per op, and 1 op of 12 waited
            for a retransmission timeout (650 instead of 310 ms).
    latency --delay one way between hosts of different racks, by the first method that works:
            netem   where the kernel has sch_netem: netem delay --delay/2 on both uplinks' devices
                    (under the tbf), so a packet from one rack to another (two uplinks) sees --delay
            nfqueue otherwise (this VM's kernel has neither sch_netem nor sch_fq, so no eBPF
                    earliest-departure-time pacing either): in every host namespace an iptables
                    OUTPUT rule `-m iprange --dst-range <other rack> -j NFQUEUE` hands packets for
                    other racks to a delay line, delayq.py (pure Python, one process per host, in
                    its namespace, SCHED_FIFO), that accepts each one --delay after it was queued;
                    packets wait in the kernel (metadata only reaches userspace, GSO kept whole),
                    then go through the uplinks' tbf as usual. Its own cost (wake-up, verdict:
                    ~0.2 ms per direction on an idle machine) is measured once the cluster is up
                    (cross-rack ping) and taken off the lines' delay; a loaded machine adds more.
                    The store (root namespace) is not delayed. Needs `iptables` (and `ping` for
                    the calibration).
            describe() gives the method and the cross-rack ping RTT measured at set-up.

Everything is named with a unique prefix (`xrc` + 5 characters derived from the pid) and torn
down by `Cluster.down()`: every process started through the cluster is killed (process group),
any other process left in one of its namespaces too, then the namespaces, uplinks and bridges
are deleted. `with Cluster(...)` and the launcher call it in a `finally`, also when a rank fails;
SIGTERM/SIGINT are turned into exceptions while a cluster is up so the `finally` runs. A cluster
left by a process that was SIGKILLed is removed by `--cleanup-stale` (its creator pid is dead).
The delay lines are processes started through the cluster in the host namespaces, so they go
with the rest (and die with their parent, PR_SET_PDEATHSIG); iptables rules go with the namespace.

Ranks are started directly (no torchrun), each with `ip netns exec <ns> env ... python3 ...` and
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR (the core address), MASTER_PORT
(a TCPStore served by the launcher in the root namespace), TORCHELASTIC_USE_AGENT_STORE=True (so
`init_process_group(init_method="env://")` connects as a client on every rank),
XIRANG_SOCKET_IFNAME / GLOO_SOCKET_IFNAME = xeth0, XIRANG_HOST = the namespace's host label and
XIRANG_TOPOLOGY_FILE = a file mapping host labels to racks.

Command line:

    sudo python3 tests/cluster/netns.py --racks 2 --hosts-per-rack 2 --ranks-per-host 2 \
        --rate 200mbit --delay 1ms -- python3 my_script.py args...
    sudo python3 tests/cluster/netns.py --probe          # can this machine create namespaces? latency?
    sudo python3 tests/cluster/netns.py --measure        # ping RTT and TCP throughput, then tear down
    sudo python3 tests/cluster/netns.py --cleanup-stale  # remove clusters of dead creators
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

BASE = "xrc"  # every object this module creates starts with it (namespaces, links)
IFNAME = "xeth0"  # the host's interface inside its namespace
DELAYQ = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delayq.py")  # NFQUEUE delay line
NFQUEUE_NUM = 0  # netfilter queue of the delay line (queues are per namespace)
UPLINK_QUEUE = "5ms"  # rack uplink queue, as tc tbf latency (see the module docstring)


class ClusterUnavailable(RuntimeError):
    """The machine does not allow what the cluster needs (namespaces, veth, bridges, tc)."""


def _ip(*args: str, check: bool = True, ns: Optional[str] = None) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc={p.returncode}): {p.stderr.strip()}")
    return p


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} failed (rc={p.returncode}): {p.stderr.strip()}")
    return p


def _pid_tag(pid: int) -> str:
    """5 base-36 characters from the pid (pids < 36**5 = 60M are exact): names stay <= 15 chars."""
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    for _ in range(5):
        pid, d = divmod(pid, 36)
        out = digits[d] + out
    return out


def _tag_pid(tag: str) -> int:
    return int(tag, 36)


def probe() -> tuple[bool, str]:
    """(True, "") when namespaces, veth pairs, bridges and tc tbf can be created here, else
    (False, why). Creates and deletes a throw-away namespace and links."""
    for tool in ("ip", "tc"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode != 0:
            return False, f"`{tool}` (iproute2) is not installed"
    tag = f"{BASE}{_pid_tag(os.getpid())}"
    ns, a, b = f"{tag}p", f"{tag}pa", f"{tag}pb"
    try:
        p = _ip("netns", "add", ns, check=False)
        if p.returncode != 0:
            return False, f"`ip netns add` is not permitted here: {p.stderr.strip()}"
        for args, what in (
            (("link", "add", a, "type", "veth", "peer", "name", b), "veth pairs"),
            (("link", "add", f"{tag}pc", "type", "bridge"), "bridges"),
            (("link", "set", b, "netns", ns), "moving a link into a namespace"),
        ):
            p = _ip(*args, check=False)
            if p.returncode != 0:
                return False, f"cannot create {what}: {p.stderr.strip()}"
        p = _tc("qdisc", "add", "dev", a, "root", "tbf", "rate", "100mbit", "burst", "64kb",
                "latency", "20ms", check=False)
        if p.returncode != 0:
            return False, f"tc tbf is not available: {p.stderr.strip()}"
        return True, ""
    finally:
        _ip("link", "del", a, check=False)
        _ip("link", "del", f"{tag}pc", check=False)
        _ip("netns", "del", ns, check=False)


def netem_available() -> bool:
    tag = f"{BASE}{_pid_tag(os.getpid())}"
    a, b = f"{tag}qa", f"{tag}qb"
    try:
        if _ip("link", "add", a, "type", "veth", "peer", "name", b, check=False).returncode != 0:
            return False
        return _tc("qdisc", "add", "dev", a, "root", "netem", "delay", "1ms", check=False).returncode == 0
    finally:
        _ip("link", "del", a, check=False)


def _start_delayq(argv_prefix: Sequence[str], delay: str, popen=subprocess.Popen,
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
    ns = f"{BASE}{_pid_tag(os.getpid())}q"
    pr = None
    try:
        p = _ip("netns", "add", ns, check=False)
        if p.returncode != 0:
            return False, f"`ip netns add` failed: {p.stderr.strip()}"
        pr, why = _start_delayq(["ip", "netns", "exec", ns], "1ms")
        if why:
            return False, f"delayq.py cannot bind a netfilter queue: {why}"
        p = subprocess.run(["ip", "netns", "exec", ns, "iptables", "-w", "-A", "OUTPUT", "-m", "iprange",
                            "--dst-range", "127.0.0.2-127.0.0.3", "-j", "NFQUEUE", "--queue-num",
                            str(NFQUEUE_NUM)], capture_output=True, text=True, timeout=30)
        if p.returncode != 0:
            return False, f"iptables NFQUEUE rule refused: {p.stderr.strip()}"
        return True, ""
    finally:
        if pr is not None and pr.poll() is None:
            pr.kill()
            pr.wait(timeout=10)
        _ip("netns", "del", ns, check=False)


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
    mine = _pid_tag(os.getpid())
    for kind, names in (("netns", list_namespaces()), ("link", list_links())):
        for name in names:
            if not name.startswith(BASE) or len(name) < len(BASE) + 5:
                continue
            tag = name[len(BASE):len(BASE) + 5]
            try:
                pid = _tag_pid(tag)
            except ValueError:
                continue
            if tag == mine or _pid_alive(pid):
                continue
            if kind == "netns":
                _kill_ns_pids(name)
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)
            removed.append(name)
            if verbose:
                print(f"netns: removed stale {kind} {name}", file=sys.stderr)
    return removed


def _kill_ns_pids(ns: str) -> None:
    p = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    for tok in p.stdout.split():
        try:
            os.kill(int(tok), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass


@dataclasses.dataclass
class Host:
    index: int
    ns: str  # namespace name; also the host label (XIRANG_HOST)
    rack: str  # rack label
    ip: str
    ifname: str = IFNAME


class _Terminated(BaseException):
    pass


def _raise_terminated(signum, frame):  # noqa: ARG001
    raise _Terminated(f"signal {signum}")


class Cluster:
    """R racks x H hosts; `with Cluster(2, 2) as c:` ... `c.popen(host, argv, env)`."""

    _instances = 0

    def __init__(self, racks: int = 2, hosts_per_rack: int = 2, rate: Optional[str] = "200mbit",
                 delay: Optional[str] = "1ms", burst: str = "128kb", queue_latency: str = UPLINK_QUEUE,
                 require_delay: bool = False, verbose: bool = False):
        if racks < 1 or hosts_per_rack < 1 or racks * hosts_per_rack > 200:
            raise ValueError("need 1..200 hosts in all")
        Cluster._instances += 1
        self.racks, self.hosts_per_rack = racks, hosts_per_rack
        self.rate, self.delay, self.burst, self.queue_latency = rate, delay, burst, queue_latency
        self.require_delay, self.verbose = require_delay, verbose
        self.prefix = f"{BASE}{_pid_tag(os.getpid())}{chr(ord('a') + (Cluster._instances - 1) % 26)}"
        self.core = f"{self.prefix}c"
        # 10.A.B.0/24, A in 200..249, B random: pick one no local route uses
        used = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True).stdout
        rnd = random.Random(os.getpid() * 1000 + Cluster._instances)
        for _ in range(100):
            a, b = rnd.randrange(200, 250), rnd.randrange(0, 256)
            if f"10.{a}.{b}." not in used:
                break
        self.net = f"10.{a}.{b}"
        self.store_addr = f"{self.net}.1"
        self.hosts: list[Host] = []
        for k in range(racks):
            for h in range(hosts_per_rack):
                i = len(self.hosts)
                self.hosts.append(Host(i, f"{self.prefix}h{i}", f"rack{k}", f"{self.net}.{10 + i}"))
        self.delay_emulated = False
        self.delay_method: Optional[str] = None  # "netem" | "nfqueue" | None
        self.rtt_cross_ms: Optional[dict] = None  # ping across racks once up (delay on)
        self.delay_line_setting: Optional[str] = None  # delayq.py --delay after calibration
        self._delay_procs: list[subprocess.Popen] = []
        self.shaping = "none"
        self.procs: list[subprocess.Popen] = []
        self._created_ns: list[str] = []
        self._created_links: list[str] = []
        self._tmp = tempfile.mkdtemp(prefix=f"{self.prefix}_")
        self.topology_file = os.path.join(self._tmp, "topology.txt")
        self._old_handlers: dict = {}
        self.up_done = False

    # ------------------------------------------------------------------ set-up / tear-down
    def hosts_in_rack(self, k: int) -> list[Host]:
        return [h for h in self.hosts if h.rack == f"rack{k}"]

    def _link(self, *args: str) -> None:
        _ip("link", *args)

    def up(self) -> "Cluster":
        ok, why = probe()
        if not ok:
            raise ClusterUnavailable(why)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, _raise_terminated)
            except ValueError:  # not the main thread
                pass
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        self.up_done = True
        return self

    def _up(self) -> None:
        p = self.prefix
        self._created_links.append(self.core)
        self._link("add", self.core, "type", "bridge")
        _ip("addr", "add", f"{self.store_addr}/24", "dev", self.core)
        self._link("set", self.core, "up")
        method, why_not = delay_method() if self.delay else (None, "")
        if self.delay and method is None and self.require_delay:
            raise ClusterUnavailable(f"cannot add latency: {why_not}")
        self.delay_method = method
        self.delay_emulated = method is not None
        use_delay = method == "netem"
        for k in range(self.racks):
            rb, ua, ub = f"{p}r{k}", f"{p}u{k}", f"{p}U{k}"
            self._created_links += [rb, ua]
            self._link("add", rb, "type", "bridge")
            self._link("set", rb, "up")
            self._link("add", ua, "type", "veth", "peer", "name", ub)
            self._link("set", ua, "master", rb)
            self._link("set", ub, "master", self.core)
            for dev in (ua, ub):
                self._shape(dev, use_delay)
                self._link("set", dev, "up")
        for h in self.hosts:
            k = int(h.rack[4:])
            ns, rv, nv = h.ns, f"{p}h{h.index}", f"{p}n{h.index}"
            self._created_ns.append(ns)
            _ip("netns", "add", ns)
            self._created_links.append(rv)
            self._link("add", rv, "type", "veth", "peer", "name", nv)
            self._link("set", rv, "master", f"{p}r{k}")
            self._link("set", rv, "up")
            self._link("set", nv, "netns", ns)
            _ip("link", "set", nv, "name", h.ifname, ns=ns)
            _ip("addr", "add", f"{h.ip}/24", "dev", h.ifname, ns=ns)
            _ip("link", "set", h.ifname, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
        with open(self.topology_file, "w") as f:
            f.write("# host rack (xirang XIRANG_TOPOLOGY_FILE)\n")
            for h in self.hosts:
                f.write(f"{h.ns} {h.rack}\n")
        if method == "nfqueue":
            self._start_delay_lines(self.delay)
            self._add_delay_rules()
        parts = []
        if self.rate:
            parts.append(f"tbf {self.rate} (queue {self.queue_latency})")
        if method == "netem":
            parts.append(f"netem delay {self.delay} one way across racks")
        elif method == "nfqueue":
            parts.append(f"{self.delay} one way across racks (NFQUEUE delay line, delayq.py: {why_not})")
        elif self.delay:
            parts.append(f"NO latency ({why_not}; asked for {self.delay})")
        self._wait_reachable()
        if method == "nfqueue" and self.racks > 1:
            self.rtt_cross_ms = self._calibrate_delay_lines()
        elif method and self.racks > 1:
            a, b = self.hosts_in_rack(0)[0], self.hosts_in_rack(1)[0]
            self.rtt_cross_ms = ping_rtt_ms(a.ns, b.ip)
        if self.rtt_cross_ms:
            parts.append(f"cross-rack ping RTT {self.rtt_cross_ms['avg']:.2f} ms at set-up"
                         + (f" (delay lines set to {self.delay_line_setting} to make up for their own cost)"
                            if self.delay_line_setting else ""))
        self.shaping = ", ".join(parts) or "none"

    def _start_delay_lines(self, delay: str) -> None:
        """One delayq.py per host namespace (held in self._delay_procs)."""
        self._delay_procs = []
        for h in self.hosts:
            pr, why = _start_delayq([], delay, popen=lambda argv, **kw: self.popen(h, argv, None, **kw))
            self._delay_procs.append(pr)
            if why:
                raise ClusterUnavailable(f"delay line in {h.ns} did not start: {why}")

    def _stop_delay_lines(self) -> None:
        for pr in self._delay_procs:
            if pr.poll() is None:
                pr.kill()
            pr.wait(timeout=10)
            self.procs.remove(pr)
        self._delay_procs = []

    def _add_delay_rules(self) -> None:
        """In every host namespace, the iptables rules that hand the packets for hosts of other
        racks to the delay line (only once it has bound the queue: unbound, NFQUEUE drops)."""
        ranges = {}
        for k in range(self.racks):
            ips = sorted(int(h.ip.rsplit(".", 1)[1]) for h in self.hosts_in_rack(k))
            ranges[f"rack{k}"] = f"{self.net}.{ips[0]}-{self.net}.{ips[-1]}"  # contiguous per rack
        for h in self.hosts:
            for rack, rng in ranges.items():
                if rack == h.rack:
                    continue
                p = subprocess.run(["ip", "netns", "exec", h.ns, "iptables", "-w", "-A", "OUTPUT", "-m", "iprange",
                                    "--dst-range", rng, "-j", "NFQUEUE", "--queue-num", str(NFQUEUE_NUM)],
                                   capture_output=True, text=True, timeout=30)
                if p.returncode != 0:
                    raise ClusterUnavailable(f"iptables NFQUEUE rule in {h.ns} refused: {p.stderr.strip()}")

    def _calibrate_delay_lines(self) -> Optional[dict]:
        """The delay line's own cost (wake-up on a queued packet, verdict, re-injection: ~0.2 ms
        per direction on an idle machine) comes on top of its delay: measure the cross-rack ping
        RTT, and if it exceeds 2 x --delay, restart the lines with the excess taken off their delay.
        Returns the RTT measured last (None without ping). A loaded machine adds more."""
        a, b = self.hosts_in_rack(0)[0], self.hosts_in_rack(1)[0]
        rtt = ping_rtt_ms(a.ns, b.ip, count=20)
        want = _seconds(self.delay)
        if not rtt:
            return None
        excess = rtt["avg"] / 2e3 - want
        if excess <= 20e-6:
            return rtt
        self.delay_line_setting = f"{max(0.0, want - excess) * 1e6:.0f}us"
        self._stop_delay_lines()
        self._start_delay_lines(self.delay_line_setting)
        return ping_rtt_ms(a.ns, b.ip, count=20)

    def _shape(self, dev: str, use_delay: bool) -> None:
        parent = ["root"]
        if use_delay:
            half = _half_time(self.delay)
            _tc("qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", half, "limit", "100000")
            parent = ["parent", "1:1"]
        if self.rate:
            _tc("qdisc", "add", "dev", dev, *parent, "handle", "10:", "tbf", "rate", self.rate,
                "burst", self.burst, "latency", self.queue_latency)

    def _wait_reachable(self, timeout: float = 30.0) -> None:
        """Every host opens a TCP connection to the core address (bridges forward at once
        without STP, but give DAD/ARP a moment)."""
        import socket

        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.bind((self.store_addr, 0))
        srv.listen(64)
        port = srv.getsockname()[1]
        code = ("import socket,sys,time\n"
                "d=time.monotonic()+%r\n"
                "while True:\n"
                "    try:\n"
                "        socket.create_connection((%r,%d),timeout=1).close(); break\n"
                "    except OSError as e:\n"
                "        if time.monotonic()>d: sys.exit('unreachable: %%s' %% e)\n"
                "        time.sleep(0.1)\n") % (timeout, self.store_addr, port)
        try:
            procs = [(h, subprocess.Popen(["ip", "netns", "exec", h.ns, sys.executable, "-c", code],
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
                     for h in self.hosts]
            for h, pr in procs:
                out, _ = pr.communicate(timeout=timeout + 10)
                if pr.returncode != 0:
                    raise RuntimeError(f"host {h.ns} cannot reach {self.store_addr}: {out.strip()}")
        finally:
            srv.close()

    def kill_all(self) -> None:
        for pr in self.procs:
            if pr.poll() is None:
                try:
                    os.killpg(pr.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    try:
                        pr.kill()
                    except ProcessLookupError:
                        pass
        for pr in self.procs:
            try:
                pr.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def down(self) -> list[str]:
        """Tear everything down; returns the problems met (also printed). Idempotent."""
        problems = []
        self.kill_all()
        for ns in self._created_ns:
            _kill_ns_pids(ns)
        for ns in reversed(self._created_ns):
            r = _ip("netns", "del", ns, check=False)
            if r.returncode != 0 and "No such file" not in r.stderr:
                problems.append(f"netns del {ns}: {r.stderr.strip()}")
        self._created_ns = []
        existing = set(list_links())
        for link in reversed(self._created_links):
            if link in existing:
                r = _ip("link", "del", link, check=False)
                if r.returncode != 0 and "Cannot find device" not in r.stderr:  # gone with its peer
                    problems.append(f"link del {link}: {r.stderr.strip()}")
        self._created_links = []
        try:
            for f in os.listdir(self._tmp):
                os.unlink(os.path.join(self._tmp, f))
            os.rmdir(self._tmp)
        except OSError:
            pass
        for sig, h in self._old_handlers.items():
            try:
                signal.signal(sig, h)
            except (ValueError, TypeError):
                pass
        self._old_handlers = {}
        for pr in problems:
            print(f"netns: cleanup: {pr}", file=sys.stderr)
        return problems

    def leftovers(self) -> list[str]:
        """Namespaces or links with this cluster's prefix that still exist."""
        return [n for n in list_namespaces() + list_links() if n.startswith(self.prefix)]

    def __enter__(self) -> "Cluster":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # ------------------------------------------------------------------ processes
    def host_env(self, h: Host) -> dict:
        return {
            "XIRANG_SOCKET_IFNAME": h.ifname,
            "GLOO_SOCKET_IFNAME": h.ifname,
            "XIRANG_HOST": h.ns,
            "XIRANG_TOPOLOGY_FILE": self.topology_file,
        }

    def popen(self, h: Host, argv: Sequence[str], env: Optional[dict] = None, **kw) -> subprocess.Popen:
        """Start argv inside host h's namespace (own process group), with `env` added to ours."""
        penv = dict(os.environ)
        penv.update(self.host_env(h))
        penv.update({k: str(v) for k, v in (env or {}).items()})
        pr = subprocess.Popen(["ip", "netns", "exec", h.ns, *argv], env=penv, start_new_session=True,
                              stdin=subprocess.DEVNULL, **kw)
        self.procs.append(pr)
        return pr

    def describe(self) -> str:
        racks = ", ".join(f"{f'rack{k}'}: " + " ".join(f"{h.ns}({h.ip})" for h in self.hosts_in_rack(k))
                          for k in range(self.racks))
        return (f"{self.racks} racks x {self.hosts_per_rack} hosts (netns); {racks}; store {self.store_addr}; "
                f"rack uplinks: {self.shaping}; intra-rack: unlimited veth/bridge")


def _seconds(t: str) -> float:
    """'1ms', '500us', '0.002s' -> seconds."""
    return float(_half_time(t)[:-2]) * 2e-6


def _half_time(t: str) -> str:
    t = t.strip()
    for suf, mult in (("us", 1), ("ms", 1000), ("s", 1_000_000)):
        if t.endswith(suf):
            try:
                v = float(t[: -len(suf)]) * mult
                return f"{v / 2:g}us"
            except ValueError:
                break
    raise ValueError(f"cannot parse delay {t!r} (e.g. 1ms, 500us)")


def leftovers(prefix: str) -> list[str]:
    """Namespaces and links whose name contains `prefix` (a cluster's objects still there)."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
    return [line for line in (ns + links).splitlines() if prefix in line]


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
        results = [RankResult(r, hosts[r].ns, rcs[r], _read(logs[r])) for r in range(ws)]
        if any(rc != 0 for rc in rcs):
            why = "timed out" if any(rc is None for rc in rcs) and not failed else f"ranks {failed or []} failed"
            tails = "\n".join(f"--- rank {x.rank} on {x.host} rc={x.returncode}:\n{x.log[-3000:]}"
                              for x in results if x.returncode != 0)
            raise RuntimeError(f"launch {why}; rc per rank {rcs}\n{tails}")
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
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
        results = [RankResult(h.index, h.ns, rcs[i], _read(logs[i])) for i, h in enumerate(cluster.hosts)]
        if any(rc != 0 for rc in rcs):
            tails = "\n".join(f"--- agent on {x.host} rc={x.returncode}:\n{x.log[-3000:]}"
                              for x in results if x.returncode != 0)
            raise RuntimeError(f"torchrun launch failed or timed out; rc per host {rcs}\n{tails}")
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        del store


_TPUT = """
import socket, sys, time
mode, ip, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "server":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((ip, port)); s.listen(1)
    print("listening", flush=True)
    c, _ = s.accept(); n, t0 = 0, None
    while True:
        b = c.recv(1 << 20)
        if not b: break
        if t0 is None: t0 = time.monotonic()
        n += len(b)
    print(n * 8 / (time.monotonic() - t0) / 1e6, flush=True)
else:
    nbytes = int(sys.argv[4]); c = socket.create_connection((ip, port)); buf = b"x" * (1 << 20); sent = 0
    while sent < nbytes:
        sent += c.send(buf[: min(len(buf), nbytes - sent)])
    c.close()
"""


def tcp_mbit(cluster: "Cluster", src: Host, dst: Host, nbytes: int = 50 * 10**6, port: int = 5399) -> float:
    """One TCP stream of nbytes from src to dst; Mbit/s seen by the receiver."""
    srv = cluster.popen(dst, [sys.executable, "-c", _TPUT, "server", dst.ip, str(port)], stdout=subprocess.PIPE,
                        text=True)
    try:
        if srv.stdout.readline().strip() != "listening":
            raise RuntimeError(f"throughput server on {dst.ns} did not start")
        cli = cluster.popen(src, [sys.executable, "-c", _TPUT, "client", dst.ip, str(port), str(nbytes)])
        cli.wait(timeout=120)
        return float(srv.communicate(timeout=30)[0].strip())
    finally:
        if srv.poll() is None:
            srv.kill()


def measure(cluster: "Cluster", nbytes: int = 50 * 10**6) -> list[str]:
    """Ping RTT and one-stream TCP throughput for a same-rack and a cross-rack pair of hosts."""
    out = []
    a = cluster.hosts_in_rack(0)
    pairs = []
    if len(a) > 1:
        pairs.append(("same rack", a[0], a[1]))
    if cluster.racks > 1:
        b = cluster.hosts_in_rack(1)
        pairs += [("cross rack", a[0], b[0]), ("cross rack", b[0], a[0])]
    for what, x, y in pairs:
        rtt = ping_rtt_ms(x.ns, y.ip, count=50)
        rtt_s = (f"ping RTT min/avg/max/mdev {rtt['min']:.3f}/{rtt['avg']:.3f}/{rtt['max']:.3f}/{rtt['mdev']:.3f} ms"
                 if rtt else "ping RTT n/a")
        mbit = tcp_mbit(cluster, x, y, nbytes)
        out.append(f"{what:10s} {x.ns} -> {y.ns}: {rtt_s}; TCP {nbytes / 1e6:.0f} MB one stream: {mbit:.0f} Mbit/s")
    return out


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--racks", type=int, default=2)
    ap.add_argument("--hosts-per-rack", type=int, default=2)
    ap.add_argument("--ranks-per-host", type=int, default=1)
    ap.add_argument("--placement", default="roundrobin", choices=("roundrobin", "block"))
    ap.add_argument("--rate", default="200mbit", help="rack uplink rate (tc tbf), '' for none")
    ap.add_argument("--delay", default="1ms", help="one-way cross-rack latency (netem, else the NFQUEUE "
                    "delay line delayq.py), '' for none")
    ap.add_argument("--queue", default=UPLINK_QUEUE, help="uplink queue, as tc tbf latency (the time a full queue "
                    "takes to drain at --rate)")
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


if __name__ == "__main__":
    sys.exit(main())
