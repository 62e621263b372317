#!/usr/bin/env python3
"""DDP training-step benchmark: gloo vs xirang vs xirang's BF16 error-feedback hook vs torch's hooks.

    python3 benchmarks/ddp_step.py                              # WS 2 and 4, 30 timed steps per config
    python3 benchmarks/ddp_step.py --ws 2 --steps 20 --markdown --json /tmp/ddp.json
    python3 benchmarks/ddp_step.py --configs gloo,xirang,xirang_hook --blocks 32 --width 512
    python3 benchmarks/ddp_step.py --ws 2 --sweep-groups              # layers_per_group auto vs 1,2,4,8,16
    python3 benchmarks/ddp_step.py --ws 2 --sweep-groups --model gpt2 --blocks 12 --width 128

One self-spawning job per world size (torch.multiprocessing, spawn, a free port on 127.0.0.1,
bounded by --timeout). Every rank calls torch.set_num_threads(1), creates a xirang default
process group and a gloo group (dist.new_group(backend="gloo")), and builds one DDP replica
per configuration, each from the same seed (identical initial weights, identical batches):

    gloo            DDP default on the gloo group (C++ allreduce, default buckets)
    xirang          DDP default on the xirang group (no hook)
    xirang_hook     xirang + xirang.register_comm_hook(ddp, layers_per_group=8) (default buckets;
                    on one host over shared memory it averages DDP's buckets in place,
                    local_average: XIRANG_TRANSPORT_LOCAL=tcp times the layer groups)
    xirang_hook_late  the same with early_launch=False: groups launch when DDP hands their last
                    bucket, not when backward has accumulated their gradients
    xirang_hook_bc  the same with bucket_cap_mb=--hook-bucket-cap-mb (0.25: the setting the hook's
                    docstring recommends, ~1/8 of a group's fp32 gradient bytes)
    gloo_fp16       gloo + torch's default_hooks.fp16_compress_hook
    gloo_bf16       gloo + torch's default_hooks.bf16_compress_hook (reported "not runnable: <why>"
                    when torch or gloo rejects it)
    gloo_powersgd   gloo + torch's powerSGD_hook, matrix_approximation_rank=4,
                    start_powerSGD_iter=2 (compressing from the first step after warmup)
    xirang_powersgd the same PowerSGD hook over xirang's plain allreduce (its callbacks call
                    further collectives of the group: they run off xirang's communication thread)
    xirang_fp16     xirang + fp16_compress_hook (torch's hook over xirang's plain allreduce)
    xirang_hook_gK  the hook with layers_per_group=K and bucket_cap_mb=--hook-bucket-cap-mb
    xirang_hook_auto  the same with layers_per_group="auto" (calibrated and chosen during warmup)

--sweep-groups runs xirang_hook_g1, _g2, _g4, _g8, _g16 and xirang_hook_auto side by side (no gloo
reference) and prints, after the usual table, one more: step ms, exposed comm ms, the ratio of
each step time to the best fixed size's, and auto's choice with its predicted and measured exposed
communication (the hook's stats()["autogroup"], rank 0). Warmup must cover auto's calibration
(DDP's first step + 6 measured; the choice is applied at the 8th synced step): >= 8, the default
when an auto config runs. --json keeps the auto config's calibration samples and inputs
(``auto_samples``, ``auto_inputs``, rank 0's) to replay its model offline.

Model: --model stack (default): --blocks x [Linear(width, width) -> LayerNorm -> GELU] with
residual connections, a ModuleList of blocks (the hook's default layers = the blocks), MSE loss,
SGD, batch --batch. --model gpt2: GPT-2's shape (HF GPT2LMHeadModel's module tree:
transformer.{wte, wpe, h.i = ln_1, attn.c_attn (d x 3d), attn.c_proj, ln_2, mlp.c_fc (d x 4d),
mlp.c_proj}, ln_f, lm_head tied to wte) with d = --width, --blocks blocks, --heads heads, a
vocabulary of --vocab (default 50257 x d / 768, so the embedding keeps GPT-2 small's share of the
parameters), --batch sequences of --seq tokens, next-token cross-entropy; the hook's default
layers: wte, wpe, h.0 .. h.N-1, ln_f. GPT-2 small itself is --blocks 12 --width 768 --heads 12.
Measurement: the configurations take turns in --rounds rounds (the order rotates each round);
within a round a configuration runs its steps alternating a synchronised step and a step of the
same replica under ddp.no_sync() (no communication). Before every timed step all ranks meet at a
gloo barrier (untimed); a step (zero_grad, forward, backward, optimizer.step) is timed on every
rank and its time is the slowest rank's.

    step ms         median of the synchronised steps (IQR = p75 - p25), >= --steps samples
    local ms        median of the no_sync steps of the same replica: compute only
    exposed comm    step - local: time the step (backward + optimizer step) waits on communication
                    that backward did not hide (measured as a difference of medians, so it can be
                    slightly negative within noise)
    wire/step       bytes this rank sends per step (mean of the ranks). xirang configs: measured, the
                    sum of xirang.stats() records' bytes_wire over the step's operations (over
                    shared memory, the default on one host, that is what a rank writes into the
                    segment: (N-1)/N of a 32-bit allreduce's input, no compression); gloo and
                    torch hooks: computed, ring count 2(N-1)/N x bytes of what they allreduce
                    (gloo's own algorithm may send a different amount)
    launches/step   xirang: backend operations per step (stats records); gloo: DDP buckets;
                    fp16/bf16 hooks: one allreduce per bucket; PowerSGD: three per bucket
                    (uncompressed tensors, Ps, Qs)
Ratios are against "gloo" of the same world size.

On loopback all ranks share this machine's cores (often 2) and memory bandwidth, so the times
here carry no speed claim: they show overheads and overlap under CPU contention. Speed claims
come from the emulated cluster (benchmarks/topology.py), where links are slow.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import socket
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import auto_model, auto_warmup, machine_info, run_ranks  # noqa: E402

ALL_CONFIGS = ["gloo", "xirang", "xirang_hook", "xirang_hook_late", "xirang_hook_bc", "gloo_fp16", "gloo_bf16",
               "gloo_powersgd", "xirang_powersgd", "xirang_fp16", "xirang_hook_fp16", "xirang_hook_int8"]
# The hook configs and their wire format (register_comm_hook(wire=...)).
HOOK_WIRE = {"xirang_hook": "bf16", "xirang_hook_late": "bf16", "xirang_hook_bc": "bf16", "xirang_hook_fp16": "fp16", "xirang_hook_int8": "int8"}
DESCR = {
    "gloo": "gloo DDP default",
    "xirang": "xirang DDP default (no hook)",
    "xirang_hook": "xirang + BF16 EF hook, 8 layers/group",
    "xirang_hook_late": "xirang + BF16 EF hook, 8 layers/group, early_launch=False",
    "xirang_hook_bc": "xirang + BF16 EF hook, 8 layers/group, bucket_cap_mb={bc}",
    "gloo_fp16": "gloo + torch fp16_compress_hook",
    "gloo_bf16": "gloo + torch bf16_compress_hook",
    "gloo_powersgd": "gloo + torch powerSGD_hook rank 4",
    "xirang_powersgd": "xirang + torch powerSGD_hook rank 4",
    "xirang_fp16": "xirang + torch fp16_compress_hook",
    "xirang_hook_fp16": "xirang + fp16 (scaled) EF hook, 8 layers/group",
    "xirang_hook_int8": "xirang + int8 (scaled) EF hook, 8 layers/group",
}
NOTE = ("loopback: all ranks share this machine's cores and memory bandwidth; no speed claim "
        "(speed claims: the emulated cluster, benchmarks/topology.py)")


def quartiles(xs):
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


# ---------------------------------------------------------------- model
def gpt2_vocab(width: int) -> int:
    """The default vocabulary at width d: 50257 x d / 768 (the embedding keeps GPT-2 small's share)."""
    return max(2, round(50257 * width / 768))


def make_gpt2(blocks: int, width: int, heads: int, vocab: int, seq: int):
    """GPT-2's module tree (HF GPT2LMHeadModel's names) at width d = `width`; input token ids
    [B, T] (T <= seq), output logits [B, T, vocab]."""
    import torch
    from torch import nn

    d = width

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(d, 3 * d)
            self.c_proj = nn.Linear(d, d)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.c_attn(x).split(d, dim=2)
            q, k, v = (t.view(B, T, heads, d // heads).transpose(1, 2) for t in (q, k, v))
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).reshape(B, T, d))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(d, 4 * d)
            self.c_proj = nn.Linear(4 * d, d)

        def forward(self, x):
            return self.c_proj(nn.functional.gelu(self.c_fc(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(d), Attn(), nn.LayerNorm(d), MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT2(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn.Module()
            self.transformer.wte = nn.Embedding(vocab, d)
            self.transformer.wpe = nn.Embedding(seq, d)
            self.transformer.h = nn.ModuleList(Block() for _ in range(blocks))
            self.transformer.ln_f = nn.LayerNorm(d)
            self.lm_head = nn.Linear(d, vocab, bias=False)
            self.lm_head.weight = self.transformer.wte.weight

        def forward(self, idx):
            t = self.transformer
            x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1]))
            for b in t.h:
                x = b(x)
            return self.lm_head(t.ln_f(x))

    return GPT2()


def make_model(blocks: int, width: int, kind: str = "stack", heads: int = 4, vocab: int = 0, seq: int = 64):
    import torch
    from torch import nn

    if kind == "gpt2":
        return make_gpt2(blocks, width, heads, vocab, seq)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(width, width)
            self.norm = nn.LayerNorm(width)

        def forward(self, x):
            return x + torch.nn.functional.gelu(self.norm(self.fc(x)))

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    return Stack()


# ---------------------------------------------------------------- one configuration on one rank
class Config:
    def __init__(self, name, cfg, groups, ws, rank):
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.name, self.ws, self.rank = name, ws, rank
        self.error = None
        self.times = {"sync": [], "local": []}
        self.rec_count = 0
        self.rec_bytes = 0
        self.rec_steps = 0
        self.launch_samples = []
        self.rec_by_op = {}
        self.hook_state = None
        self.psgd = None
        self.wire_kind = "computed"
        backend = "xirang" if name.startswith("xirang") else "gloo"
        self.backend = backend
        self.pg = groups[backend]
        torch.manual_seed(cfg["seed"])
        self.kind = cfg["model"]
        model = make_model(cfg["blocks"], cfg["width"], cfg["model"], cfg["heads"], cfg["vocab"], cfg["seq"])
        kw = {}
        sweep = sweep_size(name)
        if name == "xirang_hook_bc" or sweep is not None:
            kw["bucket_cap_mb"] = cfg["hook_bucket_cap_mb"]
        if name in ("gloo_powersgd", "xirang_powersgd") and cfg["powersgd_bucket_cap_mb"] > 0:
            # explicit cap: no small first bucket, one bucket for the whole model (see --help)
            kw["bucket_cap_mb"] = cfg["powersgd_bucket_cap_mb"]
        self.ddp = DDP(model, process_group=None if backend == "xirang" else self.pg, **kw)
        if name in HOOK_WIRE or sweep is not None:
            import xirang

            lpg = cfg["layers_per_group"] if sweep is None else sweep
            wire = HOOK_WIRE.get(name, "bf16")  # bf16 (the default) not passed: runs on builds before wire=
            extra = {} if wire == "bf16" else {"wire": wire}
            if name == "xirang_hook_late":
                extra["early_launch"] = False
            self.hook_state = xirang.register_comm_hook(self.ddp, layers_per_group=lpg, **extra)
            self.wire_kind = "measured"
        elif name == "xirang":
            self.wire_kind = "measured"
        elif name in ("gloo_fp16", "xirang_fp16"):
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            self.ddp.register_comm_hook(self.pg, default_hooks.fp16_compress_hook)
            self.wire_kind = "measured" if name == "xirang_fp16" else "computed"
        elif name == "gloo_bf16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            self.ddp.register_comm_hook(self.pg, default_hooks.bf16_compress_hook)
        elif name in ("gloo_powersgd", "xirang_powersgd"):
            self.wire_kind = "measured" if name == "xirang_powersgd" else "computed"
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

            self.psgd = ps.PowerSGDState(process_group=self.pg, matrix_approximation_rank=4,
                                         start_powerSGD_iter=2, random_seed=cfg["seed"])
            self.ddp.register_comm_hook(self.psgd, ps.powerSGD_hook)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=cfg["lr"])
        self.numel = sum(p.numel() for p in model.parameters())
        self.nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.psgd_before = 0

    def step(self, x, y, sync: bool) -> float:
        import torch

        self.opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        ctx = contextlib.nullcontext() if sync else self.ddp.no_sync()
        with ctx:
            out = self.ddp(x)
            if self.kind == "gpt2":
                loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            else:
                loss = torch.nn.functional.mse_loss(out, y)
            loss.backward()
        self.opt.step()
        dt = time.perf_counter() - t0
        if not math.isfinite(loss.item()):
            raise RuntimeError(f"{self.name}: non-finite loss")
        return dt

    def n_buckets(self) -> int:
        try:
            d = self.ddp._get_ddp_logging_data()
            bs = d.get("rebuilt_bucket_sizes") or d.get("bucket_sizes")
            if isinstance(bs, str):
                return len([s for s in bs.split(",") if s.strip()])
            if isinstance(bs, (list, tuple)):
                return len(bs)
        except Exception:
            pass
        return -1


def xirang_max_seq(pg=None) -> int:
    import xirang

    recs = xirang.stats(pg)
    return max((r["seq"] for r in recs), default=-1)


def worker(rank: int, ws: int, port: int, cfg: dict, q) -> None:
    try:
        import torch
        import torch.distributed as dist

        import xirang

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, ws, rank == 0, timeout=datetime.timedelta(seconds=60))
        timeout = datetime.timedelta(seconds=cfg["op_timeout"])
        dist.init_process_group("xirang", store=store, rank=rank, world_size=ws, timeout=timeout)
        gloo = dist.new_group(backend="gloo", timeout=timeout)
        groups = {"xirang": dist.group.WORLD, "gloo": gloo}

        # the same batches for every configuration (different per rank, as in data parallelism)
        g = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)
        nb = 8
        if cfg["model"] == "gpt2":  # token ids and their next tokens
            toks = [torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g) for _ in range(nb)]
            batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in toks]
        else:
            batches = [(torch.randn(cfg["batch"], cfg["width"], generator=g),
                        torch.randn(cfg["batch"], cfg["width"], generator=g)) for _ in range(nb)]

        def agree_failed(err: str | None) -> bool:
            flag = torch.tensor([1.0 if err else 0.0])
            dist.all_reduce(flag, group=gloo)
            return flag.item() > 0

        # build every configuration and warm it up (first iteration: bucket rebuild)
        confs = []
        for name in cfg["configs"]:
            err = None
            c = None
            try:
                c = Config(name, cfg, groups, ws, rank)
                for i in range(cfg["warmup"]):
                    c.step(*batches[i % nb], sync=True)
                for i in range(2):
                    c.step(*batches[i % nb], sync=False)
            except Exception as e:  # noqa: BLE001
                err = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
            if agree_failed(err):
                errs = [None] * ws
                dist.all_gather_object(errs, err, group=gloo)
                reason = next(e for e in errs if e)
                if rank == 0:
                    q.put(("log", f"WS={ws} {name}: not runnable: {reason}"))
                confs.append((name, None, reason))
                if c is not None:
                    c.ddp = c.opt = None
                continue
            confs.append((name, c, None))

        live = [c for _, c, _ in confs if c is not None]
        rounds = max(1, cfg["rounds"])
        per_round = max(1, math.ceil(cfg["steps"] / rounds))
        k = 0
        for r in range(rounds):
            order = live[r % len(live):] + live[: r % len(live)] if live else []
            for c in order:
                seq0 = xirang_max_seq() if c.backend == "xirang" else None
                ps0 = c.psgd.total_numel_after_compression if c.psgd else None
                for i in range(per_round):
                    modes = (True, False) if (i + r) % 2 == 0 else (False, True)
                    for sync in modes:
                        x, y = batches[k % nb]
                        k += 1
                        dist.barrier(group=gloo)
                        c.times["sync" if sync else "local"].append(c.step(x, y, sync))
                if c.backend == "xirang":
                    recs = [rr for rr in xirang.stats() if rr["seq"] > seq0]
                    c.rec_count += len(recs)
                    c.rec_bytes += sum(rr["bytes_wire"] for rr in recs)
                    c.rec_steps += per_round
                    c.launch_samples.append(len(recs) / per_round)
                    for rr in recs:
                        key = f"{rr['op']}/{rr.get('dtype')}"
                        d = c.rec_by_op.setdefault(key, {"count": 0, "numel": 0, "bytes_raw": 0, "bytes_wire": 0})
                        d["count"] += 1
                        d["numel"] += rr.get("numel", 0)
                        d["bytes_raw"] += rr.get("bytes_raw", 0)
                        d["bytes_wire"] += rr["bytes_wire"]
                        for f in ("queued_s", "encode_s", "scatter_reduce_s", "allgather_s", "decode_s", "total_s"):
                            if isinstance(rr.get(f), (int, float)):
                                d[f] = d.get(f, 0.0) + rr[f]
                    if c.hook_state is not None:
                        c.hook_groups = sorted({rr["group_id"] for rr in recs if rr.get("group_id", -1) >= 0})
                if c.psgd is not None:
                    c.psgd_numel = getattr(c, "psgd_numel", 0) + c.psgd.total_numel_after_compression - ps0
                    c.psgd_steps = getattr(c, "psgd_steps", 0) + per_round

        # reduce: per step the slowest rank; bytes: mean over ranks
        ring = 2.0 * (ws - 1) / ws
        rows = []
        for name, c, reason in confs:
            row = {"ws": ws, "config": name,
                   "description": describe(name, cfg["hook_bucket_cap_mb"])}
            if c is None:
                row["not_runnable"] = reason
                rows.append(row)
                continue
            for mode in ("sync", "local"):
                t = torch.tensor(c.times[mode], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
                c.times[mode] = t.tolist()
            nbk = c.n_buckets()
            if c.backend == "xirang":
                wire = c.rec_bytes / max(1, c.rec_steps)
                launches = c.rec_count / max(1, c.rec_steps)
            if c.name == "gloo":
                wire, launches = ring * c.nbytes, nbk
            elif c.name in ("gloo_fp16", "gloo_bf16"):
                wire, launches = ring * 2 * c.numel, nbk
            elif c.name == "gloo_powersgd":
                wire = ring * 4 * c.psgd_numel / max(1, c.psgd_steps)
                launches = 3 * nbk
            v = torch.tensor([wire, launches], dtype=torch.float64)
            dist.all_reduce(v, group=gloo)
            wire, launches = (v / ws).tolist()
            p25, med, p75 = quartiles(c.times["sync"])
            l25, lmed, l75 = quartiles(c.times["local"])
            row.update({
                "step_ms": med * 1e3, "step_iqr_ms": (p75 - p25) * 1e3,
                "local_ms": lmed * 1e3, "local_iqr_ms": (l75 - l25) * 1e3,
                "exposed_comm_ms": (med - lmed) * 1e3,
                "wire_bytes_per_step": wire, "wire_kind": c.wire_kind,
                "raw_fp32_ring_bytes": ring * c.nbytes,
                "launches_per_step": launches,
                "launches_kind": "records" if c.backend == "xirang" else "computed",
                "ddp_buckets": nbk, "steps": len(c.times["sync"]),
                "samples_step_ms": [x * 1e3 for x in c.times["sync"]],
                "samples_local_ms": [x * 1e3 for x in c.times["local"]],
            })
            if c.backend == "xirang":
                row["launches_per_step_by_round"] = c.launch_samples
                # rank 0's records per step by op/dtype: count, elements, bytes_raw, bytes_wire
                row["records_per_step_by_op"] = {k: {f: v / max(1, c.rec_steps) for f, v in d.items()}
                                                 for k, d in c.rec_by_op.items()}
            if c.hook_state is not None:
                try:
                    row["autogroup"] = c.hook_state.stats()["autogroup"]
                    auto = getattr(c.hook_state, "_auto", None)  # auto's calibration, to replay its model offline
                    if auto is not None:
                        cal = auto.calibration_record()
                        row["auto_inputs"], row["auto_samples"] = cal["inputs"], cal["samples"]
                    row["layers_per_group"] = c.hook_state.group_size()
                    tot = c.hook_state.stats()["totals"]
                    row["hook"] = {k: tot.get(k) for k in ("groups", "launches_per_step", "bytes_wire_per_step",
                                                           "bytes_raw_per_step", "mean_exposed_comm_s",
                                                           "residual_bytes", "skipped_steps")}
                    row["hook"]["group_ids_in_records"] = getattr(c, "hook_groups", None)
                    row["hook"]["per_group"] = [
                        {k: gr.get(k) for k in ("group", "numel_compressed", "numel_plain", "collectives_per_step",
                                                "mean_comm_s", "mean_launch_delay_s",
                                                "mean_launch_delay_from_grad_ready_s")}
                        for gr in c.hook_state.stats()["groups"]]
                except Exception as e:  # noqa: BLE001
                    row["hook"] = {"error": repr(e)}
            rows.append(row)
        if rank == 0:
            q.put(("rows", rows))
            q.put(("info", {"params": live[0].numel if live else None,
                            "param_bytes": live[0].nbytes if live else None}))
        dist.barrier(group=gloo)
        dist.destroy_process_group()
        q.put(("done", rank))
    except BaseException:
        q.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


# ---------------------------------------------------------------- driver
def run_ws(ws: int, cfg: dict, log) -> tuple[list, dict]:
    result = {"rows": [], "info": {}}

    def on_message(kind, val):
        if kind == "rows":
            result["rows"] = val
        elif kind == "info":
            result["info"].update(val)
        elif kind == "log":
            log(val)

    run_ranks(worker, ws, cfg, on_message)
    return result["rows"], result["info"]


def fmt_bytes(n: float) -> str:
    for unit, m in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m:
            return f"{n / m:.2f} {unit}"
    return f"{n:.0f} B"


def launches_str(r: dict) -> str:
    s = f"{r['launches_per_step']:.2f}".rstrip("0").rstrip(".")
    by = r.get("records_per_step_by_op")
    if by and len(by) > 1:
        s += " (" + " + ".join(f"{v['count']:.3g} {k.split('/')[0]}" for k, v in by.items()) + ")"
    if r.get("hook", {}).get("groups"):
        s += f", {r['hook']['groups']} groups"
    return s


def ratio(a, b):
    return f"{a / b:.2f}" if b else "-"


def text_table(rows: list) -> str:
    hdr = (f"{'WS':>2} {'config':<16} | {'step ms':>8} {'iqr':>6} {'local ms':>8} {'exposed comm ms':>15} |"
           f" {'wire/step':>10} {'':<8} {'launch/step':>11} | {'step/g':>6} {'wire/g':>6}")
    out = [hdr, "-" * len(hdr)]
    base = {r["ws"]: r for r in rows if r["config"] == "gloo" and "step_ms" in r}
    for r in rows:
        if "not_runnable" in r:
            out.append(f"{r['ws']:>2} {r['config']:<16} | not runnable: {r['not_runnable']}")
            continue
        b = base.get(r["ws"])
        out.append(
            f"{r['ws']:>2} {r['config']:<16} | {r['step_ms']:>8.2f} {r['step_iqr_ms']:>6.2f} {r['local_ms']:>8.2f}"
            f" {r['exposed_comm_ms']:>15.2f} | {fmt_bytes(r['wire_bytes_per_step']):>10} {r['wire_kind']:<8}"
            f" {launches_str(r):>11} | {ratio(r['step_ms'], b['step_ms']) if b else '-':>6}"
            f" {ratio(r['wire_bytes_per_step'], b['wire_bytes_per_step']) if b else '-':>6}")
    return "\n".join(out)


def markdown(rows: list) -> str:
    out = ["| WS | configuration | step ms (IQR) | local ms, no_sync | exposed comm ms (step - local) |"
           " wire bytes/step per rank | launches/step | step / gloo | wire / gloo |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    base = {r["ws"]: r for r in rows if r["config"] == "gloo" and "step_ms" in r}
    for r in rows:
        if "not_runnable" in r:
            out.append(f"| {r['ws']} | {r['description']} | not runnable: {r['not_runnable']} | | | | | | |")
            continue
        b = base.get(r["ws"])
        lk = "" if r["launches_kind"] == "records" else " (computed)"
        out.append(
            f"| {r['ws']} | {r['description']} | {r['step_ms']:.2f} ({r['step_iqr_ms']:.2f}) | {r['local_ms']:.2f}"
            f" | {r['exposed_comm_ms']:.2f} | {fmt_bytes(r['wire_bytes_per_step'])} ({r['wire_kind']})"
            f" | {launches_str(r)}{lk} | {ratio(r['step_ms'], b['step_ms']) if b else '-'}"
            f" | {ratio(r['wire_bytes_per_step'], b['wire_bytes_per_step']) if b else '-'} |")
    return "\n".join(out)


SWEEP = [1, 2, 4, 8, 16]


def sweep_size(name: str):
    """layers_per_group of a xirang_hook_gK / xirang_hook_auto config; None for another name."""
    if name == "xirang_hook_auto":
        return "auto"
    if name.startswith("xirang_hook_g") and name[len("xirang_hook_g"):].isdigit() and int(name[len("xirang_hook_g"):]) > 0:
        return int(name[len("xirang_hook_g"):])
    return None


def describe(name: str, bc: float) -> str:
    k = sweep_size(name)
    if k is not None:
        return f"xirang + BF16 EF hook, layers_per_group={k!s}, bucket_cap_mb={bc}"
    return DESCR[name].format(bc=bc)


def sweep_table(rows: list) -> str:
    """auto vs the fixed sizes, per WS: step ms, exposed comm ms (step - local), step / best fixed."""
    out = []
    for ws in sorted({r["ws"] for r in rows}):
        rs = [r for r in rows if r["ws"] == ws and sweep_size(r["config"]) is not None and "step_ms" in r]
        fixed = [r for r in rs if sweep_size(r["config"]) != "auto"]
        if not fixed:
            continue
        best = min(fixed, key=lambda r: r["step_ms"])
        hdr = (f"{'WS':>2} {'layers/group':<14} | {'step ms':>8} {'iqr':>6} {'exposed comm ms':>15} | "
               f"{'step / best fixed':>17} | {'groups':>6}")
        out += [hdr, "-" * len(hdr)]
        for r in rs:
            k = sweep_size(r["config"])
            label = f"auto -> {r.get('layers_per_group')}" if k == "auto" else str(k)
            out.append(f"{ws:>2} {label:<14} | {r['step_ms']:>8.2f} {r['step_iqr_ms']:>6.2f} "
                       f"{r['exposed_comm_ms']:>15.2f} | {r['step_ms'] / best['step_ms']:>17.3f} | "
                       f"{r.get('hook', {}).get('groups', '-')!s:>6}")
        out.append(f"best fixed: layers_per_group={sweep_size(best['config'])} ({best['step_ms']:.2f} ms)")
        for r in rs:
            a = r.get("autogroup")
            if sweep_size(r["config"]) == "auto" and a:
                pred = a.get("predicted_exposed_comm_s")
                meas = a.get("measured_exposed_comm_s")
                out.append(f"auto (rank 0): chose {a.get('layers_per_group')}; predicted exposed "
                           f"{1e3 * pred if pred is not None else float('nan'):.3f} ms, hook-measured "
                           f"{1e3 * meas if meas is not None else float('nan'):.3f} ms")
                out.append("  model: " + auto_model(a))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--ws", default="2,4", help="world sizes, comma-separated (default 2,4)")
    ap.add_argument("--configs", default=",".join(ALL_CONFIGS), help=f"subset of {','.join(ALL_CONFIGS)}")
    ap.add_argument("--steps", type=int, default=30, help="timed synchronised steps per config (>= 20 for the table)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds the steps are split into, configs rotating")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed synchronised steps per config first (>= 3; >= 6 with auto; default 5, 6 with auto)")
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--model", choices=("stack", "gpt2"), default="stack", help="see Model above (default stack)")
    ap.add_argument("--heads", type=int, default=4, help="--model gpt2: attention heads (width must divide)")
    ap.add_argument("--vocab", type=int, default=0, help="--model gpt2: vocabulary (default 50257 x width / 768)")
    ap.add_argument("--seq", type=int, default=64, help="--model gpt2: tokens per sequence (default 64)")
    ap.add_argument("--layers-per-group", default="8", help="the xirang_hook configs' size: an int or auto (default 8)")
    ap.add_argument("--sweep-groups", action="store_true",
                    help="run xirang_hook_g1,_g2,_g4,_g8,_g16 and xirang_hook_auto (bucket_cap_mb=--hook-bucket-cap-mb) "
                         "and print the auto-vs-fixed table")
    ap.add_argument("--hook-bucket-cap-mb", type=float, default=0.25,
                    help="bucket_cap_mb of the xirang_hook_bc config (default 0.25)")
    ap.add_argument("--powersgd-bucket-cap-mb", type=float, default=25,
                    help="bucket_cap_mb passed explicitly to the PowerSGD config (default 25: one bucket for "
                         "the default model; 0 = DDP's default layout, whose 1 MiB first bucket makes torch's "
                         "PowerSGD hook desynchronise gloo here)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900, help="wall-clock bound per world size, seconds")
    ap.add_argument("--op-timeout", type=float, default=120, help="process group timeout, seconds")
    ap.add_argument("--json", metavar="PATH", help="write rows (with every sample) and machine info as JSON")
    ap.add_argument("--markdown", action="store_true", help="also print a markdown table (for the README)")
    a = ap.parse_args(argv)

    if a.sweep_groups:
        configs = [f"xirang_hook_g{k}" for k in SWEEP] + ["xirang_hook_auto"]
    else:
        configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in ALL_CONFIGS and sweep_size(c) is None]
    if bad:
        ap.error(f"unknown configs {bad}; choose from {ALL_CONFIGS}, xirang_hook_gK, xirang_hook_auto")
    if "gloo" not in configs and not a.sweep_groups:
        configs.insert(0, "gloo")  # the reference of the ratios
    if a.layers_per_group != "auto":
        try:
            a.layers_per_group = int(a.layers_per_group)
        except ValueError:
            ap.error(f"--layers-per-group must be a positive int or auto, got {a.layers_per_group!r}")
        if a.layers_per_group < 1:
            ap.error(f"--layers-per-group must be a positive int or auto, got {a.layers_per_group!r}")
    if a.model == "gpt2":
        a.vocab = a.vocab or gpt2_vocab(a.width)
        if a.width % a.heads:
            ap.error(f"--width ({a.width}) must be a multiple of --heads ({a.heads})")
    wss = [int(x) for x in a.ws.split(",") if x.strip()]
    if not wss or min(wss) < 2:
        ap.error("--ws: world sizes must be >= 2")
    uses_auto = "xirang_hook_auto" in configs or (
        a.layers_per_group == "auto" and any(c in ("xirang_hook", "xirang_hook_bc") for c in configs))
    need = auto_warmup() if uses_auto else 0
    if a.warmup is None:
        a.warmup = need or 5
    if a.warmup < 3:
        ap.error("--warmup must be >= 3 (DDP rebuilds buckets after the first step; PowerSGD starts at 2)")
    if a.warmup < need:
        ap.error(f"--warmup must be >= {need} with layers_per_group auto (its calibration: DDP's first "
                 f"step + {need - 2} measured, the choice applied at the next)")
    cfg = {"configs": configs, "steps": a.steps, "rounds": a.rounds, "warmup": a.warmup, "blocks": a.blocks,
           "width": a.width, "batch": a.batch, "layers_per_group": a.layers_per_group,
           "model": a.model, "heads": a.heads, "vocab": a.vocab, "seq": a.seq,
           "hook_bucket_cap_mb": a.hook_bucket_cap_mb,
           "powersgd_bucket_cap_mb": a.powersgd_bucket_cap_mb, "lr": a.lr, "seed": a.seed,
           "timeout": a.timeout, "op_timeout": a.op_timeout}
    info = machine_info()
    print(f"# xirang DDP step benchmark: {info.get('cpu', '?')}, {info['cpus']} CPUs, load "
          f"{tuple(round(x, 2) for x in info.get('loadavg', ()))}, torch {info.get('torch')}, "
          f"env {info['env'] or '{}'}")
    shape = (f"{a.blocks} x [Linear({a.width},{a.width}) + LayerNorm + GELU, residual], batch {a.batch}"
             if a.model == "stack" else
             f"GPT-2-shaped: {a.blocks} blocks, d={a.width}, {a.heads} heads, vocab {a.vocab} (tied head), "
             f"{a.batch} x {a.seq} tokens")
    print(f"# model: {shape},"
          f" SGD; torch.set_num_threads(1) per rank; {a.steps} timed steps + as many no_sync steps per"
          f" config in {a.rounds} rotating rounds, after {a.warmup} warmup steps; seed {a.seed}")
    print(f"# NOTE {NOTE}")
    print("# step/local: median of the slowest rank per step (IQR p75-p25), ms; exposed comm = step - local"
          " (no_sync step of the same replica, i.e. no communication);")
    print("# wire/step: bytes each rank sends per step (measured = xirang.stats() bytes_wire; computed ="
          " 2(N-1)/N x bytes allreduced); ratios vs gloo DDP default of the same WS")
    all_rows, failures, infos = [], [], {}
    for ws in wss:
        t0 = time.monotonic()
        try:
            rows, winfo = run_ws(ws, cfg, lambda s: print(f"# {s}", flush=True))
        except Exception as e:  # noqa: BLE001
            failures.append(str(e))
            print(f"# WS={ws} FAILED: {e}", file=sys.stderr, flush=True)
            continue
        infos.update(winfo)
        all_rows.extend(rows)
        print(f"# WS={ws} done in {time.monotonic() - t0:.0f} s", flush=True)
        print(text_table(rows), flush=True)
        if a.sweep_groups:
            print(sweep_table(rows), flush=True)
    if infos.get("params"):
        print(f"# model parameters: {infos['params']} ({fmt_bytes(infos['param_bytes'])} fp32)")
    if a.markdown and all_rows:
        print()
        print(markdown(all_rows))
        print()
        print(f"_{NOTE}._")
    try:
        end_load = os.getloadavg()
    except OSError:
        end_load = None
    print(f"# load average at the end: {tuple(round(x, 2) for x in end_load) if end_load else '?'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "machine": info, "model": infos, "end_loadavg": end_load, "note": NOTE,
                       "rows": all_rows, "failures": failures}, f, indent=1, default=str)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
