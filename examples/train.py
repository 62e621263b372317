#!/usr/bin/env python3
"""Multi-rank DDP training on real, offline data, with the xirang backend and comm hook.

Launch with torchrun (one process per rank)::

    torchrun --nproc_per_node=2 examples/train.py --compare            # gloo vs xirang+bf16-ef
    torchrun --nproc_per_node=2 examples/train.py --backend gloo --hook none
    torchrun --nproc_per_node=2 examples/train.py --task text --steps 300

Tasks
-----
digits  The handwritten digits scikit-learn ships (1797 8x8 images, 10 classes). A fixed 20 %
        held-out split (independent of --seed) gives the accuracy. Model: a stem, 24 pre-norm
        residual MLP blocks of width 64, a head (26 layers, so 4 groups of 8 layers).
text    Byte-level GPT-style decoder (24 blocks, width 64, 4 heads, context 64) on a corpus every
        machine with Python has: the standard library's own top-level ``*.py`` files, in sorted
        order, up to --corpus-bytes (or ``--data PATH``: a file, or a folder read recursively in
        sorted order). The last 10 % of the bytes is held out; perplexity is per byte.

The model is an ``nn.Sequential`` whose children are the layers, so xirang's layer grouping (top-level
blocks holding parameters, in registration order) sees one layer per block.

Determinism: for a given seed, world size, thread count and backend, runs are reproducible. The batch
of step ``s`` is a pure function of (seed, step, rank), in the manner of DistributedSampler: the
global batch is cut into ``world_size`` consecutive slices, one per rank. So resuming needs only the
step, which the checkpoint stores (together with model, optimizer, RNG states and the hook state).

Measurements (printed by ``--compare`` and stored in the JSON summary)
------------------------------------------------------------------------
final loss      mean over the last 20 steps of the global (all-rank mean) training loss.
step time       mean wall time of a training step (forward, backward with sync, optimizer),
                excluding the first ``--warmup-steps`` steps.
bytes on wire   per rank and step. Without the hook: computed, not measured, as the ring allreduce
                count 2(N-1)/N x gradient bytes. With the hook: what the hook's stats report.
exposed comm    measured after training on ``--probe-steps`` extra steps (no optimizer step):
                mean time of forward+backward with gradient sync minus forward+backward inside
                ``ddp.no_sync()``, i.e. the time backward waits on communication, clamped at 0.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import glob
import inspect
import json
import logging
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

log = logging.getLogger("xirang.examples.train")


def no_forward_buffer_sync() -> Dict[str, bool]:
    """DDP keyword that turns off the per-forward buffer broadcast from rank 0 (elastic mode: that
    broadcast would raise MembershipChanged mid-forward when a rank dies). torch >= 2.13 calls it
    ``forward_sync_buffers`` and deprecates ``broadcast_buffers`` (a FutureWarning per DDP); the
    buffers are still broadcast once at construction, as the parameters are, which is what a
    rebuilt DDP after an admission wants. Older torch: ``broadcast_buffers=False``."""
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}

LAST_N_LOSS = 20  # "final loss" = mean of the last 20 steps' global loss
PER_FILE_BYTES = 16_384  # default text corpus: at most this much of each stdlib file (variety)


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------
def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--task", choices=["digits", "text"], default="digits")
    p.add_argument("--backend", choices=["xirang", "gloo"], default="xirang")
    p.add_argument("--hook", choices=["none", "bf16-ef"], default=None,
                   help="DDP comm hook: none = DDP's own allreduce; bf16-ef = xirang's bf16 "
                        "with error feedback (needs --backend xirang). Default: bf16-ef with "
                        "xirang, none with gloo")
    p.add_argument("--layers-per-group", type=int, default=8)
    p.add_argument("--bucket-cap-mb", type=float, default=0.25,
                   help="DDP bucket cap; small buckets keep the hook's launch delay small")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=None,
                   help="per-rank batch (default: digits 32 samples, text 8 sequences)")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate of AdamW (default: digits 2e-3, text 3e-3)")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-steps", type=int, default=10,
                   help="lr warm-up steps; also excluded from the step-time mean")
    p.add_argument("--depth", type=int, default=24, help="number of blocks")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--context", type=int, default=64, help="text: sequence length in bytes")
    p.add_argument("--data", default=None,
                   help="text: a file or folder of text (default: the Python stdlib's source)")
    p.add_argument("--corpus-bytes", type=int, default=400_000,
                   help="text: bytes of the default corpus to use (the first %d bytes of each "
                        "stdlib file, files in sorted order, until this many)" % PER_FILE_BYTES)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads per rank (0 = leave torch's default)")
    p.add_argument("--save", default=None, metavar="DIR",
                   help="write a checkpoint at the end (one file per rank: DIR/rank<R>.pt)")
    p.add_argument("--save-every", type=int, default=0,
                   help="also checkpoint to --save every N steps (0 = only at the end)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="resume from a checkpoint written by --save with the same world size")
    p.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                   help="stop before STEP as if interrupted (the lr schedule still spans --steps); "
                        "with --save, resume later with --resume")
    p.add_argument("--compare", action="store_true",
                   help="run the gloo baseline (gloo, hook none) and then --compare-with, same "
                        "seed, in this torchrun job; rank 0 prints a side-by-side table")
    p.add_argument("--compare-with", default="xirang:bf16-ef", metavar="BACKEND:HOOK",
                   help="the second configuration of --compare")
    p.add_argument("--probe-steps", type=int, default=10,
                   help="extra steps after training to measure exposed communication (0 = skip)")
    p.add_argument("--stats-dir", default=None,
                   help="write per-rank step records and hook stats (JSON) here")
    p.add_argument("--summary", default=None, metavar="PATH", help="also write the JSON summary here")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("--log-level", default="INFO")
    e = p.add_argument_group("elastic mode (xirang; see README 'Elastic mode')")
    e.add_argument("--elastic", action="store_true",
                   help="survive lost ranks: the survivors rebuild the ring and train on, re-sharding "
                        "each step's global batch over the live ranks; a process started with "
                        "XIRANG_JOIN=1 and a dead rank's RANK takes its place at the next admission")
    e.add_argument("--admit-every", type=int, default=20, metavar="N",
                   help="--elastic: admit waiting spares every N steps (0 = never)")
    e.add_argument("--die-at", type=int, default=None, metavar="STEP",
                   help="--elastic demo: the ranks in --die-ranks SIGKILL themselves at STEP, "
                        "as if their node had crashed")
    e.add_argument("--die-ranks", default="", metavar="R,R",
                   help="--elastic demo: comma-separated ranks that die at --die-at")
    e.add_argument("--log-every", type=int, default=0, metavar="N",
                   help="print the live ranks' mean training loss every N steps (0 = never)")
    args = p.parse_args(argv)

    if args.hook is None:
        args.hook = "bf16-ef" if args.backend == "xirang" else "none"
    if args.batch_size is None:
        args.batch_size = 32 if args.task == "digits" else 8
    if args.lr is None:
        args.lr = 2e-3 if args.task == "digits" else 3e-3
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.compare and (args.save or args.resume):
        p.error("--compare runs two trainings; use --save/--resume with a single configuration")
    if ":" not in args.compare_with:
        p.error("--compare-with takes BACKEND:HOOK, e.g. xirang:bf16-ef")
    if args.elastic:
        if args.backend != "xirang" or args.compare:
            p.error("--elastic needs --backend xirang and a single configuration (no --compare)")
        if args.save or args.resume:
            p.error("--elastic: --save/--resume are not supported (checkpoints assume a fixed world)")
        args.probe_steps = 0  # the probe assumes every rank is there
    args.die_ranks = [int(r) for r in args.die_ranks.split(",") if r.strip()]
    if args.die_ranks and args.die_at is None:
        p.error("--die-ranks needs --die-at")
    return args


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------
def _mix(*xs: int) -> int:
    """A deterministic 63-bit seed from integers (no Python hash randomisation)."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (int(x) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


