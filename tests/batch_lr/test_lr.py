import itertools
import math
import re

import pytest
import torch
from accelerate.state import AcceleratorState

from accel_common.batch_lr.lr import (
    Decay,
    LRScaling,
    LRSettings,
    Schedule,
    build_scheduler,
    scale_lr,
)
from accel_common.batch_lr.onecycle import OneCycle
from accel_common.errors import ConfigError
from accel_common.recipe_cli.options import SharedSettings


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


def recipe_lrs(tmp_path, flags: dict, steps_per_epoch: int, epochs: int) -> list[float]:
    """The LR a recipe's optimizer uses at each optimizer step, from its flags as SharedSettings
    reads them (--schedule, --gamma, --step-size, --milestones, --decay-per-epoch), stepped by
    the loop's rule: once per optimizer step."""
    AcceleratorState._reset_state(reset_partial_state=True)
    args = SharedSettings.from_config({"lr": 1.0, "ref_bs": 2, "bs": 2, "epochs": epochs, **flags})
    args.validate()
    accelerator, plan = args.make_accelerator()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = args.make_lr_schedule(accelerator, optimizer, plan, steps_per_epoch)
    used = []
    for _ in range(schedule.total_steps):
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.scheduler.step()
    AcceleratorState._reset_state(reset_partial_state=True)
    return used


