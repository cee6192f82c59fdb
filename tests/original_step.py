"""One training step of a recipe held against its original's (issue 49): the preset's settings,
the LR of the first optimizer step as the run's schedule sets it, and the comparison with a
fixture of the original's step (`loss`, `grad/<parameter>`, `after/<state-dict key>`)."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import torch
from safetensors.torch import load_file

from accel_common.batch_lr.lr import make_lr_schedule
from accel_common.recipe_cli.options import SharedSettings
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


# a tensor with more entries is kept at this many, so that a large network's step fits a small file
SAMPLE = 2048


def sampled(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (of parameter or buffer `name`), or SAMPLE of its entries, at positions drawn
    from a generator seeded by the crc32 of `name`: the same for its gradient and its value."""
    if tensor.numel() <= SAMPLE:
        return tensor
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    index = torch.randperm(tensor.numel(), generator=generator)[:SAMPLE].sort().values
    return tensor.reshape(-1)[index]


# a gradient below this fraction of the model's largest entry is taken for rounding noise
NOISE = 1e-4


def step_tensors(
    loss: torch.Tensor, model: torch.nn.Module, sample: bool = False
) -> dict[str, torch.Tensor]:
    """A model's step in the fixtures' layout: `loss`, `grad/<parameter>`, `after/<key>`, each
    `sampled` if `sample`."""
    keep = sampled if sample else lambda _name, tensor: tensor
    ours = {"loss": loss.detach().reshape(1)}
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    ours |= {f"grad/{k}": keep(k, g) for k, g in grads.items()}
    return ours | {f"after/{k}": keep(k, v) for k, v in model.state_dict().items()}


def differences(
    ours: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], lr: float
) -> dict[str, float]:
    """How far `ours` is from `expected` (both in the fixtures' layout), by kind, each on the
    scale at which float order shows: the loss relative to itself; the gradients relative to
    the largest gradient entry of the model (a gradient that is 0 but for rounding, a
    BatchNorm bias before another BatchNorm, is noise on its own scale); the weights after the
    step in units of `lr`, apart for those whose gradient is noise (below NOISE x the largest:
    Adam's first step moves any weight by lr x sign(gradient), so these may land up to 2 lr
    apart); what has no gradient (buffers) relative to its own largest entry, integers
    exactly. Every key of one must be the other's."""
    assert set(ours) == set(expected), sorted(set(ours) ^ set(expected))[:5]
    scale = max(v.abs().max().item() for k, v in expected.items() if k.startswith("grad/"))
    worst = dict.fromkeys(("loss", "grad", "weights", "noise_weights", "buffers"), 0.0)
    for key, want in expected.items():
        have = ours[key]
        assert have.shape == want.shape and have.dtype == want.dtype, (key, have, want)
        if not want.is_floating_point():
            kind, error = "buffers", float(not torch.equal(have, want))
        else:
            gap = (have.double() - want.double()).abs().max().item()
            name = key.partition("/")[2]
            if key == "loss":
                kind, error = "loss", gap / abs(want.item())
            elif key.startswith("grad/"):
                kind, error = "grad", gap / scale
            elif f"grad/{name}" in expected:
                noise = expected[f"grad/{name}"].abs() < NOISE * scale
                gaps = (have.double() - want.double()).abs() / lr
                error = gaps[noise].max().item() if noise.any() else 0.0
                worst["noise_weights"] = max(worst["noise_weights"], error)
                kind, error = "weights", gaps[~noise].max().item() if not noise.all() else 0.0
            else:
                kind, error = "buffers", gap / max(want.abs().max().item(), 1e-30)
        worst[kind] = max(worst[kind], error)
    return worst


def step_differences(
    fixtures: list[Path],
    loss: torch.Tensor,
    model: torch.nn.Module,
    lr: float,
    untrained: tuple[str, ...] = (),
    apart: tuple[str, ...] = (),
    sample: bool = False,
) -> dict[str, float]:
    """`differences` of the model's step to the original's in `fixtures`. `untrained`: parameters
    the recipe leaves untrained on purpose; the original's gradient for them must be 0 (so the
    steps still agree), and it is left out; `apart`: the recipe's parameters that the original's
    model lacks, left out. `sample`: the fixtures hold large tensors `sampled`."""
    expected: dict[str, torch.Tensor] = {}
    for path in fixtures:
        expected |= load_file(str(path))
    for name in untrained:
        assert not expected.pop(f"grad/{name}").any(), name
    ours = step_tensors(loss, model, sample)
    for name in apart:
        ours.pop(f"grad/{name}", None)
        ours.pop(f"after/{name}")
    return differences(ours, expected, lr)
