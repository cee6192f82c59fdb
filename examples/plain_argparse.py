"""The library with plain argparse, and a loss averaged over variable-length items.

Each sample is a sequence of 1 to 12 items (think caption tokens or graph nodes), padded into
batches; the loss is the squared error averaged over the real items of the global batch. The
script uses the batch plan, the LR schedule, the TrainLoop and GlobalItemMean one by one, with
its own flags, so the same pieces fit a script configured by argparse or Hydra.

    python examples/plain_argparse.py --bs 16
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml examples/plain_argparse.py \\
        --bs 16 --grad-accum 2            # same parameters as the line above
    ... --naive-mean                      # per-micro-batch means: the result depends on the launch
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from accel_common import (
    BatchRequest,
    Decay,
    GlobalItemMean,
    LoopPolicy,
    LRSettings,
    Run,
    RunConfig,
    SavePolicy,
    TrainLoop,
    make_accelerator,
    make_lr_schedule,
)
from accel_common.data import make_train_loader


class VariableLengthItems(Dataset):
    """Sequences of 1..12 items with 4 features each; every item's target is linear in them."""

    def __init__(self, size: int = 256, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        weights = torch.randn(4, generator=g)
        lengths = torch.randint(1, 13, (size,), generator=g).tolist()
        self.samples = []
        for length in lengths:
            x = torch.randn(length, 4, generator=g)
            self.samples.append((x, x @ weights + 0.1 * torch.randn(length, generator=g)))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.samples[index]


def pad_batch(samples: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, y = zip(*samples, strict=True)
    mask = pad_sequence([torch.ones(len(t)) for t in y], batch_first=True)
    return pad_sequence(x, batch_first=True), pad_sequence(y, batch_first=True), mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bs", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--max-steps", type=int, default=24)
    parser.add_argument("--output-dir", type=Path, default=Path("runs/plain_argparse"))
    parser.add_argument("--naive-mean", action="store_true", help="mean per micro-batch (wrong)")
    args = parser.parse_args()

    accelerator, plan = make_accelerator(
        output_dir=args.output_dir, batch=BatchRequest(args.bs, grad_accum_steps=args.grad_accum)
    )
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loader = make_train_loader(
        VariableLengthItems(), plan.per_device_batch_size, collate_fn=pad_batch
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    schedule = make_lr_schedule(
        accelerator, optimizer, plan, LRSettings(args.lr, ref_bs=args.bs, decay=Decay.constant),
        steps_per_epoch=len(loader), epochs=10, max_steps=args.max_steps,
    )  # fmt: skip
    config = RunConfig("plain_argparse", vars(args))
    run = Run.open(accelerator, plan, schedule, config, output_dir=args.output_dir)
    loop = TrainLoop(accelerator, plan, loader, schedule, run, LoopPolicy(SavePolicy(log_every=1)))
    item_mean = GlobalItemMean(accelerator, plan)
    for _epoch in loop.epochs():
        for x, y, mask in loop.batches():
            with accelerator.accumulate(model):
                squared_error = (model(x).squeeze(-1) - y) ** 2 * mask
                if args.naive_mean:
                    accelerator.backward(squared_error.sum() / mask.sum())
                else:
                    accelerator.backward(item_mean.loss(squared_error.sum(), mask.sum()))
                    item_mean.normalize_gradients(model)
                loop.clip_gradients(model)
                optimizer.step()
                optimizer.zero_grad()
            loop.record(squared_error.sum() / mask.sum())
        loop.end_epoch({})
    loop.finish(model)


if __name__ == "__main__":
    main()
