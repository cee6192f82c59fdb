"""The crystal recipe and ComFormer checkpoints: convert from and back strictly, refuse another
network naming the tensor, start training from a converted checkpoint.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from safetensors.torch import load_file
from typer.testing import CliRunner

import recipes.train_crystal as recipe
from accel_common.checkpoints.export import write_export
from accel_common.errors import CheckpointError
from accel_common.recipe_cli.entry import train_in_python
from accel_common.tools import cli
from recipes.crystal import convert
from tests.processes import CRYSTAL
from tests.recipes.crystal.helpers import (
    FIXTURES,
    as_batch,
    original_graphs,
    original_outputs,
    relative,
    write_volumes,
)


def write_original_checkpoint(folder: Path, name: str = "icomformer", **config) -> Path:
    """A ComFormer run folder: best_model.pt as its train.py saves it, and its config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    state = load_file(FIXTURES / f"{name}.safetensors")
    torch.save({"model": state}, folder / "best_model.pt")
    model = original_outputs(name)["config"]
    original = {"model": model, "cutoff": 6.0, "max_neighbors": 25, "target": "band_gap"}
    (folder / "config.json").write_text(json.dumps(original | config))
    return folder / "best_model.pt"


def test_convert_from_comformer_imports_best_model_strictly_and_back(tmp_path):
    source = write_original_checkpoint(tmp_path / "orig", mean_train=1.5, std_train=2.0)
    out = tmp_path / "export"
    result = CliRunner().invoke(cli.app, ["convert", str(source), str(out), "--from", "comformer"])
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "model.json").read_text())
    config = meta["config"]
    assert meta["recipe"] == "crystal" and config["mean"] == 1.5 and config["std"] == 2.0
    assert (config["width"], config["rbf_bins"], config["angle_bins"]) == (16, 12, 10)
    assert (config["fc_features"], config["max_neighbors"], config["target"]) == (8, 25, "band_gap")
    model = recipe.build_model(None, recipe.CrystalSettings.from_config(config))
    model.load_state_dict(load_file(out / "model.safetensors"), strict=True)
    with torch.no_grad():
        got = model.eval()(as_batch(original_graphs(25)))
    assert relative(got, original_outputs()["eval"]) <= 1e-5
    back = tmp_path / "back" / "best_model.pt"
    result = CliRunner().invoke(cli.app, ["convert", str(out), str(back), "--to", "comformer"])
    assert result.exit_code == 0, result.output
    saved = torch.load(back, weights_only=True)["model"]
    original = load_file(FIXTURES / "icomformer.safetensors")
    assert saved.keys() == original.keys()
    assert all(torch.equal(saved[k], original[k]) for k in original)
    written = json.loads((back.parent / "config.json").read_text())
    assert written["model"] == {k: v for k, v in original_outputs()["config"].items()}
    assert (written["mean_train"], written["std_train"], written["max_neighbors"]) == (1.5, 2.0, 25)


def test_convert_from_comformer_imports_an_ecomformer_strictly_and_back(tmp_path):
    """The original's config names the network; the tensors must be that network's."""
    source = write_original_checkpoint(tmp_path / "orig", "ecomformer", mean_train=0.5)
    state, config = convert.import_checkpoint(source)
    assert (config["model"], config["width"], config["layers"]) == ("eComformer", 16, 3)
    assert (config["rbf_bins"], config["fc_features"], config["mean"]) == (12, 8, 0.5)
    model = recipe.build_model(None, recipe.CrystalSettings.from_config(config))
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        got = model.eval()(as_batch(original_graphs(25)))
    assert relative(got, original_outputs("ecomformer")["eval"]) <= 1e-5
    write_export(state, tmp_path / "export", {"recipe": "crystal", "config": config})
    back = tmp_path / "back" / "best_model.pt"
    result = CliRunner().invoke(
        cli.app, ["convert", str(tmp_path / "export"), str(back), "--to", "comformer"]
    )
    assert result.exit_code == 0, result.output
    saved = torch.load(back, weights_only=True)["model"]
    original = load_file(FIXTURES / "ecomformer.safetensors")
    assert saved.keys() == original.keys()
    assert all(torch.equal(saved[k], original[k]) for k in original)
    written = json.loads((back.parent / "config.json").read_text())
    assert written["model"] == original_outputs("ecomformer")["config"]
    (source.parent / "config.json").write_text(json.dumps({"model": {"name": "iComformer"}}))
    with pytest.raises(CheckpointError, match=r"'iComformer' but the checkpoint's tensors are eC"):
        convert.import_checkpoint(source)


