"""Measuring the links: one-stream TCP throughput and ping RTT, same rack and across racks."""
from __future__ import annotations

import subprocess
import sys

from .cluster import Cluster, Host
from .probe import ping_rtt_ms


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
