"""A short run of tests/tied_model.py's TiedGPT through the library (Run, TrainLoop): a save
every step, the export at the end; stopped after a step and resumed in the tests.

tests/checkpoints/test_tied.py runs it on 2 processes (gloo), plain or under FSDP (the FSDP_ON_CPU
shim). Usage: tied_gpt.py OUT STOP_AFTER(0 = run to the end) RESUME(0|1)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from accel_common.batch_lr.batching import BatchRequest
from accel_common.batch_lr.lr import Decay, LRSettings, make_lr_schedule
from accel_common.data.loaders import make_train_loader
from accel_common.hardware.accelerator import make_accelerator
from accel_common.training.loop import TrainLoop
from accel_common.training.policy import LoopPolicy, SavePolicy
from accel_common.training.run import Run, RunConfig, StartRequest
from tests.tied_model import CONTEXT, VOCAB, TiedGPT
from tests.toy_loop import train_toy

out, stop_after, resume = Path(sys.argv[1]), *map(int, sys.argv[2:4])
accelerator, plan = make_accelerator(
    output_dir=out, batch=BatchRequest(global_batch_size=8), seed=3
)
tokens = torch.randint(0, VOCAB, (32, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
model = TiedGPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
loader = make_train_loader(data, plan.per_device_batch_size, seed=3)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
schedule = make_lr_schedule(
    accelerator, optimizer, plan, LRSettings(1e-2, ref_bs=8, decay=Decay.constant),
    steps_per_epoch=len(loader), epochs=1,
)  # fmt: skip
config = RunConfig("tied", {"seed": 3})
start = StartRequest(resume="latest" if resume else None)
run = Run.open(accelerator, plan, schedule, config, output_dir=out, start=start)
loop = TrainLoop(accelerator, plan, loader, schedule, run, LoopPolicy(SavePolicy(1, 1, 10)))


def loss_of(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten())


train_toy(accelerator, model, optimizer, loop, loss_of, stop_after)  # the export: OUT/model
