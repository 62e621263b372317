"""Every collective x dtype x reduce op x world size 1-4 against fp64 / exact references.

Functions named ``w_*`` run on the ranks (shipped by ``mp_pool``); ``test_*`` run in the test
process, rebuild every rank's input with ``refs.make_input`` and check what the ranks returned.
For backend "xirang" the same inputs also go through a gloo group in the same workers, and
gloo's answer is checked too where gloo supports the case.
"""
from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist

import mp_pool
from refs import (FLOATS, MOVE_DTYPES, REDUCE_DTYPES, assert_identical_across_ranks,
                  assert_reduced, bitwise_equal, dt, gloo_unsupported, make_input, ops_for, redop)

WS = [1, 2, 3, 4]
WS_MULTI = [2, 3, 4]
SMALL = [1, 7]
MEDIUM = 100_003
DTYPE_OPS = [(d, o) for d in REDUCE_DTYPES for o in ops_for(d)]
# the reduce-op x dtype product for the non-allreduce reductions: every op on a representative
# set of dtypes, every dtype on SUM and MAX (keeps the suite inside its time budget)
DTYPE_OPS_REDUCE = sorted({(d, o) for d, o in DTYPE_OPS
                           if d in ("float32", "bfloat16", "int32", "uint8", "bool") or o in ("SUM", "MAX")},
                          key=DTYPE_OPS.index)


def _ids(p):
    return "-".join(map(str, p)) if isinstance(p, tuple) else str(p)


def rank():
    return dist.get_rank(mp_pool.group())


def size():
    return dist.get_world_size(mp_pool.group())


# ====================================================================== helpers (test side)
def skip_gloo(backend, coll, dtype, op=None):
    if backend == "gloo":
        why = gloo_unsupported(coll, dtype, op)
        if why:
            pytest.skip(why)


def also_gloo(pool, backend, coll, dtype, op, fn, *args):
    """Run ``fn`` on the pool's gloo group when the backend under test is not gloo."""
    if backend == "gloo" or gloo_unsupported(coll, dtype, op):
        return None
    return pool.run(fn, *args, group="gloo")


def check_reduction(outs, inputs, op, backend, what, identical=True):
    for r, out in enumerate(outs):
        assert_reduced(out, inputs, op, strict16=backend != "gloo", what=f"{what} rank {r}")
    if identical:
        assert_identical_across_ranks(outs, what)


# ====================================================================== all_reduce
def w_all_reduce(dtype, op, sizes, case="ar", async_op=False):
    out = []
    for n in sizes:
        t = make_input(rank(), n, dtype, op, case)
        w = dist.all_reduce(t, op=redop(op), group=mp_pool.group(), async_op=async_op)
        if async_op:
            w.wait()
        out.append(t)
    return out


def _check_all_reduce(res, ws, dtype, op, sizes, backend, case="ar"):
    for i, n in enumerate(sizes):
        inputs = [make_input(r, n, dtype, op, case) for r in range(ws)]
        check_reduction([res[r][i] for r in range(ws)], inputs, op, backend, f"all_reduce n={n}")


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("dtype,op", DTYPE_OPS, ids=_ids)
def test_all_reduce(backend, ws, dtype, op, pool):
    skip_gloo(backend, "all_reduce", dtype, op)
    res = pool.run(w_all_reduce, dtype, op, SMALL)
    _check_all_reduce(res, ws, dtype, op, SMALL, backend)
    g = also_gloo(pool, backend, "all_reduce", dtype, op, w_all_reduce, dtype, op, SMALL)
    if g is not None:
        _check_all_reduce(g, ws, dtype, op, SMALL, "gloo")
        if dtype not in FLOATS:
            assert all(torch.equal(a, b) for a, b in zip(res[0], g[0])), "differs from gloo"


@pytest.mark.parametrize("ws", WS_MULTI)
@pytest.mark.parametrize("dtype,op", [("float32", "SUM"), ("float32", "MAX"), ("float64", "SUM"),
                                      ("bfloat16", "SUM"), ("float16", "AVG"), ("int32", "SUM"),
                                      ("uint8", "BXOR")], ids=_ids)
def test_all_reduce_medium(backend, ws, dtype, op, pool):
    skip_gloo(backend, "all_reduce", dtype, op)
    res = pool.run(w_all_reduce, dtype, op, [MEDIUM], "arm")
    _check_all_reduce(res, ws, dtype, op, [MEDIUM], backend, "arm")


@pytest.mark.slow
@pytest.mark.parametrize("ws", WS_MULTI)
@pytest.mark.parametrize("dtype,n", [("float32", 1_048_583), ("bfloat16", 2_097_169)], ids=_ids)
def test_all_reduce_large(backend, ws, dtype, n, pool):
    """>= 4 MiB per rank, so a ring/segmented large-message path runs."""
    res = pool.run(w_all_reduce, dtype, "SUM", [n], "arl")
    _check_all_reduce(res, ws, dtype, "SUM", [n], backend, "arl")


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("dtype,op", [("float32", "SUM"), ("bfloat16", "AVG"), ("int64", "MAX"),
                                      ("float64", "PREMUL_SUM")], ids=_ids)
def test_all_reduce_async(backend, ws, dtype, op, pool):
    skip_gloo(backend, "all_reduce", dtype, op)
    res = pool.run(w_all_reduce, dtype, op, SMALL, "ara", True)
    _check_all_reduce(res, ws, dtype, op, SMALL, backend, "ara")


# ---------------------------------------------------------------------- coalesced allreduce
def w_all_reduce_coalesced(dtype, op, sizes):
    ts = [make_input(rank(), n, dtype, op, f"arc{n}") for n in sizes]
    dist.all_reduce_coalesced(ts, op=redop(op), group=mp_pool.group())
    return ts


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("dtype,op", DTYPE_OPS_REDUCE, ids=_ids)
def test_all_reduce_coalesced(backend, ws, dtype, op, pool):
    skip_gloo(backend, "all_reduce_coalesced", dtype, op)
    sizes = [7, 1, 13]
    res = pool.run(w_all_reduce_coalesced, dtype, op, sizes)
    for i, n in enumerate(sizes):
        inputs = [make_input(r, n, dtype, op, f"arc{n}") for r in range(ws)]
        check_reduction([res[r][i] for r in range(ws)], inputs, op, backend, f"all_reduce_coalesced[{i}]")


