"""Elastic mode (#8): a lost rank is dropped, survivors agree on a new ring and go on.

Each test spawns its own ranks (a dedicated ``mp_pool.Pool``; the c10d store lives in the test
process, so it outlives every rank) and kills some of them: with the test-only knob
XIRANG_TEST_DIE_AFTER_SEGMENTS=k@r (rank r SIGKILLs itself after sending k data frames) or
with os.kill. Values are checked against references computed in the test from the inputs of
the ranks that survived. Tests that count TCP data frames run with XIRANG_TRANSPORT_LOCAL=tcp;
the others take the default (shared memory between these same-host ranks, rebuilt per epoch).
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

import mp_pool

pytestmark = [pytest.mark.xirang_only, pytest.mark.dedicated, pytest.mark.slow]

MiB = 1 << 20


def _xirang():
    import xirang

    return xirang


def _retrying(fn, t):
    """xirang.retry_on_membership_change around fn(t); returns how many retries it took."""
    calls = [0]

    def once():
        calls[0] += 1
        fn(t)

    _xirang().retry_on_membership_change(once, t)
    return calls[0] - 1


def _ints(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1000, 1000, (n,), generator=g).float()  # sums exact in fp32


def _checked_allreduces(seed: int, count: int, base_n: int) -> list:
    """`count` allreduces of integer-valued inputs (rank r's i-th: _ints(seed * i + r, base_n + i)),
    each re-issued on MembershipChanged. Returns [(retries, result == the live ranks' sum)]."""
    X = _xirang()
    me, out = dist.get_rank(), []
    for i in range(count):
        n = base_n + i
        x = _ints(seed * i + me, n)
        tries = _retrying(dist.all_reduce, x)
        live = X.membership()["live"]
        out.append((tries, bool(torch.equal(x, sum(_ints(seed * i + r, n) for r in live)))))
    return out


# ---------------------------------------------------------------- killed mid-allreduce
def w_killed_mid_allreduce():
    X = _xirang()
    me = dist.get_rank()
    dist.barrier()
    t = torch.full((16 * MiB,), float(me + 1))  # 64 MiB of float32
    t0 = time.perf_counter()
    tries = _retrying(dist.all_reduce, t)
    t_done = time.perf_counter()
    m = X.membership()
    first_ok = bool(torch.all(t == float(sum(r + 1 for r in m["live"]))))
    first_val = float(t[0])
    # The next 10 allreduces on the rebuilt ring, checked against the live ranks' inputs.
    later = [ok for _, ok in _checked_allreduces(100, 10, 1000)]
    return dict(tries=tries, membership=m, first_ok=first_ok, first_val=first_val, later=later,
                op_s=t_done - t0)


@pytest.mark.parametrize("phase,frames", [("scatter_reduce", 10), ("allgather", 70)])
def test_killed_mid_64mib_allreduce(phase, frames):
    # WS=4 ring, 1 MiB segments: each rank sends 48 data frames in scatter-reduce, then 48 in
    # allgather (plus one for the barrier before), so frame 10 is in the first, 70 in the second.
    env = dict(XIRANG_ELASTIC="1", XIRANG_ALGO="ring", XIRANG_TRANSPORT_LOCAL="tcp", XIRANG_SEGMENT_BYTES=str(MiB),
               XIRANG_TEST_DIE_AFTER_SEGMENTS=f"{frames}@2", XIRANG_HEARTBEAT_S="1.0")
    with mp_pool.Pool(4, "xirang", timeout_s=60, env=env) as pool:
        res = pool.run(w_killed_mid_allreduce, allow_exit=[2], timeout=120)
    assert isinstance(res[2], mp_pool.Exited)
    for r in (0, 1, 3):
        d = res[r]
        m = d["membership"]
        print(f"{phase}: rank {r}: tries={d['tries']} value={d['first_val']} epoch={m['epoch']} "
              f"live={m['live']} recovery={m['last_recovery_s']:.3f} s "
              f"(agreement {m['last_agreement_s']:.3f} s), failed op took {d['op_s']:.2f} s")
        assert m["live"] == [0, 1, 3] and m["epoch"] == 1, m
        assert d["first_val"] == 1 + 2 + 4, f"rank {r}: {d['first_val']} is not the survivors' sum 7"
        assert d["first_ok"]
        assert d["later"] == [True] * 10
        assert m["last_recovery_s"] < 5.0
    assert len({res[r]["tries"] for r in (0, 1, 3)}) == 1, "survivors disagree on whether the op completed"


# ---------------------------------------------------------------- the hook's op retries itself
def w_hook_op_retried():
    X = _xirang()
    from xirang._backend import backend_for

    be = backend_for()
    me = dist.get_rank()
    n = 4 * MiB
    dist.barrier()
    buf = torch.full((n,), float(me + 1))
    res, staged = torch.zeros(n), torch.zeros(n)
    bias = torch.full((1000,), float(10 * (me + 1)), dtype=torch.float64)
    work = be.allreduce_ef(buf, res, staged, 0, label="g0", plain=[bias])
    work.wait()  # rank 2 dies inside it: retried on the new ring, no exception
    return dict(buf=buf, bias=float(bias[0]), m=X.membership())


def test_hook_op_retried_on_new_ring():
    env = dict(XIRANG_ELASTIC="1", XIRANG_ALGO="ring", XIRANG_TRANSPORT_LOCAL="tcp", XIRANG_SEGMENT_BYTES=str(256 << 10),
               XIRANG_TEST_DIE_AFTER_SEGMENTS="6@2")
    with mp_pool.Pool(4, "xirang", timeout_s=60, env=env) as pool:
        res = pool.run(w_hook_op_retried, allow_exit=[2], timeout=120)
    mean = (1 + 2 + 4) / 3
    for r in (0, 1, 3):
        d = res[r]
        assert d["m"]["live"] == [0, 1, 3]
        # BF16 on the wire: the average of the survivors within bf16 rounding; the plain fp64
        # tensor exactly (10+20+40)/3.
        # Each of the 3 survivors' partial sums is rounded to bf16 once on the ring.
        err = float((d["buf"] - mean).abs().max())
        assert err <= 3 * mean * 2 ** -8, f"rank {r}: max error {err} vs the survivors' mean {mean}"
        assert d["bias"] == pytest.approx(70 / 3, rel=1e-12)
        assert torch.equal(d["buf"], res[0]["buf"]), f"rank {r}'s result differs from rank 0's"


# ---------------------------------------------------------------- two failures at once
def w_two_die():
    X = _xirang()
    me = dist.get_rank()
    mp_pool.W.store.set(f"pid{me}", str(os.getpid()))
    dist.barrier()
    if me in (1, 3):
        x = _ints(me, 2 * MiB)  # the same op #2 the survivors issue (a different size is a mismatch)
        if me == 3:
            os.kill(int(mp_pool.W.store.get("pid1").decode()), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(x)  # rank 1 is killed by rank 3 around here
        time.sleep(60)
    results = _checked_allreduces(7, 5, 2 * MiB)
    return dict(m=X.membership(), results=results)


def test_two_failures_at_once():
    env = dict(XIRANG_ELASTIC="1", XIRANG_HEARTBEAT_S="1.0")
    with mp_pool.Pool(5, "xirang", timeout_s=60, env=env) as pool:
        res = pool.run(w_two_die, allow_exit=[1, 3], timeout=120)
    for r in (0, 2, 4):
        d = res[r]
        print(f"rank {r}: {d['m']}")
        assert d["m"]["live"] == [0, 2, 4], d["m"]
        assert all(ok for _, ok in d["results"]), d["results"]
    assert len({str(res[r]["results"]) for r in (0, 2, 4)}) == 1


# ---------------------------------------------------------------- a failure during the rebuild
def w_fail_during_rebuild():
    X = _xirang()
    me = dist.get_rank()
    if me == 1:
        # Rank 1 dies the moment the first rebuild is done, while the others may still be
        # connecting to the new ring: a second membership change right after the first.
        X.on_membership_change(lambda m: os.kill(os.getpid(), signal.SIGKILL))
    dist.barrier()
    out = _checked_allreduces(11, 6, MiB)
    return dict(m=X.membership(), out=out)


def test_failure_during_rebuild():
    env = dict(XIRANG_ELASTIC="1", XIRANG_ALGO="ring", XIRANG_TRANSPORT_LOCAL="tcp", XIRANG_SEGMENT_BYTES=str(256 << 10),
               XIRANG_TEST_DIE_AFTER_SEGMENTS="3@2")
    with mp_pool.Pool(4, "xirang", timeout_s=60, env=env) as pool:
        res = pool.run(w_fail_during_rebuild, allow_exit=[1, 2], timeout=120)
    for r in (0, 3):
        d = res[r]
        print(f"rank {r}: {d['m']}")
        assert d["m"]["live"] == [0, 3]
        assert d["m"]["epoch"] == 2 and d["m"]["recoveries"] == 2
        assert all(ok for _, ok in d["out"]), d["out"]


def w_second_loss_in_the_rebuild():
    X = _xirang()
    me = dist.get_rank()
    dist.barrier()
    if me == 3:
        os.kill(os.getpid(), signal.SIGKILL)  # the first loss; rank 2 dies in the rebuild (knob)
    t0 = time.perf_counter()
    out = _checked_allreduces(13, 4, 4096)
    return dict(m=X.membership(), out=out, s=time.perf_counter() - t0, shm=list(X._backend_for(None).shm_ranks))


def test_a_rank_lost_during_the_shared_memory_rebuild_is_dropped_too():
    # Ranks 0-2 agree on [0 1 2]; rank 2 dies before its shared-memory set-up of that epoch. Its
    # local peers used to wait for its segment until the group timeout (here 60 s), then fail.
    env = dict(XIRANG_ELASTIC="1", XIRANG_HEARTBEAT_S="1.0", XIRANG_TEST_DIE_IN_REBUILD="2")
    with mp_pool.Pool(4, "xirang", timeout_s=60, env=env) as pool:
        res = pool.run(w_second_loss_in_the_rebuild, allow_exit=[2, 3], timeout=120)
    for r in (0, 1):
        d = res[r]
        print(f"rank {r}: {d['m']}, {d['s']:.1f} s")
        assert d["m"]["live"] == [0, 1], d["m"]
        assert d["m"]["epoch"] == 2 and d["m"]["recoveries"] == 2, d["m"]
        assert all(ok for _, ok in d["out"]), d["out"]
        assert d["s"] < 30, d["s"]  # the heartbeat (1 s) found it, not the group timeout
        assert d["shm"] == [0, 1]  # the last epoch has its shared memory again


# ---------------------------------------------------------------- declared dead, then back
def w_stopped_rank_comes_back():
    X = _xirang()
    me = dist.get_rank()
    mp_pool.W.store.set(f"pid{me}", str(os.getpid()))
    dist.barrier()
    mp_pool.W.store.set(f"past_barrier{me}", "1")
    if me == 0:
        # rank 3 freezes between operations: once its barrier has returned (over shared memory
        # it may still be reading the others' counts when rank 0's barrier returns)
        mp_pool.W.store.wait(["past_barrier3"])
        pid3 = int(mp_pool.W.store.get("pid3").decode())
        os.kill(pid3, signal.SIGSTOP)  # rank 3 freezes: no heartbeats, no traffic
        mp_pool.W.store.set("stopped", "1")
    else:
        mp_pool.W.store.wait(["stopped"])
    if me == 3:  # runs after SIGCONT: it was dropped meanwhile
        time.sleep(0.5)
        try:
            dist.all_reduce(torch.ones(8))
            return dict(err=None)
        except RuntimeError as e:
            return dict(err=str(e))
    x = torch.ones(1 << 16)
    tries = _retrying(dist.all_reduce, x)
    m = X.membership()
    if me == 0:
        os.kill(int(mp_pool.W.store.get("pid3").decode()), signal.SIGCONT)
    return dict(m=m, tries=tries, val=float(x[0]))


def test_declared_dead_rank_gets_clear_error():
    env = dict(XIRANG_ELASTIC="1", XIRANG_HEARTBEAT_S="0.5")
    with mp_pool.Pool(4, "xirang", timeout_s=30, env=env) as pool:
        res = pool.run(w_stopped_rank_comes_back, timeout=120)
    for r in (0, 1, 2):
        assert res[r]["m"]["live"] == [0, 1, 2], res[r]
        assert res[r]["val"] == 3.0
    err = res[3]["err"]
    assert err is not None and "declared dead" in err, err


# ---------------------------------------------------------------- elastic off: fail fast
def w_not_elastic():
    dist.barrier()
    if dist.get_rank() == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(MiB))
        return dict(err=None)
    except Exception as e:  # noqa: BLE001
        return dict(err=mp_pool.exc_info(e), elapsed=time.perf_counter() - t0)


def test_without_elastic_survivors_raise_fast():
    with mp_pool.Pool(3, "xirang", timeout_s=60, env=dict(XIRANG_ELASTIC="0")) as pool:
        res = pool.run(w_not_elastic, allow_exit=[2], timeout=60)
    for r in (0, 1):
        assert res[r]["err"] is not None and res[r]["err"].is_runtime_error
        assert not res[r]["err"].isinstance_of("MembershipChanged")
        assert res[r]["elapsed"] < 5.0


# ---------------------------------------------------------------- DDP + hook, a rank killed at step 20
STEPS, KILL_AT, DIM = 60, 20, 64


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(DIM, DIM), torch.nn.Tanh())],
                               torch.nn.Linear(DIM, 1))


