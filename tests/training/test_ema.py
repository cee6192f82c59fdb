"""The library's EMA of the weights (--ema-decay, accel_common.training.ema).

In this process: each warm-up's decay is diffusers' `EMAModel.get_decay` (or pcdiff's constant),
each update is its original's arithmetic bit for bit, `applied()` swaps and restores exactly, an
evaluation outside it is refused, the state round-trips (and pointcloud's older AveragedModel
state loads). As real runs of the template recipe: the export is the EMA of the trajectory the
checkpoints record (a reference update, written here, from each step to the next) and what the
logged evaluation scored; kill -9 and --resume end bit for bit where the uninterrupted run ends;
2 processes = 1; FSDP2 = DDP, and a resume from FSDP's sharded checkpoint is exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file
from torch import nn

from accel_common import ConfigError, EmaSettings, EmaWarmup, WeightEMA, make_ema
from accel_common.checkpoints.checkpoint import list_checkpoints
from accel_common.errors import CheckpointError
from accel_common.tools.check.recipe import discovered, find_recipe
from recipes.train_template import MLPRegressor, load_split
from tests.hardware import test_sharded
from tests.hardware.test_sharded import checked, launch_fsdp
from tests.processes import kill_once_written, run_recipe, run_to_the_end
from tests.results import exported_params, max_relative_difference, metrics_log
from tests.training.test_nonfinite import run_injected

EMA_STATE = "custom_checkpoint_1.pkl"  # registered after the LR scheduler (custom_checkpoint_0)
SMALL = ["--bs", "256", "--hidden", "8", "--depth", "1", "--log-every", "1"]
TOLERANCE = 1e-5  # 2 processes or FSDP against one: the order of float sums (test_distributed)


def reference_decay(warmup: str, k: int, decay: float, power: float = 2 / 3) -> float:
    """The decay of update k (from 1): pcdiff's constant, diffusers' warm-ups (inv_gamma 1)."""
    if warmup == "none":
        return decay
    if k == 1:
        return 0.0
    s = k - 1
    return min(decay, (1 + s) / (10 + s) if warmup == "ratio" else 1 - (1 + s) ** -power)


def reference_update(average: torch.Tensor, weight: torch.Tensor, warmup: str, decay: float):
    """One update as the originals write it: pcdiff's EMA.update, diffusers' EMAModel.step."""
    if warmup == "none":
        return average.clone().mul_(decay).add_(weight, alpha=1 - decay)
    return average - (1 - decay) * (average - weight)


class Small(nn.Module):
    """Trainable weights, a frozen parameter and a buffer: only the first are averaged."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 4)
        self.norm = nn.BatchNorm1d(4)
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)