# ---------------------------------------------------------------------- sparse allreduce
# Sparse COO allreduce (SUM), gloo's semantics: the result is coalesced and holds every row any
# rank sent. Cases: (sizes, sparse_dim, rows per rank by rank % 4); the indices are random in a
# small range plus one forced repeat, so rows repeat within a rank and across ranks.
SPARSE_CASES = {
    "embedding": ((10, 3), 1, [0, 5, 1, 8]),   # nn.Embedding's gradient: 2-D values (rows); rank 0 sends none
    "matrix": ((6, 5), 2, [3, 0, 7, 2]),       # scalar values at (row, col); rank 1 sends none
    "hybrid": ((4, 3, 2), 1, [2, 6, 0, 4]),    # values of shape (3, 2) per row
    "vector": ((13,), 1, [4, 4, 4, 4]),
    "empty": ((10, 3), 1, [0, 0, 0, 0]),       # no rank sends a row
}


def sparse_input(src, case, dtype):
    sizes, sd, rows = SPARSE_CASES[case]
    nnz = rows[src % 4]
    g = torch.Generator().manual_seed(1000 + 17 * src + len(case))
    idx = torch.stack([torch.randint(0, sizes[d], (nnz,), generator=g) for d in range(sd)])
    if nnz >= 2:
        idx[:, -1] = idx[:, 0]  # a repeated row within this rank
    vals = make_input(src, (nnz, *sizes[sd:]), dtype, "SUM", f"sparse-{case}")
    return torch.sparse_coo_tensor(idx, vals, sizes, check_invariants=True)


def _sparse_parts(t):
    """(indices, values, coalesced, shape): sparse tensors travel back from the ranks as parts."""
    return t._indices().clone(), t._values().clone(), t.is_coalesced(), tuple(t.shape)


def w_sparse_all_reduce(case, dtype, async_op=False):
    t = sparse_input(rank(), case, dtype)
    w = dist.all_reduce(t, group=mp_pool.group(), async_op=async_op)
    fut = None
    if async_op:
        w.wait()
        fut = _sparse_parts(w.get_future().value()[0])  # what DDP's sparse buckets read
    return _sparse_parts(t), fut


def _check_sparse(res, ws, case, dtype, what):
    sizes = SPARSE_CASES[case][0]
    inputs = [sparse_input(r, case, dtype) for r in range(ws)]
    wide = [x.to(torch.float64) for x in inputs]
    ref = torch.stack([x.to_dense() for x in wide]).sum(0)  # fp64 (exact for integers)
    # float tolerance: (terms - 1) eps |x| summed, per element (terms: entries landing on it)
    terms = torch.stack([torch.sparse_coo_tensor(x._indices(), torch.ones_like(x._values()), sizes,
                                                 check_invariants=True).to_dense()
                         for x in wide]).sum(0)
    scale = torch.stack([torch.sparse_coo_tensor(x._indices(), x._values().abs(), sizes,
                                                 check_invariants=True).to_dense()
                         for x in wide]).sum(0)
    rows = torch.cat([x._indices() for x in inputs], 1).unique(dim=1)  # distinct rows over the ranks, sorted
    for r, ((idx, val, coalesced, shape), _) in enumerate(res):
        assert shape == sizes and coalesced, f"{what} rank {r}: shape {shape}, coalesced {coalesced}"
        assert torch.equal(idx, rows), f"{what} rank {r}: rows {idx.tolist()}, want {rows.tolist()}"
        assert val.dtype == dt(dtype) and val.shape == (rows.shape[1], *sizes[idx.shape[0]:]), f"{what} rank {r}"
        got = torch.sparse_coo_tensor(idx, val, sizes, check_invariants=True).to_dense().to(torch.float64)
        if dt(dtype).is_floating_point:
            tol = (terms - 1).clamp_min(0) * torch.finfo(dt(dtype)).eps * scale
            err = (got - ref).abs()
            assert bool((err <= tol).all()), f"{what} rank {r}: off by {(err - tol).max().item():.3g} beyond tolerance"
        else:
            assert torch.equal(got, ref), f"{what} rank {r}: not exact"
        assert torch.equal(idx, res[0][0][0]) and bitwise_equal(val, res[0][0][1]), \
            f"{what}: rank {r}'s result differs bitwise from rank 0's"


