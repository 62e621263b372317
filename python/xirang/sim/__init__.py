"""Scale simulator: step time and communication cost of data-parallel gradient sync at scale.

    python -m xirang.sim [model/cluster/optimisation flags] [--json]   one configuration
    python -m xirang.sim --paper [--json]       the claims of the published 175B-parameter / 128-GPU
                                                platform report: internally consistent? reproduced?
    python -m xirang.sim --recommend [--json]   which optimisations pay, 8..1024 GPUs
    python -m xirang.sim --calibrate FILE [--cores N]  fit alpha/beta from benchmarks/allreduce.py JSON
                                                (ranks beyond N cores share them; N defaults to os.cpu_count())

Cost model (alpha-beta; Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009):
- ring allreduce of numel elements over n ranks: 2(n-1) lockstep steps, each sending one chunk
  (ceil(numel/n) elements) over every ring edge at once, so one step costs the slowest edge:
  max_e(alpha_e + chunk_bytes / B_e). With equal edges and n | numel this is exactly
  2(n-1) alpha + 2(n-1)/n S / B. Bytes each position sends are those of csrc/core/ring
  (2 numel - |chunk pos+1| - |chunk pos+2|), which tests check against xirang._C's replay.
- edge bandwidth by class: same host (NVLink-like), same rack (the GPU's NIC), cross rack: the NIC
  or the rack's share of its uplink, whichever is smaller. A rack's uplink carries
  gpus_per_rack x cross_rack_bw / oversubscription and is split evenly between the ring edges
  leaving that rack, counted over every data-parallel ring running at the same time (all tp x pp
  DP groups sync concurrently). One NIC per GPU; duplex links (send and receive do not compete).
- two-level: reduce-scatter inside the local group (host, else rack) of g DP members, g concurrent
  allreduces of S/g across the H groups, allgather inside: 2(g-1)(a_l + S/g/B_l) + ring(S/g, H).
- CPU cost per byte (optional: cpu_GBps > 0): every ring step a rank also spends chunk_bytes / cpu_Bps
  of CPU on the chunk (its copies in and out of the transport, the reduction). Pipelined by segments
  with the wire, so a step costs alpha_e + max(chunk / B_e, chunk / cpu_Bps x share), where share =
  max(1, ranks / cores) of the ranks that share those cores (a host's, or with shared_cpu the whole
  machine's: an emulated cluster on one box). cores_per_host = 0 means one core per rank (share 1):
  with cores >= ranks, or a CPU faster than the links, this is the alpha-beta model unchanged. On
  loopback the "wire" is itself CPU work (kernel copies), so --calibrate fits alpha and the per-byte
  cost together as CPU work and scales both by the share: T = share (2(n-1) alpha + 2(n-1)/n S beta).
- per-launch overhead per collective; BF16 halves bytes on the wire and adds a codec pass.
- timeline: layers finish backward one by one; a group's collectives may start when its last layer
  is done and the link is free (collectives run one at a time, FIFO). Exposed comm = what runs past
  the end of backward. Communication does not slow compute (no contention for SMs/memory); the
  FIFO queue (timeline.serial_queue) can slow collectives that run beside backward by a factor,
  which the comm hook's layers_per_group="auto" measures on CPU tensors (hooks/autogroup.py).

Modules: ``model`` (inputs), ``cost`` (one allreduce), ``timeline`` (one configuration's step),
``args`` (the command line's flags), ``paper``, ``recommend``, ``calibrate`` (the modes), ``cli``.
"""
from .args import add_args, build, check_args, settings
from .calibrate import calibrate, cpu_share, fit, fit_per_op, load_measurements, loopback_cluster, predict
from .cli import check_finite, main, run_mode
from .cost import RingSet, chunk_elems, ring_elements_sent, ring_time, two_level_time
from .model import GB, PRESETS, Cluster, Compute, Model, SettingsError
from .paper import PUBLICATION, PUBLISHED, REPRODUCE_TOL, TOLERANCE_TEXT, paper, print_paper
from .recommend import advice, print_recommend, recommend
from .table import table
from .timeline import ALL, OPTS, Config, Sim, exposed_comm, serial_queue

__all__ = [
    "ALL", "GB", "OPTS", "PRESETS", "PUBLICATION", "PUBLISHED", "REPRODUCE_TOL", "TOLERANCE_TEXT",
    "Cluster", "Compute", "Config", "Model", "RingSet", "SettingsError", "Sim",
    "add_args", "advice", "build", "calibrate", "check_args", "check_finite", "chunk_elems", "cpu_share",
    "exposed_comm", "fit", "fit_per_op",
    "load_measurements", "loopback_cluster", "main", "paper", "predict", "print_paper", "print_recommend",
    "recommend", "ring_elements_sent", "ring_time", "run_mode", "serial_queue", "settings", "table", "two_level_time",
]
