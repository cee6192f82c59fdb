"""Settings declared once: flags, --config files, --dry-run, the run identity and trackers all come
from one declaration (accel_common.settings), shown on the template recipe."""

from __future__ import annotations

import functools
import importlib
import math
import re
from dataclasses import dataclass
from enum import Enum

import pytest
import torch
from typer.testing import CliRunner

from accel_common.errors import ConfigError
from accel_common.monitoring.tracking import PACKAGES, TRACKERS, parse_report_to
from accel_common.recipe_cli.options import SharedSettings
from accel_common.settings import Settings, setting
from accel_common.tools import example_data
from tests.processes import dry_run_plan, invoke_train, run_recipe

template = importlib.import_module("recipes.train_template")
invoke = functools.partial(invoke_train, template.train)
dry_run = functools.partial(dry_run_plan, template.train)


class Colour(str, Enum):
    red = "red"
    blue = "blue"


@dataclass
class Example(Settings):
    width: int = setting(8, "Width.", min=1)
    rate: float = setting(0.5, "Rate.", above=0, max=1)
    colour: Colour = setting(Colour.red, "Colour.")
    cadence: int = setting(10, "How often.", adjustable=True)


def test_a_declaration_checks_its_bounds_by_flag_name():
    Example().validate()
    for values, message in [
        ({"width": 0}, "--width 0: give 1 or more"),
        ({"rate": 0.0}, "--rate 0.0: give a positive number at most 1"),
        ({"rate": 1.5}, "--rate 1.5: give a positive number at most 1"),
        ({"rate": math.nan}, "--rate nan: give"),
    ]:
        with pytest.raises(ConfigError, match=f"^{message}"):
            Example(**values).validate()


def test_a_declaration_round_trips_through_a_recorded_config():
    recorded = {**Example(width=3, colour=Colour.blue).as_config(), "lr": 0.1, "other": "x"}
    assert recorded["colour"] == "blue"  # plain JSON values
    assert Example.from_config(recorded) == Example(width=3, colour=Colour.blue)
    assert Example.adjustable() == {"cadence"}


def test_what_changes_the_math_is_in_the_identity_and_cadence_is_not():
    adjustable = SharedSettings.adjustable()
    assert {"log_every", "save_every", "workers", "output_dir", "report_to"} <= adjustable
    assert {"epochs", "max_steps", "lr"} <= adjustable  # may change on a resume, which says so
    assert not {"seed", "ref_bs", "schedule", "weight_decay", "mixed_precision"} & adjustable


def test_config_file_sets_values_and_the_command_line_wins(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("hidden: 32\nref-bs: 128\nlr: 1e-3\nschedule: constant\ndepth: 1\n")
    plan = dry_run(["--config", str(config), "--hidden", "16"])
    expected = template.MLPRegressor(template.FEATURES, 16, 1)  # --hidden wins, depth from file
    assert plan["parameters"] == str(sum(p.numel() for p in expected.parameters()))
    # lr 1e-3 at ref-bs 128 (YAML reads '1e-3' as a string: converted as on the command line)
    assert plan["learning rate"].startswith("peak 0.0005 (--lr 0.001 at --ref-bs 128")
    assert plan["learning rate"].endswith("then constant")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("hiden: 3\n", r"unknown key 'hiden' \(did you mean 'hidden'\?\); valid keys: hidden, "),
        ("hidden: abc\n", r"hidden: Invalid value for '--hidden'"),
        ("hidden: 0\n", r"hidden: Invalid value for '--hidden'"),
        ("schedule: cosin\n", r"schedule: Invalid value for '--schedule'.*'cosine'"),
        # a value the command line refuses is refused from the file too, not read as 1 or True
        ("hidden: true\n", r"hidden: True is a boolean .*; give a number as for --hidden$"),
        ("lr: false\n", r"lr: False is a boolean .*; give a number as for --lr$"),
        ("hidden: 16.5\n", r"hidden: 16.5 is not a whole number; give one as for --hidden$"),
        ("deterministic: 1\n", r"deterministic: 1 is not a boolean; give true or false as for"),
        ("mixed-precision: no\n", r"mixed-precision: False is a boolean .*in quotes \('no'\)"),
        # issue 43: null reached the model as None (a TypeError), and a mistyped depth built
        # for hours, even for --dry-run's parameter count
        ("hidden: null\n", r"hidden: null, but --hidden takes a value; .*default \(64\)$"),
        ("depth: 99999999999999999999\n", r"depth: .*less than or equal to 1000"),
        # any other absurd number: a plan for it said nothing (--dry-run exit 0), and a value
        # refused after the file was read did not name the file
        ("hidden: 99999999999999999999\n", r": --hidden 99999999999999999999: absurdly large"),
        ("bs: 99999999999999999999\n", r": --bs 99999999999999999999: absurdly large"),
        ("lr: -1\n", r": --lr -1.0: give a positive number$"),
        ("- lr\n", r"expected a mapping of flag names to values"),
        ("lr: [1\n", r"is not readable YAML"),
    ],
)
def test_a_bad_config_file_is_refused_naming_the_file_and_key(tmp_path, text, message):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    result = invoke(["--config", str(config), "--dry-run"])
    assert result.exit_code != 0
    assert isinstance(result.exception, ConfigError)
    assert str(result.exception).startswith(f"--config {config}")
    assert re.search(message, str(result.exception)), str(result.exception)


def test_a_missing_config_file_is_named(tmp_path):
    result = invoke(["--config", str(tmp_path / "nope.yaml"), "--dry-run"])
    assert str(result.exception) == f"--config {tmp_path / 'nope.yaml'}: no such file"