SPARSE_PARAMS = [("embedding", "float32"), ("embedding", "float64"), ("embedding", "int64"),
                 ("matrix", "float32"), ("hybrid", "float32"), ("vector", "int32"), ("empty", "float32")]


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("case,dtype", SPARSE_PARAMS, ids=_ids)
def test_sparse_all_reduce(backend, ws, case, dtype, pool):
    res = pool.run(w_sparse_all_reduce, case, dtype)
    _check_sparse(res, ws, case, dtype, backend)
    g = also_gloo(pool, backend, "sparse_all_reduce", dtype, "SUM", w_sparse_all_reduce, case, dtype)
    if g is not None:
        _check_sparse(g, ws, case, dtype, "gloo")
        for r in range(ws):
            assert torch.equal(res[r][0][0], g[r][0][0]), f"rank {r}: rows differ from gloo's"
            torch.testing.assert_close(res[r][0][1], g[r][0][1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("ws", [3])
def test_sparse_all_reduce_future(backend, ws, pool):
    """Work.wait() then get_future().value()[0] is the reduced tensor (how DDP reads it)."""
    res = pool.run(w_sparse_all_reduce, "embedding", "float32", True)
    _check_sparse(res, ws, "embedding", "float32", backend)
    for r, (t, fut) in enumerate(res):
        assert fut is not None and torch.equal(fut[0], t[0]) and bitwise_equal(fut[1], t[1]), \
            f"rank {r}: the Future's value is not the reduced tensor"


def w_sparse_max():
    t = sparse_input(rank(), "embedding", "float32")
    return mp_pool.capture(dist.all_reduce, t, op=dist.ReduceOp.MAX, group=mp_pool.group())


@pytest.mark.parametrize("ws", [2])
def test_sparse_all_reduce_only_sum(backend, ws, pool):
    """Like gloo: a sparse allreduce other than SUM is a RuntimeError on every rank, before any
    traffic (the group stays usable)."""
    for r, e in enumerate(pool.run(w_sparse_max)):
        assert isinstance(e, mp_pool.ExcInfo) and e.is_runtime_error, f"rank {r}: {e!r}"
        assert "SUM" in e.message, f"rank {r}: {e.message}"
    _check_sparse(pool.run(w_sparse_all_reduce, "vector", "int32"), ws, "vector", "int32", f"{backend} after")


def w_sparse_mismatch(kind):
    me = rank()
    if kind == "shape":  # same element count, different shape
        rows, cols = (6, 5) if me == 0 else (5, 6)
        t = torch.sparse_coo_tensor([[1]], torch.ones(1, cols), (rows, cols))
    else:  # sparse on rank 0, dense of the same shape elsewhere
        t = sparse_input(me, "embedding", "float32") if me == 0 else torch.ones(10, 3)
    t0 = time.monotonic()
    return mp_pool.capture(dist.all_reduce, t, group=mp_pool.group()), time.monotonic() - t0


@pytest.mark.xirang_only
@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("kind", ["shape", "sparse_vs_dense"])
def test_sparse_all_reduce_mismatch(backend, ws, kind, pool):
    res = pool.run(w_sparse_mismatch, kind, timeout=30)
    pool.discard()
    for r, (e, elapsed) in enumerate(res):
        assert isinstance(e, mp_pool.ExcInfo) and e.is_runtime_error, f"rank {r}: {e!r}"
        want = (r"sparse tensor of size \[6, 5\].*\[5, 6\]|\[5, 6\].*\[6, 5\]" if kind == "shape"
                else r"mismatch|aborted|lost|closed")
        assert re.search(want, e.message), f"rank {r}: {e.message}"
        assert elapsed < 10.0, f"rank {r} raised after {elapsed:.1f} s"


# ---------------------------------------------------------------------- DDP with a sparse embedding
class SparseNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 4, sparse=True)
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.emb(x).mean(1))


def _sparse_batch(src, step):
    g = torch.Generator().manual_seed(100 * src + step)
    n = 0 if (src == 1 and step == 0) else 4  # rank 1's first batch is empty: no embedding rows
    return torch.randint(0, 20, (n, 3), generator=g), torch.randn(n, 2, generator=g)


def _sparse_loss(model, x, y):
    return ((model(x) - y) ** 2).sum() / 4


def w_ddp_sparse(steps):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = SparseNet()
    ddp = DDP(model, process_group=mp_pool.group())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        _sparse_loss(ddp, *_sparse_batch(rank(), step)).backward()
        opt.step()
    ops = []
    if mp_pool.W.current == "xirang":
        import xirang

        ops = [r["op"] for r in xirang.stats(mp_pool.group())]
    return [p.detach().clone() for p in model.parameters()], ops


def _ddp_sparse_reference(ws, steps):
    """One process, the mean of the ranks' losses: what DDP's averaged gradients step on."""
    torch.manual_seed(0)
    model = SparseNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        (sum(_sparse_loss(model, *_sparse_batch(r, step)) for r in range(ws)) / ws).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("ws", [2, 3])
def test_ddp_sparse_embedding(backend, ws, pool):
    """nn.Embedding(sparse=True) + a dense layer, 5 SGD steps (one rank's first gradient has no
    rows): every rank ends with the single-process reference's parameters, and with gloo's."""
    res = pool.run(w_ddp_sparse, 5)
    ref = _ddp_sparse_reference(ws, 5)
    for r in range(ws):
        params, ops = res[r]
        for j, (p, q) in enumerate(zip(params, ref)):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {r} param {j}: {m}")
            assert bitwise_equal(p, res[0][0][j]), f"rank {r} param {j} differs from rank 0's"
        if backend == "xirang":  # the embedding's gradient took the sparse allreduce, once per step
            assert ops.count("sparse_all_reduce") >= 5, ops
    g = also_gloo(pool, backend, "ddp_sparse", "float32", "SUM", w_ddp_sparse, 5)
    if g is not None:
        for j, (p, q) in enumerate(zip(res[0][0], g[0][0])):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=lambda m: f"param {j} vs gloo: {m}")


# ====================================================================== reduce (every root)
def w_reduce(dtype, op, n):
    out = []
    for root in range(size()):
        t = make_input(rank(), n, dtype, op, f"red{root}")
        dist.reduce(t, root, op=redop(op), group=mp_pool.group())
        out.append(t if rank() == root else None)
    return out


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("dtype,op", DTYPE_OPS_REDUCE, ids=_ids)
def test_reduce(backend, ws, dtype, op, pool):
    skip_gloo(backend, "reduce", dtype, op)
    res = pool.run(w_reduce, dtype, op, 7)
    for root in range(ws):
        inputs = [make_input(r, 7, dtype, op, f"red{root}") for r in range(ws)]
        assert_reduced(res[root][root], inputs, op, strict16=backend != "gloo", what=f"reduce root={root}")


# ====================================================================== reduce_scatter
def w_reduce_scatter(dtype, op, n):
    ins = [make_input(rank(), n, dtype, op, f"rs{j}") for j in range(size())]
    out = torch.empty(n, dtype=dt(dtype))
    dist.reduce_scatter(out, ins, op=redop(op), group=mp_pool.group())
    return out


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("dtype,op", DTYPE_OPS_REDUCE, ids=_ids)
def test_reduce_scatter(backend, ws, dtype, op, pool):
    skip_gloo(backend, "reduce_scatter", dtype, op)
    res = pool.run(w_reduce_scatter, dtype, op, 7)
    for me in range(ws):
        inputs = [make_input(r, 7, dtype, op, f"rs{me}") for r in range(ws)]
        assert_reduced(res[me], inputs, op, strict16=backend != "gloo", what=f"reduce_scatter rank {me}")


