"""The crystal recipe's settings: the original's presets, config files under flags, the
original's API defaults and arguments, resume refusals naming the setting.
"""

from __future__ import annotations

import functools

import pytest
from accelerate.state import AcceleratorState
from ase.build import bulk

import recipes.train_crystal as recipe
from accel_common.errors import CheckpointError, ConfigError
from accel_common.recipe_cli.entry import train_in_python
from recipes import crystal_api as api
from recipes.crystal.model import Comformer, EComformer
from tests.processes import CRYSTAL, CRYSTAL_TINY, REPO, dry_run_plan, invoke_train
from tests.recipes.crystal.helpers import write_volumes

TORCHS_PRECISION = "torch's default (fp32 matrix products, TF32 cuDNN convolutions)"


def test_the_originals_arguments_without_a_counterpart_are_refused_by_name(monkeypatch):
    call = functools.partial(api.train_from_extxyz, "never_read.extxyz", "energy")
    with pytest.raises(ConfigError, match=r"^model_name='cgcnn': not available here; give one"):
        call(model_name="cgcnn")
    with pytest.raises(ConfigError, match=r"^use_angle=True: not available here .* leave use_"):
        call(use_angle=True)
    with pytest.raises(ConfigError, match=r"^n_early_stopping: not an argument this recipe kn"):
        call(n_early_stopping=50)
    with pytest.raises(ConfigError, match=r"^--train-ratio, --val-ratio and --test-ratio must"):
        call(train_ratio=0.5)  # checked here, before anything is read or launched
    monkeypatch.setattr(api.torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match=r"^distributed=True: this machine has 0 GPU\(s\); pass"):
        call(distributed=True)
    with pytest.raises(ConfigError, match=r"^3 structures but 2 labels"):
        api.train_from_list(strucs=[bulk("Cu")] * 3, labels=[1.0, 2.0])


# --------------------------------------------------------------------------- settings

ORIGINAL = REPO / "recipes" / "crystal" / "configs" / "original.yaml"
ORIGINAL_ECOMFORMER = ORIGINAL.with_name("original_ecomformer.yaml")


invoke = functools.partial(invoke_train, recipe.train)
dry_run = functools.partial(dry_run_plan, recipe.train)


def parameters(width: int, layers: int, heads: int = 1, bins: int = 256, fc: int = 16) -> str:
    model = Comformer(width, layers, heads, bins, bins, fc)
    return str(sum(p.numel() for p in model.parameters()))


def test_the_original_preset_plans_its_size_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = dry_run(["--config", str(ORIGINAL)])
    # the original's iComformer at its default config: 4,966,497 parameters in 166 tensors
    assert plan["parameters"] == parameters(256, 4, fc=256) == "4966497"
    assert plan["batch"] == "global batch 64 = 64 per device x 1 processes x 1 accumulation steps"
    assert plan["learning rate"].startswith("peak 0.001 (--lr 0.001 at --ref-bs 64, linear")
    assert plan["learning rate"].endswith(
        "onecycle from 4e-05 (peak / 25) up along a cosine over the first 30% of the steps, "
        "then down to 4e-09 (peak / 25 / 10000) at the last step; momentum (Adam's beta1) from "
        "0.95 down to 0.85 at the peak LR and back"
    )  # OneCycleLR(max_lr=1e-3, pct_start=0.3) at its defaults (train.py 278-287)
    assert plan["epochs"] == "500" and plan["mixed precision"] == "no"
    # the original touches no speed switch: torch's defaults (train.py 124-128, 267-269)
    assert plan["matmul precision"] == TORCHS_PRECISION
    assert plan["fused optimizer"] == plan["DDP static graph"] == "no"
    assert list(tmp_path.iterdir()) == []  # no output folder, no example data


def test_the_original_ecomformer_preset_plans_its_size(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = dry_run(["--config", str(ORIGINAL_ECOMFORMER)])
    # the original's eComformer at its default config: 5,583,809 parameters in 116 tensors
    model = EComformer(256, 3, 1, 256, 256)
    assert plan["parameters"] == str(sum(p.numel() for p in model.parameters())) == "5583809"
    assert plan["learning rate"].startswith("peak 0.001 (--lr 0.001 at --ref-bs 64, linear")
    assert plan["epochs"] == "500" and list(tmp_path.iterdir()) == []


def test_a_config_value_is_used_and_a_flag_overrides_it(tmp_path):
    config = tmp_path / "small.yaml"
    config.write_text("width: 16\nlayers: 2\nrbf-bins: 16\nangle-bins: 16\nlr: 2.0e-3\n")
    plan = dry_run(["--config", str(config)])
    assert plan["parameters"] == parameters(16, 2, bins=16)
    assert plan["learning rate"].startswith("peak 0.002 (--lr 0.002 at --ref-bs 64")
    plan = dry_run(["--config", str(config), "--width", "24", "--processes", "4"])
    assert plan["parameters"] == parameters(24, 2, bins=16)
    assert plan["batch"] == "global batch 64 = 16 per device x 4 processes x 1 accumulation steps"
    # the recipe's own checks hold for a file as for a flag
    config.write_text("train-ratio: 0.5\n")
    result = invoke(["--config", str(config), "--dry-run"])
    assert isinstance(result.exception, ConfigError)
    assert str(result.exception) == "--train-ratio, --val-ratio and --test-ratio must sum to 1"
    result = invoke(["--batchnorm", "sync", "--dry-run"])
    assert isinstance(result.exception, ConfigError)
    assert str(result.exception) == "--batchnorm sync: one of float64, torch"


def test_resuming_with_another_split_seed_is_refused_naming_it(tmp_path):
    path = tmp_path / "v.extxyz"
    write_volumes(path, 30)
    out = tmp_path / "run"
    argv = ["--data", str(path), "--target", "volume", "--no-cache-graphs", *CRYSTAL_TINY]
    argv += ["--bs", "8", "--output-dir", str(out)]
    try:
        train_in_python(recipe.train, [*argv, "--max-steps", "2"], out, script=CRYSTAL)
        again = [*argv, "--max-steps", "3", "--resume", "latest", "--split-seed", "7"]
        with pytest.raises(CheckpointError, match=r"belongs to another run") as refused:
            train_in_python(recipe.train, again, out, script=CRYSTAL)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert len(str(refused.value).splitlines()) == 1
    assert "--split-seed 123 in the checkpoint, 7 now" in str(refused.value)


def test_the_python_apis_defaults_are_the_originals():
    """An argument left out of train_from_extxyz takes the original's default (its preset),
    not the CPU-sized command-line default."""
    args, settings = recipe.train.resolve(**api.original_defaults())
    assert (args.lr, args.bs, args.epochs, args.weight_decay) == (1e-3, 64, 500, 1e-5)
    assert (settings.cutoff, settings.max_neighbors, settings.width) == (6.0, 25, 256)
    assert (settings.rbf_bins, settings.angle_bins, settings.fc_features) == (256, 256, 256)
    assert recipe.train.resolve()[1].width == 16  # the command line's own default
    # model_name="eComformer" takes eComformerConfig's defaults, as the original's config does
    _, settings = recipe.train.resolve(**api.original_defaults("eComformer"))
    assert (settings.model, settings.layers, settings.width) == ("eComformer", 3, 256)
