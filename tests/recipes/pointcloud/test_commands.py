"""The point-cloud recipe's commands (complete, evaluate, --init-from) refuse what they would
silently change or replace, in one line naming the flag or file.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import typer
from typer.testing import CliRunner

import recipes.train_pointcloud as recipe
from accel_common.checkpoints.export import write_export
from accel_common.errors import CheckpointError, ConfigError, exit_on_error
from recipes.pointcloud.example import write_dataset
from recipes.pointcloud.model import PVCNN2

# --------------------------------------------------------------------------- bad command input


def tiny_export(folder, **changes) -> PVCNN2:
    """An export of the tests' tiny network (random weights), as training writes it."""
    settings = recipe.PointCloudSettings(
        num_points=256, num_nn=32, vox_res_mult=0.125, num_neighbors=8, embed_dim=16, **changes
    )
    torch.manual_seed(0)
    model = recipe.network(settings)
    write_export(
        model.state_dict(), folder, {"recipe": "pointcloud", "config": settings.as_config()}
    )
    return model


def command_app(command) -> typer.Typer:
    """One of the recipe's single-device commands as `python recipe.py NAME` runs it."""
    app = typer.Typer(add_completion=False)
    app.command()(exit_on_error(command))
    return app


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-ens", "0"], "Invalid value for '--num-ens'"),
        (["--num-ens", "-1"], "Invalid value for '--num-ens'"),
        (["--sample-steps", "0"], "Invalid value for '--sample-steps'"),
        (["--sample-steps", "101"], "--sample-steps 101 exceeds the model's --timesteps 100"),
        (["--sampler", "ddpm", "--sample-steps", "10"], "DDPM takes all 100 steps of the model"),
    ],
)
def test_evaluate_refuses_sampling_counts_it_would_silently_replace(tmp_path, flags, message):
    """0 used to fall back to the export's value (`or`), a negative count crashed, more DDIM
    steps than timesteps repeated timesteps, and DDPM ignored --sample-steps."""
    tiny_export(tmp_path / "model")
    data = write_dataset(tmp_path / "data", train_skulls=1, test_skulls=1, points_per_skull=300)
    args = ["--model", str(tmp_path / "model"), "--data", str(data), *flags]
    result = CliRunner().invoke(command_app(recipe.evaluate_export), args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def complete_args(tmp_path, *flags) -> list[str]:
    tiny_export(tmp_path / "model")
    skull = tmp_path / "skull.npy"
    np.save(skull, np.random.default_rng(0).normal(size=(300, 3)).astype(np.float32))
    return ["--model", str(tmp_path / "model"), "--skull", str(skull), *flags]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sample-steps", "0"], "Invalid value for '--sample-steps'"),
        (["--sample-steps", "500"], "--sample-steps 500 exceeds the model's --timesteps 100"),
        (["--out", "implant"], "--out implant: give a file name ending in .npy"),
        (["--sampler", "ddpm", "--sample-steps", "10"], "DDPM takes all 100 steps of the model"),
    ],
)
def test_complete_refuses_what_it_would_silently_change(tmp_path, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)
    args = complete_args(tmp_path, *flags)
    args += [] if "--out" in flags else ["--out", "implant.npy"]
    result = CliRunner().invoke(command_app(recipe.complete), args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not list(tmp_path.glob("implant*"))


def test_complete_writes_no_file_over_another_and_makes_their_folders(tmp_path):
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    out = tmp_path / "implant.npy"
    cases = [
        (["--out", str(out), "--png", str(out)], "--png: give another file than --out"),
        (["--out", str(mine / "implant.npy")], f"implant.npy: {mine} is a file, not a folder"),
        (["--out", str(out), "--png", str(mine / "v.png")], f"v.png: {mine} is a file, not a"),
    ]
    for flags, message in cases:
        result = CliRunner().invoke(command_app(recipe.complete), complete_args(tmp_path, *flags))
        assert result.exit_code == 2, result.output
        assert message in result.output and not out.exists(), result.output
    assert mine.read_text() == "mine"
    png = tmp_path / "new" / "views" / "view.png"
    args = complete_args(tmp_path, "--out", str(out), "--png", str(png), "--sample-steps", "2")
    result = CliRunner().invoke(command_app(recipe.complete), args)
    assert result.exit_code == 0, result.output
    assert np.load(out).shape == (32, 3) and png.read_bytes()[:4] == b"\x89PNG"


def test_complete_keeps_an_existing_picture(tmp_path):
    png = tmp_path / "view.png"
    png.write_bytes(b"mine")
    args = complete_args(tmp_path, "--out", str(tmp_path / "implant.npy"), "--png", str(png))
    result = CliRunner().invoke(command_app(recipe.complete), args)
    assert result.exit_code == 2, result.output
    assert f"--png {png} exists" in result.output
    assert png.read_bytes() == b"mine" and not (tmp_path / "implant.npy").exists()


def test_init_from_names_the_flag_and_what_it_takes(tmp_path):
    model = tiny_export(tmp_path / "export")
    pcdiff = tmp_path / "model_best.pth"
    torch.save({"model_state": {f"model.{k}": v for k, v in model.state_dict().items()}}, pcdiff)
    with pytest.raises(ConfigError, match=r"--init-from .*model_best\.pth: .*--from pcdiff"):
        recipe.initialise_from(model, pcdiff)
    with pytest.raises(ConfigError, match=r"--init-from .*missing: no export there"):
        recipe.initialise_from(model, tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"--init-from .*data: no export there"):
        recipe.initialise_from(
            model, write_dataset(tmp_path / "data", train_skulls=1, test_skulls=1)
        )
    wider = recipe.network(recipe.PointCloudSettings(num_points=256, num_nn=32, width_mult=0.5))
    with pytest.raises(CheckpointError) as refused:
        recipe.initialise_from(wider, tmp_path / "export")
    message = str(refused.value)
    assert "\n" not in message  # one line, not torch's list of every mismatched tensor
    assert "sa_layers.0.0.voxel_layers.0.weight has shape (8, 3, 3, 3, 3)" in message
    assert "(16, 3, 3, 3, 3)" in message
    recipe.initialise_from(recipe.network(recipe.PointCloudSettings(
        num_points=256, num_nn=32, vox_res_mult=0.125, num_neighbors=8, embed_dim=16
    )), tmp_path / "export")  # fmt: skip


def test_a_csv_other_than_the_splits_is_refused_not_replaced(tmp_path):
    """The original trains on the CSV --path names; the recipe reads train.csv beside it, so
    another name would train on a file the user did not give."""
    assert recipe.csv_folder(tmp_path / "train.csv", "--data", "train") == tmp_path
    assert recipe.csv_folder(tmp_path, "--data", "train") == tmp_path
    with pytest.raises(ConfigError, match=r"--data .*train_small\.csv: .*train\.csv"):
        recipe.csv_folder(tmp_path / "train_small.csv", "--data", "train")
    tiny_export(tmp_path / "model")
    data = write_dataset(tmp_path / "data", train_skulls=1, test_skulls=1, points_per_skull=300)
    args = ["--model", str(tmp_path / "model"), "--data", str(data / "train.csv")]
    result = CliRunner().invoke(command_app(recipe.evaluate_export), args)
    assert result.exit_code == 2 and "name the file test.csv" in result.output, result.output


@pytest.mark.parametrize("points", [np.ones((1, 3)), np.ones((40, 3))])
def test_complete_refuses_a_skull_whose_points_coincide(tmp_path, points):
    """Its bounding box has no extent: normalising divides by zero (it crashed in voxelisation)."""
    args = complete_args(tmp_path, "--out", str(tmp_path / "implant.npy"))
    np.save(tmp_path / "skull.npy", points.astype(np.float32))
    result = CliRunner().invoke(command_app(recipe.complete), args)
    assert result.exit_code == 2, result.output
    assert "skull.npy: its points all coincide" in result.output
    assert not (tmp_path / "implant.npy").exists()


def test_an_export_with_an_impossible_setting_names_its_json(tmp_path):
    tiny_export(tmp_path / "model")
    meta = tmp_path / "model" / "model.json"
    document = json.loads(meta.read_text())
    document["config"]["vox_res_mult"] = 0.01  # edited by hand: the 8^3 grid vanishes
    meta.write_text(json.dumps(document))
    with pytest.raises(ConfigError, match=r"model\.json: --vox-res-mult 0\.01"):
        recipe.load_model(tmp_path / "model", torch.device("cpu"))


def test_init_from_says_which_shape_free_settings_differ_from_the_exports(tmp_path):
    """Voxel grids, radii, neighbours and centres change no tensor, so a strict load accepts an
    export trained at others: the run would fine-tune another function without a word."""
    model = tiny_export(tmp_path / "export")
    recorded = recipe.initialise_from(model, tmp_path / "export")
    same = recipe.PointCloudSettings.from_config(recorded["config"])
    assert recipe.unshaped_differences(recorded, same) == ""
    other = recipe.PointCloudSettings.from_config(recorded["config"], vox_res_mult=0.5)
    other.num_neighbors = 32
    note = recipe.unshaped_differences(recorded, other)
    assert (
        "--vox-res-mult 0.125 (this run: 0.5)" in note
        and "--num-neighbors 8 (this run: 32)" in note
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton kernels run on this GPU")
@pytest.mark.parametrize(
    "kernels, message",
    [
        ("triton", "POINTCLOUD_KERNELS=triton runs the Triton kernels, which need a CUDA GPU"),
        ("bogus", "POINTCLOUD_KERNELS='bogus': use one of auto, torch, triton"),
    ],
)
@pytest.mark.parametrize("command", ["train --dry-run", "train", "complete", "evaluate"])
def test_kernels_the_ops_would_fail_on_are_refused_before_any_work(
    tmp_path, monkeypatch, kernels, message, command
):
    """Triton on the CPU failed in the first op ("0 active drivers"), after the data was read;
    an unknown value was planned by the dry run, then stopped the run."""
    monkeypatch.setenv("POINTCLOUD_KERNELS", kernels)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "implant.npy"
    if command == "complete":
        function, args = recipe.complete, complete_args(tmp_path, "--out", str(out))
    elif command == "evaluate":
        data = tmp_path / "data"  # not there: the refusal comes before it is read
        function, args = recipe.evaluate_export, ["--model", str(tmp_path), "--data", str(data)]
    else:
        function, args = recipe.train, ["--output-dir", str(tmp_path / "run")]
        args += ["--dry-run"] if command.endswith("--dry-run") else []
    result = CliRunner().invoke(command_app(function), args)
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: {message}"), result.output
    assert "dry run" not in result.output
    assert not out.exists() and not (tmp_path / "run").exists()