def _uneven(j):
    """Elements of chunk j in the uneven reduce_scatter tests: an empty chunk, small ones and one
    above the direct exchange's 64 KiB (the ring's blocks)."""
    return (0, 5, 20001, 3)[j]


def w_reduce_scatter_uneven(dtype, op):
    ins = [make_input(rank(), _uneven(j), dtype, op, f"rsu{j}") for j in range(size())]
    out = torch.full((_uneven(rank()),), -7, dtype=dt(dtype))
    dist.reduce_scatter(out, ins, op=redop(op), group=mp_pool.group())
    return out


@pytest.mark.parametrize("ws", WS_MULTI)
@pytest.mark.parametrize("dtype,op", [("float32", "SUM"), ("bfloat16", "SUM"), ("int32", "MAX"), ("float64", "AVG")],
                         ids=_ids)
def test_reduce_scatter_uneven_chunks(backend, ws, dtype, op, pool):
    """Found by a new user: chunks of different sizes (chunk r of every rank has rank r's output
    size), which gloo takes, were refused ("input tensor has 2 elements, output 1")."""
    skip_gloo(backend, "reduce_scatter", dtype, op)
    res = pool.run(w_reduce_scatter_uneven, dtype, op)
    for me in range(ws):
        assert res[me].numel() == _uneven(me)
        inputs = [make_input(r, _uneven(me), dtype, op, f"rsu{me}") for r in range(ws)]
        assert_reduced(res[me], inputs, op, strict16=backend != "gloo", what=f"uneven reduce_scatter rank {me}")


def w_reduce_scatter_tensor(dtype, op, n, async_op=False):
    t = make_input(rank(), n * size(), dtype, op, "rst")
    out = torch.empty(n, dtype=dt(dtype))
    w = dist.reduce_scatter_tensor(out, t, op=redop(op), group=mp_pool.group(), async_op=async_op)
    if async_op:
        w.wait()
    return out


def _check_rst(res, ws, dtype, op, n, backend):
    full = [make_input(r, n * ws, dtype, op, "rst") for r in range(ws)]
    for me in range(ws):
        inputs = [f[me * n:(me + 1) * n] for f in full]
        assert_reduced(res[me], inputs, op, strict16=backend != "gloo", what=f"reduce_scatter_tensor rank {me}")


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("dtype,op", DTYPE_OPS_REDUCE, ids=_ids)
def test_reduce_scatter_tensor(backend, ws, dtype, op, pool):
    skip_gloo(backend, "reduce_scatter_tensor", dtype, op)
    res = pool.run(w_reduce_scatter_tensor, dtype, op, 7)
    _check_rst(res, ws, dtype, op, 7, backend)


@pytest.mark.parametrize("ws", WS_MULTI)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reduce_scatter_tensor_medium(backend, ws, dtype, pool):
    n = MEDIUM // ws + 1
    res = pool.run(w_reduce_scatter_tensor, dtype, "SUM", n)
    _check_rst(res, ws, dtype, "SUM", n, backend)


def w_reduce_scatter_tensor_coalesced(dtype, op, sizes):
    pg = mp_pool.group()
    ins = [make_input(rank(), n * size(), dtype, op, f"rstc{n}") for n in sizes]
    outs = [torch.empty(n, dtype=dt(dtype)) for n in sizes]
    with dist._coalescing_manager(group=pg):
        for o, i in zip(outs, ins):
            dist.reduce_scatter_tensor(o, i, op=redop(op), group=pg)
    return outs


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("dtype,op", [(d, o) for d, o in DTYPE_OPS_REDUCE if o in ("SUM", "MAX", "AVG")], ids=_ids)
def test_reduce_scatter_tensor_coalesced(backend, ws, dtype, op, pool):
    """``_coalescing_manager`` fast path -> ProcessGroup.reduce_scatter_single_coalesced ->
    Backend::reduce_scatter_tensor_coalesced."""
    skip_gloo(backend, "reduce_scatter_tensor_coalesced", dtype, op)
    sizes = [5, 1, 3]
    res = pool.run(w_reduce_scatter_tensor_coalesced, dtype, op, sizes)
    for i, n in enumerate(sizes):
        full = [make_input(r, n * ws, dtype, op, f"rstc{n}") for r in range(ws)]
        for me in range(ws):
            inputs = [f[me * n:(me + 1) * n] for f in full]
            assert_reduced(res[me][i], inputs, op, strict16=backend != "gloo", what=f"rs_coalesced[{i}] rank {me}")


# ====================================================================== data movement
def w_broadcast(dtype, n, async_op=False):
    out = []
    for root in range(size()):
        t = make_input(rank(), n, dtype, "MOVE", f"bc{root}")
        w = dist.broadcast(t, root, group=mp_pool.group(), async_op=async_op)
        if async_op:
            w.wait()
        out.append(t)
    return out


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
def test_broadcast(backend, ws, dtype, pool):
    skip_gloo(backend, "broadcast", dtype)
    res = pool.run(w_broadcast, dtype, 7)
    for root in range(ws):
        want = make_input(root, 7, dtype, "MOVE", f"bc{root}")
        for r in range(ws):
            assert bitwise_equal(res[r][root], want), f"broadcast root={root} wrong on rank {r}"


@pytest.mark.parametrize("ws", WS_MULTI)
def test_broadcast_medium(backend, ws, pool):
    res = pool.run(w_broadcast, "float32", MEDIUM)
    for root in range(ws):
        want = make_input(root, MEDIUM, "float32", "MOVE", f"bc{root}")
        assert all(bitwise_equal(res[r][root], want) for r in range(ws))


def w_all_gather(dtype, n):
    t = make_input(rank(), n, dtype, "MOVE", "ag")
    outs = [torch.empty(n, dtype=dt(dtype)) for _ in range(size())]
    dist.all_gather(outs, t, group=mp_pool.group())
    return outs


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
def test_all_gather(backend, ws, dtype, pool):
    skip_gloo(backend, "all_gather", dtype)
    res = pool.run(w_all_gather, dtype, 7)
    for r in range(ws):
        for src in range(ws):
            assert bitwise_equal(res[r][src], make_input(src, 7, dtype, "MOVE", "ag")), f"rank {r} slot {src}"


