"""Same-host ranks over shared memory (#13): XIRANG_TRANSPORT_LOCAL=shm against =tcp.

Every collective runs in a pool whose ranks use the shared-memory domain and in one whose ranks
use TCP, on the same inputs (``refs.make_input``): the results must be bitwise equal between the
two and equal to the fp64 / exact reference; the records must say which transport carried the
bytes. Then the failure paths: a peer SIGKILLed mid-operation, a knob that differs between
ranks, and a loop of 50 group creations that must leave file descriptors, mappings and /dev/shm flat.
XIRANG_SHM_BYTES=4096 (the smallest slot) makes the 50 K-element cases run in many pieces.
"""
from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import hook_workers
import mp_pool
from refs import assert_reduced, bitwise_equal, dt, make_input

pytestmark = pytest.mark.xirang_only

# (dtype, numel): a small message (the direct exchange's rank order) and large ones (the ring's
# order; 16-bit floats through allreduce16), every dtype family.
CASES = [("float32", 7), ("float32", 50_003), ("bfloat16", 50_003), ("float16", 1_003), ("int32", 50_003)]
SHM_ENV = {"XIRANG_TRANSPORT_LOCAL": "shm", "XIRANG_SHM_BYTES": "4096"}
TCP_ENV = {"XIRANG_TRANSPORT_LOCAL": "tcp", "XIRANG_SHM_BYTES": "4096"}


def shm_segments() -> set:
    return {f for f in os.listdir("/dev/shm") if f.startswith("xirang-")}


def _be():
    import xirang._backend

    return xirang._backend.backend_for(mp_pool.group())


# ====================================================================== workers (on the ranks)
def w_every_collective(cases):
    g = mp_pool.group()
    r, n = dist.get_rank(g), dist.get_world_size(g)
    be = _be()
    be.clear_records()
    out = {"shm_ranks": list(be.shm_ranks)}
    for dtype, numel in cases:
        k = f"{dtype}-{numel}"
        t = make_input(r, numel, dtype, "SUM", "ar")
        dist.all_reduce(t, group=g)
        out[k + "/all_reduce_sum"] = t
        op2 = "AVG" if dtype.startswith(("float", "bfloat")) else "MAX"
        t = make_input(r, numel, dtype, op2, "ar2")
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op2), group=g)
        out[k + "/all_reduce_" + op2.lower()] = t
        t = make_input(r, numel, dtype, "MOVE", "bc")
        dist.broadcast(t, src=n - 1, group=g)
        out[k + "/broadcast"] = t
        o = torch.empty(n * numel, dtype=dt(dtype))
        dist.all_gather_into_tensor(o, make_input(r, numel, dtype, "MOVE", "ag"), group=g)
        out[k + "/all_gather"] = o
        o = torch.empty(numel, dtype=dt(dtype))
        dist.reduce_scatter_tensor(o, make_input(r, n * numel, dtype, "SUM", "rs"), group=g)
        out[k + "/reduce_scatter"] = o
        o = torch.empty(n * numel, dtype=dt(dtype))
        dist.all_to_all_single(o, make_input(r, n * numel, dtype, "MOVE", "a2a"), group=g)
        out[k + "/all_to_all"] = o
        lst = [torch.empty(numel, dtype=dt(dtype)) for _ in range(n)] if r == 0 else None
        dist.gather(make_input(r, numel, dtype, "MOVE", "ga"), lst, dst=0, group=g)
        if r == 0:
            out[k + "/gather"] = torch.cat(lst)
        o = torch.empty(numel, dtype=dt(dtype))
        src = list(make_input(n - 1, n * numel, dtype, "MOVE", "sc").chunk(n)) if r == n - 1 else None
        dist.scatter(o, src, src=n - 1, group=g)
        out[k + "/scatter"] = o
        t = make_input(r, numel, dtype, "SUM", "rd")
        dist.reduce(t, dst=0, group=g)
        if r == 0:
            out[k + "/reduce"] = t
        dist.barrier(group=g)
    # the hook's op (averaged error feedback) on fp32
    x = make_input(r, 20_001, "float32", "SUM", "ef")
    res = make_input(r, 20_001, "float32", "SUM", "efr") * 1e-3
    staged = torch.full_like(x, 7.0)
    be.allreduce_ef(x, res, staged).wait()
    out["ef/x"], out["ef/staged"] = x, staged
    out["records"] = [(rec["op"], rec["algorithm"], rec["bytes_shm"], rec["bytes_tcp"], rec["bytes_wire"])
                      for rec in be.records()]
    return out


