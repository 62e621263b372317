"""Multi-process workers for test_hook.py: models, the stand-in backend, and scenarios.

Each scenario runs in every rank (started by ``run_ranks``) and saves ``rank{r}.pt`` into the
output directory; test_hook.py asserts on those files. ``kind`` is ``"xirang"`` (the real
backend, needs xirang._C) or ``"fake"``: gloo plus :class:`FakeEFBackend`, a stand-in for
``ProcessGroupXirang.allreduce_ef`` used to test the hook's pure-Python logic.
"""

from __future__ import annotations

import datetime
import gc
import importlib.util
import logging
import os
import sys
import time
import traceback
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import mp_pool

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def xirang_built() -> bool:
    try:
        import xirang._C  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def load_hooks():
    """xirang.hooks from the installed package, else the package from the source tree."""
    try:
        import xirang.hooks as h

        return h
    except Exception:  # noqa: BLE001  (package not built yet)
        pass
    name = "xirang_hooks_src"
    if name in sys.modules:
        return sys.modules[name]
    pkg = os.path.join(_ROOT, "python", "xirang", "hooks")
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def use_backend(hooks, factory):
    """Make the hook state resolve its backend with ``factory(process_group)`` (the stand-in)."""
    hooks.state._backend_for = factory


# ---------------------------------------------------------------------------------------------
# Stand-in backend (tests only)
# ---------------------------------------------------------------------------------------------


class _FakeWork:
    def __init__(self, fut):
        self._fut = fut

    def get_future(self):
        return self._fut

    def wait(self):
        self._fut.wait()
        return True


class FakeEFBackend:
    """Emulates allreduce_ef on gloo: v = x/N + r; q = bf16(v); staged = v - q; y = sum_i q_i;
    then each ``plain`` tensor averaged in its own dtype (pre-divided by N, then a SUM).

    ``exact=True`` skips the rounding (q = v), so outputs equal the plain average: used to
    check packing, splitting and unpacking exactly. Records every call that has compressed
    elements as (group_id, numel).
    """

    def __init__(self, pg, exact=False):
        self.pg = pg
        self.exact = exact
        self.calls = []
        self.ring = list(range(dist.get_world_size(pg)))
        self.shm_ranks = []  # no shared-memory domain: the hook takes its layer-group path

    def allreduce_ef(self, buffer, residual, staged, group_id, label="", plain=(), wire="bf16", pack_into=(),
                     pack_from=()):
        assert wire == "bf16", f"the stand-in emulates the bf16 wire only, got {wire!r}"
        assert len(pack_into) == len(pack_from)
        for d, s in zip(pack_into, pack_from):  # the packing the real op does first
            d.copy_(s)
        for t in (buffer, residual, staged):
            assert t.dtype == torch.float32 and t.dim() == 1 and t.is_contiguous(), t
            assert t.numel() == buffer.numel()
        assert isinstance(group_id, int) and isinstance(label, str)
        n = dist.get_world_size(self.pg)
        futs = []
        if buffer.numel():
            assert staged.data_ptr() != residual.data_ptr(), "staged aliases residual"
            assert staged.data_ptr() != buffer.data_ptr() and residual.data_ptr() != buffer.data_ptr()
            self.calls.append((group_id, buffer.numel()))
            v = buffer / n + residual
            q = v.clone() if self.exact else v.to(torch.bfloat16).float()
            staged.copy_(v - q)

            def done(f):
                buffer.copy_(f.value()[0])
                return [buffer]

            futs.append(dist.all_reduce(q, group=self.pg, async_op=True).get_future().then(done))
        for b in plain:
            if n > 1:
                b.div_(n)
                futs.append(dist.all_reduce(b, op=dist.ReduceOp.SUM, group=self.pg, async_op=True).get_future())
        return _FakeWork(torch.futures.collect_all(futs).then(lambda f: [x.value() for x in f.value()]))


FAKE = {}


