"""A toy run whose early stopping is decided on the main process's metric alone.

tests/training/test_loop.py runs it as 1 and as 2 processes (gloo). Every epoch each rank reports
its own `val_mae`: rank 0 a value that stops improving after epoch 1, any other rank one that always
improves, so a rank deciding for itself would stop at another epoch (or never) and wait alone in
the next collective. With --patience 1 --min-epochs 3 the run must stop after epoch 4 on every
rank; each rank writes the epochs it ran, its optimizer steps and LR at each step to
OUT/rank_R.json. Usage: early_stopping_check.py OUT EPOCHS PATIENCE MIN_EPOCHS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from accel_common.batch_lr.batching import BatchRequest
from accel_common.batch_lr.lr import Decay, LRSettings, make_lr_schedule
from accel_common.data.loaders import make_train_loader
from accel_common.hardware.accelerator import make_accelerator
from accel_common.training.loop import TrainLoop
from accel_common.training.policy import EarlyStopping, LoopPolicy
from accel_common.training.run import Run, RunConfig

out, epochs, patience, min_epochs = Path(sys.argv[1]), *map(int, sys.argv[2:5])
accelerator, plan = make_accelerator(output_dir=out, batch=BatchRequest(8), cpu=True)
torch.manual_seed(0)
x = torch.randn(64, 3)
data = TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5]]))
model = nn.Linear(3, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
loader = make_train_loader(data, plan.per_device_batch_size)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
schedule = make_lr_schedule(
    accelerator, optimizer, plan,
    LRSettings(0.05, ref_bs=8, decay=Decay.cosine, hold_epochs=2, decay_per_epoch=True),
    steps_per_epoch=len(loader), epochs=epochs,
)  # fmt: skip
run = Run.open(
    accelerator, plan, schedule, RunConfig("toy", {"lr": 0.05}), output_dir=out, monitored=True
)
stopping = EarlyStopping("val_mae", patience=patience, min_epochs=min_epochs)
loop = TrainLoop(accelerator, plan, loader, schedule, run, LoopPolicy(early_stopping=stopping))
ran, lrs = [], []
for epoch in loop.epochs():
    for xb, yb in loop.batches():
        lrs.append(optimizer.param_groups[0]["lr"])
        with accelerator.accumulate(model):
            loss = (model(xb) - yb).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        loop.record(loss)
    ran.append(epoch)
    own = 1.0 + (epoch > 1) * epoch if accelerator.is_main_process else 1.0 / epoch
    loop.end_epoch({"val_mae": own}, model)
loop.finish(model)
report = {"epochs": ran, "step": loop.step, "lrs": lrs, "best": loop.progress.best}
(out / f"rank_{accelerator.process_index}.json").write_text(json.dumps(report))