def torch_lrs(make, steps: int, every: int = 1) -> list[float]:
    """torch's scheduler `make(optimizer)`'s LR, stepped after every `every` optimizer steps."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = make(optimizer)
    used = []
    for step in range(steps):
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        if (step + 1) % every == 0:
            scheduler.step()
    return used


@pytest.mark.parametrize("per_epoch", [False, True])
def test_step_and_multistep_are_torchs_steplr_and_multisteplr(tmp_path, monkeypatch, per_epoch):
    """The classic ImageNet example's StepLR(step_size, gamma=0.1) and a MultiStepLR, stepped
    after every optimizer step, or after every epoch with --decay-per-epoch (the step size and
    milestones then count epochs): the recipe's LR equals torch's at every step."""
    monkeypatch.chdir(tmp_path)
    per, epochs = 4, 12
    every = per if per_epoch else 1
    lower = torch.optim.lr_scheduler
    flags = {"schedule": "step", "gamma": 0.1, "step_size": 3, "decay_per_epoch": per_epoch}
    expected = torch_lrs(lambda o: lower.StepLR(o, step_size=3, gamma=0.1), per * epochs, every)
    assert recipe_lrs(tmp_path, flags, per, epochs) == pytest.approx(expected, rel=1e-12)
    assert len(set(expected)) > 3  # it decays more than once
    flags = {"schedule": "multistep", "gamma": 0.5, "milestones": "2,5,9"} | {
        "decay_per_epoch": per_epoch
    }
    expected = torch_lrs(lambda o: lower.MultiStepLR(o, [2, 5, 9], gamma=0.5), per * epochs, every)
    assert recipe_lrs(tmp_path, flags, per, epochs) == pytest.approx(expected, rel=1e-12)
    assert len(set(expected)) == 4


def test_decay_steps_end_the_cosine_there_as_nanogpts_lr_decay_iters():
    """nanoGPT's get_lr: cosine from the warmup's end to lr_decay_iters, then min_lr held; the
    run may be longer or shorter than the horizon."""
    warmup, horizon, floor = 10, 60, 0.1
    schedule = Schedule(
        total_steps=100, warmup_steps=warmup, decay=Decay.cosine, min_lr_ratio=floor,
        decay_steps=horizon,
    )  # fmt: skip
    for step in range(warmup, 100):
        ratio = min(1.0, (step - warmup) / (horizon - warmup))
        expected = floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1 - floor)
        assert schedule.multiplier(step) == pytest.approx(expected)
    assert schedule.multiplier(99) == schedule.multiplier(60) == pytest.approx(floor)
    shorter = Schedule(total_steps=30, warmup_steps=warmup, decay=Decay.cosine, decay_steps=horizon)
    assert shorter.multiplier(29) == pytest.approx(0.5 * (1 + math.cos(math.pi * 19 / 50)))
    exp = Schedule(total_steps=50, decay=Decay.exponential, gamma=0.9, decay_steps=20)
    assert exp.multiplier(30) == exp.multiplier(20) == pytest.approx(0.9**20)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"schedule": "step"}, "--schedule step needs --step-size N"),
        ({"schedule": "multistep"}, "--schedule multistep needs --milestones"),
        ({"schedule": "multistep", "milestones": "5,3"}, "--milestones 5,3: give increasing"),
        ({"schedule": "multistep", "milestones": "a"}, "--milestones a: give increasing"),
        ({"schedule": "step", "step_size": 2, "decay_steps": 9}, "--decay-steps 9 ends a"),
        ({"step_size": 30}, "--step-size shapes another schedule than --schedule cosine"),
        ({"schedule": "step", "step_size": 3, "milestones": "5"}, "--milestones shapes another"),
    ],
)
def test_a_schedule_missing_its_shape_is_refused_naming_the_flag(flags, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        SharedSettings.from_config(flags).validate()


def test_decay_steps_before_the_decay_starts_is_refused():
    with pytest.raises(ConfigError, match=r"^--decay-steps 5: the decay ends at that"):
        Schedule(total_steps=20, warmup_steps=5, decay=Decay.cosine, decay_steps=5)


@pytest.mark.parametrize(
    ("settings", "ends"),
    [
        (LRSettings(1e-3, 32, decay=Decay.cosine, min_lr_ratio=0.1), "then cosine to 0.0001 "
         "(0.1 x peak) at the last step"),
        (LRSettings(1e-3, 32, decay=Decay.cosine, decay_steps=500, warmup_steps=5,
                    warmup_start=0.01), "5 warmup steps from 0.01 x peak, then cosine to 0 "
         "(0 x peak) at step 500, then held"),
        (LRSettings(1e-3, 32, decay=Decay.step, gamma=0.1, step_size=30, decay_per_epoch=True),
         "then step per epoch, x 0.1 every 30 epochs"),
        (LRSettings(1e-3, 32, decay=Decay.multistep, gamma=0.5, milestones=(100, 200)),
         "then multistep, x 0.5 at steps 100, 200 after the warmup"),
        (LRSettings(1e-3, 32, decay=Decay.exponential, gamma=0.99),
         "then exponential, x 0.99 per step until the last step"),
    ],
)  # fmt: skip
def test_the_lr_line_names_the_decay_and_its_floor(settings, ends):
    assert settings.describe(32).endswith(ends), settings.describe(32)


@pytest.mark.parametrize(
    ("flags", "torch_args"),
    [
        ({}, {}),  # torch's defaults: cosine, pct_start 0.3, div 25, final div 1e4
        ({"anneal": "linear", "pct_start": 0.25}, {"anneal_strategy": "linear", "pct_start": 0.25}),
        ({"div_factor": 10.0, "final_div_factor": 100.0, "pct_start": 0.5},
         {"div_factor": 10.0, "final_div_factor": 100.0, "pct_start": 0.5}),
    ],
)  # fmt: skip
def test_onecycle_is_torchs_onecyclelr_stepped_per_optimizer_step(tmp_path, monkeypatch, flags,
                                                                  torch_args):  # fmt: skip
    """--schedule onecycle's LR at every optimizer step is OneCycleLR's over the same steps
    (epochs x steps per epoch), stepped after each: step 0 at peak / div_factor, rising along its
    anneal over pct_start of the steps, down to peak / div_factor / final_div_factor at the last.
    The bound: both round differently near the floor (1e-15 of the peak)."""
    monkeypatch.chdir(tmp_path)
    per, epochs = 7, 5
    lower = torch.optim.lr_scheduler

    def onecycle(optimizer):
        return lower.OneCycleLR(
            optimizer, max_lr=1.0, epochs=epochs, steps_per_epoch=per, cycle_momentum=False,
            **torch_args,
        )  # fmt: skip

    expected = torch_lrs(onecycle, per * epochs)
    used = recipe_lrs(tmp_path, {"schedule": "onecycle", **flags}, per, epochs)
    assert used == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert used[0] == pytest.approx(1.0 / torch_args.get("div_factor", 25.0))  # no step ahead
    floor = 1.0 / torch_args.get("div_factor", 25.0) / torch_args.get("final_div_factor", 1e4)
    assert used[-1] == pytest.approx(floor, rel=1e-9)  # its floor at the last step


def test_onecycle_decay_steps_end_the_cycle_there_then_hold_its_floor():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    cycle = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=1.0, total_steps=30, cycle_momentum=False
    )
    expected = []
    for _ in range(30):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        cycle.step()
    schedule = Schedule(total_steps=50, decay=Decay.onecycle, decay_steps=30)
    values = [schedule.multiplier(s) for s in range(50)]
    assert values[:30] == pytest.approx(expected, rel=1e-12)
    assert values[30:] == [1 / 25 / 1e4] * 20


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"schedule": "onecycle", "warmup_steps": 100}, "--schedule onecycle takes no "
         "--warmup-steps 100: it rises over --pct-start of the run"),
        ({"schedule": "onecycle", "min_lr_ratio": 0.01}, "--schedule onecycle takes no "
         "--min-lr-ratio 0.01:"),
        ({"schedule": "onecycle", "decay_per_epoch": True}, "--schedule onecycle takes no "
         "--decay-per-epoch:"),
        ({"schedule": "onecycle", "hold_epochs": 2}, "--schedule onecycle takes no --hold-epo"),
        ({"pct_start": 0.25}, "--pct-start shapes another schedule than --schedule cosine: "
         "drop it, or choose --schedule onecycle"),
        ({"schedule": "step", "step_size": 3, "anneal": "linear"}, "--anneal shapes another"),
        ({"schedule": "exponential", "div_factor": 10.0}, "--div-factor shapes another"),
    ],
)  # fmt: skip
def test_onecycles_shape_flags_go_with_onecycle_only(flags, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}") as refused:
        SharedSettings.from_config(flags).validate()
    assert len(str(refused.value).splitlines()) == 1


def test_the_lr_line_names_onecycles_shape():
    settings = LRSettings(1e-3, 64, decay=Decay.onecycle)
    assert settings.describe(64) == (
        "peak 0.001 (--lr 0.001 at --ref-bs 64, linear scaling to global batch 64); onecycle "
        "from 4e-05 (peak / 25) up along a cosine over the first 30% of the steps, then down "
        "to 4e-09 (peak / 25 / 10000) at the last step"
    )
    cycled = LRSettings(1e-3, 64, decay=Decay.onecycle, onecycle=OneCycle(cycle_momentum=True))
    assert cycled.describe(64).endswith(
        "(peak / 25 / 10000) at the last step; momentum (Adam's beta1) from 0.95 down to 0.85 "
        "at the peak LR and back"
    )


def test_a_onecycle_scheduler_resumed_from_its_state_continues_bit_equal():
    """A checkpoint holds LambdaLR's numbers only (no function): a fresh scheduler of the same
    schedule, loaded with them and the optimizer's state, goes on at the LRs of an unbroken run."""
    schedule = Schedule(total_steps=40, decay=Decay.onecycle, cycle=OneCycle(0.25, 10.0, 100.0))

    def run(steps, state=None):
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=2e-3)
        scheduler = build_scheduler(optimizer, schedule)
        if state is not None:
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
    assert state[1]["lr_lambdas"] == [None]
    assert first + run(23, state)[0] == unbroken