def nudge(model: nn.Module, seed: int) -> None:
    """An optimizer step's worth of change to every trainable weight, and to the buffers."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=generator))
        model.norm.running_mean.add_(1.0)


# --------------------------------------------------------------------------- in this process


@pytest.mark.parametrize("warmup", ["ratio", "power"])
def test_the_warmups_are_diffusers_ema_model_decays(warmup):
    training_utils = pytest.importorskip("diffusers.training_utils")
    theirs = training_utils.EMAModel(
        [nn.Parameter(torch.zeros(1))], decay=0.9999, use_ema_warmup=warmup == "power", power=0.75
    )
    ours = EmaSettings(0.9999, EmaWarmup(warmup), power=0.75)
    assert [ours.decay_at(k) for k in range(1, 3000)] == [
        theirs.get_decay(k) for k in range(1, 3000)
    ]
    assert EmaSettings(0.99).decay_at(1) == EmaSettings(0.99).decay_at(500) == 0.99  # pcdiff's


@pytest.mark.parametrize("warmup", ["none", "ratio", "power"])
def test_each_update_is_its_originals_arithmetic_bit_for_bit(warmup):
    torch.manual_seed(0)
    model = Small()
    settings = EmaSettings(0.9, EmaWarmup(warmup))
    ema = WeightEMA(model, settings)
    assert set(ema.shadow) == {"linear.weight", "linear.bias", "norm.weight", "norm.bias"}
    if warmup == "none":  # pcdiff's EMA, as train_completion.py writes it
        expected = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    else:
        training_utils = pytest.importorskip("diffusers.training_utils")
        theirs = training_utils.EMAModel(
            model.parameters(), decay=0.9, use_ema_warmup=warmup == "power"
        )
    for step in range(1, 6):
        nudge(model, step)
        ema.update()
        if warmup == "none":
            for name, p in model.named_parameters():
                if p.requires_grad:
                    expected[name].mul_(0.9).add_(p.data, alpha=1 - 0.9)
        else:
            theirs.step(model.parameters())
            names = [n for n, _ in model.named_parameters()]
            expected = {
                n: s for n, s in zip(names, theirs.shadow_params, strict=True) if n in ema.shadow
            }
        for name, average in ema.shadow.items():
            assert torch.equal(average, expected[name]), (step, name)
    assert ema.updates == 5


def test_applied_swaps_the_average_in_and_the_trained_weights_back_exactly():
    torch.manual_seed(0)
    model = Small()
    ema = WeightEMA(model, EmaSettings(0.5))
    nudge(model, 1)
    ema.update()
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    average = {k: v.clone() for k, v in ema.shadow.items()}
    with ema.applied():
        averaged = {k: v.clone() for k, v in model.state_dict().items()}
        for name in average:
            assert torch.equal(averaged[name], average[name]), name
        with ema.applied():  # nested (an export inside an evaluation's block): no second swap
            assert all(torch.equal(model.state_dict()[k], averaged[k]) for k in averaged)
    for name in ema.shadow:
        assert not torch.equal(averaged[name], trained[name]), name
    for name in ("norm.running_mean", "frozen"):  # the model's own: not averaged
        assert torch.equal(averaged[name], trained[name])
    after = model.state_dict()
    assert all(torch.equal(after[k], trained[k]) for k in trained)  # bit for bit


def test_an_evaluation_of_the_trained_weights_is_refused():
    model = Small()
    ema = WeightEMA(model, EmaSettings(0.9), "recipes/train_mine.py")
    ema.update()
    with pytest.raises(ConfigError, match=r"--ema-decay: recipes/train_mine.py logged .*applied"):
        ema.require_scored({"mse": 1.0})
    with ema.applied():
        pass
    ema.require_scored({"mse": 1.0})  # scored the average of this step
    ema.update()
    with pytest.raises(ConfigError):
        ema.require_scored({"mse": 1.0})  # an older step's
    ema.require_scored({})  # no evaluation at this epoch's end
    WeightEMA().require_scored({"mse": 1.0})  # no EMA: nothing to refuse
    with pytest.raises(ConfigError, match=r"does not pass its model to make_loop \(model=model\)"):
        make_ema(None, None, EmaSettings(0.9), "recipes/train_mine.py")


def test_the_state_round_trips_and_pointclouds_averaged_model_state_loads():
    torch.manual_seed(0)
    model = Small()
    ema = WeightEMA(model, EmaSettings(0.9))
    for step in (1, 2):
        nudge(model, step)
        ema.update()
    state = ema.state_dict()
    again = WeightEMA(model, EmaSettings(0.9))
    again.load_state_dict(state)
    assert again.updates == 2
    assert all(torch.equal(again.shadow[k], ema.shadow[k]) for k in ema.shadow)

    # what recipes/train_pointcloud.py registered before the library's EMA
    averaged = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
    )
    for step in (3, 4, 5):
        nudge(model, step)
        averaged.update_parameters(model)
    legacy = WeightEMA(model, EmaSettings(0.9))
    legacy.load_state_dict(averaged.state_dict())
    assert legacy.updates == 3
    for name, average in legacy.shadow.items():
        assert torch.equal(average, averaged.module.state_dict()[name]), name

    with pytest.raises(CheckpointError, match="other parameters than this model has"):
        WeightEMA(nn.Linear(3, 4), EmaSettings(0.9)).load_state_dict(state)


# --------------------------------------------------------------------------- template runs


def template_export_mse(model_dir: Path, data: Path, state: dict[str, torch.Tensor]) -> float:
    """The test split's MSE of the template's MLP holding `state`, as its evaluate computes it."""
    test = load_split(data, "test")
    model = MLPRegressor(test.tensors[0].shape[1], 8, 1)
    model.load_state_dict(state)
    with torch.no_grad():
        return F.mse_loss(model(test.tensors[0]), test.tensors[1]).item()


@pytest.mark.slow
@pytest.mark.parametrize("warmup", ["none", "ratio", "power"])
def test_the_export_is_the_ema_of_the_trajectory_and_what_was_scored(
    warmup, tmp_path, template_data
):
    """8 optimizer steps, each checkpointed: the checkpoint of step k holds the trained weights
    and the average; the average of step k is one reference update of step k - 1's towards
    step k's weights, bit for bit, and the export is the last average, not the weights."""
    out = tmp_path / "out"
    args = ["--data", str(template_data), "--output-dir", str(out), *SMALL, "--epochs", "1"]
    args += ["--ema-decay", "0.9", "--ema-warmup", warmup, "--ema-power", "0.75"]
    run_recipe([*args, "--save-every", "1", "--keep-last", "10"], cwd=tmp_path)
    steps = list_checkpoints(out)
    assert [p.name for p in steps] == [f"step_{k}" for k in range(1, 9)]
    trained = [load_file(str(p / "model.safetensors")) for p in steps]
    averages = [torch.load(p / EMA_STATE, weights_only=True) for p in steps]
    assert [a["updates"] for a in averages] == list(range(1, 9))
    for k in range(2, 9):
        decay = reference_decay(warmup, k, 0.9, power=0.75)
        for name, previous in averages[k - 2]["shadow"].items():
            expected = reference_update(previous, trained[k - 1][name], warmup, decay)
            assert torch.equal(averages[k - 1]["shadow"][name], expected), (k, name)
    if warmup != "none":  # the first update copies the weights (to rounding: s - (s - w))
        for name, first in averages[0]["shadow"].items():
            torch.testing.assert_close(first, trained[0][name])

    exported, last = exported_params(out), averages[-1]["shadow"]
    assert exported.keys() == last.keys()
    for name in last:
        assert torch.equal(exported[name], last[name]), name
        assert not torch.equal(exported[name], trained[-1][name]), name
    meta = json.loads((out / "model" / "model.json").read_text())
    expected_record = {"decay": 0.9, "warmup": warmup, "updates": 8}
    if warmup == "power":
        expected_record |= {"power": 0.75, "inv_gamma": 1.0}
    assert meta["ema"] == expected_record
    # the epoch's evaluation scored the average (the export), not the trained weights
    scored = meta["metrics"]["test_mse"]
    assert scored == pytest.approx(template_export_mse(out, template_data, exported), rel=1e-6)
    assert scored != pytest.approx(template_export_mse(out, template_data, trained[-1]), rel=1e-3)


