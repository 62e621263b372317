#!/usr/bin/env python3
"""One rank of the topology tests (tests/python/test_topology.py), on loopback or inside an
emulated-cluster namespace (tests/cluster/netns).

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (a TCPStore served by the launcher;
TORCHELASTIC_USE_AGENT_STORE=True so every rank connects as a client), XIRANG_TEST_SCENARIO,
XIRANG_TEST_OUT (a directory: the rank writes rank<r>.pkl with its result, a dict). Labels come
from XIRANG_HOST / XIRANG_RACK / XIRANG_TOPOLOGY_FILE as set by the launcher; scenarios that need
several topologies in one job change XIRANG_HOST / XIRANG_RACK before each `dist.new_group`
(xirang reads them when a group is created).

Inputs are deterministic functions of (case, rank), so every rank recomputes every rank's input
and checks its result against a reference computed here (float64 / exact integer arithmetic).
"""
from __future__ import annotations

import datetime
import os
import pickle
import sys
import time
import traceback

import torch
import torch.distributed as dist

KiB = 1024


def log(msg: str) -> None:
    print(f"[rank {os.environ.get('RANK')}] {msg}", file=sys.stderr, flush=True)


def _init(default_backend: str = "gloo", **kw) -> tuple[int, int]:
    torch.set_num_threads(1)
    import xirang  # noqa: F401  (registers the backend)

    timeout = datetime.timedelta(seconds=float(os.environ.get("XIRANG_TEST_OP_TIMEOUT", "120")))
    dist.init_process_group(default_backend, init_method="env://", timeout=timeout, **kw)
    return dist.get_rank(), dist.get_world_size()


def _group(**opts):
    import xirang

    return dist.new_group(backend="xirang", pg_options=xirang.Options(**opts) if opts else None)


def _with_labels(host, rack, fn):
    """Create a group with XIRANG_HOST/XIRANG_RACK set to host/rack (None: unset) for the call."""
    saved = {k: os.environ.get(k) for k in ("XIRANG_HOST", "XIRANG_RACK", "XIRANG_TOPOLOGY_FILE")}
    try:
        for k, v in (("XIRANG_HOST", host), ("XIRANG_RACK", rack)):
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        os.environ.pop("XIRANG_TOPOLOGY_FILE", None)
        return fn()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _last(pg, op_prefix: str = "all_reduce") -> dict:
    import xirang

    recs = [r for r in xirang.stats(pg) if str(r.get("op", "")).startswith(op_prefix)]
    if not recs:
        raise AssertionError(f"no {op_prefix} record in xirang.stats(): {xirang.stats(pg)}")
    r = recs[-1]
    return {k: r.get(k) for k in ("op", "algorithm", "numel", "dtype", "bytes_raw", "bytes_wire",
                                  "bytes_cross_host", "bytes_cross_rack", "ok", "total_s")}


def _ring(pg) -> list:
    import xirang

    return list(xirang._backend_for(pg).ring)


# ---------------------------------------------------------------- inputs and references
OPS = {
    "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT, "avg": dist.ReduceOp.AVG,
}
DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
    "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8,
}


def make_input(dtype: torch.dtype, op: str, numel: int, rank: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000003 + rank * 7919 + numel * 31 + sum(map(ord, op)))
    if dtype.is_floating_point:
        if op == "product":
            x = 1.0 + 0.05 * torch.randn(numel, generator=g, dtype=torch.float64)
        else:
            x = torch.randn(numel, generator=g, dtype=torch.float64) * 3
        return x.to(dtype)
    if dtype == torch.uint8:
        lo, hi = (1, 4) if op == "product" else (0, 60)  # 4 ranks: sum <= 236, product <= 81
    else:
        lo, hi = (-3, 4) if op == "product" else (-1000, 1000)
    return torch.randint(lo, hi, (numel,), generator=g, dtype=torch.int64).to(dtype)


def reference(dtype: torch.dtype, op: str, numel: int, ws: int, seed: int = 0) -> torch.Tensor:
    xs = [make_input(dtype, op, numel, r, seed) for r in range(ws)]
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    st = torch.stack([x.to(wide) for x in xs])
    if op == "sum":
        y = st.sum(0)
    elif op == "avg":
        y = st.sum(0) / ws
    elif op == "max":
        y = st.max(0).values
    elif op == "min":
        y = st.min(0).values
    else:
        y = st.prod(0)
    return y


def tol(dtype: torch.dtype, op: str, ws: int) -> tuple[float, float]:
    """(rtol, atol) for comparing a float result with the float64 reference / another algorithm."""
    if dtype == torch.bfloat16:
        return 2e-2 * ws, 2e-2 * ws * 3
    if dtype == torch.float32:
        return 1e-5, 1e-5 * ws * 3
    return 1e-12, 1e-12 * ws * 3