def test_warmup_epochs_count_the_runs_own_steps_per_epoch(tmp_path, monkeypatch):
    """--warmup-epochs 4 is pcdiff's LinearLR(total_iters=4) stepped per epoch whatever an epoch's
    optimizer steps (5 on one process, 2 on more, or with accumulation): the same epochs rise,
    where --warmup-steps would fix one size's count."""
    monkeypatch.chdir(tmp_path)
    lower = torch.optim.lr_scheduler

    def pcdiff(optimizer):
        linear = lower.LinearLR(optimizer, start_factor=0.01, total_iters=4)
        constant = lower.ExponentialLR(optimizer, gamma=1.0)
        return lower.SequentialLR(optimizer, [linear, constant], milestones=[4])

    flags = {"warmup_epochs": 4, "warmup_start": 0.01, "decay_per_epoch": True}
    for per in (5, 2):
        expected = torch_lrs(pcdiff, per * 7, every=per)
        used = recipe_lrs(tmp_path, {"schedule": "constant", **flags}, per, 7)
        assert used == pytest.approx(expected, rel=1e-12)
        assert used[4 * per - 1] < 1.0 == used[4 * per]  # the peak from the 5th epoch on


def test_warmup_epochs_name_their_steps_once_the_data_is_read():
    settings = LRSettings(1e-3, 8, decay=Decay.constant, warmup_epochs=500, warmup_start=0.01)
    assert settings.run_warmup(10**6) is None  # a dry run: the data's steps per epoch unknown
    assert settings.run_warmup(500) == 500  # --max-steps 500: warming up throughout
    assert settings.run_warmup(10**6, steps_per_epoch=7) == 3500
    assert settings.run_warmup(10**6, steps_per_epoch=56, grad_accum_steps=2) == 14000
    assert settings.run_warmup(100, steps_per_epoch=56) == 100  # cut to the run's length
    assert settings.describe(8).endswith(
        "; 500 warmup epochs (x the data's optimizer steps per epoch) from 0.01 x peak, then "
        "constant"
    )
    assert settings.describe(8, 3500).endswith(
        "; 500 warmup epochs (3500 optimizer steps) from 0.01 x peak, then constant"
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"warmup_steps": 100, "warmup_epochs": 5}, "--warmup-steps 100 and --warmup-epochs 5 "
         "both set the warmup's length: give one (--warmup-epochs 0 to count steps, or "
         "--warmup-steps 0 to count epochs"),
        ({"schedule": "onecycle", "warmup_epochs": 5}, "--schedule onecycle takes no "
         "--warmup-epochs 5:"),
        ({"cycle_momentum": True}, "--cycle-momentum shapes another schedule than --schedule "
         "cosine: drop it, or choose --schedule onecycle"),
        ({"schedule": "onecycle", "base_momentum": 0.8}, "--base-momentum 0.8 is a bound of the "
         "momentum that --cycle-momentum cycles: add --cycle-momentum, or drop it"),
        ({"schedule": "onecycle", "cycle_momentum": True, "max_momentum": 1.0},
         "--max-momentum must be in [0, 1), got 1"),
    ],
)  # fmt: skip
def test_warmup_and_momentum_flags_that_do_not_go_together_are_refused(flags, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}") as refused:
        SharedSettings.from_config(flags).validate()
    assert len(str(refused.value).splitlines()) == 1


