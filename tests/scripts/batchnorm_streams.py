"""A small CNN with BatchNorm2d, trained with or without --sync-batchnorm's conversion.

tests/test_distributed.py runs it on 1 and 2 processes (gloo) at one global batch; the export
is in OUT/model. Usage: batchnorm_streams.py OUT SYNC(0|1)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from accel_common.batch_lr.batching import BatchRequest
from accel_common.batch_lr.batchnorm import sync_batchnorm
from accel_common.batch_lr.lr import Decay, LRSettings, make_lr_schedule
from accel_common.data.loaders import make_train_loader
from accel_common.hardware.accelerator import make_accelerator
from accel_common.training.loop import TrainLoop
from accel_common.training.policy import LoopPolicy
from accel_common.training.run import Run, RunConfig
from tests.toy_loop import train_toy

out, sync = Path(sys.argv[1]), bool(int(sys.argv[2]))
accelerator, plan = make_accelerator(output_dir=out, batch=BatchRequest(global_batch_size=8))
generator = torch.Generator().manual_seed(0)
images = torch.randn(64, 2, 6, 6, generator=generator) * 2 + 1
data = TensorDataset(images, images.mean(dim=(1, 2, 3)).unsqueeze(1))
model = nn.Sequential(
    nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 1)
)
if sync:
    sync_batchnorm(model, accelerator.device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
loader = make_train_loader(data, plan.per_device_batch_size)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
schedule = make_lr_schedule(
    accelerator, optimizer, plan, LRSettings(0.05, ref_bs=8, decay=Decay.constant),
    steps_per_epoch=len(loader), epochs=1,
)  # fmt: skip
run = Run.open(accelerator, plan, schedule, RunConfig("toy", {"sync": sync}), output_dir=out)
loop = TrainLoop(accelerator, plan, loader, schedule, run, LoopPolicy())
train_toy(accelerator, model, optimizer, loop, lambda m, b: (m(b[0]) - b[1]).pow(2).mean())