def compare(a: torch.Tensor, b: torch.Tensor, dtype, op, ws) -> tuple[bool, float]:
    """(equal within the rule, max abs diff): integers and MIN/MAX exactly, floats allclose."""
    if a.shape != b.shape:
        return False, float("inf")
    diff = float((a.to(torch.float64) - b.to(torch.float64)).abs().max()) if a.numel() else 0.0
    if not dtype.is_floating_point or op in ("max", "min"):
        return bool(torch.equal(a.to(torch.float64), b.to(torch.float64))), diff
    rtol, atol = tol(dtype, op, ws)
    return bool(torch.allclose(a.to(torch.float64), b.to(torch.float64), rtol=rtol, atol=atol)), diff


# ---------------------------------------------------------------- scenarios
def scenario_cross_rack() -> dict:
    """8 ranks, labels from the launcher (XIRANG_HOST/XIRANG_RACK), XIRANG_ALGO=ring: the same
    256 KiB allreduce on the topology ring, on the rank-order ring (XIRANG_RING_ORDER=rank, and
    Options(ring_order="rank")) and on gloo."""
    rank, ws = _init("gloo")
    topo = _group()
    saved = os.environ.get("XIRANG_RING_ORDER")
    os.environ["XIRANG_RING_ORDER"] = "rank"
    try:
        byrank = _group()
    finally:
        if saved is None:
            os.environ.pop("XIRANG_RING_ORDER", None)
        else:
            os.environ["XIRANG_RING_ORDER"] = saved
    byrank_opt = _group(ring_order="rank")
    gloo = dist.group.WORLD
    numel = 256 * KiB // 4
    out = {"rank": rank, "ring_topology": _ring(topo), "ring_rank": _ring(byrank),
           "ring_rank_options": _ring(byrank_opt), "records": {}, "equal": {}}
    for dtype in (torch.float32, torch.int64):
        name = str(dtype).split(".")[1]
        # integer-valued floats: every summation order gives the same bits
        x = ((torch.arange(numel, dtype=torch.int64) * (rank + 3) + 11 * rank) % 1009 - 500).to(dtype)
        res = {}
        for gname, pg in (("topology", topo), ("rank", byrank), ("gloo", gloo)):
            y = x.clone()
            dist.all_reduce(y, group=pg)
            res[gname] = y
            if gname != "gloo":
                out["records"][(gname, name)] = _last(pg)
        ref = sum(((torch.arange(numel, dtype=torch.int64) * (r + 3) + 11 * r) % 1009 - 500) for r in range(ws))
        out["equal"][name] = {
            "topology_vs_gloo": bool(torch.equal(res["topology"], res["gloo"])),
            "rank_vs_gloo": bool(torch.equal(res["rank"], res["gloo"])),
            "gloo_vs_ref": bool(torch.equal(res["gloo"].to(torch.int64), ref)),
        }
    dist.barrier()
    return out


def run_cases(pg, ws, rank, cases, tag) -> list:
    rows = []
    for dname, opname, numel in cases:
        dtype = DTYPES[dname]
        x = make_input(dtype, opname, numel, rank)
        y = x.clone()
        dist.all_reduce(y, op=OPS[opname], group=pg)
        rec = _last(pg)
        ref = reference(dtype, opname, numel, ws)
        ok, diff = compare(y, ref.to(dtype), dtype, opname, ws)
        rows.append({"case": (dname, opname, numel), "tag": tag, "algorithm": rec["algorithm"],
                     "ref_ok": ok, "ref_diff": diff, "result": y if numel <= 4096 else None,
                     "bytes_cross_host": rec["bytes_cross_host"], "bytes_cross_rack": rec["bytes_cross_rack"],
                     "bytes_wire": rec["bytes_wire"]})
    return rows


def scenario_two_level() -> dict:
    """4 ranks, 2 hosts x 2 ranks (host = rank % 2, one rack): the two-level and the ring
    allreduce of every dtype and op, compared with each other and with a float64/int64 reference."""
    rank, ws = _init("gloo")
    host = f"h{rank % 2}"
    tl = _with_labels(host, "rackA", lambda: _group(algorithm="two_level"))
    ring = _with_labels(host, "rackA", lambda: _group(algorithm="ring"))
    out = {"rank": rank, "ring_two_level_group": _ring(tl), "rows": [], "pairs": []}
    numels = (2, 7, 1001, 40000)
    for dname, dtype in DTYPES.items():
        for opname in OPS:
            if opname == "avg" and not dtype.is_floating_point:
                continue
            for numel in numels:
                x = make_input(dtype, opname, numel, rank)
                a, b = x.clone(), x.clone()
                dist.all_reduce(a, op=OPS[opname], group=tl)
                ra = _last(tl)
                dist.all_reduce(b, op=OPS[opname], group=ring)
                rb = _last(ring)
                ref = reference(dtype, opname, numel, ws)
                eq, diff = compare(a, b, dtype, opname, ws)
                ok_a, da = compare(a, ref.to(dtype), dtype, opname, ws)
                ok_b, db = compare(b, ref.to(dtype), dtype, opname, ws)
                out["pairs"].append({
                    "case": (dname, opname, numel), "equal": eq, "diff": diff,
                    "two_level_ref_ok": ok_a, "two_level_ref_diff": da, "ring_ref_ok": ok_b, "ring_ref_diff": db,
                    "alg_two_level": ra["algorithm"], "alg_ring": rb["algorithm"],
                    "cross_host_two_level": ra["bytes_cross_host"], "cross_host_ring": rb["bytes_cross_host"],
                    "cross_rack_two_level": ra["bytes_cross_rack"],
                    "digest": float(a.to(torch.float64).sum()) if numel else 0.0,
                })
    dist.barrier()
    return out