def momentum_of(optimizer: torch.optim.Optimizer) -> float:
    group = optimizer.param_groups[0]
    return group["betas"][0] if "betas" in group else group["momentum"]


@pytest.mark.parametrize(
    ("make", "flags"),
    [
        (lambda p: torch.optim.AdamW(p, lr=1.0), {}),  # ComFormer's: torch's defaults
        (lambda p: torch.optim.SGD(p, lr=1.0, momentum=0.9),
         {"base_momentum": 0.8, "max_momentum": 0.9, "anneal": "linear", "pct_start": 0.4}),
    ],
)  # fmt: skip
def test_cycle_momentum_is_onecyclelrs_at_every_optimizer_step(tmp_path, monkeypatch, make,
                                                              flags):  # fmt: skip
    """--cycle-momentum sets Adam's beta1 (SGD's momentum) at every optimizer step as OneCycleLR's
    cycle_momentum does on a twin optimizer: from --max-momentum down to --base-momentum at the
    peak LR and back, beta2 untouched."""
    monkeypatch.chdir(tmp_path)
    per, epochs = 7, 5
    twin = make([torch.nn.Parameter(torch.zeros(1))])
    torch_args = {"anneal_strategy": flags.get("anneal", "cos"), "pct_start": 0.3} | {
        k: v for k, v in flags.items() if k != "anneal"
    }
    cycle = torch.optim.lr_scheduler.OneCycleLR(
        twin, max_lr=1.0, epochs=epochs, steps_per_epoch=per, **torch_args
    )
    AcceleratorState._reset_state(reset_partial_state=True)
    args = SharedSettings.from_config(
        {"lr": 1.0, "ref_bs": 2, "bs": 2, "epochs": epochs, "schedule": "onecycle"}
        | {"cycle_momentum": True, **flags}
    )
    args.validate()
    accelerator, plan = args.make_accelerator()
    optimizer = make([torch.nn.Parameter(torch.zeros(1))])
    schedule = args.make_lr_schedule(accelerator, optimizer, plan, per)
    AcceleratorState._reset_state(reset_partial_state=True)
    used, expected = [], []
    for _ in range(per * epochs):
        used.append((optimizer.param_groups[0]["lr"], momentum_of(optimizer)))
        expected.append((twin.param_groups[0]["lr"], momentum_of(twin)))
        for o in (optimizer, twin):
            o.step()
        schedule.scheduler.step()
        cycle.step()
    for (lr, momentum), (torch_lr, torch_momentum) in zip(used, expected, strict=True):
        assert momentum == pytest.approx(torch_momentum, rel=1e-12, abs=1e-12)
        assert lr == pytest.approx(torch_lr, rel=1e-12, abs=1e-15)
    momenta = [m for _, m in used]
    assert max(momenta) == momenta[0] == flags.get("max_momentum", 0.95)
    assert min(momenta) == pytest.approx(flags.get("base_momentum", 0.85), abs=1e-3)  # near R
    if "betas" in optimizer.param_groups[0]:
        assert optimizer.param_groups[0]["betas"][1] == 0.999
    assert "momentum" in schedule.description  # the banner says so


