#!/usr/bin/env python3
"""xirang under PyTorch Lightning: the "xirang" process group and the bf16 error-feedback hook.

    pip install -c <(echo "torch==$(python3 -c 'import torch; print(torch.__version__)')") lightning
    torchrun --nproc_per_node=2 examples/lightning_example.py               # xirang + hook
    torchrun --nproc_per_node=2 examples/lightning_example.py --backend gloo --hook none

(The constraint keeps pip from replacing the torch that xirang was built against.) Without torchrun,
``python examples/lightning_example.py --devices 2`` lets Lightning start the ranks itself.

Two things to know:

* Lightning builds the DistributedDataParallel wrapper itself, after the Trainer exists, so the hook
  state is made from the plain LightningModule (``xirang.hooks.BF16ErrorFeedbackState`` accepts the
  module or the DDP wrapper; DDP wraps the LightningModule directly, so parameter names agree) and
  handed to the strategy as ``ddp_comm_state`` with ``ddp_comm_hook=xirang.hooks.bf16_error_feedback_hook``.
* Lightning's ``DDPStrategy`` registers ``ddp_comm_hook`` only when the root device is CUDA (checked on
  Lightning 2.6: ``DDPStrategy._register_ddp_hooks``); on CPU it silently drops the hook. The small
  subclass below registers it on every device. On GPUs the plain ``DDPStrategy`` does the same.

The model and data are those of examples/train.py (examples/tasks.py: digits, 24 residual blocks of width 64).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tasks import DigitsData, digits_model  # noqa: E402  (examples/tasks.py)

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
except ImportError:  # the older package name
    import pytorch_lightning as pl  # type: ignore[no-redef]
    from pytorch_lightning.strategies import DDPStrategy  # type: ignore[no-redef]


class HookOnEveryDeviceDDPStrategy(DDPStrategy):
    """DDPStrategy that registers ``ddp_comm_hook`` on CPU too (Lightning only does so on CUDA) and
    averages integer tensors in float64 (xirang rejects AVG on integers)."""

    def _register_ddp_hooks(self) -> None:
        if self.root_device.type == "cuda" or self._ddp_comm_hook is None:
            return super()._register_ddp_hooks()
        self.model.register_comm_hook(self._ddp_comm_state, self._ddp_comm_hook)

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Any = "mean") -> Any:
        # Lightning averages its integer batch-size counters with ReduceOp.AVG on every backend but
        # gloo. xirang, like gloo, rejects AVG on integers (NCCL would truncate silently), so
        # average those in float64.
        if isinstance(tensor, torch.Tensor) and not tensor.is_floating_point() and str(reduce_op).lower() in (
            "mean", "avg", "reduceop.avg", "redopttype.avg"
        ):
            tensor = tensor.double()
        return super().reduce(tensor, group=group, reduce_op=reduce_op)


class DigitsModule(pl.LightningModule):
    def __init__(self, depth: int = 24, width: int = 64, lr: float = 2e-3) -> None:
        super().__init__()
        self.net = digits_model(depth, width)
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["xirang", "gloo"], default="xirang")
    p.add_argument("--hook", choices=["none", "bf16-ef"], default=None,
                   help="default: bf16-ef with xirang, none with gloo")
    p.add_argument("--layers-per-group", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--devices", type=int, default=None,
                   help="ranks on this node (default: torchrun's LOCAL_WORLD_SIZE, else 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--summary", default=None, help="write the final metrics here (JSON, rank 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    hook = args.hook or ("bf16-ef" if args.backend == "xirang" else "none")
    torch.set_num_threads(1)
    pl.seed_everything(args.seed, workers=True)

    model = DigitsModule()
    strategy_kwargs: dict = {"process_group_backend": args.backend}
    if args.backend == "xirang" or hook != "none":
        try:
            import xirang  # registers the "xirang" backend
        except ImportError as e:
            sys.exit(f"xirang is not importable ({e}); build it with `pip install --no-build-isolation .` "
                     f"from the repository root, or pass --backend gloo --hook none")
        if hook == "bf16-ef":
            # Lightning wraps the module in DDP later, so the state is made from the plain module.
            state = xirang.hooks.BF16ErrorFeedbackState(model, layers_per_group=args.layers_per_group)
            strategy_kwargs.update(ddp_comm_state=state,
                                   ddp_comm_hook=xirang.hooks.bf16_error_feedback_hook)
    strategy = HookOnEveryDeviceDDPStrategy(bucket_cap_mb=0.25, **strategy_kwargs)

    data = DigitsData()
    train_dl = DataLoader(TensorDataset(data.x_train, data.y_train), batch_size=args.batch_size,
                          shuffle=True, drop_last=True)
    val_dl = DataLoader(TensorDataset(data.x_test, data.y_test), batch_size=256)
    devices = args.devices or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=args.steps,
        val_check_interval=None, check_val_every_n_epoch=None, limit_val_batches=1.0,
        logger=False, enable_checkpointing=False, enable_model_summary=False,
        deterministic=True, use_distributed_sampler=True,
        enable_progress_bar=not args.no_progress,
    )
    trainer.fit(model, train_dl)
    metrics = trainer.validate(model, val_dl, verbose=False)[0]
    if trainer.is_global_zero:
        out = {"backend": args.backend, "hook": hook, "world_size": trainer.world_size,
               "steps": trainer.global_step, **{k: float(v) for k, v in metrics.items()}}
        if hook == "bf16-ef":
            try:
                out["hook_totals"] = strategy._ddp_comm_state.stats().get("totals")
            except Exception as e:  # noqa: BLE001 - stats are informative only
                out["hook_totals"] = f"unavailable: {e}"
        print(json.dumps(out, indent=2, default=str), flush=True)
        if args.summary:
            with open(args.summary, "w") as f:
                json.dump(out, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
