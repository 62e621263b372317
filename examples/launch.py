"""Process-group plumbing for the examples: the rendezvous, the device, the reductions of figures
over ranks, and rank 0's output."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, List

import torch
import torch.distributed as dist

log = logging.getLogger("xirang.examples")


def import_xirang(why: str):
    try:
        import xirang  # noqa: F401  (registers the "xirang" backend)
    except Exception as e:  # ImportError, or an ABI mismatch raised at import
        log.error("%s needs the xirang package, which failed to import: %s: %s\n"
                  "Build and install it from the repository root with\n    pip install --no-build-isolation .\n"
                  "(or run `bash examples/demo.sh`, which does so), or use --backend gloo --hook none.",
                  why, type(e).__name__, e)
        sys.exit(2)
    return xirang


class Launch:
    """Rank/world from torchrun's environment and one base store; each training gets a fresh
    process group on its own prefix of that store, so one job can train several times."""

    def __init__(self) -> None:
        if "RANK" not in os.environ:  # plain `python train.py`: a world of one
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.store, _, _ = next(dist.rendezvous("env://", self.rank, self.world))
        self.count = 0

    def init(self, backend: str, pg_options: Any = None) -> None:
        self.count += 1
        store = dist.PrefixStore(f"xirang-train/run{self.count}", self.store)
        kw = {"pg_options": pg_options} if pg_options is not None else {}
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world, **kw)


def device_of(args: argparse.Namespace, launch: Launch) -> torch.device:
    if args.device != "cuda":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        log.error("--device cuda: torch %s sees no CUDA device", torch.__version__)
        sys.exit(2)
    torch.cuda.set_device(launch.local_rank)  # no device_id to init_process_group: no eager init
    return torch.device("cuda", launch.local_rank)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def global_mean(vals: List[float], device: torch.device) -> List[float]:
    if not vals:
        return []
    t = torch.tensor(vals, dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def slowest(v: float, device: torch.device, xirang: Any = None) -> float:
    """The largest v over the (live) ranks; with xirang passed (elastic) retried on a shrunken ring."""
    t = torch.tensor([v], dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
    reduce = lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX)  # noqa: E731
    xirang.retry_on_membership_change(reduce, t) if xirang is not None else reduce()
    return float(t.item())


def dump(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)


def setup(args: argparse.Namespace) -> Launch:
    """Logging (rank 0 at --log-level, others WARNING), threads, determinism, the rendezvous."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO) if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s rank{rank} %(levelname)s %(message)s", datefmt="%H:%M:%S")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    return Launch()


def write_summary(obj: Any, args: argparse.Namespace, launch: Launch) -> None:
    """Rank 0: the JSON on stdout, and into --summary and --stats-dir/summary.json."""
    if launch.rank != 0:
        return
    js = json.dumps(obj, indent=2, default=str)
    print(js, flush=True)
    if args.summary:
        os.makedirs(os.path.dirname(os.path.abspath(args.summary)), exist_ok=True)
        with open(args.summary, "w") as f:
            f.write(js + "\n")
    if args.stats_dir:
        dump(os.path.join(args.stats_dir, "summary.json"), obj)


