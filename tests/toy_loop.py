"""The recipes' loop, for the toy runs of tests/scripts (dropout streams, BatchNorm, a tied GPT)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator

from accel_common.training.loop import TrainLoop


def train_toy(
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loop: TrainLoop,
    loss_of: Callable[[torch.nn.Module, Any], torch.Tensor],
    stop_after: int = 0,
) -> None:
    """Every epoch's batches, `loss_of(model, batch)` each, then the export; with `stop_after`,
    the run ends in the micro-batch after that step's save, as a kill there would end it."""
    for _epoch in loop.epochs():
        for batch in loop.batches():
            with accelerator.accumulate(model):
                loss = loss_of(model, batch)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            loop.record(loss)
            if stop_after and loop.step == stop_after:
                return  # nothing more is written
        loop.end_epoch({})
    loop.finish(model)