def _batch(step: int, shard: int, n_shards: int, bs: int = 96):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(bs, DIM, generator=g)
    y = torch.sin(x[:, :4].sum(1, keepdim=True))
    per = bs // n_shards
    return x[shard * per:(shard + 1) * per], y[shard * per:(shard + 1) * per]


def _eval_loss(model):
    g = torch.Generator().manual_seed(99999)
    x = torch.randn(512, DIM, generator=g)
    y = torch.sin(x[:, :4].sum(1, keepdim=True))
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


def _train(ddp, opt, first, last, live, me, ckpt=None, die_rank=None):
    for step in range(first, last):
        if ckpt and step == KILL_AT and me == 0:
            torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict()}, ckpt)
        if die_rank is not None and step == KILL_AT:
            mp_pool.W.store.set("ckpt_saved", "1") if me == 0 else mp_pool.W.store.wait(["ckpt_saved"])
            if me == die_rank:
                os.kill(os.getpid(), signal.SIGKILL)
        x, y = _batch(step, live.index(me), len(live))
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()


def w_ddp_elastic(ckpt):
    X = _xirang()
    me = dist.get_rank()
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False, bucket_cap_mb=0.01)
    X.register_comm_hook(ddp)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    live = list(range(dist.get_world_size()))
    changes = []

    def on_change(m):  # re-shard the data over the live ranks from the next step on
        live[:] = m["live"]
        changes.append(m["epoch"])

    X.on_membership_change(on_change)
    _train(ddp, opt, 0, STEPS, live, me, ckpt=ckpt, die_rank=2)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return dict(params=params, loss=_eval_loss(model), m=X.membership(), changes=changes)