def w_all_gather_into_tensor(dtype, n, async_op=False):
    t = make_input(rank(), n, dtype, "MOVE", "agt")
    out = torch.empty(n * size(), dtype=dt(dtype))
    w = dist.all_gather_into_tensor(out, t, group=mp_pool.group(), async_op=async_op)
    if async_op:
        w.wait()
    return out


def _check_agt(res, ws, dtype, n):
    want = torch.cat([make_input(src, n, dtype, "MOVE", "agt") for src in range(ws)])
    for r in range(ws):
        assert bitwise_equal(res[r], want), f"all_gather_into_tensor wrong on rank {r}"


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
def test_all_gather_into_tensor(backend, ws, dtype, pool):
    skip_gloo(backend, "all_gather_into_tensor", dtype)
    _check_agt(pool.run(w_all_gather_into_tensor, dtype, 7), ws, dtype, 7)


@pytest.mark.parametrize("ws", WS_MULTI)
def test_all_gather_into_tensor_medium(backend, ws, pool):
    _check_agt(pool.run(w_all_gather_into_tensor, "float32", MEDIUM), ws, "float32", MEDIUM)


def w_all_gather_into_tensor_coalesced(dtype, sizes):
    pg = mp_pool.group()
    ins = [make_input(rank(), n, dtype, "MOVE", f"agc{n}") for n in sizes]
    outs = [torch.empty(n * size(), dtype=dt(dtype)) for n in sizes]
    with dist._coalescing_manager(group=pg):
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i, group=pg)
    return outs


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "uint8", "bool", "complex64"])
def test_all_gather_into_tensor_coalesced(backend, ws, dtype, pool):
    """``_coalescing_manager`` fast path -> ProcessGroup.all_gather_single_coalesced ->
    Backend::allgather_into_tensor_coalesced."""
    skip_gloo(backend, "all_gather_into_tensor_coalesced", dtype)
    sizes = [5, 1, 3]
    res = pool.run(w_all_gather_into_tensor_coalesced, dtype, sizes)
    for i, n in enumerate(sizes):
        want = torch.cat([make_input(src, n, dtype, "MOVE", f"agc{n}") for src in range(ws)])
        for r in range(ws):
            assert bitwise_equal(res[r][i], want), f"coalesced all_gather[{i}] wrong on rank {r}"


# ---------------------------------------------------------------------- all_gather_coalesced
# output_tensor_lists[r][i] receives rank r's input i (torch's documented layout, gloo's). Cases:
# (shape, dtype) per input; shapes differ within a call, empty and 0-dim tensors among them, and
# complex64 next to float32 (torch's one dtype mix: it sends complex tensors as their real view).
AGC_CASES = {
    "one": [((7,), "float32")],
    "two": [((2,), "float32"), ((3,), "float32")],
    "five_shapes": [((), "float32"), ((3, 4), "float32"), ((0,), "float32"), ((2, 0, 3), "float32"), ((5,), "float32")],
    "complex_real": [((4,), "complex64"), ((3,), "float32"), ((0,), "complex64"), ((2, 2), "complex64")],
    "all_empty": [((0,), "int64"), ((0, 4), "int64")],
    "int64": [((1,), "int64"), ((2, 3), "int64"), ((0,), "int64"), ((4,), "int64"), ((3,), "int64")],
    "bool": [((9,), "bool"), ((1,), "bool"), ((2, 2), "bool")],
    "bf16": [((5,), "bfloat16"), ((1, 1), "bfloat16")],
}


def _agc_input(src, case, i):
    shape, dtype = AGC_CASES[case][i]
    return make_input(src, shape, dtype, "MOVE", f"agco-{case}-{i}")


def w_all_gather_coalesced(case, async_op=False):
    ins = [_agc_input(rank(), case, i) for i in range(len(AGC_CASES[case]))]
    outs = [[torch.zeros_like(t) for t in ins] for _ in range(size())]
    fut = dist.all_gather_coalesced(outs, ins, group=mp_pool.group(), async_op=async_op)
    if async_op:
        fut.wait()  # async_op=True returns the Work's Future
    return outs


def _check_agc(res, ws, case, what):
    for r in range(ws):
        assert len(res[r]) == ws, f"{what}: rank {r} has {len(res[r])} output lists"
        for src in range(ws):
            for i in range(len(AGC_CASES[case])):
                got, want = res[r][src][i], _agc_input(src, case, i)
                assert got.shape == want.shape and bitwise_equal(got.reshape(-1), want.reshape(-1)), \
                    f"{what}: rank {r} output[{src}][{i}] is not rank {src}'s input {i}"


@pytest.mark.parametrize("ws", [1, 2, 3, 8])
@pytest.mark.parametrize("case", list(AGC_CASES))
def test_all_gather_coalesced(backend, ws, case, pool):
    _check_agc(pool.run(w_all_gather_coalesced, case), ws, case, backend)
    g = also_gloo(pool, backend, "all_gather_coalesced", "float32", None, w_all_gather_coalesced, case)
    if g is not None:
        _check_agc(g, ws, case, "gloo")


@pytest.mark.parametrize("ws", [3])
@pytest.mark.parametrize("case", ["five_shapes", "complex_real"])
def test_all_gather_coalesced_async(backend, ws, case, pool):
    """The Future of async_op=True completes once every input has been gathered."""
    _check_agc(pool.run(w_all_gather_coalesced, case, True), ws, case, f"{backend} async")


def w_all_gather_coalesced_issue():
    ins = [torch.full((2,), 10.0 * rank() + i) for i in range(2)]
    outs = [[torch.empty(2) for _ in ins] for _ in range(size())]
    dist.all_gather_coalesced(outs, ins, group=mp_pool.group())
    return [[o[0].item() for o in lst] for lst in outs]


@pytest.mark.parametrize("ws", [2])
def test_all_gather_coalesced_issue_layout(backend, ws, pool):
    """Issue #15 item 7: rank r sends [10r, 10r + 1]; every rank gets [[0, 1], [10, 11]]."""
    for r, got in enumerate(pool.run(w_all_gather_coalesced_issue)):
        assert got == [[0.0, 1.0], [10.0, 11.0]], f"rank {r}: {got}"