def setup(rank, ws, port, kind, exact=False, threads=1, transport=None):
    torch.set_num_threads(threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    backend = "xirang" if kind == "xirang" else "gloo"
    if kind == "xirang":
        import xirang  # noqa: F401  (registers the backend)
        # These scenarios check the hook's BF16 error-feedback wire, which ranks on different
        # hosts use. On one host the default (auto) runs the hook's op as an exact fp32 average
        # over shared memory instead (residuals stay 0; test_shm.test_hook_op_is_fp32_over_shm).
        # A scenario's cfg["transport"] ("auto", "shm") runs it on one host's shared memory.
        os.environ.setdefault("XIRANG_TRANSPORT_LOCAL", transport or "tcp")
    dist.init_process_group(
        backend, rank=rank, world_size=ws, timeout=datetime.timedelta(seconds=60)
    )
    hooks = load_hooks()
    if kind == "fake":
        use_backend(hooks, lambda pg: FAKE.setdefault("b", FakeEFBackend(pg, exact=exact)))
    return hooks


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.ln(x)))


class TinyLM(nn.Module):
    """wte (tied with head), a root-level ``pos`` parameter, a ModuleList of blocks."""

    def __init__(self, V=50, D=48, T=8, L=6, fp64=False, unused=False):
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.randn(T, D) * 0.02)
        self.blocks = nn.ModuleList(Block(D) for _ in range(L))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.wte.weight
        self.gain64 = nn.Parameter(torch.ones(D, dtype=torch.float64)) if fp64 else None
        self.unused = nn.Linear(D, D) if unused else None

    def forward(self, idx):
        x = self.wte(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        x = self.ln_f(x)
        if self.gain64 is not None:
            x = x * self.gain64.float()
        return self.head(x)


class Direct(nn.Module):
    """loss = sum(W * X): the gradient of W is exactly X (controlled inputs)."""

    def __init__(self, shapes):
        super().__init__()
        self.ws = nn.ParameterList(nn.Parameter(torch.zeros(s)) for s in shapes)

    def forward(self, xs, skip=None):
        return sum((w * x).sum() for i, (w, x) in enumerate(zip(self.ws, xs)) if i != skip)


class Digits(nn.Module):
    def __init__(self, depth=24, width=64):
        super().__init__()
        self.inp = nn.Linear(64, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, 10)

    def forward(self, x):
        x = torch.relu(self.inp(x))
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def lm_batch(step, rank, V=50, T=8, B=4):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, V, (B, T), generator=g)


def lm_loss(model, idx):
    logits = model(idx)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                       idx[:, 1:].reshape(-1))


def grads_of(module):
    return {n: (p.grad.detach().clone() if p.grad is not None else None)
            for n, p in module.named_parameters()}


# ---------------------------------------------------------------------------------------------
# Scenarios
# ---------------------------------------------------------------------------------------------


def sc_train(rank, ws, hooks, out, cfg):
    """TinyLM under DDP with the hook; records hook outputs, local inputs, calls, stats."""
    torch.manual_seed(0)
    model = TinyLM(fp64=cfg.get("fp64", False), unused=cfg.get("unused", False))
    ref = TinyLM(fp64=cfg.get("fp64", False), unused=cfg.get("unused", False))
    ref.load_state_dict(model.state_dict())
    ddp_kw = dict(
        bucket_cap_mb=cfg.get("bucket_cap_mb"),
        gradient_as_bucket_view=cfg.get("gabv", False),
        static_graph=cfg.get("static_graph", False),
        find_unused_parameters=cfg.get("find_unused", False),
    )
    ddp = DDP(model, **{k: v for k, v in ddp_kw.items() if v is not None})
    state = hooks.register_comm_hook(ddp, layers_per_group=cfg.get("lpg", 2),
                                     **cfg.get("state_kw", {}))
    rec = {"groups": state.groups, "steps": []}
    autocast = cfg.get("autocast", False)
    for step in range(cfg.get("steps", 4)):
        idx = lm_batch(step, rank)
        n0 = len(FAKE["b"].calls) if "b" in FAKE else 0
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext()
        with ctx:
            loss = lm_loss(ddp, idx)
        loss.backward()
        with ctx:
            lm_loss(ref, idx).backward()
        calls = FAKE["b"].calls[n0:] if "b" in FAKE else None
        rec["steps"].append({
            "out": grads_of(model), "inp": grads_of(ref), "calls": calls,
            "stats": state.stats(), "residuals": {k: v.clone() for k, v in state.residuals.items()},
        })
        model.zero_grad(set_to_none=cfg.get("set_to_none", True))
        ref.zero_grad(set_to_none=True)
    rec["state_dict"] = state.state_dict()
    torch.save(rec, os.path.join(out, f"rank{rank}.pt"))


