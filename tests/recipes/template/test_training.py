"""The template recipe trained: it learns, its export reloads on one device and evaluates, a
diverging run saves nothing, a corrupt checkpoint is refused and left alone.
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from accelerate.state import AcceleratorState

from tests.processes import invoke_train, run_recipe
from tests.recipes.template.helpers import digest


def load_recipe_module():
    return importlib.import_module("recipes.train_template")


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


def test_eval_every_scores_the_test_set_between_epoch_ends(template_data, tmp_path):
    """--eval-every 2 on a run by iterations (--epochs 0 --max-steps 5): the template evaluates
    after steps 2 and 4 (logged at their step as eval/test_mse, printed once) and at the run's
    end, which is step 5."""
    out = tmp_path / "run"
    args = ["--data", str(template_data), "--output-dir", str(out), "--epochs", "0"]
    args += ["--max-steps", "5", "--eval-every", "2"]
    AcceleratorState._reset_state(reset_partial_state=True)
    result = invoke_train(load_recipe_module().train, args)
    AcceleratorState._reset_state(reset_partial_state=True)
    assert result.exit_code == 0, result.output
    lines = (out / "logs" / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(line) for line in lines]
    assert [r["step"] for r in logged if "eval/test_mse" in r] == [2, 4, 5]
    assert "step 2: test_mse " in result.output and "step 4: test_mse " in result.output
