"""GPU check: DDP + xirang's BF16 error-feedback hook on a CUDA model (ranks share GPU 0).

    python tests/gpu/check_ddp.py OUT_DIR [WORLD] [STEPS]
    python tests/gpu/check_ddp.py OUT_DIR [WORLD] [STEPS] --cpu   # a dry run on CPU tensors (CI)

Trains the same MLP (Linear + LayerNorm + GELU blocks) from the same seed: DDP over gloo with
fp32 allreduce (the baseline; NCCL cannot put several ranks on one GPU), and DDP over xirang with
xirang.register_comm_hook. Pass: the loss falls below half its first value, final loss (mean of the
last 5 steps) within 2% of the baseline's, and the replicas' parameters bitwise equal across ranks
after training. Then AMP (autocast to fp16, torch.amp.GradScaler; --cpu: bf16), on gloo and with
the hook, one step's loss made inf on every rank (step 10): that step must be skipped by the scaler
(its scale halves), leave the hook's residuals bitwise untouched and, on the hook's groups path
(XIRANG_TRANSPORT_LOCAL=tcp), count in the state's skipped_steps; the hook's final loss within 2% of
gloo's under the same AMP, replicas bitwise equal. Rank 0 writes OUT_DIR/ddp.json (ddp-nccl.json
under XIRANG_CUDA_TRANSPORT=nccl: WORLD 1, the hook's device buffers through the NCCL engine;
ddp-staged.json under XIRANG_TRANSPORT_LOCAL=tcp: the hook's layer groups, bf16 with error
feedback, through the staged engine's kernels, where on one host's shared memory the hook takes its
exact fp32 local average instead). Where NCCL can run (WORLD 1 on a GPU), a last run times torch's
bf16_compress_hook on NCCL beside the xirang hook's run (median step time; printed, not judged).
Dry runs: test_hook::test_gpu_ddp_check_dry_run.
"""
import datetime
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn

import ranks  # tests/gpu/ranks.py


INF_STEP = 10  # the AMP run's step whose loss is made inf


def train(backend, rank, world, steps, use_hook, dev, amp=False):
    """use_hook: False, True (xirang's hook) or "torch_bf16" (torch's bf16_compress_hook). Returns
    the losses, whether the replicas ended bitwise equal, the AMP inf step's checks, and the median
    step time in ms (steps 5 on, the inf step excluded; CUDA: synchronized per step)."""
    import xirang
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(256, 256), nn.LayerNorm(256), nn.GELU()]
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), *layers, nn.Linear(256, 10)).to(dev)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=None)
    state = None
    if use_hook == "torch_bf16":  # a CPU torch refuses the bf16 hook: the dry run takes the fp16 one
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook if dev.type == "cuda"
                               else default_hooks.fp16_compress_hook)
    elif use_hook:
        state = xirang.register_comm_hook(ddp, layers_per_group=2)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler(dev.type) if amp else None
    amp_dtype = torch.float16 if dev.type == "cuda" else torch.bfloat16
    inf_step = {}
    g = torch.Generator().manual_seed(1000 + rank)
    wt = torch.randn(64, 10, generator=torch.Generator().manual_seed(7))
    losses, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        x = torch.randn(128, 64, generator=g)
        y = (x @ wt).argmax(1)
        x, y = x.to(dev), y.to(dev)
        opt.zero_grad(set_to_none=True)
        if not amp:
            loss = nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())  # .item() waits for the step's kernels
            times.append(time.perf_counter() - t0)
            continue
        with torch.autocast(device_type=dev.type, dtype=amp_dtype):
            loss = nn.functional.cross_entropy(ddp(x), y)
        if len(losses) == INF_STEP:  # every rank: non-finite gradients this step
            before = {k: v.clone() for k, v in state.residuals.items()} if state else {}
            scale, skipped = scaler.get_scale(), state.skipped_steps if state else 0
            scaler.scale(loss * float("inf")).backward()
        else:
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if len(losses) == INF_STEP:
            inf_step = {"scale_halved": scaler.get_scale() == scale / 2}
            if state:
                after = state.residuals
                inf_step["residuals_untouched"] = bool(before.keys() == after.keys() and all(
                    torch.equal(before[k].view(torch.int32), after[k].view(torch.int32)) for k in before))
            if state and state.stats()["totals"]["path"] == "groups":  # the local average keeps no step to skip
                inf_step["hook_skipped_it"] = state.skipped_steps == skipped + 1
            losses.append(losses[-1])  # the skipped step changed nothing
        else:
            losses.append(loss.item())
            times.append(time.perf_counter() - t0)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(gathered[0].cpu().view(torch.int32), t.cpu().view(torch.int32)) for t in gathered)
    return losses, same, inf_step, 1e3 * statistics.median(times[5:])


RUNS = (("baseline_gloo_fp32", "gloo", False, False), ("xirang_hook", "xirang", True, False),
        ("baseline_gloo_amp", "gloo", False, True), ("xirang_hook_amp", "xirang", True, True))
# Timing only: torch's bf16_compress_hook on NCCL, the reference, where NCCL can run (one
# rank per GPU: WORLD 1 here); the dry run runs torch's fp16_compress_hook on xirang's plain
# allreduce instead.
TORCH_BF16 = ("torch_bf16_hook", "nccl", "torch_bf16", False)