@pytest.mark.slow
def test_kill_and_resume_ends_bit_for_bit_where_the_uninterrupted_run_ends(
    tmp_path, template_data, capsys, monkeypatch
):
    """Killed (SIGKILL) in the second epoch, after an evaluation; the power warm-up, whose
    decay depends on the update count the checkpoint restores."""
    template = find_recipe("template")
    args = ["--data", str(template_data), *SMALL, "--epochs", "2", "--jitter", "0.1"]
    args += ["--ema-decay", "0.99", "--ema-warmup", "power", "--eval-every", "3"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    run_to_the_end(template, [*args, "--output-dir", str(full)], tmp_path, capsys, monkeypatch)
    args += ["--save-every", "11"]
    marker = killed / "checkpoints" / "step_11" / "progress.json"
    kill_once_written(
        template.script, [*args, "--output-dir", str(killed)], cwd=tmp_path, marker=marker
    )
    assert not (killed / "model").exists()
    resume = [*args, "--output-dir", str(killed), "--resume", "latest"]
    printed = run_to_the_end(template, resume, tmp_path, capsys, monkeypatch)
    assert f"resumed from {marker.parent}" in printed
    expected, resumed = exported_params(full), exported_params(killed)
    assert expected.keys() == resumed.keys()
    for key in expected:
        assert torch.equal(expected[key], resumed[key]), key
    metas = [json.loads((run / "model" / "model.json").read_text()) for run in (full, killed)]
    assert metas[0]["ema"] == metas[1]["ema"] == {
        "decay": 0.99, "warmup": "power", "power": 2 / 3, "inv_gamma": 1.0, "updates": 16
    }  # fmt: skip
    for meta in metas:
        del meta["metrics"]["train_seconds"]
    assert metas[0]["metrics"] == metas[1]["metrics"]
    logged = [
        {r["step"]: r["eval/test_mse"] for r in metrics_log(run) if "eval/test_mse" in r}
        for run in (full, killed)
    ]
    assert logged[0] == logged[1] and len(logged[0]) >= 5  # every evaluation, the EMA's


@pytest.mark.dist
def test_a_step_skipped_for_a_non_finite_loss_is_not_averaged(tmp_path, template_data):
    """tests/scripts/nan_injection.py: a NaN loss on rank 1 at step 6 of 12, skipped on both."""
    flags = ("--on-nonfinite", "skip", "--ema-decay", "0.9")
    result, ranks = run_injected(tmp_path, template_data, *flags)
    assert result.returncode == 0, result.stderr
    assert [r["updates"] for r in ranks] == [11, 11]  # the optimizer's
    meta = json.loads((tmp_path / "out" / "model" / "model.json").read_text())
    assert meta["ema"] == {"decay": 0.9, "warmup": "none", "updates": 11}
    assert all(torch.isfinite(t).all() for t in exported_params(tmp_path / "out").values())


@pytest.mark.slow
@pytest.mark.dist
def test_two_processes_average_as_one(tmp_path, template_data):
    args = ["--data", str(template_data), *SMALL, "--epochs", "1", "--ema-decay", "0.9"]
    args += ["--ema-warmup", "ratio"]
    run_recipe([*args, "--output-dir", "one"], cwd=tmp_path)
    run_recipe([*args, "--output-dir", "two"], cwd=tmp_path, nproc=2)
    one, two = exported_params(tmp_path / "one"), exported_params(tmp_path / "two")
    assert max_relative_difference(one, two) <= TOLERANCE
    metas = [
        json.loads((tmp_path / run / "model" / "model.json").read_text()) for run in ("one", "two")
    ]
    assert metas[0]["ema"] == metas[1]["ema"] == {"decay": 0.9, "warmup": "ratio", "updates": 8}
    scored = [meta["metrics"]["test_mse"] for meta in metas]
    assert scored[0] == pytest.approx(scored[1], rel=TOLERANCE)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_fsdp_averages_as_ddp_and_resumes_from_its_sharded_checkpoint(
    reshard_after_forward, tmp_path, template_data, monkeypatch
):
    """Under FSDP2 every process averages its own shard of each weight (fsdp_min_num_params 1000
    makes each Linear a unit of its own); the checkpoint holds the average gathered whole, which
    a resume splits again; the evaluation swaps the shards in (all-gathered by its forward).
    Without resharding after the forward (the config's option), an evaluation leaves the units'
    gathered weights (the average) in place, which the next training forward would use: the
    swap drops them."""
    config_for = test_sharded.fsdp_cpu_config

    def config(folder: Path, min_num_params: int = 1000) -> Path:
        path = config_for(folder, min_num_params)
        settings = yaml.safe_load(path.read_text())
        settings["fsdp_config"]["fsdp_reshard_after_forward"] = reshard_after_forward
        path.write_text(yaml.safe_dump(settings))
        return path

    monkeypatch.setattr(test_sharded, "fsdp_cpu_config", config)
    args = ["--data", str(template_data), "--bs", "128", "--max-steps", "8", "--log-every", "1"]
    args += ["--ema-decay", "0.9", "--ema-warmup", "ratio", "--save-every", "4"]
    args += ["--keep-last", "5", "--eval-every", "3"]
    run_recipe([*args, "--output-dir", "ddp"], cwd=tmp_path, nproc=2)
    printed = checked(launch_fsdp(tmp_path, [*args, "--output-dir", "fsdp"])).stdout
    assert any(line.split()[:2] == ["distributed", "FSDP"] for line in printed.splitlines())
    ddp, fsdp = exported_params(tmp_path / "ddp"), exported_params(tmp_path / "fsdp")
    assert max_relative_difference(ddp, fsdp) <= TOLERANCE
    evaluations = [
        [r["eval/test_mse"] for r in metrics_log(tmp_path / run) if "eval/test_mse" in r]
        for run in ("ddp", "fsdp")
    ]
    assert len(evaluations[0]) == 3 and evaluations[0] == pytest.approx(evaluations[1], rel=1e-5)
    whole = torch.load(tmp_path / "fsdp" / "checkpoints" / "step_8" / EMA_STATE, weights_only=True)
    for name, average in whole["shadow"].items():
        assert torch.equal(average, fsdp[name]), name  # gathered whole: the export's tensors

    resume = ["--resume", str(tmp_path / "fsdp" / "checkpoints" / "step_4")]
    checked(launch_fsdp(tmp_path, [*args, "--output-dir", "resumed", *resume]))
    resumed = exported_params(tmp_path / "resumed")
    for name in fsdp:
        assert torch.equal(resumed[name], fsdp[name]), name


@pytest.mark.parametrize("recipe", discovered())
def test_every_recipe_switches_the_ema_on(recipe, tmp_path, check_example, capsys, monkeypatch):
    """--ema-decay is one switch for every recipe there is: each passes its model to make_loop
    and scores inside loop.ema.applied() (else the flag is refused), and its export says so."""
    found = find_recipe(recipe)
    out = tmp_path / "run"
    args = ["--data", str(check_example(recipe)), *found.args, "--ema-decay", "0.5"]
    args += ["--epochs", "1", "--max-steps", "2", "--output-dir", str(out)]
    run_to_the_end(found, args, tmp_path, capsys, monkeypatch)
    export = json.loads((out / "model" / "model.json").read_text())
    assert export["ema"]["decay"] == 0.5 and export["ema"]["updates"] == export["step"] == 2
