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

    sudo python3 tests/cluster/netns --racks 2 --hosts-per-rack 2 --ranks-per-host 2 \
        --rate 200mbit --delay 1ms -- python3 my_script.py args...
    sudo python3 tests/cluster/netns --probe          # can this machine create namespaces? latency?
    sudo python3 tests/cluster/netns --measure        # ping RTT and TCP throughput, then tear down
    sudo python3 tests/cluster/netns --cleanup-stale  # remove clusters of dead creators

Modules: ``base`` (names, ip/tc), ``probe`` (what the machine allows), ``cluster`` (the Cluster),
``launch`` (jobs on it), ``measure`` (ping, TCP throughput), ``reap`` (the one process reaper and
the clean-up of leftovers), ``cli``.
"""
from .base import BASE, DELAYQ, IFNAME, NFQUEUE_NUM, UPLINK_QUEUE, ClusterUnavailable
from .cli import add_cluster_args
from .cluster import Cluster, Host
from .launch import RankResult, launch, launch_torchrun, placement
from .measure import measure, tcp_mbit
from .probe import delay_method, netem_available, nfqueue_available, ping_rtt_ms, probe
from .reap import cleanup_stale, leftovers, list_links, list_namespaces, reap

__all__ = [
    "add_cluster_args", "BASE", "DELAYQ", "IFNAME", "NFQUEUE_NUM", "UPLINK_QUEUE", "ClusterUnavailable", "Cluster", "Host", "RankResult",
    "launch", "launch_torchrun", "placement", "measure", "tcp_mbit", "delay_method", "netem_available",
    "nfqueue_available", "ping_rtt_ms", "probe", "cleanup_stale", "leftovers", "list_links", "list_namespaces", "reap",
]
