"""The cluster itself: namespaces as hosts, bridges as racks, shaped veth uplinks, delay lines;
up, down, and processes started in a host's namespace."""
from __future__ import annotations

import dataclasses
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

from .base import IFNAME, NFQUEUE_NUM, UPLINK_QUEUE, BASE, ClusterUnavailable, half_time, ip, pid_tag, seconds, tc
from .probe import delay_method, ping_rtt_ms, probe, start_delayq
from .reap import kill_ns_pids, leftovers, list_links, reap


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
        self.prefix = f"{BASE}{pid_tag(os.getpid())}{chr(ord('a') + (Cluster._instances - 1) % 26)}"
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
        ip("link", *args)

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
        ip("addr", "add", f"{self.store_addr}/24", "dev", self.core)
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
            ip("netns", "add", ns)
            self._created_links.append(rv)
            self._link("add", rv, "type", "veth", "peer", "name", nv)
            self._link("set", rv, "master", f"{p}r{k}")
            self._link("set", rv, "up")
            self._link("set", nv, "netns", ns)
            ip("link", "set", nv, "name", h.ifname, ns=ns)
            ip("addr", "add", f"{h.ip}/24", "dev", h.ifname, ns=ns)
            ip("link", "set", h.ifname, "up", ns=ns)
            ip("link", "set", "lo", "up", ns=ns)
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
            pr, why = start_delayq([], delay, popen=lambda argv, **kw: self.popen(h, argv, None, **kw))
            self._delay_procs.append(pr)
            if why:
                raise ClusterUnavailable(f"delay line in {h.ns} did not start: {why}")

    def _stop_delay_lines(self) -> None:
        reap(self._delay_procs)
        for pr in self._delay_procs:
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
        RTT, and if its minimum exceeds 2 x --delay, restart the lines with the excess taken off
        their delay. The minimum, not the mean: load only adds to an RTT, and a mean inflated by a
        few late wake-ups took off more than the lines cost (a minimum of 1.48 ms for 2 ms seen
        under load, 2026-12-03). Returns the RTT measured last (None without ping). A loaded machine
        adds more."""
        a, b = self.hosts_in_rack(0)[0], self.hosts_in_rack(1)[0]
        rtt = ping_rtt_ms(a.ns, b.ip, count=20)
        want = seconds(self.delay)
        if not rtt:
            return None
        excess = rtt["min"] / 2e3 - want
        if excess <= 20e-6:
            return rtt
        self.delay_line_setting = f"{max(0.0, want - excess) * 1e6:.0f}us"
        self._stop_delay_lines()
        self._start_delay_lines(self.delay_line_setting)
        return ping_rtt_ms(a.ns, b.ip, count=20)

    def _shape(self, dev: str, use_delay: bool) -> None:
        parent = ["root"]
        if use_delay:
            half = half_time(self.delay)
            tc("qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", half, "limit", "100000")
            parent = ["parent", "1:1"]
        if self.rate:
            tc("qdisc", "add", "dev", dev, *parent, "handle", "10:", "tbf", "rate", self.rate,
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
        reap(self.procs)

    def down(self) -> list[str]:
        """Tear everything down; returns the problems met (also printed). Idempotent."""
        problems = []
        self.kill_all()
        for ns in self._created_ns:
            kill_ns_pids(ns)
        for ns in reversed(self._created_ns):
            r = ip("netns", "del", ns, check=False)
            if r.returncode != 0 and "No such file" not in r.stderr:
                problems.append(f"netns del {ns}: {r.stderr.strip()}")
        self._created_ns = []
        existing = set(list_links())
        for link in reversed(self._created_links):
            if link in existing:
                r = ip("link", "del", link, check=False)
                if r.returncode != 0 and "Cannot find device" not in r.stderr:  # gone with its peer
                    problems.append(f"link del {link}: {r.stderr.strip()}")
        self._created_links = []
        shutil.rmtree(self._tmp, ignore_errors=True)
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
        return leftovers(self.prefix)

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