def w_killed_mid_op():
    g = mp_pool.group()
    me = dist.get_rank(g)
    t = torch.ones(4 * 1024 * 1024)  # 16 MiB of float32: thousands of 4 KiB pieces per op
    dist.barrier(group=g)
    if me == 2:
        def killer():
            time.sleep(0.1)
            mp_pool.W.store.set("shm_killed_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=killer, daemon=True).start()
    for i in range(500):
        try:
            dist.all_reduce(t, group=g)
        except Exception as e:  # noqa: BLE001
            t_err = time.time()
            killed_at = float(mp_pool.W.store.get("shm_killed_at").decode())
            second = mp_pool.capture(dist.all_reduce, torch.ones(4), group=g)
            return dict(exc=mp_pool.exc_info(e), latency=t_err - killed_at, ops_done=i, second=second)
    return dict(exc=None, ops_done=500)


def w_mismatch(prefix, env_by_rank):
    """init_process_group with this rank's entry of `env_by_rank` set (restored after)."""
    env = env_by_rank[mp_pool.W.rank]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        got = mp_pool.capture(
            dist.init_process_group, "xirang", store=dist.PrefixStore(prefix, mp_pool.W.store),
            rank=mp_pool.W.rank, world_size=mp_pool.W.world_size, timeout=datetime.timedelta(seconds=20))
        if dist.is_initialized():  # created: one allreduce through it, then gone for the next case
            t = torch.full((1000,), float(mp_pool.W.rank + 1))
            dist.all_reduce(t)
            dist.destroy_process_group()
            return got if isinstance(got, mp_pool.ExcInfo) else float(t[0])
        return got
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _mappings() -> tuple:
    """(all mappings of this process, those of xirang's shared-memory segments)."""
    with open("/proc/self/maps") as f:
        lines = f.read().splitlines()
    return len(lines), sum("/dev/shm/xirang-" in ln for ln in lines)


def w_init_destroy(cycles):
    import xirang._backend

    fds, segs, chosen, maps, shm_maps = [], [], [], [], []
    for i in range(cycles):
        dist.init_process_group("xirang", store=dist.PrefixStore(f"cycle{i}", mp_pool.W.store),
                                rank=mp_pool.W.rank, world_size=mp_pool.W.world_size,
                                timeout=datetime.timedelta(seconds=30))
        t = torch.full((1000,), float(mp_pool.W.rank + 1))
        dist.all_reduce(t)
        chosen.append((list(xirang._backend.backend_for().shm_ranks), t[0].item()))
        dist.destroy_process_group()
        fds.append(_open_fds())
        segs.append(len(shm_segments()))
        m, x = _mappings()
        maps.append(m)
        shm_maps.append(x)
    return dict(fds=fds, segs=segs, chosen=chosen, maps=maps, shm_maps=shm_maps)


def w_two_hosts(mode):
    """2 labelled hosts x 2 ranks, the two-level allreduce: over shm the host level goes through
    each host's domain, the cross-host level over TCP."""
    import xirang
    import xirang._backend

    r = mp_pool.W.rank
    os.environ["XIRANG_HOST"] = f"fakehost{r // 2}"
    os.environ["XIRANG_TRANSPORT_LOCAL"] = mode
    try:
        dist.init_process_group("xirang", store=dist.PrefixStore(f"twohosts-{mode}", mp_pool.W.store), rank=r,
                                world_size=mp_pool.W.world_size, timeout=datetime.timedelta(seconds=30),
                                pg_options=xirang.Options(algorithm="two_level"))
    finally:
        del os.environ["XIRANG_HOST"], os.environ["XIRANG_TRANSPORT_LOCAL"]
    be = xirang._backend.backend_for()
    t = make_input(r, 300_001, "float32", "SUM", "2h")
    dist.all_reduce(t)
    rec = be.records()[-1]
    out = dict(t=t, shm_ranks=list(be.shm_ranks), algorithm=rec["algorithm"], bytes_shm=rec["bytes_shm"],
               bytes_tcp=rec["bytes_tcp"])
    dist.destroy_process_group()
    return out


# ====================================================================== tests
_RESULTS: dict = {}


def _run_both(ws):
    if ws not in _RESULTS:
        got = {}
        for mode, env in (("shm", SHM_ENV), ("tcp", TCP_ENV)):
            with mp_pool.Pool(ws, "xirang", timeout_s=60, env=env) as pool:
                got[mode] = pool.run(w_every_collective, CASES, timeout=120)
        _RESULTS[ws] = got
    return _RESULTS[ws]


def _expected(ws, r, key):
    """The reference of result `key` on rank r (None: checked by a reduction bound instead)."""
    case, coll = key.split("/")
    dtype, numel = case.rsplit("-", 1)
    numel = int(numel)
    if coll == "broadcast":
        return make_input(ws - 1, numel, dtype, "MOVE", "bc")
    if coll == "all_gather":
        return torch.cat([make_input(q, numel, dtype, "MOVE", "ag") for q in range(ws)])
    if coll == "all_to_all":
        return torch.cat([make_input(q, ws * numel, dtype, "MOVE", "a2a").chunk(ws)[r] for q in range(ws)])
    if coll == "gather":
        return torch.cat([make_input(q, numel, dtype, "MOVE", "ga") for q in range(ws)])
    if coll == "scatter":
        return make_input(ws - 1, ws * numel, dtype, "MOVE", "sc").chunk(ws)[r]
    return None


def _reduction_inputs(ws, r, key):
    case, coll = key.split("/")
    dtype, numel = case.rsplit("-", 1)
    numel = int(numel)
    if coll == "all_reduce_sum":
        return [make_input(q, numel, dtype, "SUM", "ar") for q in range(ws)], "SUM"
    if coll.startswith("all_reduce_"):
        op = coll.rsplit("_", 1)[1].upper()
        return [make_input(q, numel, dtype, op, "ar2") for q in range(ws)], op
    if coll == "reduce_scatter":
        return [make_input(q, ws * numel, dtype, "SUM", "rs").chunk(ws)[r] for q in range(ws)], "SUM"
    if coll == "reduce":
        return [make_input(q, numel, dtype, "SUM", "rd") for q in range(ws)], "SUM"
    raise KeyError(key)


@pytest.mark.parametrize("ws", [2, 4])
def test_shm_chosen_only_when_asked(backend, ws):
    got = _run_both(ws)
    assert all(res["shm_ranks"] == list(range(ws)) for res in got["shm"]), [res["shm_ranks"] for res in got["shm"]]
    assert all(res["shm_ranks"] == [] for res in got["tcp"])


@pytest.mark.parametrize("ws", [2, 4])
def test_every_collective_bitwise_equal_to_tcp_and_reference(backend, ws):
    got = _run_both(ws)
    keys = [k for k in got["shm"][0] if "/" in k and not k.startswith("ef/")]
    assert len(keys) == 9 * len(CASES), keys  # rank 0 holds the rooted results too
    for r in range(ws):
        for k in [k for k in got["shm"][r] if "/" in k and not k.startswith("ef/")]:
            a, b = got["shm"][r][k], got["tcp"][r][k]
            assert bitwise_equal(a, b), f"ws={ws} rank {r} {k}: shm and tcp differ bitwise"
            want = _expected(ws, r, k)
            if want is not None:
                assert torch.equal(a, want), f"ws={ws} rank {r} {k}: wrong bytes"
            else:
                inputs, op = _reduction_inputs(ws, r, k)
                assert_reduced(a, inputs, op, strict16=True, what=f"ws={ws} rank {r} {k}")


@pytest.mark.parametrize("ws", [2, 4])
def test_hook_op_is_fp32_over_shm(backend, ws):
    """shm::allreduceEF: x = sum_i (x_i / N + r_i) in fp32, residual 0; TCP: the BF16 ring keeps
    sum_t y_t + sum_i r_i = sum_i x_i / N (one step)."""
    got = _run_both(ws)
    xs = [make_input(q, 20_001, "float32", "SUM", "ef").double() for q in range(ws)]
    rs = [make_input(q, 20_001, "float32", "SUM", "efr").double() * 1e-3 for q in range(ws)]
    want = sum(x / ws + r for x, r in zip(xs, rs))
    for r in range(ws):
        y = got["shm"][r]["ef/x"]
        assert bitwise_equal(y, got["shm"][0]["ef/x"])
        assert float((y.double() - want).abs().max()) < 4 * ws * 1.2e-7, "shm EF off the fp32 sum"
        assert torch.count_nonzero(got["shm"][r]["ef/staged"]) == 0, "shm EF leaves a residual"
        yt = got["tcp"][r]["ef/x"]
        assert not bitwise_equal(yt, y), "the TCP hook op should be the BF16 ring (rounded), not fp32"
    total = got["tcp"][0]["ef/x"].double() + sum(got["tcp"][q]["ef/staged"].double() for q in range(ws))
    assert float((total - sum(xs) / ws - sum(rs)).abs().max()) < 1e-5


@pytest.mark.parametrize("ws", [2, 4])
def test_records_name_the_transport(backend, ws):
    got = _run_both(ws)
    for mode in ("shm", "tcp"):
        for r in range(ws):
            recs = got[mode][r]["records"]
            ar = [x for x in recs if x[0] == "all_reduce"]
            assert len(ar) == 2 * len(CASES), recs
            for op, algo, b_shm, b_tcp, b_wire in ar:
                if mode == "shm":
                    assert algo.startswith("shm") and b_shm > 0 and b_tcp == 0, (mode, r, op, algo, b_shm, b_tcp)
                else:
                    assert not algo.startswith("shm") and b_tcp > 0 and b_shm == 0, (mode, r, op, algo, b_shm, b_tcp)
                assert b_wire == b_shm + b_tcp
            # every collective of the run (not only allreduce) took the chosen transport
            moved = [x for x in recs if x[0] != "barrier"]
            assert all((x[2] > 0) == (mode == "shm") or (x[2] == 0 and x[3] == 0) for x in moved), recs
            assert sum(x[2] for x in recs) > 0 if mode == "shm" else sum(x[2] for x in recs) == 0


@pytest.mark.dedicated
def test_peer_killed_mid_op_survivors_raise_and_dev_shm_is_clean(backend):
    before = shm_segments()
    env = {"XIRANG_TRANSPORT_LOCAL": "shm"}
    with mp_pool.Pool(3, "xirang", timeout_s=60, env=env) as pool:
        res = pool.run(w_killed_mid_op, allow_exit=[2], timeout=60)
    assert isinstance(res[2], mp_pool.Exited)
    for r in (0, 1):
        d = res[r]
        assert d["exc"] is not None, f"rank {r} never raised after rank 2 was killed ({d['ops_done']} ops)"
        assert d["exc"].is_runtime_error, f"rank {r}: not a RuntimeError: {d['exc']}"
        assert d["latency"] < 10.0, f"rank {r} raised {d['latency']:.2f} s after the kill"
        assert "rank 2" in d["exc"].message, f"rank {r}: the error does not name rank 2: {d['exc'].message}"
        assert isinstance(d["second"], mp_pool.ExcInfo), f"rank {r}: the group is not poisoned"
    # the segment was unlinked when the domain was made: nothing of this pool is left
    deadline = time.monotonic() + 3
    while shm_segments() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (shm_segments() - before), shm_segments() - before


# Settings every rank of a group must share (python/xirang/_backend.py: _shared_settings): the
# knobs set on both ranks, the knob, rank 0's value, rank 1's value, and the name the error gives.
MISMATCHES = [
    ({}, "XIRANG_TRANSPORT_LOCAL", "shm", "tcp", "XIRANG_TRANSPORT_LOCAL"),
    ({}, "XIRANG_CUDA_TRANSPORT", "host", "nccl", "XIRANG_CUDA_TRANSPORT"),
    ({}, "XIRANG_ALGO", "ring", "direct", "XIRANG_ALGO"),
    ({}, "XIRANG_RING_ORDER", "topology", "rank", "XIRANG_RING_ORDER"),
    ({}, "XIRANG_SEGMENT_BYTES", "1048576", "65536", "XIRANG_SEGMENT_BYTES"),
    ({}, "XIRANG_SMALL_BYTES", "65536", "0", "XIRANG_SMALL_BYTES"),
    ({}, "XIRANG_ELASTIC", "0", "1", "XIRANG_ELASTIC"),
    ({"XIRANG_ELASTIC": "1"}, "XIRANG_HEARTBEAT_S", "1.0", "2.5", "XIRANG_HEARTBEAT_S"),
]

# Settings that may differ, or that differ only in spelling: (rank 0's knobs, rank 1's knobs).
AGREEMENTS = [
    ({"XIRANG_ALGO": "ring", "XIRANG_SEGMENT_BYTES": "65536"},) * 2,
    ({"XIRANG_SEGMENT_BYTES": "64K"}, {"XIRANG_SEGMENT_BYTES": "65536"}),
    ({"XIRANG_CUDA_TRANSPORT": "auto"}, {"XIRANG_CUDA_TRANSPORT": "host"}),
    ({"XIRANG_CUDA_TRANSPORT": "mirror"}, {"XIRANG_CUDA_TRANSPORT": "auto"}),  # the same frames over TCP
    ({"XIRANG_ELASTIC": "1"}, {"XIRANG_ELASTIC": "true"}),
    # the creator's slot size is the host's (shm.h); the small size is read only by auto
    ({"XIRANG_TRANSPORT_LOCAL": "shm", "XIRANG_SHM_BYTES": "4194304"},
     {"XIRANG_TRANSPORT_LOCAL": "shm", "XIRANG_SHM_BYTES": "8192"}),
    ({"XIRANG_ALGO": "ring", "XIRANG_SMALL_BYTES": "65536"}, {"XIRANG_ALGO": "ring", "XIRANG_SMALL_BYTES": "0"}),
    # a rank's own timing: one rank sleeps at once, the other polls 10 ms before it sleeps
    ({"XIRANG_SPIN_US": "0"}, {"XIRANG_SPIN_US": "10000"}),
]

# One rank's own bad knob (rank 1's; rank 0's are the defaults): the text of its error.
BAD_ON_ONE_RANK = [
    ("XIRANG_RING_ORDER", "random", "XIRANG_RING_ORDER must be topology or rank"),
    ("XIRANG_HOST", "node\t1", "a host or rack label must be printable"),
    ("XIRANG_SEGMENT_BYTES", "abc", "XIRANG_SEGMENT_BYTES='abc' is not an integer"),
    # Read by the C++ group itself, not compared across ranks:
    ("XIRANG_STATS", "maybe", "XIRANG_STATS"),
    ("XIRANG_STATS_CAPACITY", "abc", "XIRANG_STATS_CAPACITY='abc' is not an integer"),
    ("XIRANG_SHM_BYTES", "abc", "XIRANG_SHM_BYTES"),
    ("XIRANG_HANDSHAKE_TIMEOUT_MS", "x", "XIRANG_HANDSHAKE_TIMEOUT_MS"),
    ("XIRANG_SEND_THREAD_BYTES", "lots", "XIRANG_SEND_THREAD_BYTES='lots' is not an integer"),
    ("XIRANG_AUTH_KEY_FILE", "/nonexistent/xirang.key", "XIRANG_AUTH_KEY_FILE"),
    ("XIRANG_SOCKET_IFNAME", "nosuchif0", "nosuchif0"),
]


def _shown(knob, value):
    """The value as the error shows it (repr of the resolved setting)."""
    if knob == "XIRANG_ELASTIC":
        return repr(value == "1")
    if knob in ("XIRANG_SEGMENT_BYTES", "XIRANG_SMALL_BYTES"):
        return repr(int(value))
    if knob == "XIRANG_HEARTBEAT_S":
        return repr(float(value))
    return repr(value)


@pytest.mark.dedicated
def test_knob_mismatch_is_a_clear_error(backend):
    """Ranks that disagree on a per-group setting fail the creation on every rank, naming the
    setting and both values, instead of waiting for each other until the timeout."""
    with mp_pool.Pool(2, "xirang", timeout_s=30, init=False) as pool:
        for i, (common, knob, v0, v1, name) in enumerate(MISMATCHES):
            env = [dict(common, **{knob: v0}), dict(common, **{knob: v1})]
            res = pool.run(w_mismatch, f"mismatch{i}", env, timeout=60)
            for r, other, theirs in ((0, 1, v1), (1, 0, v0)):
                e = res[r]
                assert isinstance(e, mp_pool.ExcInfo), f"{knob}: rank {r} created the group despite the mismatch"
                assert e.type_name == "ValueError", f"{knob}: rank {r}: {e.type_name}: {e.message}"
                assert name in e.message and f"rank {other}: {_shown(knob, theirs)}" in e.message, e.message
                assert f"this rank {_shown(knob, (v0, v1)[r])}" in e.message, e.message
                assert e.elapsed < 15, f"{knob}: rank {r} took {e.elapsed:.1f} s to fail"
        # settings that agree create the group (the check is not a blanket refusal), and it works
        for i, env in enumerate(AGREEMENTS):
            res = pool.run(w_mismatch, f"agree{i}", list(env), timeout=60)
            assert res == [3.0, 3.0], (env, res)
        # a rank's own bad knob fails it, and its peer at once (told through the store)
        for i, (knob, value, text) in enumerate(BAD_ON_ONE_RANK):
            res = pool.run(w_mismatch, f"bad{i}", [{}, {knob: value}], timeout=60)
            for r, e in enumerate(res):
                assert isinstance(e, mp_pool.ExcInfo), f"{knob}: rank {r} created the group"
                assert e.type_name == "ValueError" and text in e.message, f"{knob}: rank {r}: {e.message}"
                assert e.elapsed < 15, f"{knob}: rank {r} took {e.elapsed:.1f} s to fail"
            # (XIRANG_SHM_BYTES: the domain's set-up tells the local ranks, in its own words)
            told = "shared memory set-up: rank 1: " if knob == "XIRANG_SHM_BYTES" else "rank 1 cannot create group"
            assert told in res[0].message, res[0].message
    # XIRANG_CODEC is read once per process, at its first use: the group's creation in a fresh one.
    with mp_pool.Pool(2, "xirang", timeout_s=30, init=False) as pool:
        res = pool.run(w_mismatch, "badcodec", [{}, {"XIRANG_CODEC": "bogus"}], timeout=60)
        for r, e in enumerate(res):
            assert isinstance(e, mp_pool.ExcInfo) and e.type_name == "ValueError", f"XIRANG_CODEC: rank {r}: {e}"
            assert "XIRANG_CODEC=bogus: unknown codec path" in e.message and e.elapsed < 15, (r, e.message)


@pytest.mark.dedicated
def test_init_destroy_loop_leaves_fds_mappings_and_dev_shm_flat(backend):
    before = len(shm_segments())
    with mp_pool.Pool(2, "xirang", timeout_s=60, init=False) as pool:  # default knob: auto
        res = pool.run(w_init_destroy, 50, timeout=240)
    for r, d in enumerate(res):
        assert all(c == ([0, 1], 3.0) for c in d["chosen"]), (r, d["chosen"])  # auto picked shm every time
        assert d["fds"][-1] == d["fds"][1], f"rank {r}: open fds grew over 50 cycles: {d['fds']}"
        assert max(d["segs"]) <= before, f"rank {r}: /dev/shm grew: {d['segs']} (before: {before})"
        # Every segment unmapped at destroy; the process's mapping count flat after the first
        # cycles (the allocator's and torch's lazily created arenas settle by then).
        assert max(d["shm_maps"]) == 0, f"rank {r}: segments still mapped after destroy: {d['shm_maps']}"
        assert d["maps"][-1] <= d["maps"][4], f"rank {r}: mappings grew over 50 cycles: {d['maps']}"


@pytest.mark.dedicated
def test_two_hosts_two_level_host_level_over_shm(backend):
    with mp_pool.Pool(4, "xirang", timeout_s=60, init=False) as pool:
        got = {mode: pool.run(w_two_hosts, mode, timeout=90) for mode in ("shm", "tcp")}
    inputs = [make_input(q, 300_001, "float32", "SUM", "2h") for q in range(4)]
    for r in range(4):
        s, t = got["shm"][r], got["tcp"][r]
        assert s["shm_ranks"] == ([0, 1] if r < 2 else [2, 3]), s["shm_ranks"]
        assert s["algorithm"] == "shm_two_level" and s["bytes_shm"] > 0 and s["bytes_tcp"] > 0, s
        assert t["shm_ranks"] == [] and t["algorithm"] == "two_level" and t["bytes_shm"] == 0, t
        assert bitwise_equal(s["t"], t["t"]), f"rank {r}: two-level over shm differs from TCP"
        assert_reduced(s["t"], inputs, "SUM", strict16=True, what=f"two hosts rank {r}")


# A rank that has a /dev/shm of its own (a container of its own on the same host, which the
# topology still labels as that host): it runs in a mount namespace with a fresh tmpfs on
# /dev/shm, so it cannot open the segment the other rank created. Ranks are launched as plain
# processes with env:// rendezvous (the isolated one under `unshare -m`).
_ISOLATED_WORKER = r"""
import datetime, json, sys
import torch, torch.distributed as dist
import xirang, xirang._backend
try:
    dist.init_process_group("xirang", timeout=datetime.timedelta(seconds=20))
except Exception as e:
    print("INIT_ERROR " + json.dumps(str(e)), flush=True)
    sys.exit(0)
r = dist.get_rank()
be = xirang._backend.backend_for()
be.clear_records()
t = torch.arange(300_001, dtype=torch.float32) * (r + 1)
dist.all_reduce(t)
rec = be.records()[-1]
print("RESULT " + json.dumps({"shm_ranks": list(be.shm_ranks), "t": t[:5].tolist() + t[-5:].tolist(),
                              "bytes_shm": rec["bytes_shm"], "bytes_tcp": rec["bytes_tcp"]}), flush=True)
dist.destroy_process_group()
"""


def _run_with_one_rank_isolated(isolated: int, mode: str):
    import json
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux unshare (mount namespaces)")
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=64m xirang-test /dev/shm"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"needs the privilege to make a mount namespace: {probe.stderr.strip()}")
    port = hook_workers.free_port()
    procs = []
    for r in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2",
                   XIRANG_TRANSPORT_LOCAL=mode, XIRANG_DEBUG="INFO")
        cmd = [sys.executable, "-c", _ISOLATED_WORKER]
        if r == isolated:
            cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                   'mount -t tmpfs -o size=64m xirang-test /dev/shm && exec "$0" "$@"'] + cmd
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=90)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    res = []
    for r, (rc, out, err) in enumerate(outs):
        assert rc == 0, f"rank {r} exited {rc}: {err[-2000:]}"
        line = [ln for ln in out.splitlines() if ln.startswith(("RESULT ", "INIT_ERROR "))]
        assert line, f"rank {r} printed no result: {out[-1000:]} {err[-2000:]}"
        kind, _, payload = line[-1].partition(" ")
        res.append((kind, json.loads(payload), err))
    return res