def test_dry_run_plans_any_process_count_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = dry_run(["--bs", "512", "--processes", "8", "--output-dir", "runs/x"])
    assert plan["world size"] == "8 process(es)"
    assert plan["batch"] == "global batch 512 = 64 per device x 8 processes x 1 accumulation steps"
    # the template's --lr 3e-3 at --ref-bs 64, linearly to 512
    assert plan["learning rate"].startswith("peak 0.024 (--lr 0.003 at --ref-bs 64, linear")
    assert plan["mixed precision"] == "no"
    assert "weights, gradients and AdamW state" in plan["memory per device"]
    assert list(tmp_path.iterdir()) == []  # no output folder, no example data


def test_dry_run_under_a_launcher_plans_its_world_and_prints_once(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    plan = dry_run(["--per-device-bs", "16", "--grad-accum", "2"])
    assert plan["batch"] == "global batch 128 = 16 per device x 4 processes x 2 accumulation steps"
    assert plan["mixed precision"] == "bf16"
    monkeypatch.setenv("RANK", "3")
    assert invoke(["--dry-run"]).output == ""


def test_processes_without_dry_run_is_refused():
    result = invoke(["--processes", "8"])
    assert "--processes 8 only goes with --dry-run" in str(result.exception)


def test_the_dry_run_counts_embeddings_apart():
    from accel_common.hardware.parameters import count_parameters

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
    assert count_parameters(model) == (10 * 4 + 4 * 2 + 2, 40)


def test_resume_with_a_changed_setting_is_refused_naming_it(tmp_path, template_data):
    args = ["--data", str(template_data), "--output-dir", str(tmp_path / "run")]
    run_recipe([*args, "--max-steps", "3", "--epochs", "1"], cwd=tmp_path)
    refused = run_recipe([*args, "--resume", "latest", "--hidden", "32"], cwd=tmp_path, check=False)
    assert refused.returncode != 0
    error = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1, refused.stderr
    assert "--hidden 64 in the checkpoint, 32 now; resume with that run's settings" in error[0]
    # an adjustable setting may change, and the resume says so
    go = run_recipe([*args, "--resume", "latest", "--epochs", "2", "--lr", "1e-3"], cwd=tmp_path)
    assert "resuming with changed settings: --epochs 1 in the checkpoint, 2 now; --lr 0.003" in (
        go.stdout
    )


def test_report_to_takes_any_installed_accelerate_tracker(monkeypatch):
    assert parse_report_to("none") == [] and parse_report_to("") == []
    assert "tensorboard" in TRACKERS and "mlflow" in TRACKERS and "comet_ml" in TRACKERS
    installed = {"wandb", "tensorboard", "mlflow"}
    monkeypatch.setattr(
        "accel_common.monitoring.tracking.tracker_installed", lambda name: name in installed
    )
    assert parse_report_to("tensorboard, wandb,tensorboard") == ["tensorboard", "wandb"]
    assert set(parse_report_to("all")) == installed
    with pytest.raises(ConfigError, match=r"--report-to comet_ml: .* pip install comet-ml$"):
        parse_report_to("comet_ml")
    assert PACKAGES["comet_ml"] == "comet-ml"
    with pytest.raises(ConfigError, match=r"unknown tracker 'wandbb'; choose from aim, "):
        parse_report_to("wandb,wandbb")


def test_make_data_finds_a_new_recipes_generator_where_it_lives(tmp_path, monkeypatch):
    """No registry: `new` writes recipes/train_NAME.py with its own write_dataset, and a workload
    folder's recipes/NAME/example.py is found the same way."""
    import recipes

    folder = tmp_path / "recipes"
    monkeypatch.setattr(example_data, "RECIPES", folder)
    monkeypatch.setattr(recipes, "__path__", [*recipes.__path__, str(folder)])
    from accel_common.tools.cli import app

    assert CliRunner().invoke(app, ["new", "zzdemo", "--dest", str(folder)]).exit_code == 0
    (folder / "train_zzfolder.py").write_text("")
    (folder / "zzfolder").mkdir()
    (folder / "zzfolder" / "__init__.py").write_text("")
    (folder / "zzfolder" / "example.py").write_text(
        "def write_dataset(out, *, seed=0):\n    out.mkdir()\n    (out / 'x').write_text('1')\n"
        "    return out\n"
    )
    assert example_data.workloads() == ["zzdemo", "zzfolder"]
    assert example_data.make_data("zzfolder", tmp_path / "f") == tmp_path / "f"
    written = example_data.make_data("zzdemo", tmp_path / "d")
    assert (written / "train.csv").is_file()


def test_the_command_lines_batch_replaces_the_files_either_way(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("bs: 256\n")
    assert dry_run(["--config", str(config)])["batch"].startswith("global batch 256 = 256")
    plan = dry_run(["--config", str(config), "--per-device-bs", "16", "--processes", "2"])
    assert plan["batch"] == "global batch 32 = 16 per device x 2 processes x 1 accumulation steps"


def test_parameter_counts_see_zero3_partitioned_parameters():
    """DeepSpeed ZeRO-3 leaves each parameter an empty tensor and its size in `ds_numel`: the
    export records the full network's count, as the dry run printed it."""
    from accel_common.hardware.parameters import parameter_counts

    model = torch.nn.Linear(4, 2)
    for parameter in model.parameters():
        parameter.ds_numel = parameter.numel()
        parameter.data = torch.empty(0)
    assert parameter_counts(model) == {"parameters": 10}


def test_a_dry_run_by_iterations_plans_max_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = dry_run(["--epochs", "0", "--max-steps", "200", "--warmup-steps", "500"])
    assert plan["epochs"] == "as many as 200 steps take (--epochs 0)"
    assert "; 200 warmup steps, then" in plan["learning rate"]  # cut to the run, as it is
