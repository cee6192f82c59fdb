"""fp16's dynamic loss scaler through TrainLoop: an overflow is a skipped step that leaves the
weights unchanged, and the scale and the skipped count survive a resume.

One check, two devices. On a GPU it runs Accelerate's real fp16 path (autocast and the scaler
Accelerate builds from GradScalerKwargs). On the CPU, Accelerate creates no scaler for fp16 (and
the recipes refuse fp16 there), so torch's CPU GradScaler is attached where Accelerate keeps its
own; backward, the optimizer step, the skip detection and save/load then run through
Accelerate's and the loop's code as on a GPU, in fp32.

The initial scale is 2**8, not Accelerate's 2**16 nor the 2**15 this check had: on CUDA the
toy's linear layer runs in fp16 under autocast, and its gradients (up to 4.08 at the initial
weights on this data, measured in fp32) times the scale overflow fp16's 65504 from a scale of
~2**14 on. At 2**15 a step with such a batch overflowed of itself, so the skipped steps were not
the injected one alone (the likely cause of the GPU failure; the CPU stand-in computes in fp32
and never overflows). The scale grows 4 times in 16 steps (growth_interval 3, one halving), so
gradients meet at most 2**11 here: 8x below overflow.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate.state import AcceleratorState
from accelerate.utils import GradScalerKwargs
from torch import nn
from torch.utils.data import TensorDataset

from accel_common.batch_lr.batching import BatchRequest
from accel_common.batch_lr.lr import Decay, LRSettings, make_lr_schedule
from accel_common.checkpoints.checkpoint import list_checkpoints
from accel_common.checkpoints.export import read_export_metadata
from accel_common.data.loaders import make_train_loader
from accel_common.hardware.accelerator import make_accelerator
from accel_common.training.loop import TrainLoop
from accel_common.training.policy import EarlyStopping, LoopPolicy, SavePolicy
from accel_common.training.run import Run, RunConfig, StartRequest
from tests.results import exported_params, max_relative_difference

INIT_SCALE, GROWTH_INTERVAL = 2.0**8, 3
Trace = list[tuple[int, bool, float]]  # (optimizer step, weights unchanged, scale after it)


def scaled_run(
    out: Path,
    *,
    gpu: bool,
    resume: str | None = None,
    inject_at: int | None = None,
    best_epoch: int | None = None,
) -> tuple[TrainLoop, Trace]:
    """Train a toy model for 2 epochs of 8 steps with a loss scaler; at optimizer step
    `inject_at` the loss is multiplied by inf (a test-only overflow). With `best_epoch`, the loop
    monitors a val_mae that is lowest at that epoch (its export is the run's). Returns (loop,
    [(step, weights unchanged, scale after the step)])."""
    AcceleratorState._reset_state(reset_partial_state=True)
    scaler = GradScalerKwargs(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    accelerator, plan = make_accelerator(
        output_dir=out,
        batch=BatchRequest(per_device_batch_size=4),
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
        accelerator, optimizer, plan, LRSettings(1e-2, ref_bs=4, decay=Decay.constant),
        steps_per_epoch=len(loader), epochs=2,
    )  # fmt: skip
    monitor = "val_mae" if best_epoch else None
    run = Run.open(
        accelerator, plan, schedule, RunConfig("toy", {}), output_dir=out,
        start=StartRequest(resume), monitored=bool(monitor),
    )  # fmt: skip
    policy = LoopPolicy(SavePolicy(100, 5, 10), early_stopping=EarlyStopping(monitor))
    loop = TrainLoop(accelerator, plan, loader, schedule, run, policy)
    trace = []
    for epoch in loop.epochs():
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
        if best_epoch:
            loop.end_epoch({"val_mae": 1.0 if epoch == best_epoch else 2.0}, model)
        else:
            loop.end_epoch({})
    loop.finish(model)
    AcceleratorState._reset_state(reset_partial_state=True)
    return loop, trace


def check_overflow_is_skipped_and_resumes(
    tmp_path: Path, *, gpu: bool, record: Callable[..., None] | None = None
) -> dict[str, float]:
    """The assertions; returns the scales seen, for the GPU suite's record. `record` receives
    the whole trace before anything is asserted, so a failure on the GPU tells which steps were
    skipped at which scales (an overflow of the toy itself, or the injected one not seen)."""
    loop, trace = scaled_run(tmp_path / "full", gpu=gpu, inject_at=4)
    shown = "trace (step, unchanged, scale after): " + repr(trace)
    if record is not None:
        record(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, trace=trace)
    skipped = [t for t in trace if t[1]]
    assert [step for step, *_ in skipped] == [4], shown  # that step, and only it, changed nothing
    scales = {step: scale for step, _, scale in trace}
    assert scales[4] == scales[3] / 2, shown  # the scale halves on the overflow ...
    assert scales[7] == scales[4] * 2, shown  # ... and grows back after growth_interval steps
    assert loop.progress.skipped_steps == 1 and loop.metrics["skipped_steps"] == 1, shown
    final = exported_params(tmp_path / "full")

    # resumed from the step-5 checkpoint: scale and skipped count come back exactly
    partial = tmp_path / "part"
    shutil.copytree(tmp_path / "full", partial)
    shutil.rmtree(partial / "model")
    for later in (c for c in list_checkpoints(partial) if c.name != "step_5"):
        shutil.rmtree(later)
    loop, resumed = scaled_run(partial, gpu=gpu, resume="latest", inject_at=4)
    assert resumed[0][0] == 6 and resumed[0][2] == scales[6], f"{shown}; resumed: {resumed}"
    assert loop.progress.skipped_steps == 1
    difference = max_relative_difference(final, exported_params(partial))
    assert difference == 0
    return {"scale_before": scales[3], "scale_at_overflow": scales[4], "resume_difference": 0.0}


def check_a_best_epoch_export_counts_skipped_steps(tmp_path: Path, *, gpu: bool) -> None:
    """A run that exports its best epoch (early stopping's monitor) records the run's skipped
    steps in the export, as a run that exports its last step does."""
    scaled_run(tmp_path / "best", gpu=gpu, inject_at=4, best_epoch=1)
    metadata = read_export_metadata(tmp_path / "best" / "model")
    assert metadata["metrics"]["best_epoch"] == 1
    assert metadata["metrics"]["skipped_steps"] == 1, metadata["metrics"]