def worker(rank, world, port, steps, cpu, q):
    res = {}
    try:
        import xirang  # noqa: F401

        dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
        # One store on the one free port for every run (a prefix each): port + i may be taken.
        timeout = datetime.timedelta(seconds=120)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timeout)
        runs = RUNS + ((TORCH_BF16[0], "xirang" if cpu else "nccl", *TORCH_BF16[2:]),) if cpu or world == 1 else RUNS
        for name, backend, hook, amp in runs:
            dist.init_process_group(backend, store=dist.PrefixStore(name, store), rank=rank, world_size=world,
                                    timeout=timeout)
            losses, same, inf_step, step_ms = train(backend, rank, world, steps, hook, dev, amp)
            res[name] = {"losses": losses, "replicas_equal": same, "step_ms": step_ms,
                         **({"inf_step": inf_step} if amp else {})}
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        res["error"] = traceback.format_exc()
    q.put((rank, res))


def main():
    args = [a for a in sys.argv[1:] if a != "--cpu"]
    cpu = "--cpu" in sys.argv
    out = args[0] if args else "gpu-results"
    world = int(args[1]) if len(args) > 1 else 2
    steps = int(args[2]) if len(args) > 2 else 50
    assert steps > INF_STEP + 5, f"at least {INF_STEP + 6} steps (the AMP run's inf step is {INF_STEP})"
    os.makedirs(out, exist_ok=True)
    got = ranks.run(worker, world, steps, cpu, timeout=280)
    summary = {"world": world, "steps": steps}
    ok = len(got) == world and all("error" not in r for r in got.values())
    if ok:
        r0 = got[0]
        base = sum(r0["baseline_gloo_fp32"]["losses"][-5:]) / 5
        hook = sum(r0["xirang_hook"]["losses"][-5:]) / 5
        rel = abs(hook - base) / abs(base)
        eq = all(got[r]["xirang_hook"]["replicas_equal"] for r in got)
        base_amp = sum(r0["baseline_gloo_amp"]["losses"][-5:]) / 5
        amp = sum(r0["xirang_hook_amp"]["losses"][-5:]) / 5
        rel_amp = abs(amp - base_amp) / abs(base_amp)
        eq_amp = all(got[r]["xirang_hook_amp"]["replicas_equal"] for r in got)
        inf = {f"{run} {k}": all(got[r][run]["inf_step"].get(k) is True for r in got)
               for run in ("baseline_gloo_amp", "xirang_hook_amp") for k in r0[run]["inf_step"]}
        learned = hook < 0.5 * r0["xirang_hook"]["losses"][0]
        summary.update(final_loss_baseline=base, final_loss_hook=hook, rel_diff=rel, replicas_equal=eq,
                       first_loss=r0["xirang_hook"]["losses"][0], final_loss_baseline_amp=base_amp,
                       final_loss_hook_amp=amp, rel_diff_amp=rel_amp, replicas_equal_amp=eq_amp, amp_inf_step=inf)
        ok = learned and rel <= 0.02 and eq and rel_amp <= 0.02 and eq_amp and all(inf.values())
        print(f"{'PASS' if learned else 'FAIL'} ddp loss falls below half its first value "
              f"({r0['xirang_hook']['losses'][0]:.5f} -> {hook:.5f})")
        print(f"{'PASS' if rel <= 0.02 else 'FAIL'} ddp loss: hook {hook:.5f} vs fp32 {base:.5f} (rel {rel:.4f})")
        print(f"{'PASS' if eq else 'FAIL'} ddp replicas bitwise equal")
        print(f"{'PASS' if rel_amp <= 0.02 else 'FAIL'} ddp amp loss: hook {amp:.5f} vs gloo amp {base_amp:.5f} "
              f"(rel {rel_amp:.4f})")
        print(f"{'PASS' if eq_amp else 'FAIL'} ddp amp replicas bitwise equal")
        for k, v in inf.items():
            print(f"{'PASS' if v else 'FAIL'} ddp amp inf step: {k}")
        times = {n: r0[n]["step_ms"] for n in ("xirang_hook", TORCH_BF16[0]) if n in r0}
        summary["step_ms"] = times
        if len(times) == 2:  # timing, no pass/fail: one rank per GPU is all NCCL allows here
            print(f"INFO ddp step time: xirang hook {times['xirang_hook']:.3f} ms, torch bf16_compress_hook "
                  f"{'(dry run: fp16_compress_hook on xirang)' if cpu else 'on NCCL'} {times[TORCH_BF16[0]]:.3f} ms, ratio "
                  f"{times['xirang_hook'] / times[TORCH_BF16[0]]:.2f} (median of steps 5 on, rank 0)")
    else:
        for r, v in got.items():
            if "error" in v:
                print(f"FAIL rank {r}: {v['error']}")
    summary["ok"] = ok
    summary["ranks"] = got
    name = ("ddp-nccl.json" if os.environ.get("XIRANG_CUDA_TRANSPORT") == "nccl"
            else "ddp-staged.json" if os.environ.get("XIRANG_TRANSPORT_LOCAL") == "tcp" else "ddp.json")
    with open(os.path.join(out, name), "w") as f:
        json.dump(summary, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