def w_ddp_resumed(ckpt):
    X = _xirang()
    me = dist.get_rank()
    model = _model()
    sd = torch.load(ckpt)
    model.load_state_dict(sd["model"])
    ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False, bucket_cap_mb=0.01)
    X.register_comm_hook(ddp)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt.load_state_dict(sd["opt"])
    _train(ddp, opt, KILL_AT, STEPS, list(range(dist.get_world_size())), me)
    return dict(loss=_eval_loss(model))


def test_ddp_hook_survives_a_killed_rank():
    ckpt = os.path.join(tempfile.mkdtemp(prefix="xrel"), "step20.pt")
    env = dict(XIRANG_ELASTIC="1", XIRANG_HEARTBEAT_S="1.0")
    with mp_pool.Pool(4, "xirang", timeout_s=60, env=env) as pool:
        res = pool.run(w_ddp_elastic, ckpt, allow_exit=[2], timeout=240)
    with mp_pool.Pool(3, "xirang", timeout_s=60) as pool:
        ref = pool.run(w_ddp_resumed, ckpt, timeout=240)
    for r in (0, 1, 3):
        assert res[r]["m"]["live"] == [0, 1, 3]
        assert res[r]["changes"] == [1]
        assert torch.equal(res[r]["params"], res[0]["params"]), f"rank {r}'s parameters differ from rank 0's"
    loss, ref_loss = res[0]["loss"], ref[0]["loss"]
    print(f"final eval loss: elastic {loss:.5f}, 3-rank run resumed from step {KILL_AT}: {ref_loss:.5f}")
    assert abs(loss - ref_loss) <= 0.05 * ref_loss, (loss, ref_loss)


