"""--warmup-style: the default (one-step-ahead) is the schedule as it always was, bit for bit;
hf is transformers' and diffusers' get_scheduler step for step (the HF Trainer's warm-up), for
every schedule that has a warm-up; and the setting is part of the run's identity."""

import itertools

import pytest
import torch

from accel_common.batch_lr.lr import Decay, LRSettings, Schedule
from accel_common.batch_lr.warmup import WarmupStyle
from accel_common.errors import ConfigError
from accel_common.recipe_cli.options import SharedSettings
from tests.batch_lr.test_lr import recipe_lrs, torch_lrs

PER_EPOCH, EPOCHS = 12, 5  # 60 optimizer steps on one process
TOTAL = PER_EPOCH * EPOCHS
WARMUPS = (7, 20)


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # as test_lr's tests that build a run's accelerator


def hf_lrs(library: str, name: str, warmup: int) -> list[float]:
    """The LR at each of TOTAL optimizer steps of `library`'s get_scheduler(name), stepped once
    per optimizer step as the HF Trainer and the diffusers scripts step it."""
    optimization = pytest.importorskip(library).optimization
    return torch_lrs(
        lambda optimizer: optimization.get_scheduler(
            name, optimizer, num_warmup_steps=warmup, num_training_steps=TOTAL
        ),
        TOTAL,
    )


def ours(warmup: int, **flags) -> list[float]:
    """Our LR at each step from the flags (--schedule ...) with --warmup-style hf, as a run
    builds it (SharedSettings, make_lr_schedule)."""
    return recipe_lrs(
        None,
        {"warmup_steps": warmup, "warmup_style": "hf", **flags},
        PER_EPOCH,
        EPOCHS,
    )


@pytest.mark.parametrize("library", ["transformers", "diffusers"])
@pytest.mark.parametrize("warmup", WARMUPS)
@pytest.mark.parametrize(
    ("hf_name", "schedule"),
    [("linear", "linear"), ("cosine", "cosine"), ("constant_with_warmup", "constant")],
)
def test_hf_style_is_hfs_get_scheduler_at_every_step(library, warmup, hf_name, schedule):
    """linear (the HF Trainer's default), cosine and constant-with-warm-up: equal (==, not close)
    at every optimizer step, warm-up and decay; step 0 trains at LR 0. linear's line is HF's
    (T - k) / (T - W), the same integers divided, so no rounding parts them."""
    expected = hf_lrs(library, hf_name, warmup)
    used = ours(warmup, schedule=schedule)
    assert used == expected
    assert used[0] == 0.0 and used[warmup - 1] < 1.0 == used[warmup]


@pytest.mark.parametrize("warmup", WARMUPS)
def test_hf_style_is_hfs_cosine_with_min_lr(warmup):
    """--min-lr-ratio m is transformers' cosine_with_min_lr(min_lr_rate=m), bit for bit."""
    optimization = pytest.importorskip("transformers").optimization
    expected = torch_lrs(
        lambda optimizer: optimization.get_scheduler(
            "cosine_with_min_lr",
            optimizer,
            num_warmup_steps=warmup,
            num_training_steps=TOTAL,
            scheduler_specific_kwargs={"min_lr_rate": 0.1},
        ),
        TOTAL,
    )
    assert ours(warmup, schedule="cosine", min_lr_ratio=0.1) == expected


@pytest.mark.parametrize("warmup", WARMUPS)
@pytest.mark.parametrize(
    "flags",
    [
        {"schedule": "linear"},
        {"schedule": "cosine"},
        {"schedule": "constant"},
        {"schedule": "exponential", "gamma": 0.9},
        {"schedule": "step", "step_size": 5, "gamma": 0.5},
        {"schedule": "multistep", "milestones": "5,20", "gamma": 0.5},
    ],
)
def test_every_schedules_hf_warmup_is_hfs_linear_warmup(warmup, flags):
    """HF's linear: its warm-up (steps 0 to W, the peak at W) is every schedule's with
    --warmup-style hf; its decay, linear to 0 at the last step, is --schedule linear's, so
    that one is HF's over the whole run, and the others part after step W."""
    expected = hf_lrs("transformers", "linear", warmup)
    used = ours(warmup, **flags)
    assert used[: warmup + 1] == expected[: warmup + 1]
    if flags["schedule"] == "linear":
        assert used == expected
    else:
        assert used[warmup + 2] != expected[warmup + 2]


