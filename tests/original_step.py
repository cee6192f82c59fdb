"""One training step of a recipe held against its original's (issue 49): the preset's settings,
the LR of the first optimizer step as the run's schedule sets it, and the comparison with a
fixture of the original's step (`loss`, `grad/<parameter>`, `after/<state-dict key>`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import torch
from safetensors.torch import load_file

from accel_common.lr import make_lr_schedule
from accel_common.options import SharedSettings
from accel_common.settings import read_config_file


def preset(train: Callable[..., Any], config: Path, **overrides: Any) -> tuple[SharedSettings, Any]:
    """The (SharedSettings, recipe settings) that `--config config` with `overrides` gives."""
    names = [f.name for f in (*fields(train.settings_class), *fields(SharedSettings))]
    return train.resolve(**(read_config_file(config, names) | overrides))


def first_step_lr(args: SharedSettings, optimizer: torch.optim.Optimizer, steps: int) -> None:
    """Set the optimizer's LR to the first step's, as the run's make_lr_schedule does (an epoch
    of `steps` optimizer steps on one process; the accelerator only registers the scheduler)."""
    plan = args.batch_request.plan(1, warn_small=False)
    make_lr_schedule(
        Mock(), optimizer, plan, args.lr_settings,
        steps_per_epoch=steps * plan.grad_accum_steps, epochs=args.epochs,
    )  # fmt: skip


def step_differences(
    fixture: Path, loss: torch.Tensor, model: torch.nn.Module, rename: Callable[[str], str] = str
) -> dict[str, float]:
    """The largest difference to the original's step, relative to each tensor's largest entry,
    for the loss, the gradients and the weights and buffers after the step. Every gradient and
    state-dict entry of the fixture must be the model's (`rename`: the model's key to the
    original's), none missing, none extra."""
    expected = load_file(str(fixture))
    grads = {rename(k): p.grad for k, p in model.named_parameters() if p.grad is not None}
    state = {rename(k): v for k, v in model.state_dict().items()}
    ours = {"loss": loss.detach().reshape(1)} | {f"grad/{k}": v for k, v in grads.items()}
    ours |= {f"after/{k}": v for k, v in state.items()}
    assert set(ours) == set(expected), sorted(set(ours) ^ set(expected))[:5]

    def relative(a: torch.Tensor, b: torch.Tensor) -> float:
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        if not a.is_floating_point():
            return float(not torch.equal(a, b))
        scale = b.double().abs().max().clamp_min(1e-30)
        return ((a.double() - b.double()).abs().max() / scale).item()

    worst: dict[str, float] = {}
    for key, value in ours.items():
        group = key.split("/")[0]
        worst[group] = max(worst.get(group, 0.0), relative(value, expected[key]))
    return worst
