"""`convert --recipe X --set NAME=VALUE` records the settings a foreign checkpoint lacks, so that
recipe X's own commands (the template's evaluate) rebuild its model from the export."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from accel_common.errors import CheckpointError
from accel_common.tools.cli import app
from recipes import train_template
from tests.processes import recipe_env

runner = CliRunner()


def foreign(tmp_path, hidden=8, depth=1):
    """A plain torch.save of the template's MLP, as a DDP run would leave it."""
    torch.manual_seed(0)
    model = train_template.MLPRegressor(train_template.FEATURES, hidden, depth)
    path = tmp_path / "ddp.pt"
    torch.save({"model": {f"module.{k}": v for k, v in model.state_dict().items()}}, path)
    return path


def convert(*args):
    return runner.invoke(app, ["convert", *map(str, args)])


def test_set_records_the_settings_and_evaluate_runs(tmp_path):
    data = train_template.write_dataset(tmp_path / "data", train_size=16, test_size=16)
    sets = ["--set", "hidden=8", "--set", "depth=1", "--set", "target_mean=0.25"]
    result = convert(foreign(tmp_path), tmp_path / "out", "--recipe", "template", *sets)
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "out" / "model.json").read_text())
    assert meta["config"] == {"hidden": 8, "depth": 1, "target_mean": 0.25}
    assert "--set jitter=..." in " ".join(result.output.split())  # what it still lacks
    evaluate = subprocess.run(
        [sys.executable, "recipes/train_template.py", "evaluate", "--model",
         str(tmp_path / "out"), "--data", str(data)],
        capture_output=True, text=True, env=recipe_env(tmp_path), timeout=300,
    )  # fmt: skip
    assert evaluate.returncode == 0, evaluate.stderr
    assert "test_mse" in evaluate.stdout


def test_without_set_evaluate_names_the_settings_to_give(tmp_path, capsys):
    data = train_template.write_dataset(tmp_path / "data", train_size=16, test_size=16)
    result = convert(
        foreign(tmp_path, hidden=64, depth=2), tmp_path / "out", "--recipe", "template"
    )
    assert result.exit_code == 0, result.output
    note = " ".join(result.output.split())
    assert "records no template hidden, depth, jitter, target_mean" in note
    assert "--set hidden=... --set depth=..." in note
    with pytest.raises(CheckpointError, match=r"records no target_mean.*--set target_mean="):
        train_template.evaluate_export(tmp_path / "out", data, "test")
    assert "--set hidden=... --set depth=..." in capsys.readouterr().err


def test_a_bad_name_or_value_is_one_line(tmp_path):
    source = foreign(tmp_path)
    for sets, expected in (
        (["--set", "hiden=8"], "--set hiden: the template recipe has no such setting"),
        (["--set", "hidden=wide"], "--set hidden=wide: not a valid int"),
        (["--set", "hidden=0"], "--set hidden=0: give 1 or more"),
        (["--set", "target_mean=nan"], "--set target_mean=nan: not a finite number"),
    ):
        result = convert(source, tmp_path / "out", "--recipe", "template", *sets)
        assert result.exit_code != 0
        assert expected in " ".join(result.output.split()), result.output
        assert not (tmp_path / "out").exists()
    unnamed = convert(source, tmp_path / "out", "--set", "hidden=8")
    assert unnamed.exit_code != 0 and "give --recipe NAME" in " ".join(unnamed.output.split())
