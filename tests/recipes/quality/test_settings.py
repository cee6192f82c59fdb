"""The quality recipe's settings: the original's preset, config files under flags, resume
refusals.
"""

from __future__ import annotations

import functools

import pytest
import torch

import recipes.train_quality as recipe
from accel_common.errors import ConfigError, exit_on_error
from recipes.quality.example import ANNOTATORS
from tests.processes import QUALITY, REPO, dry_run_plan, invoke_train, run_recipe

# --------------------------------------------------------------------------- settings

ORIGINAL = REPO / "recipes" / "quality" / "configs" / "original.yaml"

TORCHS_PRECISION = "torch's default (fp32 matrix products, TF32 cuDNN convolutions)"


invoke = functools.partial(invoke_train, recipe.train)
dry_run = functools.partial(dry_run_plan, recipe.train)


def parameters(backbone: str, annotators: int = len(ANNOTATORS)) -> str:
    """The scorer's count, the reliabilities apart."""
    with torch.device("meta"):
        model = recipe.QualityScorer(backbone, annotators, 0.2)
    return str(sum(p.numel() for p in model.parameters()) - annotators)


def test_the_original_preset_plans_its_size_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = dry_run(["--config", str(ORIGINAL)])
    # efficientnet_b4 and the 512-256-1 head with its biases: the original's 18,598,217; one
    # reliability per annotator of the example (no --data: 6), counted apart
    assert plan["parameters"] == str(18_598_217)
    assert plan["annotator reliabilities"] == "6 (not counted above)"
    assert plan["batch"] == "global batch 32 = 32 per device x 1 processes x 1 accumulation steps"
    assert plan["learning rate"].startswith("peak 0.0001 (--lr 0.0001 at --ref-bs 32, linear")
    assert plan["learning rate"].endswith(
        "0 warmup steps, then cosine per epoch to 1e-06 (0.01 x peak) at the last step"
    )  # CosineAnnealingLR(T_max=epochs, eta_min=0.01 lr) stepped after each epoch (train.py 494)
    assert plan["epochs"] == "20" and plan["mixed precision"] == "no"
    # the original touches no speed switch: torch's defaults (train.py 378-382, 408-411)
    assert plan["matmul precision"] == TORCHS_PRECISION
    assert plan["fused optimizer"] == plan["DDP static graph"] == "no"
    assert list(tmp_path.iterdir()) == []  # no output folder, no example data


@pytest.mark.parametrize("dry", [True, False], ids=["dry-run", "run"])
def test_an_unknown_backbone_is_refused_alike_by_the_run_and_its_dry_run(tmp_path, dry):
    """The dry run built the network and died in timm's traceback; the run refused it in one
    line, after reading the data: both now refuse it as the settings are read."""
    args = ["--backbone", "nosuchnet_xyz", "--output-dir", str(tmp_path / "run")]
    # as `python recipes/train_quality.py` runs it (entry.run_recipe): errors as one line
    result = invoke_train(exit_on_error(recipe.train), args + (["--dry-run"] if dry else []))
    assert result.exit_code == 2, result.output
    assert "--backbone nosuchnet_xyz: not a timm model name" in result.output
    assert "read " not in result.output and not (tmp_path / "run").exists()  # before the data


def test_a_config_value_is_used_and_a_flag_overrides_it(tmp_path):
    config = tmp_path / "q.yaml"
    config.write_text("backbone: resnet18\nlr: 2e-4\nreliability: global\n")
    plan = dry_run(["--config", str(config)])
    assert plan["parameters"] == parameters("resnet18")
    assert plan["learning rate"].startswith("peak 0.0002 (--lr 0.0002 at --ref-bs 32")
    # --backbone on the command line wins; one reliability per annotator of --data's records,
    # read as the run reads them (its images must be there)
    two = tmp_path / "two"
    (two / "images").mkdir(parents=True)
    for name in ("x.png", "y.png"):
        (two / "images" / name).touch()
    vote = '{"comparisons": [{"img1": "x.png", "img2": "y.png", "choice": "left"}]}'
    for annotator in ("a", "b"):
        (two / annotator).mkdir()
        (two / annotator / "comparison_data.json").write_text(vote)
    plan = dry_run(
        ["--config", str(config), "--backbone", "test_efficientnet_gn", "--data", str(two)]
    )
    assert plan["parameters"] == parameters("test_efficientnet_gn", annotators=2)
    assert plan["annotator reliabilities"] == "2 (not counted above)"
    assert plan["learning rate"].startswith("peak 0.0002 (--lr 0.0002 at --ref-bs 32")
    # the recipe's own checks hold for a file as for a flag
    config.write_text("reliability: sometimes\n")
    result = invoke(["--config", str(config), "--dry-run"])
    assert isinstance(result.exception, ConfigError)
    assert str(result.exception) == (
        f"--config {config}: --reliability sometimes: choose full, global, fixed or gold"
    )


@pytest.mark.slow
def test_resuming_with_another_draw_weight_is_refused(quality_data, tmp_path):
    args = ["--data", str(quality_data), "--output-dir", str(tmp_path / "run")]
    run_recipe([*args, "--max-steps", "2"], cwd=tmp_path, script=QUALITY)  # saves step_2
    again = [*args, "--max-steps", "4", "--resume", "latest", "--draw-weight", "0.2"]
    result = run_recipe(again, cwd=tmp_path, script=QUALITY, check=False)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "belongs to another run" in errors[0]
    assert "--draw-weight 0.1 in the checkpoint, 0.2 now" in errors[0]
