"""The cricket recipe's settings: the original's preset, config files under flags, resume
refusals naming the setting.
"""

from __future__ import annotations

import functools

import pytest

import recipes.train_cricket as recipe
from accel_common.errors import CheckpointError, ConfigError
from accel_common.parameters import count_parameters
from recipes.cricket.vocab import ENTITIES
from tests.processes import CRICKET_TINY, REPO, dry_run_plan, invoke_train
from tests.recipes.cricket.helpers import train_here

ORIGINAL = REPO / "recipes" / "cricket" / "configs" / "original.yaml"

TORCHS_PRECISION = "torch's default (fp32 matrix products, TF32 cuDNN convolutions)"


dry_run = functools.partial(dry_run_plan, recipe.train)


def without_embeddings(settings: recipe.CricketSettings) -> str:
    """The parameters of the network these settings describe, less its embedding tables: what
    no vocabulary changes."""
    total, tables = count_parameters(recipe.network(settings, dict.fromkeys(ENTITIES, 1)))
    return str(total - tables)


def test_ratios_that_leave_no_training_matches_are_refused_naming_both_flags():
    """--val-ratio 0.5 --test-ratio 0.5 asked for more match files, which cannot help."""
    result = invoke_train(recipe.train, ["--val-ratio", "0.5", "--test-ratio", "0.5", "--dry-run"])
    assert isinstance(result.exception, ConfigError), result.output
    message = str(result.exception)
    assert "--val-ratio 0.5 and --test-ratio 0.5 leave no matches for training" in message
    assert "more match files" not in message and "\n" not in message
    assert dry_run(["--val-ratio", "0.45", "--test-ratio", "0.5"])


def test_the_original_preset_plans_its_run_and_writes_nothing(cricket_data, tmp_path, monkeypatch):
    """recipes/cricket/configs/original.yaml: lyndonkl/cricketmodel's sizes and hyper-parameters
    (batch 64, AdamW 1e-3, 100 epochs), its network at the vocabulary of the data (read as the
    run reads it; tests/recipe_cli/test_dry_run_plans.py holds the count to the run's)."""
    monkeypatch.chdir(tmp_path)
    cache = tmp_path.parent / f"{tmp_path.name}-cache"  # the cache, not the run's output
    data = ["--data", str(cricket_data), "--graph-cache-dir", str(cache)]
    plan = dry_run(["--config", str(ORIGINAL), *data])
    # cricketmodel's CricketHeteroGNN at these sizes, measured by running its code
    assert plan["parameters excluding embeddings"] == "17444737"
    assert int(plan["parameters"]) > 17444737
    assert plan["batch"] == "global batch 64 = 64 per device x 1 processes x 1 accumulation steps"
    assert plan["learning rate"].startswith("peak 0.001 (--lr 0.001 at --ref-bs 64, linear")
    # trainer.py: no warm-up ramp, 5 epochs at the peak, then cosine stepped after each epoch
    assert plan["learning rate"].endswith(
        "0 warmup steps, 5 epochs at the peak, then cosine per epoch to 0 (0 x peak) at the last "
        "step"
    )
    assert plan["epochs"] == "100"
    # the original touches no speed switch: torch's defaults (trainer.py 142-153, 174-178)
    assert plan["matmul precision"] == TORCHS_PRECISION
    assert plan["fused optimizer"] == plan["DDP static graph"] == "no"
    assert list(tmp_path.iterdir()) == []  # no output folder, no example data


def test_a_config_file_sets_settings_and_the_command_line_wins(cricket_data, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("hidden: 32\nheads: 2\nlayers: 1\nepochs: 3\n")
    plan = dry_run(["--config", str(config), "--hidden", "16", "--data", str(tmp_path / "no")])
    assert plan["parameters"].startswith("not counted:")  # the vocabulary is the data's
    data = ["--data", str(cricket_data), "--graph-cache-dir", str(tmp_path / "cache")]
    plan = dry_run(["--config", str(config), "--hidden", "16", *data])
    expected = recipe.CricketSettings(hidden=16, heads=2, layers=1)  # --hidden wins
    assert plan["parameters excluding embeddings"] == without_embeddings(expected)
    assert plan["epochs"] == "3"


def test_resume_with_another_loss_setting_is_refused_naming_it(cricket_data, tmp_path):
    args = ["--data", str(cricket_data), *CRICKET_TINY, "--bs", "16", "--max-steps", "2"]
    args += ["--sample-every", "8", "--val-ratio", "0.02", "--test-ratio", "0.02"]
    args += ["--graph-cache-dir", str(tmp_path / "cache")]
    train_here(args, tmp_path / "run")
    with pytest.raises(
        CheckpointError, match=r"--huber-delta 10.0 in the checkpoint, 5.0 now;"
    ) as err:
        train_here([*args, "--resume", "latest", "--huber-delta", "5"], tmp_path / "run")
    assert "\n" not in str(err.value) and "--hidden" not in str(err.value)  # one line, only it
