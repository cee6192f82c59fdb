"""fp16's dynamic loss scaler through TrainLoop: an overflow is a skipped step that leaves the
weights unchanged, and the scale and the skipped count survive a resume.

One check, two devices. On a GPU it runs Accelerate's real fp16 path (autocast and the scaler
Accelerate builds from GradScalerKwargs). On the CPU, Accelerate creates no scaler for fp16 (and
the recipes refuse fp16 there), so torch's CPU GradScaler is attached where Accelerate keeps its
own; backward, the optimizer step, the skip detection and save/load then run through
Accelerate's and the loop's code as on a GPU, in fp32.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from accelerate.state import AcceleratorState
from accelerate.utils import GradScalerKwargs
from torch import nn
from torch.utils.data import TensorDataset

from accel_common.checkpoint import list_checkpoints
from accel_common.loop import TrainLoop
from accel_common.lr import Decay, make_lr_schedule
from accel_common.runtime import make_accelerator, make_train_loader
from tests.conftest import exported_params, max_relative_difference

INIT_SCALE, GROWTH_INTERVAL = 2.0**15, 3


def scaled_run(out: Path, *, gpu: bool, resume: str | None = None, inject_at: int | None = None):
    """Train a toy model for 16 steps with a loss scaler; at optimizer step `inject_at` the loss
    is multiplied by inf (a test-only overflow). Returns (loop, [(step, weights unchanged,
    scale after the step)])."""
    AcceleratorState._reset_state(reset_partial_state=True)
    scaler = GradScalerKwargs(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    accelerator, plan = make_accelerator(
        output_dir=out,
        per_device_batch_size=4,
        cpu=not gpu,
        mixed_precision="fp16" if gpu else None,
        kwargs_handlers=[scaler],
    )
    if not gpu:
        accelerator.scaler = torch.amp.GradScaler(
            "cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL
        )
    assert accelerator.scaler is not None
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    data = TensorDataset(torch.randn(32, 3), torch.randn(32, 1))
    loader = make_train_loader(data, plan.per_device_batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    schedule = make_lr_schedule(
        accelerator, optimizer, plan, steps_per_epoch=len(loader), epochs=2, lr=1e-2,
        ref_bs=4, decay=Decay.constant,
    )  # fmt: skip
    loop = TrainLoop(
        accelerator, plan, loader, schedule, recipe="toy", config={}, output_dir=out,
        resume=resume, log_every=100, save_every=5, keep_last=10,
    )  # fmt: skip
    trace = []
    for _epoch in loop.epochs():
        for x, y in loop.batches():
            before = [p.detach().clone() for p in model.parameters()]
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                if loop.step + 1 == inject_at:
                    loss = loss * torch.tensor(float("inf"), device=loss.device)  # test only
                accelerator.backward(loss)
                loop.clip_gradients(model)
                optimizer.step()
                optimizer.zero_grad()
            unchanged = all((a == b).all() for a, b in zip(before, model.parameters(), strict=True))
            trace.append((loop.step + 1, unchanged, accelerator.scaler.get_scale()))
            # a real fp16 overflow is in the gradients, the fp32 loss stays finite; the loop
            # would (rightly) stop a run whose recorded loss is inf
            loop.record(loss.detach() if loop.step + 1 != inject_at else torch.zeros_like(loss))
        loop.end_epoch({})
    loop.finish(model)
    AcceleratorState._reset_state(reset_partial_state=True)
    return loop, trace


def check_overflow_is_skipped_and_resumes(tmp_path: Path, *, gpu: bool) -> dict[str, float]:
    """The assertions; returns the scales seen, for the GPU suite's record."""
    loop, trace = scaled_run(tmp_path / "full", gpu=gpu, inject_at=4)
    skipped = [t for t in trace if t[1]]
    assert [step for step, *_ in skipped] == [4]  # that step, and only it, changed nothing
    scales = {step: scale for step, _, scale in trace}
    assert scales[4] == scales[3] / 2  # the scale halves on the overflow ...
    assert scales[7] == scales[4] * 2  # ... and grows back after growth_interval clean steps
    assert loop.progress.skipped_steps == 1 and loop.metrics["skipped_steps"] == 1
    final = exported_params(tmp_path / "full")

    # resumed from the step-5 checkpoint: scale and skipped count come back exactly
    partial = tmp_path / "part"
    shutil.copytree(tmp_path / "full", partial)
    shutil.rmtree(partial / "model")
    for later in (c for c in list_checkpoints(partial) if c.name != "step_5"):
        shutil.rmtree(later)
    loop, trace = scaled_run(partial, gpu=gpu, resume="latest", inject_at=4)
    assert trace[0][0] == 6 and trace[0][2] == scales[6]
    assert loop.progress.skipped_steps == 1
    difference = max_relative_difference(final, exported_params(partial))
    assert difference == 0
    return {"scale_before": scales[3], "scale_at_overflow": scales[4], "resume_difference": 0.0}