def w_all_gather_coalesced_bad_lists():
    ins = [torch.ones(2), torch.ones(3)]
    outs = [[torch.empty(2), torch.empty(3)] for _ in range(size() - 1)]  # one list short
    return mp_pool.capture(dist.all_gather_coalesced, outs, ins, group=mp_pool.group())


@pytest.mark.parametrize("ws", [3])
def test_all_gather_coalesced_wrong_list_count(backend, ws, pool):
    """world_size - 1 output lists: a RuntimeError on every rank (raised before anything is sent)."""
    for r, e in enumerate(pool.run(w_all_gather_coalesced_bad_lists)):
        assert isinstance(e, mp_pool.ExcInfo) and e.is_runtime_error, f"rank {r}: {e!r}"
        assert "output lists" in e.message, f"rank {r}: {e.message}"
    _check_agc(pool.run(w_all_gather_coalesced, "two"), ws, "two", f"{backend} after the error")


def w_gather(dtype, n):
    out = []
    for root in range(size()):
        t = make_input(rank(), n, dtype, "MOVE", f"ga{root}")
        lst = [torch.empty(n, dtype=dt(dtype)) for _ in range(size())] if rank() == root else None
        dist.gather(t, lst, root, group=mp_pool.group())
        out.append(lst)
    return out


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
def test_gather(backend, ws, dtype, pool):
    skip_gloo(backend, "gather", dtype)
    res = pool.run(w_gather, dtype, 7)
    for root in range(ws):
        for src in range(ws):
            assert bitwise_equal(res[root][root][src], make_input(src, 7, dtype, "MOVE", f"ga{root}")), \
                f"gather root={root} slot {src}"


def w_scatter(dtype, n):
    out = []
    for root in range(size()):
        lst = ([make_input(root, n, dtype, "MOVE", f"sc{root}-{j}") for j in range(size())]
               if rank() == root else None)
        t = torch.empty(n, dtype=dt(dtype))
        dist.scatter(t, lst, root, group=mp_pool.group())
        out.append(t)
    return out


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
def test_scatter(backend, ws, dtype, pool):
    skip_gloo(backend, "scatter", dtype)
    res = pool.run(w_scatter, dtype, 7)
    for root in range(ws):
        for r in range(ws):
            assert bitwise_equal(res[r][root], make_input(root, 7, dtype, "MOVE", f"sc{root}-{r}")), \
                f"scatter root={root} rank {r}"


# ---------------------------------------------------------------------- all_to_all
def split(src, dst, ws, uneven):
    """Elements rank ``src`` sends to rank ``dst`` (uneven: 0..3, zero-sized blocks included)."""
    return (src + 2 * dst) % 4 if uneven else 3


def w_all_to_all_single(dtype, uneven, scale=1, async_op=False):
    me, ws = rank(), size()
    blocks = [make_input(me, split(me, j, ws, uneven) * scale, dtype, "MOVE", f"a2a{j}") for j in range(ws)]
    inp = torch.cat(blocks)
    in_splits = [b.numel() for b in blocks]
    out_splits = [split(i, me, ws, uneven) * scale for i in range(ws)]
    out = torch.empty(sum(out_splits), dtype=dt(dtype))
    kw = dict(output_split_sizes=out_splits, input_split_sizes=in_splits) if uneven else {}
    w = dist.all_to_all_single(out, inp, group=mp_pool.group(), async_op=async_op, **kw)
    if async_op:
        w.wait()
    return out


def _a2a_want(me, ws, dtype, uneven, scale=1):
    return torch.cat([make_input(i, split(i, me, ws, uneven) * scale, dtype, "MOVE", f"a2a{me}") for i in range(ws)])


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
def test_all_to_all_single(backend, ws, dtype, uneven, pool):
    skip_gloo(backend, "all_to_all_single", dtype)
    res = pool.run(w_all_to_all_single, dtype, uneven)
    for me in range(ws):
        assert bitwise_equal(res[me], _a2a_want(me, ws, dtype, uneven)), f"rank {me}"


@pytest.mark.parametrize("ws", WS_MULTI)
def test_all_to_all_single_medium(backend, ws, pool):
    scale = MEDIUM // 6
    res = pool.run(w_all_to_all_single, "float32", True, scale)
    for me in range(ws):
        assert bitwise_equal(res[me], _a2a_want(me, ws, "float32", True, scale)), f"rank {me}"


def w_all_to_all(dtype, uneven):
    me, ws = rank(), size()
    ins = [make_input(me, split(me, j, ws, uneven), dtype, "MOVE", f"a2l{j}") for j in range(ws)]
    outs = [torch.empty(split(i, me, ws, uneven), dtype=dt(dtype)) for i in range(ws)]
    dist.all_to_all(outs, ins, group=mp_pool.group())
    return outs


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int16", "int64", "bool", "complex64"])
def test_all_to_all(backend, ws, dtype, uneven, pool):
    skip_gloo(backend, "all_to_all_uneven" if uneven and ws > 1 else "all_to_all", dtype)
    res = pool.run(w_all_to_all, dtype, uneven)
    for me in range(ws):
        for i in range(ws):
            want = make_input(i, split(i, me, ws, uneven), dtype, "MOVE", f"a2l{me}")
            assert bitwise_equal(res[me][i], want), f"rank {me} block from {i}"


# ====================================================================== barrier
def w_barrier(delay):
    time.sleep(delay * rank())
    t_in = time.time()
    dist.barrier(group=mp_pool.group())
    return t_in, time.time()


@pytest.mark.parametrize("ws", WS)
def test_barrier(backend, ws, pool):
    res = pool.run(w_barrier, 0.05)
    last_in = max(t_in for t_in, _ in res)
    for r, (_, t_out) in enumerate(res):
        assert t_out >= last_in - 0.005, f"rank {r} left the barrier before rank {ws - 1} entered it"