def sc_direct(rank, ws, hooks, out, cfg):
    """Controlled gradients: per step the inputs come from cfg['gen'](step, rank) shapes."""
    shapes = cfg["shapes"]
    model = Direct(shapes)
    # cfg["unused"] = (i, steps): parameter i takes no part in those steps on any rank (its
    # recorded x is 0 there, its y None: DDP leaves the .grad of a globally unused parameter alone)
    unused_i, unused_steps = cfg.get("unused", (None, ()))
    ddp = DDP(model, bucket_cap_mb=cfg.get("bucket_cap_mb"), find_unused_parameters=unused_i is not None,
              gradient_as_bucket_view=cfg.get("gabv", False))
    coarse = []  # the layer finder's "too coarse" WARNINGs at registration (Direct's one layer)
    handler = logging.Handler()
    handler.emit = lambda r: coarse.append(r) if "default layer finder" in r.getMessage() else None
    logging.getLogger("xirang").addHandler(handler)
    try:
        state = hooks.register_comm_hook(ddp, layers_per_group=cfg.get("lpg", 8),
                                         **cfg.get("state_kw", {}))
    finally:
        logging.getLogger("xirang").removeHandler(handler)
    rec = {"steps": [], "coarse_warned": bool(coarse)}
    if cfg.get("init_residuals"):  # this rank's residuals before step 0, through load_state_dict
        g = torch.Generator().manual_seed(101 + rank)
        sd = state.state_dict()
        sd["residuals"] = {n: torch.randn(p.shape, generator=g) * cfg["init_residuals"]
                           for n, p in model.named_parameters() if n in {c for gr in state.groups for c in gr["compressed"]}}
        state.load_state_dict(sd)
        rec["r0"] = {k: v.clone() for k, v in state.residuals.items()}
    if "local_average_by_rank" in cfg:  # ranks that disagree (an error case)
        state.local_average = cfg["local_average_by_rank"][rank]
    rec["path0"] = state.stats()["totals"]["path"]  # before the first step: the path it will take
    sum_x = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    sum_y = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for step in range(cfg["steps"]):
        if step in cfg.get("local_average_at", {}):  # switched between steps
            state.local_average = cfg["local_average_at"][step]
        xs = make_inputs(cfg, step, rank, shapes)
        skip = unused_i if step in unused_steps else None
        if skip is not None:
            xs[skip] = torch.zeros_like(xs[skip])
        ddp(xs, skip).backward()
        ys = [p.grad.detach().clone() if p.grad is not None else None for p in model.ws]
        for a, x in zip(sum_x, xs):
            a += x.double()
        for a, y in zip(sum_y, ys):
            if y is not None:
                a += y.double()
        keep = cfg.get("keep_steps", True)
        rec["steps"].append({
            "x": [x.clone() for x in xs] if keep else None,
            "y": ys if keep else None,
            "res": {k: v.clone() for k, v in state.residuals.items()} if keep else None,
            "y_hash": [hash_t(y) if y is not None else None for y in ys],
            "ready_hooks": sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()),
            "path": state.stats()["totals"]["path"] if cfg.get("local_average_at") else None,
        })
        model.zero_grad(set_to_none=cfg.get("set_to_none", True))
    rec["sum_x"], rec["sum_y"] = sum_x, sum_y
    rec["res"] = {k: v.clone() for k, v in state.residuals.items()}
    rec["names"] = [n for n, _ in model.named_parameters()]
    rec["stats"] = state.stats()
    if kind_is_xirang(state):  # the backend's own records: what each op really sent
        rec["records"] = [dict(r) for r in state._backend.records()]
    torch.save(rec, os.path.join(out, f"rank{rank}.pt"))


def kind_is_xirang(state):
    return hasattr(state._backend, "records")


def hash_t(t):
    import hashlib

    return hashlib.sha1(t.detach().contiguous().numpy().tobytes()).hexdigest()


def make_inputs(cfg, step, rank, shapes):
    mode = cfg.get("inputs", "randn")
    if mode == "const":
        return [torch.full(s, cfg["value"]) for s in shapes]
    g = torch.Generator().manual_seed(7919 * step + 31 * rank + cfg.get("seed", 0))
    xs = [torch.randn(s, generator=g) * cfg.get("scale", 1.0) for s in shapes]
    bad = cfg.get("bad")  # (step, rank): inject inf
    if bad is not None and step == bad[0] and rank == bad[1]:
        xs[0].view(-1)[3] = float("inf")
    return xs