def scenario_degenerate() -> dict:
    """4 ranks: one host, one rack (2 hosts x 2), uneven hosts (3 + 1), one rank per host; for
    each, an auto group and a forced two_level group; an allreduce above and below
    XIRANG_SMALL_BYTES. Case markers go to stderr so the test can find each case's log lines."""
    rank, ws = _init("gloo")
    topologies = {
        "one_host": ("solo", "rackA"),
        "one_rack": (f"h{rank // 2}", "rackA"),
        "uneven": ("big" if rank < 3 else "small", "rackA"),
        "uneven_racks": ("big" if rank < 3 else "small", "rackA" if rank < 3 else "rackB"),
        "one_per_host": (f"h{rank}", f"rack{rank % 2}"),
    }
    out = {"rank": rank, "rows": [], "rings": {}}
    cases = [("float32", "sum", 256 * KiB // 4), ("float32", "sum", 1 * KiB // 4), ("int64", "max", 50000),
             ("bfloat16", "sum", 70000)]
    for name, (host, rack) in topologies.items():
        for algo in ("auto", "two_level"):
            dist.barrier()
            log(f"=== case {name} {algo} begin")
            pg = _with_labels(host, rack, lambda: _group(algorithm=algo))
            dist.barrier()
            log(f"=== case {name} {algo} end")
            out["rings"][(name, algo)] = _ring(pg)
            out["rows"] += run_cases(pg, ws, rank, cases, (name, algo))
    dist.barrier()
    return out


def scenario_cluster() -> dict:
    """Emulated cluster: the default group is xirang (env:// rendezvous on the namespaces'
    addresses; labels from XIRANG_HOST and XIRANG_TOPOLOGY_FILE), plus a gloo group; a 1 MiB
    allreduce on both, checked against the reference."""
    rank, ws = _init("xirang")
    gloo = dist.new_group(backend="gloo")
    numel = 1 * 1024 * 1024 // 4
    x = ((torch.arange(numel, dtype=torch.int64) * (rank + 1)) % 101).to(torch.float32)
    ref = sum(((torch.arange(numel, dtype=torch.int64) * (r + 1)) % 101) for r in range(ws)).to(torch.float32)
    y = x.clone()
    t0 = time.monotonic()
    dist.all_reduce(y)
    dt = time.monotonic() - t0
    z = x.clone()
    dist.all_reduce(z, group=gloo)
    import xirang

    be = xirang._backend_for()
    out = {"rank": rank, "ring": _ring(None), "record": _last(None), "ok": bool(torch.equal(y, ref)),
           "gloo_ok": bool(torch.equal(z, ref)), "seconds": dt, "host": os.environ.get("XIRANG_HOST"),
           "ifname": os.environ.get("XIRANG_SOCKET_IFNAME"), "address": _address(be)}
    dist.barrier()
    return out


def _address(be):
    for attr in ("address", "listen_address"):
        f = getattr(be, attr, None)
        if f is not None:
            try:
                return f() if callable(f) else f
            except Exception:  # noqa: BLE001
                return None
    return None


def scenario_fail() -> dict:
    """Rank 1 exits with an error after the group is up; the others wait in a collective (the
    launcher must kill them and clean up)."""
    rank, ws = _init("xirang")
    if rank == 1:
        raise SystemExit("rank 1: injected failure")
    dist.all_reduce(torch.ones(4))
    return {"rank": rank}


SCENARIOS = {k[len("scenario_"):]: v for k, v in globals().items() if k.startswith("scenario_")}


def main() -> int:
    name = os.environ["XIRANG_TEST_SCENARIO"]
    out_dir = os.environ["XIRANG_TEST_OUT"]
    rank = int(os.environ["RANK"])
    try:
        result = SCENARIOS[name]()
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)
    with open(os.path.join(out_dir, f"rank{rank}.pkl.tmp"), "wb") as f:
        pickle.dump(result, f)
    os.replace(os.path.join(out_dir, f"rank{rank}.pkl.tmp"), os.path.join(out_dir, f"rank{rank}.pkl"))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