# ---------------------------------------------------------------- a spare rejoins at step 40
JOIN_AT = 40


def _rebuild_ddp(model, old_ddp=None, old_state=None):
    """A new DDP wrapper + hook over the grown group; survivors keep their residuals."""
    X = _xirang()
    import gc

    sd = old_state.state_dict() if old_state is not None else None
    del old_ddp, old_state
    gc.collect()  # the old reducer's autograd hooks go with it
    ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False, bucket_cap_mb=0.01)
    state = X.register_comm_hook(ddp)
    if sd is not None:
        state.load_state_dict(sd)
    return ddp, state


def w_ddp_rejoin():
    X = _xirang()
    me = dist.get_rank()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ddp, state = _rebuild_ddp(model)
    live = list(range(dist.get_world_size()))
    X.on_membership_change(lambda m: live.__setitem__(slice(None), m["live"]))
    joined = []
    for step in range(STEPS):
        if step == KILL_AT and me == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == JOIN_AT - 5 and me == 0:
            mp_pool.W.store.set("start_spare", "1")  # the spare node comes up
        if step == JOIN_AT:
            joined = X.admit_joiners(expect=1, wait_s=60)
            if joined:
                assert X.sync_training_state(model, opt, step) == step
                ddp, state = _rebuild_ddp(model, ddp, state)
        x, y = _batch(step, live.index(me), len(live))
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return dict(params=params, m=X.membership(), joined=joined)


