"""The template recipe: it learns, its export reloads on one device, and bad input fails cleanly."""

from __future__ import annotations

import hashlib
import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, TEMPLATE, recipe_env, run_recipe


def load_recipe_module():
    return importlib.import_module("recipes.train_template")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, template_data) -> Path:
    tmp = tmp_path_factory.mktemp("template")
    out = tmp / "run"
    run_recipe(["--data", str(template_data), "--output-dir", str(out)], cwd=tmp)  # defaults
    return out


@pytest.mark.slow
def test_learns_far_better_than_the_mean_baseline(finished_run):
    metrics = json.loads((finished_run / "model" / "model.json").read_text())["metrics"]
    assert metrics["test_mse"] < 0.3 * metrics["baseline_mse"]
    assert metrics["r2"] > 0.7


@pytest.mark.slow
def test_export_reloads_strictly_on_one_device_with_the_same_outputs(finished_run, template_data):
    recipe = load_recipe_module()
    meta = json.loads((finished_run / "model" / "model.json").read_text())
    test_set = recipe.load_split(template_data, "test")
    model = recipe.MLPRegressor(test_set.tensors[0].shape[1], meta["config"]["hidden"], 2)
    recipe.load_exported(finished_run / "model", model)  # strict=True inside
    with torch.no_grad():
        mse = torch.nn.functional.mse_loss(model(test_set.tensors[0]), test_set.tensors[1])
    assert mse.item() == pytest.approx(meta["metrics"]["test_mse"], rel=1e-5)


@pytest.mark.slow
def test_evaluate_command_scores_the_export(finished_run, template_data, tmp_path):
    result = run_recipe(
        ["evaluate", "--model", str(finished_run / "model"), "--data", str(template_data)],
        cwd=tmp_path,
    )
    meta = json.loads((finished_run / "model" / "model.json").read_text())
    assert f"test_mse {meta['metrics']['test_mse']:.4g}" in result.stdout


@pytest.mark.slow
def test_without_data_it_generates_the_example_once(tmp_path):
    args = ["--epochs", "1", "--max-steps", "3", "--output-dir", "runs/a"]
    first = run_recipe(args, cwd=tmp_path)
    assert "writing example template data" in first.stdout
    assert (tmp_path / "data" / "example" / "template" / "train.csv").is_file()
    second = run_recipe([*args[:-1], "runs/b"], cwd=tmp_path)
    assert "writing example" not in second.stdout


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def bad_data(tmp_path, template_data) -> Path:
    folder = tmp_path / "bad-data"
    shutil.copytree(template_data, folder)
    lines = (folder / "train.csv").read_text().splitlines()
    lines[4] = lines[4].replace(lines[4].split(",")[2], "oops", 1)
    (folder / "train.csv").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture
def odd_data(tmp_path, template_data) -> Path:
    """Folders whose train.csv is not comma-separated text: random bytes, `;`-separated."""
    for name in ("binary", "semicolon"):
        shutil.copytree(template_data, tmp_path / name)
    (tmp_path / "binary" / "train.csv").write_bytes(bytes(range(255, -1, -1)) * 8)
    train = tmp_path / "semicolon" / "train.csv"
    train.write_text(train.read_text().replace(",", ";"))
    return tmp_path


BAD_INPUTS = {
    "unsplittable batch": (["--bs", "30", "--grad-accum", "4"], "--bs 30 cannot be split"),
    "lr not a number": (["--lr", "nan"], "--lr nan: give a positive number"),
    "both batch flags": (["--bs", "32", "--per-device-bs", "16"], "both were given"),
    "batch above the split": (
        ["--bs", "4096"],
        "the training split is smaller than one global batch: its 20 epoch(s) fill 0 of the 4096 "
        "samples of one optimizer step",
    ),
    "missing data": (["--data", "/nonexistent/data"], "--data /nonexistent/data: no such folder"),
    "malformed csv": (["--data", "{bad_data}"], "train.csv, line 5: column x2 is 'oops'"),
    "random bytes": (
        ["--data", "{odd}/binary"],
        "binary/train.csv, line 1: byte 0xff at offset 0 is not UTF-8 text; save the file as "
        "UTF-8 comma-separated values",
    ),
    "semicolons": (
        ["--data", "{odd}/semicolon"],
        "semicolon/train.csv: the header 'x0;x1;x2;x3;x4;x5;x6;x7;y' looks ';'-separated; write "
        "comma-separated values (a header such as x0,x1,x2,x3,x4,x5,x6,x7,y)",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_gives_one_clear_error(
    case, finished_run, template_data, bad_data, odd_data, tmp_path
):
    flags, message = BAD_INPUTS[case]
    flags = [f.format(bad_data=bad_data, odd=odd_data) for f in flags]
    if "--data" not in flags:
        flags = ["--data", str(template_data), *flags]
    before = digest(finished_run)
    result = run_recipe([*flags, "--output-dir", str(finished_run)], cwd=tmp_path, check=False)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert digest(finished_run) == before


@pytest.mark.slow
def test_evaluate_on_a_csv_with_other_columns_names_both(finished_run, template_data, tmp_path):
    """A test split missing two of the model's feature columns: the columns are named, not the
    tensor sizes of a model that does not fit."""
    folder = tmp_path / "fewer"
    folder.mkdir()
    rows = [line.split(",") for line in (template_data / "test.csv").read_text().splitlines()]
    (folder / "test.csv").write_text("".join(",".join(r[:6] + r[-1:]) + "\n" for r in rows))
    before = digest(finished_run)
    args = ["evaluate", "--model", str(finished_run / "model"), "--data", str(folder)]
    result = run_recipe(args, cwd=tmp_path, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: {folder / 'test.csv'}: columns x0, x1, x2, x3, x4, x5, y differ from the "
        "training split's x0, x1, x2, x3, x4, x5, x6, x7, y; every split needs the same columns "
        "in the same order"
    ]
    assert digest(finished_run) == before


@pytest.mark.slow
def test_a_diverging_run_stops_and_saves_nothing(template_data, tmp_path):
    out = tmp_path / "run"
    flags = ["--data", str(template_data), "--output-dir", str(out), "--lr", "1e6", "--epochs", "1"]
    result = run_recipe(flags, cwd=tmp_path, check=False)
    assert result.returncode == 2
    assert "error: the training loss went non-finite (" in result.stderr
    assert ") on process 0 at optimizer step " in result.stderr
    assert "No checkpoint was saved before it: lower --lr or set --clip-grad" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (out / "checkpoints").exists() and not (out / "model").exists()


def test_unknown_accelerate_config_file_is_refused():
    result = subprocess.run(
        ["make", "-s", "-o", "install", "train-cpu", "CONFIG=accelerate_configs/nope.yaml"],
        cwd=REPO,
        env=recipe_env(REPO),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "CONFIG=accelerate_configs/nope.yaml: no such accelerate config file" in result.stderr
    assert "accelerate_configs/cpu_2proc.yaml" in result.stderr  # names the valid choices


@pytest.mark.slow
def test_help_explains_the_batch_conventions():
    result = subprocess.run(
        [sys.executable, str(TEMPLATE), "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0
    # rich wraps the help in a box, with each flag's range ([x>=1]) in a column of its own
    text = re.sub(r"\[[^\]]*x[<>]=?[^\]]*\]", " ", result.stdout.replace("│", " "))
    text = " ".join(text.split())
    for flag in ("--bs", "--per-device-bs", "--ref-bs", "--lr-scaling", "--resume", "--hidden"):
        assert flag in text
    assert "GLOBAL batch" in text and "EACH device" in text
    assert "evaluate --help" in text
