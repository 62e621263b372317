#!/usr/bin/env python3
"""Fixed one-way delay for the emulated cluster when the kernel has no sch_netem (and no sch_fq
for eBPF earliest-departure-time pacing): a userspace NFQUEUE delay line, pure Python.

An iptables rule in a host's namespace sends the packets to delay to netfilter queue --queue
(`-j NFQUEUE`); this process, started in the same namespace, binds that queue and accepts every
packet --delay after it was queued. Packets are held in the kernel meanwhile: the queue copies
only metadata to us (NFQNL_COPY_META) and keeps GSO packets whole (NFQA_CFG_F_GSO), and one
batch verdict (NFQNL_MSG_VERDICT_BATCH: every id up to N) releases all packets that are due, so
the cost is one recv per queued packet and one send per release, whatever the packet size.
The delay is constant, so release order = arrival order (FIFO, no reordering).

    ip netns exec NS python3 delayq.py --queue 0 --delay 1ms   # prints "ready" once bound

Runs under SCHED_FIFO when allowed (it blocks in select() between packets, it does not spin),
so a busy machine delays its wake-ups little. Exits on SIGTERM/SIGINT and when its parent dies
(PR_SET_PDEATHSIG); unbinding the queue, or the process dying, makes the kernel drop what is
still queued, which TCP retransmits.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import os
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_NO_ENOBUFS = 5
NLMSG_ERROR = 2
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 1, 2, 3
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_GSO = 4
NF_ACCEPT = 1


def parse_time(t: str) -> float:
    """'1ms', '500us', '0.002s' -> seconds."""
    t = t.strip()
    for suf, mult in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if t.endswith(suf):
            return float(t[: -len(suf)]) * mult
    raise ValueError(f"cannot parse time {t!r} (e.g. 1ms, 500us)")


def _attr(kind: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * ((4 - n % 4) % 4)


def _msg(mtype: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST, seq: int = 0) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs  # nfgenmsg
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | mtype, flags, seq, 0) + body


class DelayQueue:
    def __init__(self, queue: int, delay: float, maxlen: int = 16384):
        self.queue, self.delay = queue, delay
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.bind((0, 0))
        try:  # room for bursts of queued-packet messages; root may exceed rmem_max
            self.sock.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
        self._seq = 0
        self._request(_attr(NFQA_CFG_CMD, struct.pack("=BBH", NFQNL_CFG_CMD_BIND, 0, 0)))
        self._request(_attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
                      + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", maxlen))
                      + _attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_GSO))
                      + _attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_GSO)))
        self.pending: collections.deque = collections.deque()  # (release time, packet id)
        self.packets = 0

    def _request(self, attrs: bytes) -> None:
        self._seq += 1
        self.sock.send(_msg(NFQNL_MSG_CONFIG, self.queue, attrs, NLM_F_REQUEST | NLM_F_ACK, self._seq))
        while True:
            data = self.sock.recv(65536)
            off = 0
            while off + 16 <= len(data):
                ln, mtype, _, seq, _ = struct.unpack_from("=IHHII", data, off)
                if mtype == NLMSG_ERROR and seq == self._seq:
                    err = struct.unpack_from("=i", data, off + 16)[0]
                    if err:
                        raise OSError(-err, f"nfqueue config of queue {self.queue}: {os.strerror(-err)}")
                    return
                off += (ln + 3) & ~3

    def _drain(self, now: float) -> None:
        """Read every queued-packet message waiting on the socket."""
        due = now + self.delay
        while True:
            try:
                data = self.sock.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            off = 0
            while off + 16 <= len(data):
                ln, mtype = struct.unpack_from("=IH", data, off)
                if ln < 16:
                    break
                if mtype == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                    a, end = off + 20, off + ln  # past nlmsghdr + nfgenmsg
                    while a + 4 <= end:
                        alen, akind = struct.unpack_from("=HH", data, a)
                        if alen < 4:
                            break
                        if (akind & 0x7FFF) == NFQA_PACKET_HDR:
                            self.pending.append((due, struct.unpack_from("!I", data, a + 4)[0]))
                            self.packets += 1
                            break
                        a += (alen + 3) & ~3
                off += (ln + 3) & ~3

    def _release(self, now: float) -> None:
        last = None
        pending = self.pending
        while pending and pending[0][0] <= now:
            last = pending.popleft()[1]
        if last is not None:
            self.sock.send(_msg(NFQNL_MSG_VERDICT_BATCH, self.queue,
                                _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, last))))

    def run(self, parent: int) -> None:
        slack = 20e-6  # release what is due within this much (a wake-up costs more)
        fd = [self.sock]
        while True:
            now = time.monotonic()
            timeout = max(0.0, self.pending[0][0] - now - slack) if self.pending else 0.5
            r, _, _ = select.select(fd, [], [], timeout)
            now = time.monotonic()
            if r:
                self._drain(now)
            self._release(now + slack)
            if not self.pending and os.getppid() != parent:
                return


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queue", type=int, default=0, help="netfilter queue number (iptables --queue-num)")
    ap.add_argument("--delay", default="1ms", help="added to every queued packet (e.g. 1ms, 500us)")
    ap.add_argument("--no-rt", action="store_true", help="do not ask for SCHED_FIFO")
    a = ap.parse_args()
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if not a.no_rt:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
        except (OSError, AttributeError):
            pass
    try:
        q = DelayQueue(a.queue, parse_time(a.delay))
    except OSError as e:
        print(f"delayq: cannot bind netfilter queue {a.queue}: {e}", flush=True)
        return 1
    print("ready", flush=True)
    try:
        q.run(parent)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
