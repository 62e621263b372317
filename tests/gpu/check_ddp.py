"""GPU check: DDP + xirang's BF16 error-feedback hook on a CUDA model (ranks share GPU 0).

    python tests/gpu/check_ddp.py OUT_DIR [WORLD] [STEPS]

Trains the same MLP from the same seed twice: DDP over gloo with fp32 allreduce (the baseline;
NCCL cannot put several ranks on one GPU), and DDP over xirang with xirang.register_comm_hook.
Pass: final loss (mean of the last 5 steps) within 2% of the baseline's, and the replicas'
parameters bitwise equal across ranks after training. Rank 0 writes OUT_DIR/ddp.json (ddp-nccl.json
under XIRANG_CUDA_TRANSPORT=nccl: WORLD 1, the hook's device buffers through the NCCL engine;
ddp-staged.json under XIRANG_TRANSPORT_LOCAL=tcp: the hook's layer groups, bf16 with error
feedback, through the staged engine's kernels, where on one host's shared memory the hook takes
its exact fp32 local average instead).
"""
import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn

import ranks  # tests/gpu/ranks.py


def train(backend, rank, world, steps, use_hook):
    import xirang

    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(256, 256), nn.GELU()]
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), *layers, nn.Linear(256, 10)).to(dev)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=None)
    if use_hook:
        xirang.register_comm_hook(ddp, layers_per_group=2)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1000 + rank)
    wt = torch.randn(64, 10, generator=torch.Generator().manual_seed(7))
    losses = []
    for _ in range(steps):
        x = torch.randn(128, 64, generator=g)
        y = (x @ wt).argmax(1)
        x, y = x.to(dev), y.to(dev)
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(gathered[0].cpu().view(torch.int32), t.cpu().view(torch.int32)) for t in gathered)
    return losses, same


def worker(rank, world, port, steps, q):
    res = {}
    try:
        import xirang  # noqa: F401

        for name, backend, hook in (("baseline_gloo_fp32", "gloo", False), ("xirang_hook", "xirang", True)):
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port + (1 if hook else 0)}", rank=rank,
                                    world_size=world, timeout=datetime.timedelta(seconds=120))
            losses, same = train(backend, rank, world, steps, hook)
            res[name] = {"losses": losses, "replicas_equal": same}
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        res["error"] = traceback.format_exc()
    q.put((rank, res))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "gpu-results"
    world = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 50
    os.makedirs(out, exist_ok=True)
    got = ranks.run(worker, world, steps, timeout=280)
    summary = {"world": world, "steps": steps}
    ok = len(got) == world and all("error" not in r for r in got.values())
    if ok:
        r0 = got[0]
        base = sum(r0["baseline_gloo_fp32"]["losses"][-5:]) / 5
        hook = sum(r0["xirang_hook"]["losses"][-5:]) / 5
        rel = abs(hook - base) / abs(base)
        eq = all(got[r]["xirang_hook"]["replicas_equal"] for r in got)
        summary.update(final_loss_baseline=base, final_loss_hook=hook, rel_diff=rel, replicas_equal=eq,
                       first_loss=r0["xirang_hook"]["losses"][0])
        ok = rel <= 0.02 and eq
        print(f"{'PASS' if rel <= 0.02 else 'FAIL'} ddp loss: hook {hook:.5f} vs fp32 {base:.5f} (rel {rel:.4f})")
        print(f"{'PASS' if eq else 'FAIL'} ddp replicas bitwise equal")
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
