"""Flags and launch settings that cannot work are refused before anything starts."""

from __future__ import annotations

import importlib
import inspect
import math
import re
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import typer
from accelerate.state import AcceleratorState
from typer.testing import CliRunner

from accel_common.batch_lr.batching import BatchRequest
from accel_common.errors import ConfigError
from accel_common.hardware.accelerator import make_accelerator
from accel_common.hardware.launch_guard import require_writable_output_dir
from accel_common.recipe_cli.command import train_command
from accel_common.recipe_cli.options import SharedSettings
from accel_common.settings import Settings, setting
from tests.processes import POINTCLOUD, QUALITY, REPO, TEMPLATE

OUT_OF_RANGE = [
    ("lr", 0.0), ("lr", -1.0), ("lr", math.nan), ("lr", math.inf), ("weight_decay", -0.1),
    ("seed", -1), ("workers", -1), ("save_every", -1), ("keep_last", 0), ("clip_grad", math.nan),
    ("clip_grad", -1.0), ("epochs", -1), ("max_steps", -5), ("log_every", 0), ("grad_accum", 0),
    ("warmup_steps", -1), ("ref_bs", 0), ("dist_timeout", -1),
]  # fmt: skip


@pytest.mark.parametrize(("name", "value"), OUT_OF_RANGE)
def test_out_of_range_flags_are_refused_by_name(name, value):
    with pytest.raises(ConfigError, match=f"^--{name.replace('_', '-')} {value}: give"):
        SharedSettings(**{name: value}).validate()


def test_the_defaults_are_valid():
    SharedSettings().validate()


def recipe_app(path: Path) -> typer.Typer:
    module = importlib.import_module(f"recipes.{path.stem}")
    app = typer.Typer()
    app.command()(module.train)
    return app


@pytest.mark.parametrize(
    ("script", "flag", "value"),
    [
        (TEMPLATE, "--hidden", "0"),
        (TEMPLATE, "--depth", "-1"),
        (POINTCLOUD, "--num-neighbors", "0"),
        (POINTCLOUD, "--dropout", "1.5"),
        (POINTCLOUD, "--timesteps", "0"),
        (QUALITY, "--image-size", "0"),
        (QUALITY, "--dropout", "1.5"),
    ],
)
def test_model_sizes_out_of_range_are_refused_before_training(script, flag, value, tmp_path):
    result = CliRunner().invoke(recipe_app(script), [flag, value, "--output-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert f"Invalid value for '{flag}'" in result.output
    assert not any(tmp_path.iterdir())  # nothing started


def test_an_output_dir_that_is_a_file_or_unwritable_is_refused(tmp_path):
    a_file = tmp_path / "runs"
    a_file.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"--output-dir .*runs is a file; give a folder"):
        require_writable_output_dir(a_file)
    with pytest.raises(ConfigError, match=r"--output-dir .*runs/sub cannot be written"):
        require_writable_output_dir(a_file / "sub")


@pytest.fixture
def fresh_state():
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_fp16_on_the_cpu_is_refused_instead_of_silently_training_fp32(fresh_state, tmp_path):
    with pytest.raises(ConfigError, match=r"fp16 mixed precision .* does not run on the CPU"):
        make_accelerator(
            output_dir=tmp_path, batch=BatchRequest(8), mixed_precision="fp16", cpu=True
        )
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator, _ = make_accelerator(
        output_dir=tmp_path, batch=BatchRequest(8), mixed_precision="bf16", cpu=True
    )
    assert accelerator.mixed_precision == "bf16"


# A GPU launch config on a machine without GPUs: tests/hardware/test_runtime_guards.py launches one.


def test_the_readme_documents_every_keyword_train_command_takes():
    """ "Starting a new recipe" shows train_command's keywords: each one it names is one
    train_command takes (its own or a setting's default), and none of its own is left out."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Starting a new recipe")[1].split("\n## ")[0]
    block = section.split("@train_command(")[1].split("\ndef train")[0]
    documented = set(re.findall(r"(\w+)=", block))
    own = {
        name
        for name, p in inspect.signature(train_command).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    settings = {f.name for f in fields(SharedSettings)}
    assert own <= documented, f"undocumented: {own - documented}"
    assert documented <= own | settings, f"not train_command's: {documented - own - settings}"


def test_a_recipe_setting_named_like_a_shared_one_must_say_it_replaces_it():
    """pointcloud's --eval-every counts epochs, the shared one optimizer steps: a recipe takes a
    shared flag's name only by saying so (replaces), and the shared setting keeps its default."""

    @dataclass
    class Own(Settings):
        eval_every: int = setting(15, "Every N epochs.", min=1, adjustable=True)

    with pytest.raises(TypeError, match=r"declares shared settings \['eval_every'\]"):
        train_command(Own, default_bs=8)
    command = train_command(Own, default_bs=8, replaces=("eval_every",))(lambda args, own: None)
    args, own = command.resolve(eval_every=4)
    assert (args.eval_every, own.eval_every) == (0, 4)
    pointcloud = importlib.import_module("recipes.train_pointcloud")
    assert [p for p in inspect.signature(pointcloud.train).parameters].count("eval_every") == 1


def test_an_optional_number_takes_none_on_the_command_line_and_in_a_config_file(tmp_path):
    """cricket's --split-seed is `int | None`: its help offers none (--seed's), which the command
    line refused as not an integer; a config file's null already worked."""

    @dataclass
    class Own(Settings):
        split_seed: int | None = setting(42, "Seed; none: --seed's.", min=0)

    seen = []
    app = typer.Typer(add_completion=False)
    app.command()(train_command(Own, default_bs=8)(lambda args, own: seen.append(own.split_seed)))
    config = tmp_path / "run.yaml"
    config.write_text("split-seed: null\n")
    cases = [([], 42), (["--split-seed", "7"], 7), (["--config", str(config)], None)]
    cases += [(["--split-seed", "none"], None), (["--split-seed", "None"], None)]
    for flags, want in cases:
        result = CliRunner().invoke(app, [*flags, "--output-dir", str(tmp_path / "run")])
        assert result.exit_code == 0, result.output
        assert seen.pop() == want, flags
    result = CliRunner().invoke(app, ["--split-seed", "x", "--output-dir", str(tmp_path)])
    assert result.exit_code == 2 and "'x': give an integer or none" in result.output
    result = CliRunner().invoke(app, ["--split-seed", "-1", "--output-dir", str(tmp_path)])
    assert str(result.exception) == "--split-seed -1: give 0 or more"  # the range still holds
    assert not seen


def test_epochs_0_needs_max_steps():
    with pytest.raises(ConfigError, match=r"^--epochs 0 trains by iterations, until --max-steps"):
        SharedSettings(epochs=0).validate()
    SharedSettings(epochs=0, max_steps=100).validate()