# ====================================================================== point to point
def w_send_recv_tags(dtype):
    """Rank 0 posts two sends per peer (tags 7 then 3); peers receive tag 3 first."""
    me, ws, pg = rank(), size(), mp_pool.group()
    if me == 0:
        works = []
        for peer in range(1, ws):
            for tag in (7, 3):
                works.append(dist.isend(make_input(peer, 5, dtype, "MOVE", f"tag{tag}"), peer, group=pg, tag=tag))
        for w in works:
            w.wait()
        return None
    got = {}
    for tag in (3, 7):
        t = torch.empty(5, dtype=dt(dtype))
        dist.recv(t, 0, group=pg, tag=tag)
        got[tag] = t
    return got


@pytest.mark.parametrize("ws", WS_MULTI)
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
def test_send_recv_tags(backend, ws, dtype, pool):
    skip_gloo(backend, "send", dtype)
    res = pool.run(w_send_recv_tags, dtype)
    for peer in range(1, ws):
        for tag in (3, 7):
            assert bitwise_equal(res[peer][tag], make_input(peer, 5, dtype, "MOVE", f"tag{tag}")), \
                f"rank {peer} tag {tag}"


def w_recv_anysource(dtype):
    me, ws, pg = rank(), size(), mp_pool.group()
    if me != 0:
        time.sleep(0.02 * (ws - me))  # arrive in a different order than rank order
        dist.send(make_input(me, 4, dtype, "MOVE", "any"), 0, group=pg)
        return None
    got = {}
    for _ in range(ws - 1):
        t = torch.empty(4, dtype=dt(dtype))
        src = dist.recv(t, group=pg)  # any source
        got[src] = t
    return got


@pytest.mark.parametrize("ws", WS_MULTI)
@pytest.mark.parametrize("dtype", ["float32", "int64", "bfloat16", "complex64"])
def test_recv_anysource(backend, ws, dtype, pool):
    skip_gloo(backend, "recv", dtype)
    got = pool.run(w_recv_anysource, dtype)[0]
    assert sorted(got) == list(range(1, ws)), f"sources {sorted(got)}"
    for src, t in got.items():
        assert bitwise_equal(t, make_input(src, 4, dtype, "MOVE", "any")), f"payload from {src}"


