"""GPU check: 4 ranks sharing GPU 0 through xirang's host-staged CUDA transport (the mirror engine,
as the ranks share a host's memory; with XIRANG_TRANSPORT_LOCAL=tcp the staged engine: kernels on
the GPU over a StagedLink), or (WORLD 1: NCCL refuses two ranks on one GPU) the NCCL engine, which
XIRANG_CUDA_TRANSPORT=auto (the default) must choose for one rank and must not for ranks sharing
the GPU: the records' engine is checked in both cases.

    python tests/gpu/check_collectives.py OUT_DIR [WORLD]
    python tests/gpu/check_collectives.py OUT_DIR [WORLD] --cpu   # a dry run on CPU tensors (CI)

Each rank runs every op twice, on CUDA tensors and on CPU copies of the same inputs (the CPU
path is the reference: same algorithm, so the results must be bitwise equal), then an allreduce
issued while the caller's stream is still writing the input (torch.cuda._sleep, then an in-place
add): the result must come from the finished values; likewise for a coalesced batch's Work (two
allreduces, and a batch_isend_irecv ring shift), and a recv whose tensor a kernel queued before it
still reads (the reader must see the old values). Rank 0 writes OUT_DIR/collectives.json
(collectives-nccl.json for WORLD 1 or XIRANG_CUDA_TRANSPORT=nccl, collectives-staged.json under
XIRANG_TRANSPORT_LOCAL=tcp; collectives-expect-E.json when XIRANG_CHECK_EXPECT_ENGINE=E names the
engine the records must show, as where NCCL cannot make its communicator and auto falls back). With --cpu the "device" tensors are CPU tensors (no producer kernel:
the checks cannot see a missing stream wait there) and the engine expected is "host": a dry run
of the script itself, run by test_collectives::test_gpu_collectives_check_dry_run.
"""
import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

import ranks  # tests/gpu/ranks.py


def nccl_expected(world):
    """Whether the NCCL engine must run the CUDA ops: forced, or auto with one rank."""
    t = os.environ.get("XIRANG_CUDA_TRANSPORT", "auto")
    return t == "nccl" or (t == "auto" and world == 1)


