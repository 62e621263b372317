"""The examples' two tasks, on data every machine has offline: data, models and held-out metrics.

digits  The handwritten digits scikit-learn ships (1797 8x8 images, 10 classes). A fixed 20 %
        held-out split (independent of the seed) gives the accuracy. Model: a stem, 24 pre-norm
        residual MLP blocks of width 64, a head (26 layers, so 4 groups of 8 layers).
text    Byte-level GPT-style decoder (24 blocks, width 64, 4 heads, context 64) on a corpus every
        machine with Python has: the standard library's own top-level ``*.py`` files, in sorted
        order (or a file, or a folder read recursively in sorted order). The last 10 % of the
        bytes is held out; perplexity is per byte.

Each model is an ``nn.Sequential`` whose children are the layers, so xirang's layer grouping
(top-level blocks holding parameters, in registration order) sees one layer per block. The batch
of step ``s`` is a pure function of (seed, step, rank), in the manner of DistributedSampler: the
global batch is cut into ``world_size`` consecutive slices, one per rank.
"""
from __future__ import annotations

import glob
import math
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

PER_FILE_BYTES = 16_384  # default text corpus: at most this much of each stdlib file (variety)


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


def make_data(task: str, data: Optional[str] = None, corpus_bytes: int = 400_000, context: int = 64) -> Any:
    """DigitsData, or TextData of ``data`` (None: the standard library's source)."""
    return DigitsData() if task == "digits" else TextData(data, corpus_bytes, context)


def make_model(task: str, depth: int, width: int, context: int) -> nn.Sequential:
    return digits_model(depth, width) if task == "digits" else text_model(depth, width, context)