def test_convert_from_comformer_refuses_another_network_naming_the_tensor(tmp_path):
    source = write_original_checkpoint(tmp_path / "orig")
    state = torch.load(source, weights_only=True)["model"]
    state["fc_out.weight"] = torch.zeros(2, 8)  # a classification head
    torch.save({"model": state}, source)
    with pytest.raises(
        CheckpointError, match=r"fc_out.weight has shape \(2, 8\) in the checkpoint, \(1, 8\)"
    ):
        convert.import_checkpoint(source)
    del state["fc_out.weight"]
    torch.save({"model": state}, source)
    with pytest.raises(CheckpointError, match=r"missing tensor fc_out.weight \(1, 8\)"):
        convert.import_checkpoint(source)
    (source.parent / "config.json").write_text(json.dumps({"model": {"name": "Matformer"}}))
    with pytest.raises(
        CheckpointError, match=r"model 'Matformer'; this recipe builds iComformer, eC"
    ):
        convert.import_checkpoint(source)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"mean_train": "abc"}, "mean_train 'abc' is not a number; set it to the training target"),
        ({"std_train": [1]}, "std_train [1] is not a number"),
        ({"cutoff": "abc"}, "cutoff 'abc'"),
        ({"max_neighbors": -3}, "max_neighbors -3"),
    ],
)
def test_a_bad_value_in_comformers_config_is_one_line_naming_the_file_and_key(
    tmp_path, config, message
):
    source = write_original_checkpoint(tmp_path / "orig", **config)
    out = tmp_path / "converted"
    result = CliRunner().invoke(cli.app, ["convert", str(source), str(out), "--from", "comformer"])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: {source.parent / 'config.json'}: {message}")
    assert len(result.stderr.splitlines()) == 1 and not out.exists()


def test_init_from_starts_training_from_a_converted_comformer_checkpoint(tmp_path):
    source = write_original_checkpoint(tmp_path / "orig", mean_train=0.0, std_train=1.0)
    state, config = convert.import_checkpoint(source)
    write_export(state, tmp_path / "converted", {"recipe": "crystal", "config": config})
    path = tmp_path / "v.extxyz"
    write_volumes(path, 20)
    sizes = ["--width", "16", "--rbf-bins", "12", "--angle-bins", "10", "--fc-features", "8"]
    argv = ["--data", str(path), "--target", "volume", "--no-cache-graphs", *sizes]
    argv += ["--bs", "8", "--max-steps", "1", "--output-dir", str(tmp_path / "run")]
    try:
        train_in_python(
            recipe.train,
            [*argv, "--init-from", str(tmp_path / "converted")],
            tmp_path / "run",
            script=CRYSTAL,
        )
        with pytest.raises(CheckpointError, match=r"does not fit this model"):
            wrong = [*argv, "--width", "24", "--output-dir", str(tmp_path / "wrong")]
            train_in_python(
                recipe.train,
                [*wrong, "--init-from", str(tmp_path / "converted")],
                tmp_path / "wrong",
                script=CRYSTAL,
            )
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    trained = load_file(tmp_path / "run" / "model" / "model.safetensors")
    # one step from the original's weights: close to them, not to a fresh initialisation
    start = load_file(FIXTURES / "icomformer.safetensors")
    assert (trained["fc_out.weight"] - start["fc_out.weight"]).abs().max() < 0.05


def test_ecomformer_trains_exports_predicts_and_converts_back(tmp_path):
    """`--model eComformer` through the whole recipe: training steps, the export, predict from
    it, and `convert --to comformer` giving the original's tensors (its fixture's keys)."""
    path = tmp_path / "v.extxyz"
    write_volumes(path, 20)
    argv = ["--data", str(path), "--target", "volume", "--no-cache-graphs", "--model", "eComformer"]
    argv += ["--width", "16", "--layers", "3", "--rbf-bins", "12", "--fc-features", "8"]
    argv += ["--bs", "8", "--max-steps", "2", "--output-dir", str(tmp_path / "run")]
    try:
        _, model_dir = train_in_python(recipe.train, argv, tmp_path / "run", script=CRYSTAL)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    out = tmp_path / "p.csv"
    recipe.predict(model_dir=model_dir, data=path, out=out, index=":")
    assert len(list(csv.DictReader(out.open()))) == 20
    back = tmp_path / "back" / "best_model.pt"
    result = CliRunner().invoke(
        cli.app, ["convert", str(model_dir), str(back), "--to", "comformer"]
    )
    assert result.exit_code == 0, result.output
    saved = torch.load(back, weights_only=True)["model"]
    original = load_file(FIXTURES / "ecomformer.safetensors")
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in original.items()}
    assert json.loads((back.parent / "config.json").read_text())["model"]["name"] == "eComformer"