@pytest.mark.parametrize("isolated", [0, 1])
def test_separate_dev_shm_auto_falls_back_to_tcp(isolated):
    before = shm_segments()
    res = _run_with_one_rank_isolated(isolated, "auto")
    n = 300_001
    full = torch.arange(n, dtype=torch.float64) * 3  # (1 + 2) x i, exact in fp32 below 2^24
    want = full[:5].tolist() + full[-5:].tolist()
    for r, (kind, d, err) in enumerate(res):
        assert kind == "RESULT", f"rank {r}: {d}"
        assert d["shm_ranks"] == [], f"rank {r} reports a shared-memory domain: {d}"
        assert d["bytes_shm"] == 0 and d["bytes_tcp"] > 0, f"rank {r}: {d}"
        assert d["t"] == want, f"rank {r}: {d['t']} != {want}"
        assert "shared memory unavailable" in err and "using TCP" in err, f"rank {r} did not say why: {err[-2000:]}"
        assert "does not share /dev/shm" in err, f"rank {r}: {err[-2000:]}"
    assert shm_segments() <= before, "a segment was left in /dev/shm"


def test_separate_dev_shm_forced_shm_is_a_clear_error_on_every_rank():
    before = shm_segments()
    res = _run_with_one_rank_isolated(1, "shm")
    for r, (kind, msg, _err) in enumerate(res):
        assert kind == "INIT_ERROR", f"rank {r} initialised: {msg}"
        assert "XIRANG_TRANSPORT_LOCAL=shm" in msg and "does not share /dev/shm" in msg, f"rank {r}: {msg}"
        assert f"xirang rank {r}" in msg, f"rank {r}: the error does not name the rank: {msg}"
    assert shm_segments() <= before, "a segment was left in /dev/shm"
