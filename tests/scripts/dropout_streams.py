"""A toy run with dropout and an augmentation drawn from the global RNG in the loader (as
torchvision's random transforms draw): which masks each process draws, where a resumed run ends.

tests/test_distributed.py runs it on 2 processes (gloo). Each rank writes the hash of every
dropout mask it drew, every augmentation draw and its final weights to OUT/rank_R.json. Usage:
dropout_streams.py OUT ONE_STREAM(0|1) STOP_AFTER(0 = run to the end) RESUME(0|1)
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from accel_common.batch_lr.batching import BatchRequest
from accel_common.batch_lr.lr import Decay, LRSettings, make_lr_schedule
from accel_common.data.loaders import make_train_loader
from accel_common.hardware.accelerator import make_accelerator
from accel_common.training.loop import TrainLoop
from accel_common.training.policy import LoopPolicy, SavePolicy
from accel_common.training.run import Run, RunConfig, StartRequest
from tests.toy_loop import train_toy

out, one_stream, stop_after, resume = Path(sys.argv[1]), *map(int, sys.argv[2:5])
accelerator, plan = make_accelerator(
    output_dir=out, batch=BatchRequest(global_batch_size=8), cpu=True, seed=3
)
draws: list[float] = []


class Jittered(Dataset):
    """64 points with their sum as target, jittered by the global RNG at every read."""

    def __init__(self) -> None:
        self.x = torch.linspace(-1, 1, 64 * 4).reshape(64, 4)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        jitter = 0.1 * torch.randn(4)
        draws.append(round(float(jitter[0]), 6))
        return self.x[index] + jitter, self.x[index].sum(dim=0, keepdim=True)


data = Jittered()
model = nn.Sequential(nn.Linear(4, 32), nn.Dropout(0.5), nn.Linear(32, 1))
masks: list[str] = []
model[1].register_forward_hook(
    lambda _m, _i, output: masks.append(hashlib.sha256((output != 0).numpy().tobytes()).hexdigest())
)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
loader = make_train_loader(data, plan.per_device_batch_size, seed=3)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
schedule = make_lr_schedule(
    accelerator, optimizer, plan, LRSettings(0.05, ref_bs=8, decay=Decay.constant),
    steps_per_epoch=len(loader), epochs=1,
)  # fmt: skip
config = RunConfig("toy", {"seed": 3, "one_rng_stream": bool(one_stream)})
start = StartRequest(resume="latest" if resume else None)
run = Run.open(accelerator, plan, schedule, config, output_dir=out, start=start)
loop = TrainLoop(accelerator, plan, loader, schedule, run, LoopPolicy(SavePolicy(1, 2, 10)))
train_toy(
    accelerator, model, optimizer, loop, lambda m, b: (m(b[0]) - b[1]).pow(2).mean(), stop_after
)
weights = [p.detach().flatten().tolist() for p in accelerator.unwrap_model(model).parameters()]
record = {"masks": masks, "draws": draws, "weights": weights, "step": loop.step}
(out / f"rank_{accelerator.process_index}.json").write_text(json.dumps(record))
