"""A run killed with SIGKILL and resumed ends exactly where the uninterrupted run ends."""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import datasets
import pytest
import torch
from accelerate.state import AcceleratorState

from accel_common.checkpoint import list_checkpoints
from accel_common.runtime import train_in_python
from accel_common.tools.bench import load_recipe
from tests.conftest import (
    CAPTIONING,
    CAPTIONING_TINY,
    CRICKET,
    CRICKET_TINY,
    CRYSTAL,
    CRYSTAL_TINY,
    POINTCLOUD,
    POINTCLOUD_TINY,
    QUALITY,
    TEMPLATE,
    exported_params,
    kill_once_written,
    metrics_log,
)

pytestmark = pytest.mark.slow

CASES = {
    # 64 steps per epoch at --bs 32: killed 16 steps into the second epoch
    "template": (TEMPLATE, "template_data", 80, 192, ["--bs", "32", "--epochs", "3"]),
    # 15 steps per epoch (120 samples, --bs 8): killed 5 steps into the second epoch; the EMA of
    # the weights (the export) is restored too
    "pointcloud": (POINTCLOUD, "pointcloud_data", 20, 45, ["--epochs", "3", "--ema-decay", "0.9"]),
    # 63 steps per epoch (2040 training comparisons, --batch-size 32), cut to 84 steps: killed 7
    # steps into the second epoch; dropout stays on, so the restored RNG state is tested too
    "quality": (QUALITY, "quality_data", 70, 84, ["--epochs", "2", "--max-steps", "84"]),
    # 50 micro-batches of 16 per epoch (800 images), 4 per optimizer step, so windows run across
    # epoch ends: 37 steps in 3 epochs, killed 3 steps into the second epoch
    "captioning": (CAPTIONING, "captioning_data", 15, 37, ["--epochs", "3"]),
    # 12 steps per epoch (800 training structures, --bs 64): killed 3 steps into the second
    "crystal": (CRYSTAL, "crystal_data", 15, 36, ["--epochs", "3"]),
    # every 8th delivery of 95 training matches: about 2,700 graphs, ~170 steps at --bs 16,
    # cut to 30 steps (one evaluation, on 1 validation and 3 test matches, so the exported
    # best epoch is the final model): killed 5 or more steps into the epoch; dropout stays on
    "cricket": (CRICKET, "cricket_data", 5, 30, ["--epochs", "1", "--max-steps", "30"]),
}
# one validation and three test matches: the final evaluation is small too
CRICKET_SMALL = [*CRICKET_TINY, "--sample-every", "8", "--bs", "16"]
CRICKET_SMALL += ["--val-ratio", "0.02", "--test-ratio", "0.02"]
SMALL = {
    "template": ["--hidden", "256", "--depth", "3"],
    "pointcloud": POINTCLOUD_TINY,
    "quality": [],
    "captioning": CAPTIONING_TINY,
    "crystal": CRYSTAL_TINY,
    "cricket": CRICKET_SMALL,
}


@functools.cache
def recipe_module(recipe: str) -> ModuleType:
    return load_recipe(recipe)


def run_to_the_end(recipe: str, args: list[str], cwd: Path, capsys, monkeypatch) -> str:
    """Run the recipe to the end in this process and return what it printed, set up as
    run_recipe sets up a process (one thread, the datasets cache under cwd/hf, so it shares the
    killed run's preprocessing cache). Only the killed run is a process of its own: the recipes'
    imports beyond torch (datasets, PyG, tokenizers) cost 1 to 4 CPU-s a process, as much as a
    small run's training."""
    script = CASES[recipe][0]
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cwd / "hf" / "datasets"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    capsys.readouterr()
    try:
        train_in_python(recipe_module(recipe).train, args, cwd, script=script)
    finally:
        torch.set_num_threads(threads)
        AcceleratorState._reset_state(reset_partial_state=True)
    return capsys.readouterr().out


@pytest.mark.parametrize("recipe", CASES)
def test_sigkill_mid_epoch_then_resume_matches_uninterrupted_run(
    recipe, tmp_path, request, capsys, monkeypatch
):
    script, data_fixture, kill_at, total_steps, flags = CASES[recipe]
    data = request.getfixturevalue(data_fixture)
    args = ["--data", str(data), "--save-every", "5", "--keep-last", "3", *flags, *SMALL[recipe]]
    full = tmp_path / "full"
    run_to_the_end(recipe, [*args, "--output-dir", str(full)], tmp_path, capsys, monkeypatch)

    killed = tmp_path / "killed"
    marker = killed / "checkpoints" / f"step_{kill_at}" / "progress.json"
    kill_once_written(script, [*args, "--output-dir", str(killed)], cwd=tmp_path, marker=marker)
    latest = int(list_checkpoints(killed)[-1].name.removeprefix("step_"))
    assert kill_at <= latest < total_steps
    assert not (killed / "model").exists()  # it really died before finishing

    resume = [*args, "--output-dir", str(killed), "--resume", "latest"]
    printed = run_to_the_end(recipe, resume, tmp_path, capsys, monkeypatch)
    assert f"resumed from {killed / 'checkpoints' / f'step_{latest}'}" in printed
    expected, resumed = exported_params(full), exported_params(killed)
    assert expected.keys() == resumed.keys()
    for key in expected:
        assert (expected[key] == resumed[key]).all(), key  # bit-identical on the same machine
    # the same test metrics; the mean training loss since the last evaluation is not
    # checkpointed, so after a resume it covers only the steps since the resume
    final = [
        {k: v for k, v in record.items() if k not in ("time", "eval/train_loss")}
        for record in (
            [r for r in metrics_log(run) if "eval/train_loss" in r][-1] for run in (full, killed)
        )
    ]
    assert final[0]["step"] == total_steps
    assert final[0] == final[1]
