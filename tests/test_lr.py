import itertools
import math

import pytest
import torch

from accel_common.errors import ConfigError
from accel_common.lr import Decay, LRScaling, Schedule, build_scheduler, scale_lr


def test_scaling_rules_match_the_guides_table():
    assert scale_lr(2e-4, 8, 64, LRScaling.linear) == pytest.approx(1.6e-3)
    assert scale_lr(2e-4, 8, 64, LRScaling.sqrt) == pytest.approx(2e-4 * math.sqrt(8))
    assert scale_lr(2e-4, 8, 64, LRScaling.none) == 2e-4


@pytest.mark.parametrize("lr", [0.0, -1e-3, float("nan")])
def test_non_positive_lr_refused(lr):
    with pytest.raises(ConfigError, match="--lr must be a positive number"):
        scale_lr(lr, 8, 8, LRScaling.linear)


def test_warmup_then_cosine_to_floor():
    schedule = Schedule(total_steps=110, warmup_steps=10, decay=Decay.cosine, min_lr_ratio=0.1)
    values = [schedule.multiplier(s) for s in range(110)]
    assert values[0] == pytest.approx(0.1)
    assert values[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(values[10:]))
    assert values[60] == pytest.approx(0.1 + 0.9 * 0.5)
    assert schedule.multiplier(110) == pytest.approx(0.1)


def test_warmup_from_a_start_factor_follows_torchs_linear_lr():
    """pcdiff warms up with LinearLR(start_factor=0.01): the schedule rises from that fraction
    along LinearLR's line (one step ahead: step k uses LinearLR's factor after k + 1 steps, so no
    step runs at the bare start factor; 0.01 + 0.99 / W instead), then stays at the peak."""
    warmup, start = 40, 0.01
    schedule = Schedule(
        total_steps=60, warmup_steps=warmup, decay=Decay.constant, warmup_start=start
    )
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    linear = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=start, total_iters=warmup)
    reference = []
    for _ in range(60):
        linear.step()
        reference.append(optimizer.param_groups[0]["lr"])
    assert [schedule.multiplier(s) for s in range(60)] == pytest.approx(reference)
    assert schedule.multiplier(0) == pytest.approx(start + (1 - start) / warmup)


def test_exponential_and_constant():
    exp = Schedule(total_steps=100, warmup_steps=2, decay=Decay.exponential, gamma=0.9)
    assert exp.multiplier(2) == 1.0
    assert exp.multiplier(4) == pytest.approx(0.81)
    const = Schedule(total_steps=10, decay=Decay.constant)
    assert {const.multiplier(s) for s in range(10)} == {1.0}


def test_onecycle_rises_then_anneals():
    sched = Schedule(total_steps=100, decay=Decay.onecycle)
    values = [sched.multiplier(s) for s in range(100)]
    assert values[0] == pytest.approx(0.04 + 0.96 / 30)
    assert all(a < b for a, b in itertools.pairwise(values[:30]))  # 30% of the run rising
    assert values[29] == pytest.approx(1.0) == max(values)
    assert values[-1] < 0.01


def test_scheduler_counts_optimizer_steps():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.5)
    schedule = Schedule(total_steps=20, warmup_steps=4, decay=Decay.cosine)
    scheduler = build_scheduler(optimizer, schedule)
    seen = []
    for _ in range(20):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.5 * schedule.multiplier(s) for s in range(20)])
    assert "lr_lambdas" in scheduler.state_dict()  # numbers only; no function is pickled
    assert scheduler.state_dict()["lr_lambdas"] == [None]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"total_steps": 0},
        {"total_steps": 5, "warmup_steps": 6},
        {"total_steps": 5, "gamma": 0},
        {"total_steps": 5, "warmup_start": 1.5},
    ],
)
def test_bad_schedules_refused(kwargs):
    with pytest.raises(ConfigError):
        Schedule(**kwargs)


def test_hold_then_cosine_per_epoch_is_torchs_cosine_stepped_after_each_epoch():
    """cricketmodel's schedule (trainer.py): CosineAnnealingLR(T_max = epochs - 5), stepped after
    each epoch from the 5th on; here 12 epochs of 7 optimizer steps, held for 5."""
    epochs, per_epoch, hold = 12, 7, 5
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs - hold)
    expected = []
    for epoch in range(epochs):
        expected += [optimizer.param_groups[0]["lr"]] * per_epoch
        optimizer.step()  # no gradient: only the order torch expects
        if epoch >= hold:
            cosine.step()
    schedule = Schedule(
        total_steps=epochs * per_epoch, decay=Decay.cosine, hold_steps=hold * per_epoch,
        decay_every=per_epoch,
    )  # fmt: skip
    values = [schedule.multiplier(s) for s in range(epochs * per_epoch)]
    assert values == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert values[: (hold + 1) * per_epoch] == [1.0] * (hold + 1) * per_epoch  # held, then cos(0)
    assert values[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 6 / 7)))  # epoch 12: 6/7


def test_per_epoch_warmup_is_pcdiffs_linear_lr_stepped_after_each_epoch():
    """pcdiff's schedule (train_completion.py): LinearLR(start_factor=0.01, total_iters=W
    epochs), then ExponentialLR(gamma=1), stepped once per epoch: a staircase. With
    `decay_every` one epoch's steps the warmup climbs it exactly; here 9 epochs of 5 steps, W 4."""
    epochs, per_epoch, warmup_epochs, start = 9, 5, 4, 0.01
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    linear = torch.optim.lr_scheduler.LinearLR(
        optimizer, start_factor=start, total_iters=warmup_epochs
    )
    constant = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=1.0)
    sequential = torch.optim.lr_scheduler.SequentialLR(
        optimizer, [linear, constant], milestones=[warmup_epochs]
    )
    expected = []
    for _ in range(epochs):
        expected += [optimizer.param_groups[0]["lr"]] * per_epoch
        optimizer.step()  # no gradient: only the order torch expects
        sequential.step()
    schedule = Schedule(
        total_steps=epochs * per_epoch, warmup_steps=warmup_epochs * per_epoch,
        decay=Decay.constant, decay_every=per_epoch, warmup_start=start,
    )  # fmt: skip
    values = [schedule.multiplier(s) for s in range(epochs * per_epoch)]
    assert values == pytest.approx(expected, rel=1e-12)
    assert values[:per_epoch] == [start] * per_epoch  # the first epoch at the start factor
    assert values[warmup_epochs * per_epoch :] == [1.0] * (epochs - warmup_epochs) * per_epoch


def test_hold_after_warmup_and_per_step_decay():
    schedule = Schedule(total_steps=30, warmup_steps=4, decay=Decay.cosine, hold_steps=6)
    values = [schedule.multiplier(s) for s in range(30)]
    assert values[3] == 1.0 and values[4:10] == [1.0] * 6
    assert values[15] == pytest.approx(0.5 * (1 + math.cos(math.pi * 5 / 20)))
    assert all(a > b for a, b in itertools.pairwise(values[10:]))  # every step lower


def test_a_hold_longer_than_the_run_is_refused():
    with pytest.raises(ConfigError, match="--hold-epochs"):
        Schedule(total_steps=10, warmup_steps=4, hold_steps=7)