def spare_main(port: int, prefix: str, rank: int, world_size: int, out: str) -> None:
    """The spare node's process (run with XIRANG_JOIN=1): waits for the signal to come up, joins
    as `rank`, copies the training state and trains to the end."""
    import datetime

    X = _xirang()
    torch.set_num_threads(1)
    base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    store = dist.PrefixStore(prefix, base)
    store.wait(["start_spare"])
    dist.init_process_group("xirang", store=dist.PrefixStore("default_pg", store), rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=60))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = X.sync_training_state(model, opt)
    ddp, _state = _rebuild_ddp(model)
    live = X.membership()["live"]
    for s in range(step, STEPS):
        x, y = _batch(s, live.index(rank), len(live))
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.save(dict(params=params, m=X.membership(), step=step), out)
    dist.destroy_process_group()


def _start_spare(call: str, env: dict, **popen):
    """A spare's process (XIRANG_JOIN=1) running ``test_elastic.<call>``."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    return subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); import test_elastic as t; t.{call}"],
        env=dict(os.environ, XIRANG_JOIN="1", OMP_NUM_THREADS="1", **env), start_new_session=True, **popen)


def test_spare_rejoins_at_step_40():
    out = os.path.join(tempfile.mkdtemp(prefix="xrspare"), "spare.pt")
    env = dict(XIRANG_ELASTIC="1", XIRANG_HEARTBEAT_S="1.0")
    with mp_pool.Pool(4, "xirang", timeout_s=60, env=env) as pool:
        spare = _start_spare(f"spare_main({pool.store.port}, {pool.prefix!r}, 2, 4, {out!r})", env)
        try:
            res = pool.run(w_ddp_rejoin, allow_exit=[2], timeout=240)
            assert spare.wait(timeout=120) == 0, "the spare failed"
        finally:
            if spare.poll() is None:
                spare.kill()
    sp = torch.load(out)
    assert sp["step"] == JOIN_AT
    assert sp["m"]["live"] == [0, 1, 2, 3]
    for r in (0, 1, 3):
        assert res[r]["joined"] == [2]
        assert res[r]["m"]["live"] == [0, 1, 2, 3] and res[r]["m"]["epoch"] == 2
        assert torch.equal(res[r]["params"], res[0]["params"])
    assert torch.equal(sp["params"], res[0]["params"]), "the spare's parameters differ from rank 0's"


# ---------------------------------------------------------------- a spare that died while it waited
def dying_spare_main(port: int, prefix: str, rank: int, world_size: int) -> None:
    """A spare (XIRANG_JOIN=1) that SIGKILLs itself 3 s into its wait for admission."""
    import datetime
    import threading

    _xirang()
    base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    store = dist.PrefixStore(prefix, base)
    store.wait(["start_spare"])
    threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    dist.init_process_group("xirang", store=dist.PrefixStore("default_pg", store), rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=60))


def w_admit_after_the_spare_died():
    X = _xirang()
    me = dist.get_rank()
    dist.barrier()
    if me == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    _retrying(dist.all_reduce, torch.ones(4))
    if me == 0:
        mp_pool.W.store.set("start_spare", "1")
    while not mp_pool.W.store.check(["spare_dead"]):  # polled (see w_live_until_the_spare_gave_up)
        time.sleep(0.1)
    t0 = time.perf_counter()
    first = X.admit_joiners()
    t1 = time.perf_counter()
    second = X.admit_joiners()
    t2 = time.perf_counter()
    x = torch.full((4,), float(me + 1))
    dist.all_reduce(x)
    return dict(first=first, second=second, s1=t1 - t0, s2=t2 - t1, m=X.membership(), val=x.tolist())


def test_a_spare_that_died_while_it_waited_is_not_admitted():
    """Found by a new user: a spare killed while it waited stayed in the store as a joiner and was
    admitted; over shared memory the survivors then waited for it until the group timeout."""
    import threading

    env = dict(XIRANG_ELASTIC="1", XIRANG_HEARTBEAT_S="1.0")
    with mp_pool.Pool(3, "xirang", timeout_s=60, env=env) as pool:
        spare = _start_spare(f"dying_spare_main({pool.store.port}, {pool.prefix!r}, 2, 3)", env)
        rc = []

        def after_the_spare():
            rc.append(spare.wait(timeout=100))
            dist.PrefixStore(pool.prefix, pool.store).set("spare_dead", "1")

        watcher = threading.Thread(target=after_the_spare, daemon=True)
        watcher.start()
        try:
            res = pool.run(w_admit_after_the_spare_died, allow_exit=[2], timeout=150)
        finally:
            if spare.poll() is None:
                spare.kill()
        watcher.join(timeout=10)
    assert rc == [-signal.SIGKILL], rc  # it died in its wait, as arranged
    for r in (0, 1):
        d = res[r]
        print(f"rank {r}: {d}")
        assert d["first"] == [] and d["second"] == [], d
        assert d["m"]["live"] == [0, 1], d["m"]
        assert d["val"] == [3.0] * 4, d
        assert d["s1"] < 15, d  # its join beat stood still for XIRANG_HEARTBEAT_S, not the group timeout
        assert d["s2"] < 1.0, d  # marked gone: not looked at again


# ---------------------------------------------------------------- a spare for a rank that is alive
def w_live_until_the_spare_gave_up():
    dist.all_reduce(torch.ones(4))
    # polled: a blocking wait would hold the store client the heartbeat thread also uses
    while not mp_pool.W.store.check(["spare_done"]):
        time.sleep(0.1)
    return dist.get_rank()


def live_rank_spare_main(port: int, prefix: str, world_size: int = 2) -> None:
    """A spare started (XIRANG_JOIN=1) with RANK 1 while rank 1 is alive; prints its error."""
    import datetime

    _xirang()
    base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    store = dist.PrefixStore(prefix, base)
    t0 = time.perf_counter()
    try:
        dist.init_process_group("xirang", store=dist.PrefixStore("default_pg", store), rank=1,
                                world_size=world_size, timeout=datetime.timedelta(seconds=6))
        print("ERROR: admitted", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"spare error after {time.perf_counter() - t0:.1f} s: {e}", flush=True)
    store.set("spare_done", "1")


def _spare_beside_two_live_ranks(extra_args: str):
    """Two live ranks and a spare running live_rank_spare_main(port, prefix<extra_args>): the live
    ranks' results, the spare's stdout and stderr."""
    import subprocess

    env = dict(XIRANG_ELASTIC="1", XIRANG_HEARTBEAT_S="0.5")
    with mp_pool.Pool(2, "xirang", timeout_s=60, env=env) as pool:
        spare = _start_spare(f"live_rank_spare_main({pool.store.port}, {pool.prefix!r}{extra_args})", env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            res = pool.run(w_live_until_the_spare_gave_up, timeout=120)
            out, err = spare.communicate(timeout=60)
        finally:
            if spare.poll() is None:
                spare.kill()
    return res, out, err


def test_a_spare_for_a_live_rank_says_that_rank_is_alive():
    """Found by a new user: a spare started with the RANK of a live rank waited the whole group
    timeout and then said only that the live ranks admit spares with admit_joiners()."""
    res, out, err = _spare_beside_two_live_ranks("")
    assert res == [0, 1]
    assert "ERROR" not in out and "spare error after" in out, out + err
    assert "rank 1 is alive (its heartbeat advanced while this spare waited)" in out, out + err
    assert "start a spare with the RANK of a rank that was lost" in out, out + err
    assert "rank 1 is alive (its heartbeat advances)" in err, err


def test_a_spare_with_another_world_size_says_so_at_once():
    """Found by a new user: a spare started with WORLD_SIZE=3 for a group of 2 waited in silence for
    a third rank's label, then failed with the store's bare timeout."""
    res, out, err = _spare_beside_two_live_ranks(", world_size=3")
    assert res == [0, 1]
    assert "this spare's world size is 3, but group '0' has 2 ranks" in out, out + err
    waited = float(out.split("spare error after ")[1].split(" s")[0])
    assert waited < 5, out  # at once, not at the 6 s timeout


# ---------------------------------------------------------------- a new group with a lost rank in it
def w_new_group_with_a_lost_rank():
    me = dist.get_rank()
    dist.barrier()
    if me == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    _retrying(dist.all_reduce, torch.ones(4))
    t0 = time.perf_counter()
    try:
        dist.new_group([0, 1, 2], timeout=datetime.timedelta(seconds=8))
        err = None
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    s = time.perf_counter() - t0
    x = torch.full((4,), float(me + 1))
    dist.all_reduce(x)  # the default group goes on
    return dict(err=err, s=s, val=x.tolist())


def test_a_new_group_with_a_lost_rank_fails_within_its_timeout():
    """Found by a new user: rank 0's generation handshake timed out, but rank 1, which rank 0 had
    already answered, waited for rank 0's topology label for the store's own timeout."""
    env = dict(XIRANG_ELASTIC="1", XIRANG_HEARTBEAT_S="1.0")
    with mp_pool.Pool(3, "xirang", timeout_s=60, env=env) as pool:
        res = pool.run(w_new_group_with_a_lost_rank, allow_exit=[2], timeout=120)
    for r in (0, 1):
        print(f"rank {r}: {res[r]}")
        assert res[r]["err"] is not None and res[r]["s"] < 20, res[r]
        assert res[r]["val"] == [3.0] * 4, res[r]
    assert "ranks [2] of 3 did not take part in the group's generation handshake" in res[0]["err"], res[0]
    assert "ranks [2] of 3 did not take part" in res[1]["err"], res[1]  # told by rank 0, not its own timeout


# ---------------------------------------------------------------- a long store.wait is not a lost rank
def w_long_store_wait():
    X = _xirang()
    dist.all_reduce(torch.ones(4))
    before = X.membership()
    if dist.get_rank() == 0:  # blocks the group's store client for 6 heartbeats
        try:
            mp_pool.W.store.wait(["never_set"], datetime.timedelta(seconds=3))
        except Exception:  # noqa: BLE001  (the wait's timeout)
            pass
    else:
        time.sleep(3.5)
    t = torch.full((4,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    return dict(before=before, after=X.membership(), sum=t.tolist())


def test_a_long_store_wait_on_the_groups_store_is_not_a_lost_rank():
    """torch's store client runs one call at a time: while rank 0's Python waited on the group's
    store, its heartbeats waited too, and rank 1 took it for lost after the heartbeat timeout. An
    elastic group has its own connection to the store."""
    env = dict(XIRANG_ELASTIC="1", XIRANG_HEARTBEAT_S="0.5")
    with mp_pool.Pool(2, "xirang", timeout_s=60, env=env) as pool:
        res = pool.run(w_long_store_wait, timeout=120)
    for r in range(2):
        assert res[r]["sum"] == [3.0] * 4, res[r]
        assert res[r]["after"]["live"] == [0, 1] and res[r]["after"]["epoch"] == res[r]["before"]["epoch"], res[r]


# ---------------------------------------------------------------- a mismatch is a bug, not a failure
def w_mismatch_elastic():
    dist.barrier()
    n = 2 if dist.get_rank() == 0 else 3
    t0 = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(64 * 1024 * n))
        return dict(err=None)
    except Exception as e:  # noqa: BLE001
        return dict(err=mp_pool.exc_info(e), elapsed=time.perf_counter() - t0)


def _assert_mismatch_on_every_rank(worker, *words):
    """Three elastic ranks run `worker`: each raises a mismatch error (not MembershipChanged)
    holding every word of `words`, within 10 s."""
    with mp_pool.Pool(3, "xirang", timeout_s=60, env=dict(XIRANG_ELASTIC="1")) as pool:
        res = pool.run(worker, timeout=60)
    for r in range(3):
        e = res[r]["err"]
        assert e is not None, f"rank {r} did not raise"
        assert not e.isinstance_of("MembershipChanged"), f"rank {r}: {e}"
        assert "mismatch" in str(e) and all(w in str(e) for w in words), f"rank {r}: {e}"
        assert res[r]["elapsed"] < 10.0


def test_mismatch_fails_every_rank_in_elastic_mode():
    _assert_mismatch_on_every_rank(w_mismatch_elastic)


def w_admit_beside_an_allreduce():
    """Rank 0 calls admit_joiners where the others call all_reduce (a program's bug)."""
    dist.barrier()
    t0 = time.perf_counter()
    try:
        if dist.get_rank() == 0:
            _xirang().admit_joiners()
        else:
            dist.all_reduce(torch.ones(4))
        return dict(err=None)
    except Exception as e:  # noqa: BLE001
        return dict(err=mp_pool.exc_info(e), elapsed=time.perf_counter() - t0)


def test_admit_joiners_beside_another_collective_fails_every_rank_at_once():
    """admit_joiners is a collective: a rank that issued another op there gets the mismatch at
    once, naming both ops (before: reported at the next op, or read as a lost rank at the op
    timeout)."""
    _assert_mismatch_on_every_rank(w_admit_beside_an_allreduce, "admit")


def test_on_membership_change_takes_a_callable():
    """Found by a new user: a non-callable was taken, to fail later as an unraisable exception."""
    with pytest.raises(TypeError, match="fn must be callable or None, got int"):
        _xirang().on_membership_change(5)


def test_a_spare_with_another_heartbeat_names_the_live_ranks_values_only():
    """Found by a review: a spare whose heartbeat period differs from the group's was told the lost
    rank's old value (its label, which the spare replaces) beside the live ranks', and the setting
    was spelt "heartbeat (...), s"."""
    from xirang import _backend

    store = dist.HashStore()
    label = {"host": "h", "rack": "r", "size": 3}
    hb = "heartbeat period in seconds (Options.heartbeat_s / XIRANG_HEARTBEAT_S)"
    for r, period in ((0, 1.0), (1, 0.25), (2, 1.0)):  # rank 1 was lost; its label stays
        store.set(f"ns/label/{r}", json.dumps(dict(label, settings={hb: period})))
    with pytest.raises(ValueError) as e:
        _backend._exchange_labels(store, "ns", 1, 3, "0", True, dict(label, settings={hb: 2.0}), None, timeout_s=5)
    msg = str(e.value)
    assert msg == (f"xirang rank 1: {hb} must agree across the group's ranks (group '0'): this rank 2.0, "
                   "rank 0: 1.0, rank 2: 1.0"), msg