def w_batch_ring(dtype, n):
    me, ws, pg = rank(), size(), mp_pool.group()
    send = make_input(me, n, dtype, "MOVE", "ring")
    right = torch.empty(n, dtype=dt(dtype))
    left = torch.empty(n, dtype=dt(dtype))
    ops = [dist.P2POp(dist.isend, send, (me + 1) % ws, group=pg),
           dist.P2POp(dist.isend, send, (me - 1) % ws, group=pg),
           dist.P2POp(dist.irecv, left, (me - 1) % ws, group=pg),
           dist.P2POp(dist.irecv, right, (me + 1) % ws, group=pg)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return left, right


@pytest.mark.parametrize("ws", WS_MULTI)
@pytest.mark.parametrize("dtype,n", [("float32", 7), ("int8", 7), ("complex64", 3), ("float32", MEDIUM)], ids=_ids)
def test_batch_isend_irecv_ring(backend, ws, dtype, n, pool):
    res = pool.run(w_batch_ring, dtype, n)
    for me in range(ws):
        left, right = res[me]
        assert bitwise_equal(left, make_input((me - 1) % ws, n, dtype, "MOVE", "ring")), f"rank {me} left"
        assert bitwise_equal(right, make_input((me + 1) % ws, n, dtype, "MOVE", "ring")), f"rank {me} right"


# ====================================================================== Work / Future
def w_work_api(coll):
    pg, me, ws = mp_pool.group(), rank(), size()
    if coll == "all_reduce":
        t = make_input(me, 7, "float32", "SUM", "work")
        w = dist.all_reduce(t, group=pg, async_op=True)
        result = t
    elif coll == "broadcast":
        t = make_input(me, 7, "float32", "MOVE", "work")
        w = dist.broadcast(t, 0, group=pg, async_op=True)
        result = t
    elif coll == "all_gather_into_tensor":
        t = make_input(me, 7, "float32", "MOVE", "work")
        result = torch.empty(7 * ws)
        w = dist.all_gather_into_tensor(result, t, group=pg, async_op=True)
    elif coll == "reduce_scatter_tensor":
        t = make_input(me, 7 * ws, "float32", "SUM", "work")
        result = torch.empty(7)
        w = dist.reduce_scatter_tensor(result, t, group=pg, async_op=True)
    elif coll == "all_to_all_single":
        t = make_input(me, 3 * ws, "float32", "MOVE", "work")
        result = torch.empty(3 * ws)
        w = dist.all_to_all_single(result, t, group=pg, async_op=True)
    else:
        raise ValueError(coll)
    try:
        fut = w.get_future()
    except RuntimeError as e:
        fut = mp_pool.exc_info(e)
    waited = w.wait()
    done_at_wait = fut.done() if not isinstance(fut, mp_pool.ExcInfo) else False
    value = fut.wait() if not isinstance(fut, mp_pool.ExcInfo) else fut
    return dict(result=result, waited=waited, completed=w.is_completed(), done_at_wait=done_at_wait,
                fut_done=fut.done() if not isinstance(fut, mp_pool.ExcInfo) else False, value=value,
                value_type=type(value).__name__)


def w_future_done_at_wait(n):
    """Counts, over n async allreduces, the Futures not yet done when Work.wait() returned."""
    late = 0
    for i in range(n):
        t = torch.full((4,), float(rank() + i))
        w = dist.all_reduce(t, group=mp_pool.group(), async_op=True)
        fut = w.get_future()
        w.wait()
        late += 0 if fut.done() else 1
        assert fut.value()[0].data_ptr() == t.data_ptr()
    return late


@pytest.mark.parametrize("ws", [2])
def test_future_done_when_wait_returns(backend, ws, pool):
    """Work.wait() returns only once get_future() is done (DDP reads the Future's value right after
    wait(); a Future completed after the Work made value() assert in ivalue_inl.h)."""
    late = pool.run(w_future_done_at_wait, 300)
    assert late == [0] * ws, f"Futures not done when wait() returned, per rank: {late}"


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("coll", ["all_reduce", "broadcast", "all_gather_into_tensor",
                                  "reduce_scatter_tensor", "all_to_all_single"])
def test_work_future(backend, ws, coll, pool):
    res = pool.run(w_work_api, coll)
    gloo_quirk = backend == "gloo" and coll == "reduce_scatter_tensor"
    for r, d in enumerate(res):
        if gloo_quirk:  # gloo: no Future and is_completed() False after wait() (finding)
            continue
        assert d["completed"], f"rank {r}: is_completed() False after wait()"
        if isinstance(d["value"], mp_pool.ExcInfo):
            if backend == "gloo" and "getFuture not implemented" in d["value"].message:
                continue  # gloo has no Future for this op (finding); xirang must have one
            raise AssertionError(f"rank {r}: get_future() raised {d['value']}")
        assert d["fut_done"], f"rank {r}: future not done after wait()"
        assert d["done_at_wait"], f"rank {r}: Work.wait() returned before its Future was completed"
        assert d["waited"] in (True, None), f"rank {r}: wait() returned {d['waited']!r}"
        assert isinstance(d["value"], list) and all(isinstance(v, torch.Tensor) for v in d["value"]), \
            f"rank {r}: future value is {d['value_type']}, want a list of tensors"
        # the value holds the output tensor (gloo's all_gather_into_tensor gives its chunks)
        assert (any(bitwise_equal(v, d["result"]) for v in d["value"])
                or bitwise_equal(torch.cat([v.flatten() for v in d["value"]]), d["result"])), \
            f"rank {r}: future value {d['value']} does not hold the result {d['result']}"
    if coll == "all_reduce":
        inputs = [make_input(r, 7, "float32", "SUM", "work") for r in range(ws)]
        check_reduction([d["result"] for d in res], inputs, "SUM", backend, "async all_reduce")


def w_inference_mode():
    with torch.inference_mode():
        t = torch.full((3,), float(rank() + 1))
        dist.all_reduce(t, group=mp_pool.group())
        return t.clone(), t.is_inference()


@pytest.mark.parametrize("ws", [2])
def test_all_reduce_inference_mode(backend, ws, pool):
    """Inference tensors are written on the communication thread (its thread-local state must
    match the caller's, or in-place writes to inference tensors fail)."""
    for t, is_inf in pool.run(w_inference_mode):
        assert is_inf
        assert t.tolist() == [3.0, 3.0, 3.0]


# ---------------------------------------------------------------- small synchronous ops on the caller's thread
def w_sync_on_caller():
    import xirang

    r = dist.get_rank()
    out = {}
    t = torch.full((1000,), float(r + 1))
    dist.all_reduce(t)  # small, synchronous, the group idle: on the caller's thread
    out["small"] = t[0].item()
    big = torch.full((1 << 18,), float(r + 1))  # 1 MiB: above XIRANG_SMALL_BYTES
    dist.all_reduce(big)
    out["big"] = big[0].item()
    a = torch.full((1000,), float(r + 1))
    w = dist.all_reduce(a, async_op=True)  # queued: the communication thread (XIRANG_TEST_DELAY_MS: slow)
    s = torch.full((10,), float(10 * (r + 1)))
    dist.all_reduce(s)  # synchronous but the queue is busy: after the async op, on the thread
    w.wait()
    out["async"], out["after"] = a[0].item(), s[0].item()
    dist.barrier()
    recs = xirang.stats()
    out["recs"] = [(x["seq"], x["op"], x["numel"], x["on_caller"], x["exposed_wait_s"]) for x in recs[-5:]]
    out["engines"] = sorted({x["engine"] for x in recs})
    return out


@pytest.mark.dedicated
@pytest.mark.xirang_only
def test_small_sync_ops_run_on_the_callers_thread_in_order():
    """A small synchronous op on an idle group runs on the caller's thread (records' on_caller, its
    whole time an exposed wait); a large one, an async one, and a synchronous one issued while an
    async op is still queued go through the communication thread; results and order are the
    same either way (the values against a sum computed here)."""
    with mp_pool.Pool(2, "xirang", timeout_s=60, env={"XIRANG_TEST_DELAY_MS": "100"}) as pool:
        res = pool.run(w_sync_on_caller, timeout=60)
    for r in (0, 1):
        o = res[r]
        assert o["small"] == 3.0 and o["big"] == 3.0 and o["async"] == 3.0 and o["after"] == 30.0, o
        recs = o["recs"]
        assert [x[0] for x in recs] == sorted(x[0] for x in recs), recs  # issued order
        ops = [(op, numel, on_caller) for _, op, numel, on_caller, _ in recs]
        assert ops == [("all_reduce", 1000, True), ("all_reduce", 1 << 18, False), ("all_reduce", 1000, False),
                       ("all_reduce", 10, False), ("barrier", 1, True)], recs
        # the inline op's whole 100 ms (the test delay) counts as the caller's exposed wait
        assert recs[0][4] is not None and recs[0][4] >= 0.09, recs
        assert o["engines"] == ["host"], o["engines"]  # CPU tensors: the host engine ran every op


@pytest.mark.dedicated
def test_gpu_collectives_check_dry_run(tmp_path):
    """tests/gpu/check_collectives.py (the GPU script's collectives steps) with --cpu at WS=2: every
    check of the script on CPU tensors, so that the script itself is known to run where no GPU is,
    and its value checks hold (the allreduce after a producer, the coalesced batch's wait, the
    batch_isend_irecv ring shift, a receive behind a reader of its tensor, the engine the records
    name)."""
    from conftest import gpu_script_dry_run

    _, res = gpu_script_dry_run("check_collectives.py", tmp_path, [2], "collectives.json")
    assert res["ok"] and set(res["ranks"]) == {"0", "1"}, res
    for r in ("0", "1"):
        got = res["ranks"][r]
        for name in ("allreduce_after_long_kernel", "coalesced_batch_wait", "batch_isend_irecv_wait",
                     "recv_after_reader", "engine is host (records: ['host'])", "allreduce_ef", "scatter"):
            assert got.get(name) is True, (r, name, got)
