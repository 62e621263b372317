"""GPU check of xirang.fsdp (issue #15 / #20, item 4): FSDP2's compressed reduce-scatter on CUDA tensors.

    python tests/gpu/check_fsdp.py OUT_DIR [WORLD]          # ranks share GPU 0 (the mirror engine)
    python tests/gpu/check_fsdp.py OUT_DIR [WORLD] --cpu    # the same script on CPU tensors (a dry run
                                                            # of its logic where there is no GPU)

Two parts, each on every rank, results in OUT_DIR/fsdp.json:

bits   xirang.fsdp's reduce-scatter object (``XirangReduceScatter``, what ``compress`` hands to
       ``set_custom_reduce_scatter``) called directly, for wire fp32 / bf16 / int8 with error
       feedback, three calls with the residual carried, on a [WORLD * 1000] input (1000: int8's
       last 128-element segment is short). Once on CPU tensors, once on CUDA tensors on a side
       stream (as FSDP calls it on its reduce-scatter stream) whose input is written by a kernel
       that is still running when the call is made (``torch.cuda._sleep`` first). Pass: outputs and
       residuals bitwise equal to the CPU call's (NaN-ness compared, not NaN bits): the call ran on
       the current stream, after the producer, and the host-staged all-to-all moved the same bytes.
train  FSDP2 (``fully_shard`` per linear and the root, mesh on "cuda") of a 3-linear model whose
       rows need padding, ``compress(wire=...)`` for fp32 / bf16 / int8; one step's gradients
       (``full_tensor()``) against an fp64 reference computed unsharded on the CPU: fp32 within
       1e-5 relative, bf16 within one bf16 rounding of sum |g_r| / N, int8 within its 128-element
       segment's scale (absmax / 127 of the contributors, summed over ranks).
Exit status 0 when everything passed.
"""
import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn

import ranks  # tests/gpu/ranks.py

D_IN, D_H, D_OUT, BATCH = 6, 7, 5, 4  # rows of 7 and 5: FSDP pads them at world size 2
S = 1000                               # the bits part's per-rank chunk
WIRES = ("fp32", "bf16", "int8")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(D_IN, D_H)
        self.l2 = nn.Linear(D_H, D_H)
        self.l3 = nn.Linear(D_H, D_OUT)

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


def make_net():
    torch.manual_seed(0)
    return Net()


def batch(rank):
    g = torch.Generator().manual_seed(7919 + rank)
    return torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_OUT, generator=g)


def reference(world):
    """name -> (mean over ranks of the fp64 gradients, sum_r |g_r| / world, per-rank grads)."""
    net = make_net().double()
    per = []
    for r in range(world):
        net.zero_grad()
        x, y = batch(r)
        ((net(x.double()) - y.double()) ** 2).mean().backward()
        per.append({n: p.grad.detach().clone() for n, p in net.named_parameters()})
    return {n: (sum(g[n] for g in per) / world, sum(g[n].abs() for g in per) / world, [g[n] for g in per])
            for n in per[0]}


def inputs(rank, world, step):
    g = torch.Generator().manual_seed(31 * rank + step)
    x = torch.randn(world * S, generator=g) * (10.0 ** torch.randint(-3, 3, (world * S,), generator=g))
    x[rank * 17] = float("inf") if step == 1 else x[rank * 17]  # a non-finite element in step 1
    return x


def same_bits(a, b):
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan = torch.isnan(a)
    return bool(torch.equal(nan, torch.isnan(b))) and bool(torch.equal(a[~nan], b[~nan]))


