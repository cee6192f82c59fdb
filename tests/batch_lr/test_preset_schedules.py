"""Every preset of an original (recipes/*/configs/*.yaml) schedules the LR as the original's own
torch scheduler does: at every optimizer step of a run of the preset's settings, the LR of the
recipe's scheduler (make_lr_schedule, from the preset as its recipe resolves it) equals the LR of
the original's scheduler, built with the original's arguments and stepped where its trainer steps
it (after each iteration or each epoch), and so does the optimizer's beta1 (which OneCycleLR
cycles; the others leave it). Each at two sizes: an epoch's optimizer steps on one GPU and on 8
(the global batch 8 x larger), since a schedule that counts epochs must follow the run's own.
Bound: 1e-12 relative (both compute in float64; torch's chainable forms and the recipe's closed
forms round differently).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, fields

import pytest
import torch
from accelerate.state import AcceleratorState
from torch.optim import Adam, AdamW, Optimizer
from torch.optim.lr_scheduler import (
    CosineAnnealingLR,
    ExponentialLR,
    LinearLR,
    OneCycleLR,
    SequentialLR,
)

from accel_common.recipe_cli.options import SharedSettings
from accel_common.settings import read_config_file
from tests.processes import REPO

PRESETS = sorted(REPO.glob("recipes/*/configs/*.yaml"))


def lrs_used(
    optimizer: Optimizer,
    epochs: int,
    per_epoch: int,
    after_iteration: Callable[[], object] = lambda: None,
    after_epoch: Callable[[int], object] = lambda epoch: None,
) -> list[tuple[float, float]]:
    """The LR and beta1 each iteration of a training loop runs at, the scheduler stepped by the
    hooks."""
    used = []
    for epoch in range(epochs):
        for _ in range(per_epoch):
            used.append((optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["betas"][0]))
            optimizer.step()  # no gradient: only the order torch expects
            after_iteration()
        after_epoch(epoch)
    return used


def parameter() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(1))]


def crowd_bt(lr: float, epochs: int, per_epoch: int) -> list[tuple[float, float]]:
    """hituldesai03/crowd-bt @b3412bd train.py: AdamW (408-412), CosineAnnealingLR(T_max=epochs,
    eta_min=lr x 0.01) (415-419), stepped once after each epoch (494)."""
    optimizer = AdamW(parameter(), lr=lr, weight_decay=1e-5)
    scheduler = CosineAnnealingLR(optimizer, T_max=epochs, eta_min=lr * 0.01)
    return lrs_used(optimizer, epochs, per_epoch, after_epoch=lambda _: scheduler.step())


def comformer(lr: float, epochs: int, per_epoch: int) -> list[tuple[float, float]]:
    """jwchen25/comformer @7241ae8 comformer/train.py: AdamW (121-128), OneCycleLR(max_lr=lr,
    epochs, steps_per_epoch=len(train_loader), pct_start=0.3) at torch's other defaults, its
    cycle_momentum included (278-287), stepped by ignite on every ITERATION_COMPLETED (309-311) of
    trainer.run(train_loader, max_epochs=epochs) (478)."""
    optimizer = AdamW(parameter(), lr=lr, weight_decay=1e-5)
    scheduler = OneCycleLR(
        optimizer, max_lr=lr, epochs=epochs, steps_per_epoch=per_epoch, pct_start=0.3
    )
    return lrs_used(optimizer, epochs, per_epoch, after_iteration=scheduler.step)


def pcdiff(lr: float, epochs: int, per_epoch: int) -> list[tuple[float, float]]:
    """DimensionLab/pcdiff-implant @115a399 pcdiff/train_completion.py: Adam at lr x bs /
    lr_base_batch (1549-1570), ExponentialLR(gamma=--lr_gamma 1) (1584) after
    LinearLR(start_factor=--lr_warmup_start_factor 0.01, total_iters=--lr_warmup_epochs 500) in
    a SequentialLR (1586-1597), stepped once after each epoch (1778)."""
    optimizer = Adam(parameter(), lr=lr, betas=(0.5, 0.999))
    main = ExponentialLR(optimizer, 1.0)
    warmup = LinearLR(optimizer, start_factor=0.01, end_factor=1.0, total_iters=500)
    scheduler = SequentialLR(optimizer, schedulers=[warmup, main], milestones=[500])
    return lrs_used(optimizer, epochs, per_epoch, after_epoch=lambda _: scheduler.step())


def cricketmodel(lr: float, epochs: int, per_epoch: int) -> list[tuple[float, float]]:
    """lyndonkl/cricketmodel @a97d68e src/training/trainer.py: AdamW (173-178),
    CosineAnnealingLR(T_max=epochs - warmup_epochs) (181-185; warmup_epochs 5, line 41),
    stepped after each epoch from `epoch >= warmup_epochs` on (422-427)."""
    optimizer = AdamW(parameter(), lr=lr, weight_decay=0.01)
    scheduler = CosineAnnealingLR(optimizer, T_max=epochs - 5)

    def after_epoch(epoch: int) -> None:
        if epoch >= 5:
            scheduler.step()

    return lrs_used(optimizer, epochs, per_epoch, after_epoch=after_epoch)


@dataclass(frozen=True)
class Original:
    """An original's schedule (`lrs(lr, epochs, steps per epoch)`, the LR and beta1 of each
    iteration) and the short runs compared: `per_epoch`, an epoch's optimizer steps on one GPU
    and on 8, and `epochs` (0: the preset's)."""

    lrs: Callable[[float, int, int], list[tuple[float, float]]]
    per_epoch: tuple[int, int] = (24, 3)
    epochs: int = 0


ORIGINALS = {
    "quality": Original(crowd_bt),
    "crystal": Original(comformer),
    # The preset's 500 warmup epochs are 28000 steps on SkullBreak's training split
    # (pcdiff/datasets/SkullBreak/train.csv: 455 samples, --bs 8, drop_last: 56 per epoch) and
    # 3500 on 8 GPUs (--bs 64: 7); 510 epochs climb the whole staircase and hold the peak.
    "pointcloud": Original(pcdiff, per_epoch=(455 // 8, 455 // 64), epochs=510),
    "cricket": Original(cricketmodel),
}


def recipe_lrs(
    preset, epochs: int, per_epoch: int
) -> tuple[list[tuple[float, float]], SharedSettings]:
    """The LR and beta1 at each optimizer step of the preset's recipe, resolved as `--config
    preset` and scheduled by make_lr_schedule on an AdamW (beta1 0.9 unless the schedule sets
    it), stepped once per optimizer step as the loop does."""
    recipe = preset.parent.parent.name
    train = importlib.import_module(f"recipes.train_{recipe}").train
    names = [f.name for f in (*fields(SharedSettings), *fields(train.settings_class))]
    values = read_config_file(preset, names)
    if epochs:
        values["epochs"] = epochs
    args, _ = train.resolve(**values)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator, plan = args.make_accelerator()
        optimizer = AdamW(parameter(), lr=1.0)
        schedule = args.make_lr_schedule(accelerator, optimizer, plan, per_epoch)
        used = []
        for _ in range(schedule.total_steps):
            used.append((optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["betas"][0]))
            optimizer.step()
            schedule.scheduler.step()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    return used, args


def test_every_recipe_with_a_preset_has_its_originals_schedule_here():
    assert PRESETS, "no presets found under recipes/*/configs"
    assert {preset.parent.parent.name for preset in PRESETS} == set(ORIGINALS)


@pytest.mark.parametrize("gpus", [1, 8])
@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_the_presets_lr_is_the_originals_at_every_optimizer_step(
    preset, gpus, tmp_path, monkeypatch
):
    """The LR and beta1 of every optimizer step, with an epoch's steps as on 1 GPU or on 8 (the
    schedule's shape depends on the steps per epoch only; the peak at another batch is
    --lr-scaling's, tested in test_lr)."""
    monkeypatch.chdir(tmp_path)  # the accelerator's output folder, if any, lands here
    original = ORIGINALS[preset.parent.parent.name]
    per_epoch = original.per_epoch[gpus > 1]
    used, args = recipe_lrs(preset, original.epochs, per_epoch)
    assert args.bs == args.ref_bs  # at the original's batch: the peak is its lr
    expected = original.lrs(args.lr, args.epochs, per_epoch)
    assert len(used) == len(expected) == args.epochs * per_epoch
    lrs, beta1s = zip(*used, strict=True)
    original_lrs, original_beta1s = zip(*expected, strict=True)
    assert lrs == pytest.approx(original_lrs, rel=1e-12, abs=0)
    assert len(set(original_lrs)) > 2  # the schedule moves in the run compared
    if len(set(original_beta1s)) > 1:  # OneCycleLR's cycle_momentum
        assert beta1s == pytest.approx(original_beta1s, rel=1e-12, abs=0)
    else:  # the original keeps its beta1: so does the recipe
        assert set(beta1s) == {0.9}