@pytest.mark.parametrize(("warmup", "start"), [(10, 0.0), (10, 0.1), (7, 0.01)])
def test_the_default_is_the_warmup_as_it_always_was_bit_for_bit(warmup, start):
    """One step ahead: step k at s + (1 - s)(k + 1)/W, the expression of 0.3.0, whether the
    style is left out or named."""
    for decay in (Decay.cosine, Decay.constant, Decay.exponential):
        shape = {"total_steps": 40, "warmup_steps": warmup, "decay": decay, "gamma": 0.9}
        shape |= {"warmup_start": start, "min_lr_ratio": 0.1}
        default = Schedule(**shape)
        named = Schedule(**shape, warmup_style=WarmupStyle.one_step_ahead)
        formula = [start + (1.0 - start) * (k + 1) / warmup for k in range(warmup)]
        assert [default.multiplier(k) for k in range(warmup)] == formula
        assert [named.multiplier(k) for k in range(40)] == [
            default.multiplier(k) for k in range(40)
        ]
    assert SharedSettings().warmup_style is WarmupStyle.one_step_ahead
    assert LRSettings(1e-3, 8, warmup_steps=5).warmup_style is WarmupStyle.one_step_ahead


def test_hf_style_from_a_start_factor_is_torchs_linear_lr_stepped_from_step_0():
    start, warmup = 0.01, 40
    schedule = Schedule(
        total_steps=60,
        warmup_steps=warmup,
        decay=Decay.constant,
        warmup_start=start,
        warmup_style=WarmupStyle.hf,
    )
    expected = torch_lrs(
        lambda optimizer: torch.optim.lr_scheduler.LinearLR(
            optimizer, start_factor=start, total_iters=warmup
        ),
        60,
    )
    assert [schedule.multiplier(k) for k in range(60)] == pytest.approx(expected, rel=1e-12)
    assert schedule.multiplier(0) == start


def test_per_epoch_the_styles_are_one():
    """--decay-per-epoch: epoch e already trains at e epochs' rise in either style."""
    shape = {"total_steps": 50, "warmup_steps": 20, "decay_every": 5, "warmup_start": 0.1}
    styles = [Schedule(**shape, warmup_style=style) for style in WarmupStyle]
    for a, b in itertools.pairwise(styles):
        assert [a.multiplier(k) for k in range(50)] == [b.multiplier(k) for k in range(50)]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"decay": Decay.onecycle}, "--schedule onecycle takes no --warmup-style hf"),
        ({}, "--warmup-style hf shapes the warm-up, and there is none"),
    ],
)
def test_hf_style_where_it_cannot_apply_is_refused_naming_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message):
        LRSettings(1e-3, 8, warmup_style=WarmupStyle.hf, **flags)


def test_the_style_is_part_of_the_runs_identity_and_its_lr_line():
    """Not adjustable: a resume with the other style is refused as any schedule change; a
    checkpoint saved before the setting existed compares as the default (unchanged)."""
    assert "warmup_style" not in SharedSettings.adjustable()
    assert SharedSettings.default_config()["warmup_style"] == "one-step-ahead"
    args = SharedSettings.from_config({"warmup_steps": 10, "warmup_style": "hf"})
    assert args.as_config()["warmup_style"] == "hf"
    assert args.lr_settings.warmup_style is WarmupStyle.hf
    line = args.lr_settings.describe(32)
    assert "10 warmup steps (hf style: step 0 at its start" in line
    assert "hf style" not in SharedSettings(warmup_steps=10).lr_settings.describe(32)
