#!/usr/bin/env python3
"""xirang inside a Hugging Face Accelerate script: the plain DDP route.

    pip install -c <(echo "torch==$(python3 -c 'import torch; print(torch.__version__)')") accelerate
    torchrun --nproc_per_node=2 examples/accelerate_example.py               # xirang + hook
    torchrun --nproc_per_node=2 examples/accelerate_example.py --backend gloo --hook none

(The constraint keeps pip from replacing the torch that xirang was built against.)

Accelerate's own comm-hook option (``DistributedDataParallelKwargs(comm_hook=...)``) accepts only
torch's built-in hooks (an enum), and on CPU it picks the process-group backend itself. So:

1. ``import xirang`` and create the process group yourself, before the ``Accelerator``:
   Accelerate then uses the group that exists (``dist.init_process_group("xirang")``).
2. ``accelerator.prepare(model, ...)`` wraps the model in ``DistributedDataParallel`` as usual.
3. Register xirang's hook on that DDP object before the first backward:
   ``state = xirang.register_comm_hook(ddp_model, layers_per_group=8)``.

Everything else (``accelerator.backward``, the prepared optimizer and dataloader) is unchanged.
The model and data are those of examples/train.py (examples/tasks.py: digits, 24 residual blocks of width 64).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tasks import DigitsData, digits_model  # noqa: E402  (examples/tasks.py)

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["xirang", "gloo"], default="xirang")
    p.add_argument("--hook", choices=["none", "bf16-ef"], default=None,
                   help="default: bf16-ef with xirang, none with gloo")
    p.add_argument("--layers-per-group", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--summary", default=None, help="write the final metrics here (JSON, rank 0)")
    args = p.parse_args(argv)
    hook = args.hook or ("bf16-ef" if args.backend == "xirang" else "none")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

    xirang = None
    if args.backend == "xirang" or hook != "none":
        try:
            import xirang  # registers the "xirang" backend
        except ImportError as e:
            sys.exit(f"xirang is not importable ({e}); build it with `pip install --no-build-isolation .` "
                     f"from the repository root, or pass --backend gloo --hook none")
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group(args.backend)       # 1. our group; Accelerate adopts it
    accelerator = Accelerator(cpu=True)
    set_seed(args.seed)

    data = DigitsData()
    model = digits_model(24, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    dl = DataLoader(TensorDataset(data.x_train, data.y_train), batch_size=args.batch_size,
                    shuffle=True, drop_last=True)
    model, opt, dl = accelerator.prepare(model, opt, dl)   # 2. DDP made by Accelerate

    state = None
    if hook == "bf16-ef":
        if not isinstance(model, DDP):
            sys.exit(f"expected a DistributedDataParallel model from accelerator.prepare, got "
                     f"{type(model).__name__} (world size {accelerator.num_processes})")
        state = xirang.register_comm_hook(model, layers_per_group=args.layers_per_group)  # 3.

    step, losses = 0, []
    model.train()
    while step < args.steps:
        for x, y in dl:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            accelerator.backward(loss)
            opt.step()
            losses.append(loss.item())
            step += 1
            if step >= args.steps:
                break

    net = accelerator.unwrap_model(model)
    net.eval()
    with torch.no_grad():
        logits = net(data.x_test)
        acc = (logits.argmax(1) == data.y_test).float().mean().item()
        val_loss = F.cross_entropy(logits, data.y_test).item()
    if accelerator.is_main_process:
        out = {"backend": args.backend, "hook": hook, "world_size": accelerator.num_processes,
               "distributed_type": str(accelerator.distributed_type),
               "process_group_backend": dist.get_backend() if dist.is_initialized() else None,
               "model_is_ddp": isinstance(model, DDP),
               "steps": step, "final_loss_rank0_last20": sum(losses[-20:]) / len(losses[-20:]),
               "heldout_loss": val_loss, "heldout_accuracy": acc}
        if state is not None:
            try:
                out["hook_totals"] = state.stats().get("totals")
            except Exception as e:  # noqa: BLE001 - stats are informative only
                out["hook_totals"] = f"unavailable: {e}"
        print(json.dumps(out, indent=2, default=str), flush=True)
        if args.summary:
            with open(args.summary, "w") as f:
                json.dump(out, f, indent=2, default=str)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