def part_bits(rank, world, device):
    import xirang  # noqa: F401
    from xirang.fsdp import XirangReduceScatter

    group = dist.group.WORLD
    res = {}
    for wire in WIRES:
        outs = {}
        devs = ["cpu"] + ([device] if device.type == "cuda" else [])
        for dev in devs:
            rs = XirangReduceScatter(f"bits-{wire}", None, wire, True, torch.float32, None)
            got = []
            for step in range(3):
                x = inputs(rank, world, step)
                out = torch.empty(S)
                if dev == "cpu":
                    rs(out, x, group, dist.ReduceOp.SUM)
                else:
                    side = torch.cuda.Stream()
                    xd = torch.empty(world * S, device=dev)
                    od = torch.empty(S, device=dev)
                    src = x.pin_memory()
                    with torch.cuda.stream(side):
                        torch.cuda._sleep(200_000_000)  # ~0.1 s: the producer is still running at the call
                        xd.copy_(src, non_blocking=True)
                        rs(od, xd, group, dist.ReduceOp.SUM)
                    side.synchronize()
                    out = od
                got.append((out.cpu(), rs.residual.cpu() if rs.residual is not None else None))
            outs[dev] = got
        if device.type != "cuda":  # the dry run: the CPU call ran, nothing to compare it with
            res[wire] = True
            continue
        ok = all(same_bits(a[0], b[0]) and (a[1] is None or same_bits(a[1], b[1]))
                 for a, b in zip(outs["cpu"], outs[device]))
        res[wire] = ok
    return res


def part_train(rank, world, device):
    import xirang
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ref = reference(world)
    # int8: each rank's element is off by at most half its segment's step, absmax / 127 / 2; a
    # 128-element segment of FSDP's flat input may hold several parameters, so take the rank's
    # largest gradient element of all (twice the bound, as margin), summed over ranks, / N.
    absmax = [max(float(v[2][r].abs().max()) for v in ref.values()) for r in range(world)]
    int8_step = sum(a / 127 for a in absmax) / world
    mesh = init_device_mesh(device.type, (world,))
    res = {}
    for wire in WIRES:
        net = make_net().to(device)
        fully_shard(net.l1, mesh=mesh)
        fully_shard(net.l2, mesh=mesh)
        fully_shard(net, mesh=mesh)
        xirang.fsdp.compress(net, wire=wire)
        x, y = batch(rank)
        ((net(x.to(device)) - y.to(device)) ** 2).mean().backward()
        worst = 0.0
        for n, p in net.named_parameters():
            got = p.grad.full_tensor().detach().cpu().double()
            want, scale, _ = ref[n]
            if wire == "fp32":
                bound = 1e-5 * scale + 1e-7
            elif wire == "bf16":
                bound = 2.0 ** -8 * scale + 1e-5 * scale + 1e-7  # half a bf16 ulp, relative
            else:
                bound = int8_step + 1e-5 * scale + 1e-7
            worst = max(worst, float(((got - want).abs() / bound).max()))
        res[wire] = {"ok": worst <= 1.0, "worst_error_over_bound": worst}
        del net
    return res


def worker(rank, world, port, device_name, q):
    res = {}
    try:
        import xirang  # noqa: F401

        device = torch.device(device_name)
        if device.type == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("xirang", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        res["bits"] = part_bits(rank, world, device)
        res["train"] = part_train(rank, world, device)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        res["error"] = traceback.format_exc()
    q.put((rank, res))


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = args[0] if args else "gpu-results"
    world = int(args[1]) if len(args) > 1 else 2
    device = "cpu" if "--cpu" in sys.argv else "cuda:0"
    os.makedirs(out, exist_ok=True)
    got = ranks.run(worker, world, device, timeout=170)
    ok = len(got) == world and all("error" not in r for r in got.values())
    if ok:
        for wire in WIRES:
            b = all(got[r]["bits"][wire] for r in got)
            t = all(got[r]["train"][wire]["ok"] for r in got)
            w = max(got[r]["train"][wire]["worst_error_over_bound"] for r in got)
            print(f"{'PASS' if b else 'FAIL'} fsdp bits {wire}: {device} reduce-scatter == CPU, bitwise, 3 calls"
                  + (" (dry run on the CPU: compared with itself)" if device == "cpu" else ""))
            print(f"{'PASS' if t else 'FAIL'} fsdp train {wire}: gradients vs fp64 reference, worst error/bound "
                  f"{w:.3f}")
            ok = ok and b and t
    else:
        for r, v in got.items():
            if "error" in v:
                print(f"FAIL rank {r}: {v['error']}")
    with open(os.path.join(out, "fsdp.json"), "w") as f:
        json.dump({"world": world, "device": device, "ok": ok, "ranks": got}, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