def worker(rank, world, port, out, cpu, q):
    import xirang  # noqa: F401  (registers the backend)

    results = {}
    try:
        dist.init_process_group("xirang", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
        if not cpu:
            torch.cuda.set_device(dev)

        def late_producer():  # ~0.25 s of GPU time before the caller's next kernel runs
            if not cpu:
                torch.cuda._sleep(int(5e8))
        g = torch.Generator().manual_seed(100 + rank)
        root = min(1, world - 1)  # the rooted ops' root

        def same(x, y):
            x, y = x.cpu().contiguous().view(-1), y.contiguous().view(-1)
            if x.dtype != y.dtype or x.shape != y.shape:
                return False
            if x.dtype.is_floating_point:  # bitwise
                x, y = x.view(torch.uint8), y.view(torch.uint8)
            return torch.equal(x, y)

        def check(name, cuda_out, cpu_out):
            a = cuda_out if isinstance(cuda_out, list) else [cuda_out]
            b = cpu_out if isinstance(cpu_out, list) else [cpu_out]
            results[name] = bool(len(a) == len(b) and all(same(x, y) for x, y in zip(a, b)))

        for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
            for op in ("SUM", "AVG", "MAX"):
                if op == "AVG" and not dt.is_floating_point:
                    continue
                base = (torch.randn(1_000_003, generator=g) * 10).to(dt)
                c, h = base.to(dev), base.clone()
                dist.all_reduce(c, op=getattr(dist.ReduceOp, op))
                dist.all_reduce(h, op=getattr(dist.ReduceOp, op))
                check(f"all_reduce[{dt},{op}]", c, h)
        # async with a non-contiguous CUDA tensor, Future value
        base = torch.randn(512, 300, generator=g)
        c, h = base.to(dev).t(), base.clone().t()
        w = dist.all_reduce(c, async_op=True)
        fut_val = w.get_future().wait()[0]
        dist.all_reduce(h)
        check("all_reduce[noncontiguous,future]", [c, fut_val], [h, h])
        # broadcast
        base = torch.randn(77_777, generator=g)
        c, h = base.to(dev), base.clone()
        dist.broadcast(c, src=root)
        dist.broadcast(h, src=root)
        check("broadcast", c, h)
        # all_gather (list) and all_gather_into_tensor
        base = torch.randn(10_001, generator=g)
        outs_c = [torch.empty(10_001, device=dev) for _ in range(world)]
        outs_h = [torch.empty(10_001) for _ in range(world)]
        dist.all_gather(outs_c, base.to(dev))
        dist.all_gather(outs_h, base.clone())
        check("all_gather", outs_c, outs_h)
        oc, oh = torch.empty(world * 10_001, device=dev), torch.empty(world * 10_001)
        dist.all_gather_into_tensor(oc, base.to(dev))
        dist.all_gather_into_tensor(oh, base.clone())
        check("all_gather_into_tensor", oc, oh)
        # reduce_scatter_tensor
        base = torch.randn(world * 4099, generator=g)
        oc, oh = torch.empty(4099, device=dev), torch.empty(4099)
        dist.reduce_scatter_tensor(oc, base.to(dev))
        dist.reduce_scatter_tensor(oh, base.clone())
        check("reduce_scatter_tensor", oc, oh)
        # reduce_scatter (list), all_to_all (list), gather and scatter (rooted at `root`)
        ins = [torch.randn(2049, generator=g) for _ in range(world)]
        oc, oh = torch.empty(2049, device=dev), torch.empty(2049)
        dist.reduce_scatter(oc, [t.to(dev) for t in ins])
        dist.reduce_scatter(oh, [t.clone() for t in ins])
        check("reduce_scatter", oc, oh)
        outs_c = [torch.empty(2049, device=dev) for _ in range(world)]
        outs_h = [torch.empty(2049) for _ in range(world)]
        dist.all_to_all(outs_c, [t.to(dev) for t in ins])
        dist.all_to_all(outs_h, [t.clone() for t in ins])
        check("all_to_all", outs_c, outs_h)
        base = torch.randn(3001, generator=g)
        gc = [torch.empty(3001, device=dev) for _ in range(world)] if rank == root else None
        gh = [torch.empty(3001) for _ in range(world)] if rank == root else None
        dist.gather(base.to(dev), gc, dst=root)
        dist.gather(base.clone(), gh, dst=root)
        check("gather", gc if rank == root else [], gh if rank == root else [])
        parts = [torch.randn(3001, generator=g) for _ in range(world)]
        sc_, sh_ = torch.empty(3001, device=dev), torch.empty(3001)
        dist.scatter(sc_, [t.to(dev) for t in parts] if rank == root else None, src=root)
        dist.scatter(sh_, [t.clone() for t in parts] if rank == root else None, src=root)
        check("scatter", sc_, sh_)
        # the hook's op: allreduce_ef on CUDA tensors vs CPU tensors
        pg = dist.distributed_c10d._get_default_group()
        be = pg._get_backend(dev)
        base = torch.randn(300_001, generator=g)
        res = torch.randn(300_001, generator=g) * 1e-3
        bc, rc, sc = base.to(dev), res.to(dev), torch.zeros(300_001, device=dev)
        bh, rh, sh = base.clone(), res.clone(), torch.zeros(300_001)
        be.allreduce_ef(bc, rc, sc).wait()
        be.allreduce_ef(bh, rh, sh).wait()
        check("allreduce_ef", [bc, sc], [bh, sh])
        # producer still running on the current stream when allreduce is called
        n = 1 << 22
        x = torch.zeros(n, device=dev)
        late_producer()
        x.add_(rank + 1.0)
        w = dist.all_reduce(x, async_op=True)
        w.wait()  # the current stream waits for the copies back; then read on it
        expect = float(sum(range(1, world + 1)))
        results["allreduce_after_long_kernel"] = bool((x == expect).all().item())
        # sync all_reduce, then an in-place op on the current stream sees the reduced values
        y = torch.full((n,), float(rank), device=dev)
        dist.all_reduce(y)
        y.mul_(2)
        results["allreduce_then_inplace"] = bool((y == 2.0 * sum(range(world))).all().item())
        # Which engine ran the CUDA ops (records): nccl under XIRANG_CUDA_TRANSPORT=nccl and, under auto,
        # for one rank (its GPU is its own); else (ranks share GPU 0) staged where
        # XIRANG_TRANSPORT_LOCAL=tcp, mirror where the ranks share host memory.
        want = ("host" if cpu else os.environ.get("XIRANG_CHECK_EXPECT_ENGINE") or ("nccl" if nccl_expected(world)
                else "staged" if os.environ.get("XIRANG_TRANSPORT_LOCAL") == "tcp" else "mirror"))
        engines = sorted({r["engine"] for r in xirang.stats() if cpu or r["engine"] != "host"})
        results[f"engine is {want} (records: {engines})"] = engines == [want]
        # A coalesced batch's Work stands for its members on the device too: after its wait() the
        # current stream sees every member's values (inputs written late by a long kernel).
        a, b = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
        late_producer()
        a.add_(rank + 1.0)
        b.add_(2.0 * (rank + 1))
        with dist._coalescing_manager(device=dev, async_ops=True) as cm:
            dist.all_reduce(a)
            dist.all_reduce(b)
        cm.wait()
        results["coalesced_batch_wait"] = bool((a == expect).all().item() and (b == 2 * expect).all().item())
        if world > 1:  # point-to-point (the mirror stage): a ring shift in one batch_isend_irecv
            send = torch.zeros(n, device=dev)
            late_producer()
            send.add_(rank + 1.0)
            recv = torch.empty(n, device=dev)
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, (rank + 1) % world),
                                           dist.P2POp(dist.irecv, recv, (rank - 1) % world)])
            for r in reqs:
                r.wait()
            results["batch_isend_irecv_wait"] = bool((recv == float((rank - 1) % world + 1)).all().item())
            # A receive writes its tensor only after the caller's stream is past the work queued
            # before it: `seen` (queued behind a long kernel) reads the old values, not the message.
            dst = torch.full((n,), -1.0, device=dev)
            late_producer()
            seen = dst * 1.0
            if rank == 0:
                dist.send(torch.full((n,), 7.0, device=dev), 1)
            elif rank == 1:
                dist.recv(dst, 0)
            if rank < 2:
                results["recv_after_reader"] = bool((seen == -1.0).all().item() and
                                                    (dst == (7.0 if rank == 1 else -1.0)).all().item())
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        results["error"] = traceback.format_exc()
    q.put((rank, results))


def main():
    args = [a for a in sys.argv[1:] if a != "--cpu"]
    cpu = "--cpu" in sys.argv
    out = args[0] if args else "gpu-results"
    world = int(args[1]) if len(args) > 1 else 4
    os.makedirs(out, exist_ok=True)
    got = ranks.run(worker, world, out, cpu, timeout=240)
    ok = all("error" not in res and all(res.values()) for res in got.values()) and len(got) == world
    expect = os.environ.get("XIRANG_CHECK_EXPECT_ENGINE")
    name = (f"collectives-expect-{expect}.json" if expect else "collectives-nccl.json" if nccl_expected(world)
            else "collectives-staged.json" if os.environ.get("XIRANG_TRANSPORT_LOCAL") == "tcp" else "collectives.json")
    with open(os.path.join(out, name), "w") as f:
        json.dump({"ok": ok, "ranks": got}, f, indent=1)
    for r in sorted(got):
        for k, v in got[r].items():
            if r == 0 or v is not True:
                print(f"rank {r} {'PASS' if v is True else 'FAIL'} {k}" + ("" if v in (True, False) else f": {v}"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
