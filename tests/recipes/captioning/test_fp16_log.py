"""fp16's logged numbers: `train/loss_scale` on every logging step and `train/skipped_steps`, as
the captioning recipe's loop writes them to metrics.jsonl.

Accelerate creates no loss scaler on a CPU, so torch's CPU GradScaler is attached where
Accelerate's fp16 path keeps its own (before `prepare`, which hands it to the optimizer); the
loop and the trackers then read it as they do on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from torch import nn
from torch.utils.data import TensorDataset

from accel_common.batch_lr.batching import BatchRequest
from accel_common.batch_lr.lr import Decay, LRSettings, make_lr_schedule
from accel_common.data.loaders import make_train_loader
from accel_common.hardware.accelerator import make_accelerator
from accel_common.training.loop import TrainLoop
from accel_common.training.policy import LoopPolicy, SavePolicy
from accel_common.training.run import Run, RunConfig
from tests.results import metrics_log


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def train_with_an_overflow(out: Path, overflow_at: int) -> dict[str, float]:
    """8 optimizer steps of a linear model, logging every 2nd; `overflow_at` has an inf gradient."""
    accelerator, plan = make_accelerator(
        output_dir=out, batch=BatchRequest(per_device_batch_size=4), cpu=True
    )
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    loader = make_train_loader(TensorDataset(torch.randn(32, 3), torch.randn(32, 1)), 4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    schedule = make_lr_schedule(
        accelerator, optimizer, plan, LRSettings(1e-2, ref_bs=4, decay=Decay.constant),
        steps_per_epoch=len(loader), epochs=1,
    )  # fmt: skip
    run = Run.open(accelerator, plan, schedule, RunConfig("toy", {}), output_dir=out)
    loop = TrainLoop(accelerator, plan, loader, schedule, run, LoopPolicy(SavePolicy(log_every=2)))
    for _epoch in loop.epochs():
        for x, y in loop.batches():
            overflow = loop.step + 1 == overflow_at
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss * torch.tensor(float("inf")) if overflow else loss)
                loop.clip_gradients(model)
                optimizer.step()
                optimizer.zero_grad()
            loop.record(loss.detach())  # a real fp16 overflow is in the gradients only
        loop.end_epoch({})
    return loop.finish(model)


def test_fp16_logs_the_loss_scale_and_the_skipped_steps_on_every_logging_step(tmp_path):
    metrics = train_with_an_overflow(tmp_path, overflow_at=3)
    logged: dict[int, dict] = {}
    for record in metrics_log(tmp_path):
        if any(key.startswith("train/") for key in record):
            logged.setdefault(record["step"], {}).update(record)
    scales = {step: r["train/loss_scale"] for step, r in logged.items()}
    skipped = {step: r["train/skipped_steps"] for step, r in logged.items()}
    # growth interval 3: halved by the overflow at step 3, doubled after clean steps 4, 5, 6
    assert scales == {2: 2.0**10, 4: 2.0**9, 6: 2.0**10, 8: 2.0**10}
    assert skipped == {2: 0, 4: 1, 6: 1, 8: 1}
    assert metrics["skipped_steps"] == 1