def test_convert_to_comformer_never_replaces_a_config_json_it_was_not_given(tmp_path):
    """Two exports converted back into one folder: the second's config.json (its target scaling)
    would have replaced the first's, so the first's weights came back with the second's mean."""
    exports = []
    for name, mean in (("a", 1.5), ("b", -3.0)):
        source = write_original_checkpoint(tmp_path / f"orig_{name}", mean_train=mean)
        exports.append(tmp_path / f"export_{name}")
        argv = ["convert", str(source), str(exports[-1]), "--from", "comformer"]
        assert CliRunner().invoke(cli.app, argv).exit_code == 0
    back = tmp_path / "back"
    argv = ["convert", str(exports[0]), str(back / "a.pt"), "--to", "comformer"]
    assert CliRunner().invoke(cli.app, argv).exit_code == 0
    result = CliRunner().invoke(
        cli.app, ["convert", str(exports[1]), str(back / "b.pt"), "--to", "comformer"]
    )
    assert result.exit_code == 2, result.output
    assert result.output.strip().endswith(
        f"{back / 'config.json'} exists; pass --force to overwrite it"
    )
    assert json.loads((back / "config.json").read_text())["mean_train"] == 1.5
    assert not (back / "b.pt").exists()
    argv = ["convert", str(exports[1]), str(back / "b.pt"), "--to", "comformer", "--force"]
    assert CliRunner().invoke(cli.app, argv).exit_code == 0
    assert json.loads((back / "config.json").read_text())["mean_train"] == -3.0


def test_convert_from_comformer_names_what_the_checkpoint_lacks_and_takes_set(tmp_path):
    """Without config.json, best_model.pt records no graph settings nor the target's scaling:
    one line names them and the original's defaults it used (its API's 6 angstrom and 25
    neighbours, mean 0, std 1: not the recipe's CPU defaults); --set gives any of them. With a
    config.json lacking only the scaling, only that is named. The BatchNorm is torch's, as the
    original trains."""
    folder = tmp_path / "orig"
    folder.mkdir()
    torch.save({"model": load_file(FIXTURES / "icomformer.safetensors")}, folder / "best_model.pt")
    source, out = folder / "best_model.pt", tmp_path / "export"
    argv = ["convert", str(source), str(out), "--from", "comformer", "--set", "std=2.5"]
    result = CliRunner().invoke(cli.app, [*argv, "--set", "max-neighbors=12"])
    assert result.exit_code == 0, result.output
    (note,) = [line for line in result.output.splitlines() if line.startswith("note:")]
    assert note.startswith(f"note: {source} does not record cutoff, max_neighbors, mean, std;")
    assert "cutoff 6.0 (the original's default), max_neighbors 12 (--set)" in note
    assert "mean 0.0 (the original's default), std 2.5 (--set)" in note
    config = json.loads((out / "model.json").read_text())["config"]
    assert (config["cutoff"], config["max_neighbors"], config["std"]) == (6.0, 12, 2.5)
    assert config["batchnorm"] == "torch"
    source = write_original_checkpoint(tmp_path / "with_config")
    _, config = convert.import_checkpoint(source)
    assert (config["cutoff"], config["max_neighbors"], config["mean"]) == (6.0, 25, 0.0)
    result = CliRunner().invoke(
        cli.app, ["convert", str(source), str(tmp_path / "x"), "--from", "comformer"]
    )
    assert f"note: {source} does not record mean, std;" in result.output, result.output
    argv = ["convert", str(source), str(tmp_path / "y"), "--from", "comformer"]
    result = CliRunner().invoke(cli.app, [*argv, "--set", "cutoff=7"])
    assert result.exit_code != 0 and len(result.output.strip().splitlines()) == 1, result.output
    assert f"--set cutoff: {source} records it" in result.output
    assert not (tmp_path / "y").exists()