class DigitsData:
    """sklearn's digits, features scaled to [0, 1], a fixed stratification-free 80/20 split."""

    def __init__(self) -> None:
        from sklearn.datasets import load_digits

        d = load_digits()
        x = torch.tensor(d.data, dtype=torch.float32) / 16.0
        y = torch.tensor(d.target, dtype=torch.long)
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
        n_test = len(y) // 5
        self.x_test, self.y_test = x[perm[:n_test]], y[perm[:n_test]]
        self.x_train, self.y_train = x[perm[n_test:]], y[perm[n_test:]]
        self._perm_cache: Dict[int, torch.Tensor] = {}

    def describe(self) -> str:
        return (f"sklearn digits: {len(self.y_train)} train / {len(self.y_test)} held-out samples, "
                f"64 features, 10 classes")

    def _epoch_perm(self, seed: int, epoch: int) -> torch.Tensor:
        if epoch not in self._perm_cache:
            g = torch.Generator().manual_seed(_mix(seed, epoch))
            self._perm_cache = {epoch: torch.randperm(len(self.y_train), generator=g)}
        return self._perm_cache[epoch]

    def batch(self, seed: int, step: int, rank: int, world: int, bs: int) -> Tuple[torch.Tensor, ...]:
        """Samples [step*GB + rank*bs, step*GB + (rank+1)*bs) of an endless stream of epochs, each
        epoch a seeded permutation of the training set (GB = bs * world)."""
        n = len(self.y_train)
        start = step * bs * world + rank * bs
        idx = []
        for i in range(start, start + bs):
            idx.append(int(self._epoch_perm(seed, i // n)[i % n]))
        idx_t = torch.tensor(idx)
        return self.x_train[idx_t], self.y_train[idx_t]


def _read_corpus(path: Optional[str], max_bytes: int) -> Tuple[bytes, str]:
    per_file = -1  # whole files
    if path is None:
        per_file = PER_FILE_BYTES
        root = os.path.dirname(os.__file__)
        files = sorted(glob.glob(os.path.join(root, "*.py")))
        what = f"Python {sys.version.split()[0]} standard library source ({root}/*.py)"
    elif os.path.isdir(path):
        files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                       if os.path.isfile(f))
        what = f"files under {path}"
        max_bytes = max(max_bytes, 1 << 62)  # user data: use all of it
    elif os.path.isfile(path):
        files = [path]
        what = path
        max_bytes = 1 << 62
    else:
        raise FileNotFoundError(f"--data {path!r}: no such file or folder")
    chunks, total = [], 0
    for f in files:
        with open(f, "rb") as fh:
            b = fh.read(per_file)
        if per_file > 0 and len(b) == per_file and b"\n" in b:
            b = b[:b.rindex(b"\n") + 1]  # whole lines only
        chunks.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    data = b"".join(chunks)[:max_bytes]
    return data, f"{what}: {len(data)} bytes from {len(chunks)} file(s)"


class TextData:
    """Byte-level corpus; the last 10 % is held out. Training windows start at seeded offsets."""

    def __init__(self, path: Optional[str], max_bytes: int, context: int) -> None:
        data, self.what = _read_corpus(path, max_bytes)
        if len(data) < 20 * (context + 1):
            raise ValueError(f"text corpus too small ({len(data)} bytes) for context {context}")
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        split = int(len(t) * 0.9)
        self.train, self.val = t[:split], t[split:]
        self.context = context

    def describe(self) -> str:
        return f"{self.what}; {len(self.train)} train / {len(self.val)} held-out bytes"

    def batch(self, seed: int, step: int, rank: int, world: int, bs: int) -> Tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(_mix(seed, step, 7))
        starts = torch.randint(0, len(self.train) - self.context - 1, (bs * world,), generator=g)
        starts = starts[rank * bs:(rank + 1) * bs]
        off = torch.arange(self.context + 1)
        w = self.train[starts[:, None] + off[None, :]]
        return w[:, :-1], w[:, 1:]

    def val_windows(self, max_windows: int = 256) -> Tuple[torch.Tensor, torch.Tensor]:
        c = self.context
        n = min(max_windows, (len(self.val) - 1) // c)
        w = torch.stack([self.val[i * c:i * c + c + 1] for i in range(n)])
        return w[:, :-1], w[:, 1:]


# --------------------------------------------------------------------------------------------------
# Models: nn.Sequential of layers (stem, blocks..., head)
# --------------------------------------------------------------------------------------------------
class ResidualMLPBlock(nn.Module):
    """x + W2 gelu(W1 LN(x)); W2 scaled by 1/sqrt(depth) so the deep stack starts near identity."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        with torch.no_grad():
            self.fc2.weight.mul_(1.0 / math.sqrt(depth))
            self.fc2.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ClassifierHead(nn.Module):
    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def digits_model(depth: int, width: int) -> nn.Sequential:
    layers: List[nn.Module] = [nn.Linear(64, width)]
    layers += [ResidualMLPBlock(width, depth) for _ in range(depth)]
    layers.append(ClassifierHead(width, 10))
    return nn.Sequential(*layers)


class TokenEmbedding(nn.Module):
    def __init__(self, vocab: int, width: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos[: idx.shape[1]]


class DecoderBlock(nn.Module):
    """Pre-norm causal self-attention + MLP (GPT-2 style), output projections scaled by depth."""

    def __init__(self, width: int, heads: int, depth: int, mlp_ratio: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, mlp_ratio * width)
        self.fc2 = nn.Linear(mlp_ratio * width, width)
        with torch.no_grad():
            for lin in (self.proj, self.fc2):
                lin.weight.mul_(1.0 / math.sqrt(2 * depth))
                lin.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def text_model(depth: int, width: int, context: int, heads: int = 4) -> nn.Sequential:
    layers: List[nn.Module] = [TokenEmbedding(256, width, context)]
    layers += [DecoderBlock(width, heads, depth) for _ in range(depth)]
    layers.append(ClassifierHead(width, 256))
    return nn.Sequential(*layers)


def task_loss(task: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if task == "text":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.cross_entropy(out, y)


@torch.no_grad()
def evaluate(task: str, model: nn.Module, data: Any, device: torch.device) -> Dict[str, float]:
    """Held-out metrics on the full held-out split; every rank computes the same numbers."""
    model.eval()
    try:
        if task == "digits":
            logits = model(data.x_test.to(device))
            y = data.y_test.to(device)
            loss = F.cross_entropy(logits, y).item()
            acc = (logits.argmax(1) == y).float().mean().item()
            return {"heldout_loss": loss, "heldout_accuracy": acc}
        x, y = data.val_windows()
        total, n = 0.0, 0
        for i in range(0, len(x), 64):
            xb, yb = x[i:i + 64].to(device), y[i:i + 64].to(device)
            out = model(xb)
            total += F.cross_entropy(out.reshape(-1, 256), yb.reshape(-1), reduction="sum").item()
            n += yb.numel()
        nll = total / n
        return {"heldout_loss": nll, "heldout_perplexity": math.exp(nll),
                "heldout_bits_per_byte": nll / math.log(2)}
    finally:
        model.train()


# --------------------------------------------------------------------------------------------------
# Distributed set-up
# --------------------------------------------------------------------------------------------------
def import_xirang(why: str):
    try:
        import xirang  # noqa: F401  (registers the "xirang" backend)
    except Exception as e:  # ImportError, or an ABI mismatch raised at import
        log.error("%s needs the xirang package, which failed to import: %s: %s\n"
                  "Build and install it from the repository root with\n"
                  "    pip install --no-build-isolation .\n"
                  "(or run `bash examples/demo.sh`, which does so), or use --backend gloo --hook none.",
                  why, type(e).__name__, e)
        sys.exit(2)
    return xirang


class Launch:
    """Rank/world from torchrun's environment and one base store; each training gets a fresh
    process group on its own prefix of that store, so --compare can init twice in one job."""

    def __init__(self) -> None:
        if "RANK" not in os.environ:  # plain `python train.py`: a world of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.store, _, _ = next(dist.rendezvous("env://", self.rank, self.world))
        self.count = 0

    def init(self, backend: str, device: torch.device, pg_options: Any = None) -> None:
        self.count += 1
        store = dist.PrefixStore(f"xirang-train/run{self.count}", self.store)
        # (the current CUDA device is set in main(); no device_id, so no eager NCCL-style init)
        kw = {"pg_options": pg_options} if pg_options is not None else {}
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world, **kw)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------------
# Hook figures
# --------------------------------------------------------------------------------------------------
def _num(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def hook_figures(state: Any, steps: int) -> Dict[str, Any]:
    """Per-step figures from ``state.stats()``. The stats layout is the hook's: read what is there,
    tolerate what is missing (None means "not reported")."""
    out: Dict[str, Any] = {"bytes_wire_per_step": None, "bytes_raw_per_step": None,
                           "exposed_comm_s": None, "launches_per_step": None, "stats": None}
    try:
        st = state.stats()
    except Exception as e:  # noqa: BLE001 - a stats failure must not lose the training result
        log.warning("state.stats() failed: %s: %s", type(e).__name__, e)
        return out
    out["stats"] = st
    totals = st.get("totals", {}) if isinstance(st, dict) else {}
    if not isinstance(totals, dict):
        totals = {}
    stats_steps = _num(totals.get("steps")) or float(steps)
    for key in ("bytes_wire", "bytes_raw"):
        v = _num(totals.get(f"{key}_per_step"))
        if v is None and _num(totals.get(key)) is not None and stats_steps:
            v = _num(totals.get(key)) / stats_steps
        if v is None and isinstance(st, dict) and isinstance(st.get("groups"), (list, dict)):
            groups = st["groups"].values() if isinstance(st["groups"], dict) else st["groups"]
            vals = [_num(g.get(f"{key}_per_step", g.get(key))) for g in groups if isinstance(g, dict)]
            if vals and all(x is not None for x in vals):
                v = sum(vals)  # type: ignore[arg-type]
        out[f"{key}_per_step"] = v
    # mean over steps when reported, else the last step's
    out["exposed_comm_s"] = _num(totals.get("mean_exposed_comm_s", totals.get("exposed_comm_s")))
    out["launches_per_step"] = _num(totals.get("launches_per_step"))
    return out


# --------------------------------------------------------------------------------------------------
# One training run
# --------------------------------------------------------------------------------------------------
@dataclass
class RunConfig:
    backend: str
    hook: str

    @property
    def name(self) -> str:
        return f"{self.backend}" + ("" if self.hook == "none" else f"+{self.hook}")


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up then cosine decay to 10 % of the peak (a pure function of the step)."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    t = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t))))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rng_state() -> Dict[str, Any]:
    s = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def _set_rng_state(s: Dict[str, Any]) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def save_checkpoint(path: str, launch: Launch, step: int, ddp: DDP, opt: torch.optim.Optimizer,
                    state: Any, losses: List[float], cfg: RunConfig, args: argparse.Namespace) -> None:
    """One file per rank (the hook's residuals are per rank): DIR/rank<R>.pt, written atomically."""
    os.makedirs(path, exist_ok=True)
    ck = {
        "format": "xirang-examples-train/1",
        "step": step,                # the next step to run; batches are a function of the step
        "world_size": launch.world,
        "rank": launch.rank,
        "task": args.task, "seed": args.seed, "backend": cfg.backend, "hook": cfg.hook,
        "model": ddp.module.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": _rng_state(),
        "hook_state": state.state_dict() if state is not None else None,
        "losses": list(losses),      # global loss per step so far
    }
    f = os.path.join(path, f"rank{launch.rank}.pt")
    torch.save(ck, f + ".tmp")
    os.replace(f + ".tmp", f)
    dist.barrier()
    if launch.rank == 0:
        log.info("checkpoint at step %d written to %s", step, path)


def load_checkpoint(path: str, launch: Launch) -> Dict[str, Any]:
    f = os.path.join(path, f"rank{launch.rank}.pt")
    if not os.path.isfile(f):
        raise FileNotFoundError(f"--resume {path}: no {os.path.basename(f)} (saved with another "
                                f"world size?)")
    ck = torch.load(f, map_location="cpu", weights_only=False)
    if ck.get("world_size") != launch.world:
        raise ValueError(f"--resume {path}: saved with world size {ck.get('world_size')}, "
                         f"this job has {launch.world}")
    return ck


def train_one(cfg: RunConfig, args: argparse.Namespace, launch: Launch, data: Any,
              device: torch.device, tag: str = "") -> Dict[str, Any]:
    xirang = None
    if cfg.backend == "xirang" or cfg.hook != "none":
        xirang = import_xirang(f"--backend {cfg.backend} --hook {cfg.hook}")
    launch.init(cfg.backend, device, xirang.Options(elastic=True) if args.elastic else None)
    try:
        return _train_in_group(cfg, args, launch, data, device, xirang, tag)
    finally:
        dist.destroy_process_group()


def _train_in_group(cfg: RunConfig, args: argparse.Namespace, launch: Launch, data: Any,
                    device: torch.device, xirang: Any, tag: str) -> Dict[str, Any]:
    rank, world = launch.rank, launch.world
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.task == "digits":
        model = digits_model(args.depth, args.width)
    else:
        model = text_model(args.depth, args.width, args.context)
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    start_step, losses = 0, []
    live = list(range(world))  # --elastic: the live ranks; each step's batch is cut over them
    if args.elastic:
        xirang.on_membership_change(lambda m: live.__setitem__(slice(None), m["live"]))
        live[:] = xirang.membership()["live"]
        if xirang.membership()["source"] >= 0:  # a spare (XIRANG_JOIN=1) that was just admitted
            start_step = xirang.sync_training_state(model, opt)
            log.warning("rank %d joined at step %d (live ranks %s)", rank, start_step, live)
    ck = None
    if args.resume:
        ck = load_checkpoint(args.resume, launch)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        start_step, losses = int(ck["step"]), list(ck["losses"])

    # Elastic: no per-forward buffer broadcast (its root may be gone); see README "Elastic mode".
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=args.bucket_cap_mb, **(no_forward_buffer_sync() if args.elastic else {}))
    state = None
    if cfg.hook == "bf16-ef":
        state = xirang.register_comm_hook(ddp, layers_per_group=args.layers_per_group)
        if ck is not None and ck.get("hook_state") is not None:
            state.load_state_dict(ck["hook_state"])
    if ck is not None:
        _set_rng_state(ck["rng"])
        if ck.get("hook_state") is None and state is not None:
            log.warning("checkpoint has no hook state: residuals start at zero")

    if rank == 0:
        log.info("[%s] %s", cfg.name, data.describe())
        log.info("[%s] model: %d layers (%d blocks x width %d), %d parameters, %.1f KiB of fp32 "
                 "gradients; world size %d; per-rank batch %d; steps %d..%d",
                 cfg.name, len(model), args.depth, args.width, n_params, grad_bytes / 1024, world,
                 args.batch_size, start_step, args.steps if args.stop_at is None else
                 min(args.steps, args.stop_at))

    step_times: List[float] = []
    local_losses: List[float] = []
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=start_step, desc=cfg.name, unit="step",
                   dynamic_ncols=True, file=sys.stderr,
                   mininterval=0.5 if sys.stderr.isatty() else 10.0)
    unit = "samples" if args.task == "digits" else "tokens"
    per_step_units = args.batch_size * world * (1 if args.task == "digits" else args.context)

    t_train = time.perf_counter()
    stop = args.steps if args.stop_at is None else max(start_step, min(args.steps, args.stop_at))
    for step in range(start_step, stop):
        if args.elastic:
            if args.die_at == step and rank in args.die_ranks:
                log.warning("rank %d: simulating the loss of its node: SIGKILL at step %d", rank, step)
                logging.shutdown()  # the line is out before the process is
                os.kill(os.getpid(), signal.SIGKILL)  # the demo's node crash
            if args.admit_every and step > start_step and step % args.admit_every == 0:
                ddp, state = _admit_spares(xirang, model, opt, ddp, state, step, args, device)
            if args.log_every and step % args.log_every == 0:
                _log_elastic(xirang, step, local_losses[-1] if local_losses else None, live, rank)
        pos, n_shards = (live.index(rank), len(live)) if args.elastic else (rank, world)
        x, y = data.batch(args.seed, step, pos, n_shards, args.batch_size)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        _sync(device)
        t0 = time.perf_counter()
        loss = task_loss(args.task, ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        _sync(device)
        dt = time.perf_counter() - t0
        step_times.append(dt)
        local_losses.append(loss.item())
        if not math.isfinite(local_losses[-1]):
            raise FloatingPointError(f"rank {rank}: loss is {local_losses[-1]} at step {step}")
        if bar is not None:
            bar.update(1)
            bar.set_postfix(refresh=False, loss=f"{local_losses[-1]:.4f}",
                            **{f"{unit}/s": f"{per_step_units / dt:,.0f}"})
        if args.save and args.save_every and (step + 1) % args.save_every == 0 and step + 1 < stop:
            losses_so_far = losses + _global_mean(local_losses, device)
            save_checkpoint(args.save, launch, step + 1, ddp, opt, state, losses_so_far, cfg, args)
            losses, local_losses = losses_so_far, []
    train_s = time.perf_counter() - t_train
    if bar is not None:
        bar.close()

    # Global mean loss per step: one allreduce of the whole history, not one per step. (Elastic:
    # ranks may have run different numbers of steps, so each rank's own history.)
    losses = losses + (local_losses if args.elastic else _global_mean(local_losses, device))
    if args.save:
        save_checkpoint(args.save, launch, stop, ddp, opt, state, losses, cfg, args)

    metrics = evaluate(args.task, ddp.module, data, device)
    hookf = hook_figures(state, len(step_times)) if state is not None else None
    if state is not None and args.stats_dir:
        _dump(os.path.join(args.stats_dir, f"{tag}{cfg.name}.hook_stats.rank{rank}.json"),
              hookf["stats"] if hookf else None)
    probe = probe_exposed_comm(args, ddp, data, launch, device) if args.probe_steps > 0 else None

    timed = step_times[args.warmup_steps:] or step_times
    mean_step = float(np.mean(timed)) if timed else float("nan")
    ring_bytes = 2.0 * (world - 1) / world * grad_bytes
    if cfg.hook == "none":
        wire, wire_how = ring_bytes, "computed: ring allreduce 2(N-1)/N x fp32 gradient bytes"
        raw = ring_bytes
    else:
        wire = hookf["bytes_wire_per_step"] if hookf else None
        raw = hookf["bytes_raw_per_step"] if hookf else None
        wire_how = "reported by state.stats()" if wire is not None else "not reported by the hook"
    exposed_hook = hookf["exposed_comm_s"] if hookf else None

    # Every rank sends its timing; the summary reports the slowest rank (the step waits for it).
    step_time_all = _gather_floats([mean_step], device) if not args.elastic else _max_over_live(mean_step, device)
    summary = {
        "config": cfg.name, "backend": cfg.backend, "hook": cfg.hook, "task": args.task,
        "world_size": world, "seed": args.seed, "steps": args.steps,
        "steps_run": len(step_times), "start_step": start_step, "stopped_at": stop,
        "layers": len(model), "layers_per_group": args.layers_per_group, "parameters": n_params,
        "gradient_bytes": grad_bytes, "batch_size_per_rank": args.batch_size,
        "final_loss": float(np.mean(losses[-LAST_N_LOSS:])),
        "final_loss_over_steps": min(LAST_N_LOSS, len(losses)),
        **metrics,
        "step_time_s": max(step_time_all),
        "step_time_s_per_rank": step_time_all,
        "train_wall_s": train_s,
        f"throughput_{unit}_per_s": per_step_units / max(step_time_all) if step_time_all else None,
        "bytes_wire_per_step": wire, "bytes_wire_how": wire_how, "bytes_raw_per_step": raw,
        "exposed_comm_s_probe": probe,
        "exposed_comm_s_hook": exposed_hook,
        "launches_per_step": hookf["launches_per_step"] if hookf else None,
        "threads_per_rank": torch.get_num_threads(),
        "device": str(device),
        "torch": torch.__version__,
    }
    if args.elastic:
        summary["membership"] = xirang.membership()
    if args.stats_dir:
        _dump(os.path.join(args.stats_dir, f"{tag}{cfg.name}.steps.rank{rank}.json"),
              {"step_time_s": step_times, "local_loss": local_losses, "global_loss": losses})
    if rank == 0:
        log.info("[%s] done: final loss %.4f, %s, step %.2f ms", cfg.name, summary["final_loss"],
                 _metric_str(summary), summary["step_time_s"] * 1e3)
    return summary


def _global_mean(vals: List[float], device: torch.device) -> List[float]:
    if not vals:
        return []
    t = torch.tensor(vals, dtype=torch.float64 if device.type == "cpu" else torch.float32,
                     device=device)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def _max_over_live(v: float, device: torch.device) -> List[float]:
    """--elastic: the slowest live rank's value (MAX allreduce runs on a shrunken ring)."""
    import xirang

    t = torch.tensor([v], dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
    xirang.retry_on_membership_change(lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX), t)
    return t.tolist()


def _admit_spares(xirang: Any, model: nn.Module, opt: Any, ddp: DDP, state: Any, step: int,
                  args: argparse.Namespace, device: torch.device) -> Tuple[DDP, Any]:
    """--elastic, at a step boundary on every live rank: admit waiting spares; if any joined,
    hand them the training state and build a new DDP wrapper over the grown group (survivors
    keep their hook residuals; spares start from zero)."""
    try:
        # DDP's constructor needs every rank: admit only when each dead rank has a spare.
        missing = dist.get_world_size() - len(xirang.membership()["live"])
        joined = xirang.admit_joiners(expect=max(1, missing))
    except xirang.MembershipChanged:  # a rank failed during the admission: try at the next one
        return ddp, state
    if not joined:
        return ddp, state
    xirang.sync_training_state(model, opt, step)
    hook_sd = state.state_dict() if state is not None else None
    del ddp, state
    gc.collect()  # the old DDP reducer's autograd hooks go with it
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=args.bucket_cap_mb, **no_forward_buffer_sync())
    state = None
    if args.hook == "bf16-ef":
        state = xirang.register_comm_hook(ddp, layers_per_group=args.layers_per_group)
        if hook_sd is not None:
            state.load_state_dict(hook_sd)
    if dist.get_rank() == min(xirang.membership()["live"]):
        print(f"step {step}: ranks {joined} joined; live ranks {xirang.membership()['live']}",
              file=sys.stderr, flush=True)
    return ddp, state


def _log_elastic(xirang: Any, step: int, loss: Optional[float], live: List[int], rank: int) -> None:
    """--elastic --log-every: the live ranks' mean loss of their previous step (a spare that has
    not trained yet adds nothing), printed by the lowest live rank; one allreduce."""
    t = torch.tensor([loss or 0.0, 0.0 if loss is None else 1.0], dtype=torch.float64)
    xirang.retry_on_membership_change(lambda: dist.all_reduce(t), t)
    if rank == min(live) and t[1] > 0:
        m = xirang.membership()
        print(f"step {step}: loss {float(t[0] / t[1]):.4f}  live ranks {live}  epoch {m['epoch']}",
              file=sys.stderr, flush=True)


def _gather_floats(vals: List[float], device: torch.device) -> List[float]:
    """All ranks' values, via one allreduce of a zero-padded vector (no allgather needed)."""
    w, r = dist.get_world_size(), dist.get_rank()
    t = torch.zeros(w * len(vals), dtype=torch.float32, device=device)
    t[r * len(vals):(r + 1) * len(vals)] = torch.tensor(vals, dtype=torch.float32)
    dist.all_reduce(t)
    return t.tolist()


def probe_exposed_comm(args: argparse.Namespace, ddp: DDP, data: Any, launch: Launch,
                       device: torch.device) -> Optional[float]:
    """Mean (forward+backward with gradient sync) - (forward+backward inside no_sync()), over
    --probe-steps alternating pairs on fresh batches, gradients discarded, no optimizer step.
    Reported by the slowest rank. This is the time backward waits on communication."""
    k = args.probe_steps
    synced, local = [], []
    for i in range(k):
        x, y = data.batch(args.seed + 1, args.steps + i, launch.rank, launch.world, args.batch_size)
        x, y = x.to(device), y.to(device)
        for use_sync in (False, True):
            ddp.zero_grad(set_to_none=True)
            ctx = contextlib.nullcontext() if use_sync else ddp.no_sync()
            _sync(device)
            t0 = time.perf_counter()
            with ctx:
                task_loss(args.task, ddp(x), y).backward()
            _sync(device)
            (synced if use_sync else local).append(time.perf_counter() - t0)
    ddp.zero_grad(set_to_none=True)
    # drop the first pair (warm-up of the no_sync path)
    d = float(np.mean(synced[1:] or synced)) - float(np.mean(local[1:] or local))
    return max(_gather_floats([max(0.0, d)], device))


def _dump(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)


def _metric_str(s: Dict[str, Any]) -> str:
    if "heldout_accuracy" in s:
        return f"held-out accuracy {100 * s['heldout_accuracy']:.2f}%"
    return f"held-out perplexity {s['heldout_perplexity']:.3f}"


# --------------------------------------------------------------------------------------------------
# The comparison table
# --------------------------------------------------------------------------------------------------
def _fmt_bytes(b: Optional[float]) -> str:
    if b is None:
        return "n/a"
    return f"{b / 1024:,.1f} KiB"


def _fmt_ms(s: Optional[float]) -> str:
    return "n/a" if s is None else f"{s * 1e3:.2f} ms"


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    if a is None or b is None or a == 0:
        return "n/a"
    return f"{b / a:.3f}x"


def comparison(base: Dict[str, Any], other: Dict[str, Any]) -> Tuple[str, Dict[str, Any]]:
    """The side-by-side table (text) and its verdicts (dict). Thresholds are issue #4's."""
    rows = [("final loss (mean of last 20 steps)", f"{base['final_loss']:.4f}",
             f"{other['final_loss']:.4f}",
             f"{other['final_loss'] - base['final_loss']:+.4f}")]
    verdict: Dict[str, Any] = {}
    dl = abs(other["final_loss"] - base["final_loss"])
    verdict["loss_within_tolerance"] = bool(dl <= max(0.02, 0.02 * abs(base["final_loss"])))
    if "heldout_accuracy" in base:
        a, b = 100 * base["heldout_accuracy"], 100 * other["heldout_accuracy"]
        rows.append(("held-out accuracy", f"{a:.2f}%", f"{b:.2f}%", f"{b - a:+.2f} pt"))
        verdict["accuracy_within_1pt"] = bool(abs(b - a) <= 1.0 + 1e-9)
    else:
        a, b = base["heldout_perplexity"], other["heldout_perplexity"]
        rows.append(("held-out perplexity (per byte)", f"{a:.3f}", f"{b:.3f}", _ratio(a, b)))
    rows.append(("step time (slowest rank, mean)", _fmt_ms(base["step_time_s"]),
                 _fmt_ms(other["step_time_s"]), _ratio(base["step_time_s"], other["step_time_s"])))
    rows.append(("bytes on the wire per step per rank", _fmt_bytes(base["bytes_wire_per_step"]),
                 _fmt_bytes(other["bytes_wire_per_step"]),
                 _ratio(base["bytes_wire_per_step"], other["bytes_wire_per_step"])))
    rows.append(("exposed comm per step (probe)", _fmt_ms(base["exposed_comm_s_probe"]),
                 _fmt_ms(other["exposed_comm_s_probe"]),
                 _ratio(base["exposed_comm_s_probe"], other["exposed_comm_s_probe"])))
    if other.get("exposed_comm_s_hook") is not None:
        rows.append(("exposed comm per step (hook stats)", "-", _fmt_ms(other["exposed_comm_s_hook"]), ""))
    if other.get("launches_per_step") is not None:
        rows.append(("hook launches per step", "-", f"{other['launches_per_step']:g}", ""))

    head = ("", base["config"] + " (baseline)", other["config"], "diff / ratio")
    w = [max(len(r[i]) for r in rows + [head]) for i in range(4)]
    line = "  ".join("-" * x for x in w)
    out = [line, "  ".join(h.ljust(w[i]) if i == 0 else h.rjust(w[i]) for i, h in enumerate(head)), line]
    for r in rows:
        out.append("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)))
    out.append(line)
    out.append(f"task {base['task']}, world size {base['world_size']}, seed {base['seed']}, "
               f"{base['steps']} steps, {base['layers']} layers in groups of "
               f"{base['layers_per_group']}, {base['parameters']:,} parameters")
    out.append(f"bytes: baseline {base['bytes_wire_how']}; {other['config']}: "
               f"{other['bytes_wire_how']}.")
    out.append("exposed comm (probe): mean of forward+backward with gradient sync minus the same "
               "inside ddp.no_sync(), over extra steps after training; slowest rank.")
    out.append("NOTE: on loopback all ranks share this machine's CPU cores and memory bandwidth, so "
               "the time ratios are not a speed claim; speed claims come from the emulated cluster "
               "(benchmarks, #6 topology). Bytes on the wire and accuracy carry over.")
    verdict_s = ", ".join(f"{k}={v}" for k, v in verdict.items())
    out.append(f"convergence check (loss within 2% or 0.02, accuracy within 1 pt): {verdict_s}")
    return "\n".join(out), verdict


# --------------------------------------------------------------------------------------------------
def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    launch_rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.INFO) if launch_rank == 0 else logging.WARNING,
        format=f"%(asctime)s rank{launch_rank} %(levelname)s %(message)s", datefmt="%H:%M:%S")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)

    launch = Launch()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            log.error("--device cuda: torch %s sees no CUDA device", torch.__version__)
            return 2
        torch.cuda.set_device(launch.local_rank)
        device = torch.device("cuda", launch.local_rank)
    else:
        device = torch.device("cpu")

    if args.compare:
        b, h = args.compare_with.split(":", 1)
        configs = [RunConfig("gloo", "none"), RunConfig(b, h)]
        if b == "xirang" or h != "none":
            import_xirang("--compare (second run: %s)" % args.compare_with)  # fail before the baseline
    else:
        if args.hook != "none" and args.backend != "xirang":
            log.error("--hook %s runs on xirang's process group: use --backend xirang", args.hook)
            return 2
        configs = [RunConfig(args.backend, args.hook)]

    data = DigitsData() if args.task == "digits" else TextData(args.data, args.corpus_bytes, args.context)
    runs = [train_one(cfg, args, launch, data, device, tag=f"run{i + 1}-" if len(configs) > 1 else "")
            for i, cfg in enumerate(configs)]

    result: Dict[str, Any] = {"runs": runs}
    if len(runs) == 2:
        table, verdict = comparison(runs[0], runs[1])
        result["comparison"] = verdict
        if launch.rank == 0:
            print("\n" + table + "\n", flush=True)
    if launch.rank == 0:
        js = json.dumps(result if len(runs) > 1 else runs[0], indent=2, default=str)
        print(js, flush=True)
        if args.summary:
            os.makedirs(os.path.dirname(os.path.abspath(args.summary)), exist_ok=True)
            with open(args.summary, "w") as f:
                f.write(js + "\n")
        if args.stats_dir:
            _dump(os.path.join(args.stats_dir, "summary.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
