"""--schedule linear: after the warm-up (and hold), a line from the peak to the floor
(--min-lr-ratio) at the decay's horizon (--decay-steps, else the run's last step), then held;
the horizon, hold, floor and --decay-per-epoch handled as cosine's, so the two differ only in
the curve. With --warmup-style hf it is transformers' and diffusers' get_scheduler("linear")
step for step (tests/batch_lr/test_warmup_style.py, against both libraries)."""

import io
import itertools
import math

import pytest
import torch

from accel_common.batch_lr.lr import Decay, LRSettings, Schedule, build_scheduler
from accel_common.recipe_cli.options import SharedSettings
from tests.batch_lr.test_lr import recipe_lrs, torch_lrs

PER_EPOCH, EPOCHS = 12, 5  # 60 optimizer steps on one process
TOTAL = PER_EPOCH * EPOCHS


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # recipe_lrs builds a run's accelerator


def hf_linear(warmup: int, horizon: int) -> list[float]:
    """transformers' get_scheduler("linear") to 0 at `horizon`, stepped once per optimizer step
    for TOTAL steps (past its horizon it stays at 0: max(0, ...))."""
    optimization = pytest.importorskip("transformers").optimization
    return torch_lrs(
        lambda optimizer: optimization.get_scheduler(
            "linear", optimizer, num_warmup_steps=warmup, num_training_steps=horizon
        ),
        TOTAL,
    )


def ours(**flags) -> list[float]:
    return recipe_lrs(None, flags, PER_EPOCH, EPOCHS)


def test_the_flag_reads_and_the_lr_line_names_the_line_and_its_floor():
    assert SharedSettings.from_config({"schedule": "linear"}).schedule is Decay.linear
    settings = LRSettings(1e-3, 32, decay=Decay.linear, min_lr_ratio=0.1, decay_steps=500)
    assert settings.describe(32).endswith(
        "then linear to 0.0001 (0.1 x peak) at step 500, then held"
    )


@pytest.mark.parametrize("warmup", [7, 20])
def test_the_floor_is_a_line_from_the_peak_to_min_lr_ratio(warmup):
    """--min-lr-ratio m: m + (1 - m) x HF's line, the same arithmetic, so equal (==); the last
    step is one step above the floor, as HF's is one step above 0."""
    floor = 0.1
    line = hf_linear(warmup, TOTAL)
    used = ours(schedule="linear", warmup_steps=warmup, warmup_style="hf", min_lr_ratio=floor)
    assert used[warmup:] == [floor + (1.0 - floor) * x for x in line[warmup:]]
    assert used[warmup] == 1.0
    assert all(a > b > floor for a, b in itertools.pairwise(used[warmup:]))
    assert Schedule(TOTAL, warmup, Decay.linear, min_lr_ratio=floor).multiplier(TOTAL) == floor


def test_decay_steps_end_the_line_there_then_hold_the_floor():
    """--decay-steps T: the line reaches the floor at step T and holds it, as cosine's; at floor 0
    it is HF's linear with num_training_steps=T (which stays at 0 after it), bit for bit."""
    flags = {"schedule": "linear", "warmup_steps": 10, "warmup_style": "hf", "decay_steps": 40}
    assert ours(**flags) == hf_linear(10, 40)
    held = ours(**flags, min_lr_ratio=0.2)
    assert held[40:] == [0.2] * (TOTAL - 40) and held[39] > 0.2
    cosine = ours(**flags | {"schedule": "cosine"}, min_lr_ratio=0.2)
    assert cosine[40:] == held[40:]


def test_hold_then_linear_per_epoch_is_torchs_linear_lr_stepped_after_each_epoch():
    """--hold-epochs 1 --decay-per-epoch: the peak for the hold, then one value per epoch, as
    torch's LinearLR(1 -> m over the decay's epochs) stepped after each epoch from the hold's end
    (torch's chained form rounds apart: within 1e-12)."""
    floor, hold = 0.1, 1
    lower = torch.optim.lr_scheduler
    decay = torch_lrs(
        lambda o: lower.LinearLR(o, start_factor=1.0, end_factor=floor, total_iters=EPOCHS - hold),
        TOTAL - hold * PER_EPOCH,
        PER_EPOCH,
    )
    expected = [1.0] * hold * PER_EPOCH + decay
    flags = {"schedule": "linear", "hold_epochs": hold, "decay_per_epoch": True}
    used = ours(**flags, min_lr_ratio=floor)
    assert used == pytest.approx(expected, rel=1e-12)
    assert used[: (hold + 1) * PER_EPOCH] == [1.0] * (hold + 1) * PER_EPOCH  # held, then 1 - 0
    assert len(set(used)) == EPOCHS - hold  # one value per epoch of decay, the first the peak
    assert used[-1] == pytest.approx(floor + (1 - floor) / (EPOCHS - hold))


@pytest.mark.parametrize(
    "flags",
    [
        {"warmup_steps": 10},
        {"warmup_steps": 7, "warmup_style": "hf", "min_lr_ratio": 0.05},
        {"warmup_steps": 5, "hold_epochs": 1, "decay_steps": 50, "min_lr_ratio": 0.1},
        {"warmup_epochs": 1, "warmup_start": 0.1, "decay_per_epoch": True, "hold_epochs": 1},
    ],
)
def test_linear_and_cosine_differ_in_the_curve_only(flags):
    """The same warm-up and hold, the decay starting and ending (reaching the floor) at the same
    steps and changing at the same steps; at each step the cosine is at the line's fraction of
    the way down."""
    line, cosine = ours(schedule="linear", **flags), ours(schedule="cosine", **flags)
    start = line.index(1.0)
    decay_start = max(k for k, lr in enumerate(cosine) if lr == 1.0) + 1
    assert line[:decay_start] == cosine[:decay_start] and start == cosine.index(1.0)
    assert line[decay_start - 1] == 1.0 > line[decay_start]

    def changes(values):
        return [k for k in range(1, TOTAL) if values[k] != values[k - 1]]

    assert changes(line) == changes(cosine)
    floor = flags.get("min_lr_ratio", 0.0)
    assert [lr == floor for lr in line] == [lr == pytest.approx(floor, abs=1e-15) for lr in cosine]
    progress = [1.0 - (lr - floor) / (1.0 - floor) for lr in line]  # the line's own fraction
    shaped = [floor + (1.0 - floor) * (1.0 + math.cos(math.pi * p)) / 2.0 for p in progress]
    assert cosine[decay_start:] == pytest.approx(shaped[decay_start:], rel=1e-12, abs=1e-15)


def test_a_linear_scheduler_resumed_from_its_state_continues_bit_equal():
    """A checkpoint holds LambdaLR's numbers only: a fresh scheduler loaded with them (weights
    only) goes on at the LRs of an unbroken run."""
    schedule = Schedule(total_steps=40, warmup_steps=6, decay=Decay.linear, min_lr_ratio=0.1)

    def run(steps, state=None):
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=2e-3)
        scheduler = build_scheduler(optimizer, schedule)
        if state is not None:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            buffer.seek(0)
            state = torch.load(buffer, weights_only=True)
            optimizer.load_state_dict(state[0])
            scheduler.load_state_dict(state[1])
        used = []
        for _ in range(steps):
            used.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return used, (optimizer.state_dict(), scheduler.state_dict())

    unbroken, _ = run(40)
    first, state = run(17)
    assert first + run(23, state)[0] == unbroken