def sc_inf_skip(rank, ws, hooks, out, cfg):
    """TinyLM + SGD: with_bad inserts a step whose rank-1 batch yields inf gradients."""
    torch.manual_seed(0)
    model = TinyLM()
    ddp = DDP(model, bucket_cap_mb=cfg.get("bucket_cap_mb"))
    state = hooks.register_comm_hook(ddp, layers_per_group=2, **cfg.get("state_kw", {}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plan = [0, "bad", 1, 2] if cfg["with_bad"] else [0, 1, 2]
    rec = {"outs": [], "finite": [], "took_step": []}
    for item in plan:
        idx = lm_batch(0 if item == "bad" else item, rank)
        loss = lm_loss(ddp, idx)
        if item == "bad" and rank == 1:
            loss = loss + model.blocks[2].fc.weight.sum() * float("inf")
        loss.backward()
        g = grads_of(model)
        finite = all(torch.isfinite(t).all().item() for t in g.values() if t is not None)
        if finite:
            opt.step()
        rec["outs"].append(g)
        rec["finite"].append(finite)
        rec["took_step"].append(finite)
        opt.zero_grad(set_to_none=True)
    rec["stats"] = state.stats()
    rec["params"] = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(rec, os.path.join(out, f"rank{rank}.pt"))


def sc_join(rank, ws, hooks, out, cfg):
    torch.manual_seed(0)
    model = TinyLM()
    ddp = DDP(model, bucket_cap_mb=cfg.get("bucket_cap_mb"))
    state = hooks.register_comm_hook(ddp, layers_per_group=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n = 3 if rank == 0 else 2
    with ddp.join():
        for step in range(n):
            lm_loss(ddp, lm_batch(step, rank)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    rec = {"params": {k: v.clone() for k, v in model.state_dict().items()},
           "stats": state.stats()}
    torch.save(rec, os.path.join(out, f"rank{rank}.pt"))


def sc_no_sync(rank, ws, hooks, out, cfg):
    """3 rounds of (3 no_sync micro-steps + 1 synced), loss / 4; returns grads before step."""
    torch.manual_seed(0)
    model = TinyLM()
    ddp = DDP(model, bucket_cap_mb=cfg.get("bucket_cap_mb"),
              gradient_as_bucket_view=cfg.get("gabv", False))
    state = hooks.register_comm_hook(ddp, layers_per_group=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rec = {"grads": [], "res_before_sync": [], "res_after_sync": [], "launch_counts": [],
           "params0": {k: v.clone() for k, v in model.state_dict().items()}}
    for rnd in range(3):
        for micro in range(4):
            idx = lm_batch(100 * rnd + micro, rank)
            if micro < 3:
                with ddp.no_sync():
                    (lm_loss(ddp, idx) / 4).backward()
                if micro == 2:
                    rec["res_before_sync"].append({k: v.clone() for k, v in state.residuals.items()})
            else:
                (lm_loss(ddp, idx) / 4).backward()
        rec["grads"].append(grads_of(model))
        rec["res_after_sync"].append({k: v.clone() for k, v in state.residuals.items()})
        rec["launch_counts"].append(sum(g["launches_total"] for g in state.stats()["groups"]))
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.save(rec, os.path.join(out, f"rank{rank}.pt"))


def no_sync_reference(ws):
    """One process, 8 micro-batches (ws ranks x 4), mean loss; grads before each opt.step."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for rnd in range(3):
        for r in range(ws):
            for micro in range(4):
                (lm_loss(model, lm_batch(100 * rnd + micro, r)) / (4 * ws)).backward()
        out.append(grads_of(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def _ckpt_train(rank, ws, hooks, steps, start, ckpt_in, ckpt_out, cfg):
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = TinyLM()
    ddp = DDP(model, bucket_cap_mb=cfg.get("bucket_cap_mb"))
    state = hooks.register_comm_hook(ddp, layers_per_group=2, **cfg.get("state_kw", {}))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    pos = 0
    if ckpt_in:
        ck = torch.load(ckpt_in, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state.load_state_dict(ck["hook"])
        torch.set_rng_state(ck["rng"])
        pos = ck["pos"]
    for _ in range(steps):
        idx = lm_batch(pos, rank)
        drop = torch.rand(()).item()  # consumes RNG: the RNG state must be restored too
        loss = lm_loss(ddp, idx) * (1.0 + 0.01 * drop)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        pos += 1
    if ckpt_out:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict(),
                    "rng": torch.get_rng_state(), "pos": pos}, ckpt_out)
    return {k: v.clone() for k, v in model.state_dict().items()}


def sc_ckpt(rank, ws, hooks, out, cfg):
    phase = cfg["phase"]
    ck = os.path.join(out, f"ckpt{rank}.pt")
    if phase == "full":
        params = _ckpt_train(rank, ws, hooks, 10, 0, None, None, cfg)
    elif phase == "first":
        params = _ckpt_train(rank, ws, hooks, 5, 0, None, ck, cfg)
    else:
        params = _ckpt_train(rank, ws, hooks, 5, 5, ck, None, cfg)
    torch.save({"params": params}, os.path.join(out, f"rank{rank}.pt"))


def digits_data():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(y), generator=g)
    x, y = x[perm], y[perm]
    n_test = 360
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def sc_digits(rank, ws, hooks, out, cfg):
    """24 blocks x width 64 on sklearn digits, 300 steps; mode: plain | ef | noef."""
    (xtr, ytr), (xte, yte) = digits_data()
    torch.manual_seed(0)
    model = Digits()
    ddp = DDP(model)
    state = None
    if cfg["mode"] != "plain":
        state = hooks.register_comm_hook(ddp, layers_per_group=8,
                                         error_feedback=cfg["mode"] == "ef")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    B = 32
    losses = []
    g = torch.Generator().manual_seed(1234)
    t0 = time.perf_counter()
    for step in range(cfg.get("steps", 300)):
        idx = torch.randint(0, len(ytr), (ws, B), generator=g)[rank]
        loss = nn.functional.cross_entropy(ddp(xtr[idx]), ytr[idx])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean().item()
    rec = {"losses": losses, "acc": acc, "time_s": time.perf_counter() - t0,
           "stats": state.stats() if state else None}
    torch.save(rec, os.path.join(out, f"rank{rank}.pt"))


def sc_delay(rank, ws, hooks, out, cfg):
    """Launch delay behind readiness for a model of 24 blocks at several bucket_cap_mb."""
    res = {}
    for cap in cfg["caps"]:
        torch.manual_seed(0)
        model = Digits(depth=24, width=cfg.get("width", 256))
        ddp = DDP(model, bucket_cap_mb=cap)
        state = hooks.register_comm_hook(ddp, layers_per_group=cfg.get("lpg", 8))
        x = torch.randn(64, 64)
        y = torch.randint(0, 10, (64,))
        rows = []
        for step in range(cfg.get("steps", 6)):
            nn.functional.cross_entropy(ddp(x), y).backward()
            model.zero_grad(set_to_none=True)
            if step >= 2:
                rows.append(state.stats())
        res[cap] = rows
        del ddp
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))


def sc_torch_hook(rank, ws, hooks, out, cfg):
    """torch's own DDP comm hooks (PowerSGD, batched PowerSGD, fp16_compress) next to plain DDP
    on the same group: a 6-layer Linear(64, 64) regression, the same data and init for both.
    PowerSGD's .then() callbacks wait on further allreduces of the group (a callback run on the
    backend's communication thread would wait for that very thread)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as psgd

    def make():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])

    torch.manual_seed(1)
    w_true = torch.randn(64, 64) / 8
    plain, hooked = DDP(make(), **cfg.get("ddp_kw", {})), DDP(make(), **cfg.get("ddp_kw", {}))
    name = cfg["hook"]
    if name == "fp16":
        hooked.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:
        st = psgd.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
        hooked.register_comm_hook(st, psgd.powerSGD_hook if name == "powersgd" else psgd.batched_powerSGD_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9) for m in (plain, hooked)]
    rec = {"plain": [], "hooked": []}
    for step in range(cfg.get("steps", 50)):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(16, 64, generator=g)
        y = x @ w_true
        for key, m, opt in (("plain", plain, opts[0]), ("hooked", hooked, opts[1])):
            loss = ((m(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            rec[key].append(loss.item())
    rec["params"] = [p.detach().clone() for p in hooked.parameters()]
    torch.save(rec, os.path.join(out, f"rank{rank}.pt"))


class DirectBlocks(nn.Module):
    """A ModuleList of :class:`Direct` blocks (the default layers: one per block); loss = sum(W * X),
    so every gradient is exactly its input."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(Direct(shapes) for shapes in blocks)

    def forward(self, xs):
        it = iter(xs)
        return sum((w * next(it)).sum() for b in self.blocks for w in b.ws)


def sc_auto(rank, ws, hooks, out, cfg):
    """layers_per_group="auto" on DirectBlocks with controlled gradients: per step the inputs,
    outputs, residuals and group count; the choice, the stats and the state_dict at the end."""
    blocks = cfg["blocks"]
    shapes = [s for b in blocks for s in b]
    model = DirectBlocks(blocks)
    ddp = DDP(model, bucket_cap_mb=cfg.get("bucket_cap_mb", 0.004))
    state = hooks.register_comm_hook(ddp, layers_per_group="auto", **cfg.get("state_kw", {}))
    rec = {"steps": []}
    sum_x = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    sum_y = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for step in range(cfg["steps"]):
        xs = make_inputs(cfg, step, rank, shapes)
        ddp(xs).backward()
        ys = [p.grad.detach().clone() for p in model.parameters()]
        for a, x in zip(sum_x, xs):
            a += x.double()
        for a, y in zip(sum_y, ys):
            a += y.double()
        rec["steps"].append({"x": xs, "y": ys, "n_groups": len(state.groups), "group_size": state.group_size(),
                             "y_hash": [hash_t(y) for y in ys]})
        model.zero_grad(set_to_none=True)
    rec["sum_x"], rec["sum_y"] = sum_x, sum_y
    rec["res"] = {k: v.clone() for k, v in state.residuals.items()}
    rec["names"] = [n for n, _ in model.named_parameters()]
    rec["stats"] = state.stats()
    rec["state_dict"] = state.state_dict()
    rec["tails"] = [smp.tail for smp in state._auto.samples]  # the calibration's (bytes, s) after the last op
    torch.save(rec, os.path.join(out, f"rank{rank}.pt"))


SCENARIOS = {
    "train": sc_train, "direct": sc_direct, "inf_skip": sc_inf_skip, "join": sc_join,
    "no_sync": sc_no_sync, "ckpt": sc_ckpt, "digits": sc_digits, "delay": sc_delay,
    "torch_hook": sc_torch_hook, "auto": sc_auto,
}


def _entry(rank, ws, port, kind, scenario, out, cfg, env=None):
    if env is not None:  # forked from the test suite's zygote (mp_pool.zygote)
        mp_pool.zygote_child(env)
    try:
        hooks = setup(rank, ws, port, kind, exact=cfg.get("exact", False),
                      threads=cfg.get("threads", 1), transport=cfg.get("transport"))
        SCENARIOS[scenario](rank, ws, hooks, out, cfg)
        # The stand-in backend (a module global) and DDP's reference cycles hold the gloo group:
        # free them while the interpreter is alive, so destroy_process_group joins gloo's
        # threads. Left to interpreter teardown, a gloo thread that takes the GIL there is ended
        # by pthread_exit, which aborts the rank ("terminate called without an active
        # exception"; CI, test_join_uneven_inputs[fake]).
        FAKE.clear()
        gc.collect()
        dist.destroy_process_group()
        if kind == "fake":
            # Even so, a gloo thread still ending at interpreter teardown aborted a rank once more
            # (fresh-clone run of 2026-12-07, test_checkpoint_resume_bitwise[fake], after its
            # records were written): the stand-in's ranks leave without that teardown.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    except BaseException:
        with open(os.path.join(out, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario, ws, out, kind="fake", timeout=120, **cfg):
    """Spawn ``ws`` ranks running ``scenario``; returns the list of per-rank records."""
    os.makedirs(out, exist_ok=True)
    port = free_port()
    # Forked from the zygote (torch imported once) where the environment allows, else spawned.
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # the zygote's (each scenario sets its own thread count)
    forked = mp_pool.zygote_fits(env)
    ctx = mp.start_processes(_entry, args=(ws, port, kind, scenario, out, cfg, env if forked else None),
                             nprocs=ws, join=False, start_method="forkserver" if forked else "spawn")
    deadline = time.time() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.time())):
            if time.time() > deadline:
                raise TimeoutError(f"scenario {scenario} (ws={ws}) did not finish in {timeout}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(ws)]