def test_cycle_momentum_on_an_optimizer_without_one_is_refused():
    optimizer = torch.optim.Adagrad([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = Schedule(total_steps=10, decay=Decay.onecycle, cycle=OneCycle(cycle_momentum=True))
    with pytest.raises(ConfigError, match=r"^--cycle-momentum cycles the optimizer's momentum"):
        build_scheduler(optimizer, schedule)


def test_a_momentum_cycle_resumed_from_weights_only_state_continues_bit_equal(tmp_path):
    """Resume mid-cycle: the scheduler's state (numbers only: it loads weights-only) and the
    optimizer's (its betas) give a fresh run the LRs, beta1s and weights of an unbroken run."""
    schedule = Schedule(
        total_steps=30, decay=Decay.onecycle, cycle=OneCycle(0.25, cycle_momentum=True)
    )

    def run(steps, state=None):
        torch.manual_seed(0)
        param = torch.nn.Parameter(torch.randn(4))
        optimizer = torch.optim.AdamW([param], lr=1e-2)
        scheduler = build_scheduler(optimizer, schedule)
        if state is not None:
            param.data.copy_(state["param"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
        used = []
        for _ in range(steps):
            used.append((optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["betas"]))
            target = torch.arange(4.0) * scheduler.last_epoch  # the step, resumed or not
            (param - target).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        path = tmp_path / f"state{steps}.pt"
        torch.save({"param": param.detach(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict()}, path)  # fmt: skip
        return used, param.detach().clone(), torch.load(path, weights_only=True)

    unbroken, final, _ = run(30)
    first, _, state = run(11)
    assert "momentum" not in state["scheduler"] and state["scheduler"]["lr_lambdas"] == [None]
    second, resumed, _ = run(19, state)
    assert first + second == unbroken
    assert torch.equal(resumed, final)
    assert len({betas for _, betas in unbroken}) > 10  # beta1 moves in the run compared
