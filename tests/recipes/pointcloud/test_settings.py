"""The point-cloud recipe's settings: the original's preset, config files under flags, resume
refusals naming the setting.
"""

from __future__ import annotations

import functools

import pytest

import recipes.train_pointcloud as recipe
from recipes.pointcloud.model import PVCNN2
from tests.processes import POINTCLOUD, REPO, dry_run_plan, run_recipe
from tests.recipes.pointcloud.helpers import TINY

ORIGINAL = REPO / "recipes" / "pointcloud" / "configs" / "original.yaml"


dry_run = functools.partial(dry_run_plan, recipe.train)


def parameters(**sizes) -> str:
    return str(sum(p.numel() for p in PVCNN2(**sizes).parameters()))


def test_the_original_preset_plans_the_originals_run_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = dry_run(["--config", str(ORIGINAL)])
    assert plan["parameters"] == parameters() == "27648963"  # the original's PVCNN2
    assert plan["batch"] == "global batch 8 = 8 per device x 1 processes x 1 accumulation steps"
    assert plan["learning rate"].startswith("peak 0.0002 (--lr 0.0002 at --ref-bs 8, linear")
    # its LinearLR warmup and ExponentialLR(gamma 1) step once per epoch (test_lr: the staircase),
    # its warmup 500 epochs of the run's steps (unknown here: the data is unread)
    assert plan["learning rate"].endswith(
        "500 warmup epochs (x the data's optimizer steps per epoch) from 0.01 x peak, then "
        "constant per epoch"
    )
    assert plan["epochs"] == "15000"
    assert plan["compile"] == "inductor (--compile)"  # as the original's torch.compile
    # its speed switches at their defaults (train_completion.py 1509, 1558-1572, 2135-2138)
    assert plan["matmul precision"].startswith("high (TF32 matrix products and convolutions")
    assert plan["fused optimizer"] == "yes (--fused-optimizer)"
    assert plan["DDP static graph"] == "no"
    assert list(tmp_path.iterdir()) == []  # no output folder, no example data


def test_a_config_value_is_used_and_a_flag_overrides_it(tmp_path):
    config = tmp_path / "small.yaml"
    config.write_text("width-mult: 0.5\nembed-dim: 16\n")
    assert dry_run(["--config", str(config)])["parameters"] == parameters(
        width_multiplier=0.5, embed_dim=16
    )
    overridden = dry_run(["--config", str(config), "--width-mult", "0.75"])["parameters"]
    assert overridden == parameters(width_multiplier=0.75, embed_dim=16)


@pytest.mark.slow
def test_resume_with_another_diffusion_setting_is_refused_naming_it(pointcloud_data, tmp_path):
    args = ["--data", str(pointcloud_data), "--output-dir", str(tmp_path / "run"), *TINY]
    args += ["--eval-every", "100", "--sample-steps", "2"]
    run_recipe([*args, "--max-steps", "2"], cwd=tmp_path, script=POINTCLOUD)
    changed = [*args, "--max-steps", "3", "--resume", "latest", "--timesteps", "50"]
    refused = run_recipe(changed, cwd=tmp_path, script=POINTCLOUD, check=False)
    assert refused.returncode != 0
    error = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1, refused.stderr
    assert "--timesteps 100 in the checkpoint, 50 now; resume with that run's settings" in error[0]
    # how finely the run is scored may change: the resume says so
    go = run_recipe(
        [*args, "--max-steps", "3", "--resume", "latest", "--sample-steps", "3"],
        cwd=tmp_path,
        script=POINTCLOUD,
    )
    noted = [line for line in go.stdout.splitlines() if line.startswith("resuming with changed")]
    assert len(noted) == 1 and "--sample-steps 2 in the checkpoint, 3 now" in noted[0], go.stdout
