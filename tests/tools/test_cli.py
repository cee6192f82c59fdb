"""The accel-recipes command: plan table, new recipe, example data, conversion."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from accel_common.checkpoints.export import load_exported, read_export_metadata
from accel_common.tools.cli import app
from accel_common.tools.example_data import generator, workloads
from tests.processes import recipe_env

runner = CliRunner()


def table_rows(output: str) -> dict[int, list[str]]:
    rows = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if cells and cells[0].isdigit():
            rows[int(cells[0])] = cells[1:]
    return rows


def test_plan_keeping_the_per_gpu_batch():
    result = runner.invoke(
        app, ["plan", "--ref-bs", "8", "--ref-lr", "2e-4", "--per-device-bs", "8"]
    )
    assert result.exit_code == 0, result.output
    rows = table_rows(result.output)
    assert sorted(rows) == [1, 2, 4, 8, 16]
    assert rows[1] == ["8", "8", "1", "0.0002", "0.0002"]
    assert rows[8] == ["64", "8", "1", "0.0016", "0.000566"]


def test_plan_keeping_the_global_batch_flags_unsplittable_counts():
    args = ["plan", "--ref-bs", "64", "--ref-lr", "1e-3", "--bs", "64", "--gpus", "1,2,128"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = table_rows(result.output)
    assert rows[2] == ["64", "32", "1", "0.001", "0.001"]
    assert rows[128][1] == "-"
    assert "--bs 64 cannot be split evenly over 128 processes" in " ".join(result.output.split())


def test_plan_with_a_memory_cap_uses_accumulation():
    args = [
        "plan",
        "--ref-bs",
        "32",
        "--ref-lr",
        "1e-4",
        "--bs",
        "512",
        "--max-per-device-bs",
        "32",
    ]
    rows = table_rows(runner.invoke(app, args).output)
    assert rows[4] == ["512", "32", "4", "0.0016", "0.0004"]


def test_plan_refuses_bad_lr():
    result = runner.invoke(app, ["plan", "--ref-bs", "8", "--ref-lr", "-1", "--per-device-bs", "8"])
    assert result.exit_code == 2
    assert "--ref-lr must be a positive number" in result.output


def test_new_copies_the_template_and_never_overwrites(tmp_path):
    result = runner.invoke(app, ["new", "skulls", "--dest", str(tmp_path)])
    assert result.exit_code == 0, result.output
    created = tmp_path / "train_skulls.py"
    text = created.read_text()
    assert 'RECIPE = "skulls"' in text and "runs/skulls" in text
    assert text.startswith('"""The skulls recipe, started from the template')
    assert '"""Train the skulls model' in text and "template MLP" not in text
    created.write_text(text + "# my edits\n")
    again = runner.invoke(app, ["new", "skulls", "--dest", str(tmp_path)])
    assert again.exit_code == 2
    assert "already exists" in again.output
    assert created.read_text().endswith("# my edits\n")
    assert runner.invoke(app, ["new", "Bad-Name", "--dest", str(tmp_path)]).exit_code == 2


def test_new_with_a_dest_that_is_a_file_or_under_one_is_one_line(tmp_path):
    """`new NAME --dest FILE` ended in a traceback (mkdir on a file)."""
    file = tmp_path / "notes.txt"
    file.write_text("mine\n")
    for dest in (file, file / "sub"):
        result = runner.invoke(app, ["new", "skulls", "--dest", str(dest)])
        assert result.exit_code == 2, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)
        assert f"{file} is a file, not a folder" in result.output
        assert result.output.strip().startswith("error: --dest")
    assert file.read_text() == "mine\n"


@pytest.mark.slow
def test_a_new_recipe_trains_out_of_the_box(tmp_path):
    runner.invoke(app, ["new", "demo", "--dest", str(tmp_path)])
    result = subprocess.run(
        [sys.executable, str(tmp_path / "train_demo.py"), "--epochs", "1", "--max-steps", "2"],
        cwd=tmp_path,
        env=recipe_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "runs" / "demo" / "model" / "model.safetensors").is_file()
    shown = subprocess.run(
        [sys.executable, str(tmp_path / "train_demo.py"), "--help"],
        cwd=tmp_path, env=recipe_env(tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert "Train the demo model" in shown.stdout and "template" not in shown.stdout.lower()


def test_make_data_writes_the_format_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "d"
    assert runner.invoke(app, ["make-data", "template", str(out)]).exit_code == 0
    header = (out / "train.csv").read_text().splitlines()[0]
    assert header == "x0,x1,x2,x3,x4,x5,x6,x7,y"
    again = runner.invoke(app, ["make-data", "template", str(out)])
    assert again.exit_code == 2 and "--force" in again.output
    unknown = runner.invoke(app, ["make-data", "nope", str(tmp_path / "e")])
    assert unknown.exit_code == 2 and "unknown workload 'nope'" in unknown.output


def test_convert_command(tmp_path):
    source = tmp_path / "ddp.pt"
    torch.save({"model_state": {"module.weight": torch.ones(3)}, "epoch": 1}, source)
    result = runner.invoke(app, ["convert", str(source), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert (tmp_path / "out" / "model.json").is_file()
    source.write_bytes(source.read_bytes()[:64])
    bad = runner.invoke(app, ["convert", str(source), str(tmp_path / "out2")])
    assert bad.exit_code == 2
    assert "corrupt, truncated" in bad.output
    assert not (tmp_path / "out2").exists()


def test_convert_to_a_safetensors_file_writes_that_file_and_its_json(tmp_path):
    source = tmp_path / "ddp.pt"
    torch.save({"state_dict": {"module.layer.weight": torch.arange(6.0).view(2, 3)}}, source)
    target = tmp_path / "out" / "merged.safetensors"
    result = runner.invoke(app, ["convert", str(source), str(target)])
    assert result.exit_code == 0, result.output
    assert target.is_file() and (tmp_path / "out" / "merged.json").is_file()
    assert not (tmp_path / "out" / "model.safetensors").exists()
    weights = load_file(str(target))  # a file safetensors opens, not a folder
    assert list(weights) == ["layer.weight"] and weights["layer.weight"][1, 2] == 5
    meta = read_export_metadata(target)
    assert meta["converted_from"] == str(source)
    model = torch.nn.Module()
    model.layer = torch.nn.Linear(3, 2, bias=False)
    assert load_exported(target, model)["num_tensors"] == 1
    before = target.read_bytes()
    again = runner.invoke(app, ["convert", str(tmp_path / "ddp.pt"), str(target)])
    assert again.exit_code == 2 and "--force" in again.output
    assert target.read_bytes() == before


def test_a_recipe_imports_only_the_library_it_uses(tmp_path):
    """The template pulls in neither the command-line tools nor other workloads' generators
    (the quality generator brings PIL)."""
    probe = (
        "import importlib, sys\n"
        "importlib.import_module('recipes.train_template')\n"
        "loaded = [m for m in sys.modules if m.startswith(('PIL', 'accel_common.tools',"
        " 'recipes.quality', 'recipes.pointcloud'))]\n"
        "assert 'accel_common.training.loop' in sys.modules\n"
        "print(sorted(loaded))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=recipe_env(tmp_path)
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_make_data_help_lists_the_workloads():
    result = runner.invoke(app, ["make-data", "--help"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.replace("│", " ").split())  # rich wraps the list in a box
    assert f"One of: {', '.join(workloads())}." in text
    for workload in workloads():  # every "module:function" in the registry resolves
        assert generator(workload).__name__ == "write_dataset"


def test_plan_without_flags_prints_a_guide_table():
    result = runner.invoke(app, ["plan"])
    assert result.exit_code == 0, result.output
    assert "No reference given: showing --ref-bs 32 --ref-lr 0.001" in result.output
    eight_gpus = next(line for line in result.output.splitlines() if line.startswith("│    8 "))
    assert [cell.strip() for cell in eight_gpus.split("│")[1:-1]] == [
        "8", "256", "32", "1", "0.008", "0.00283",
    ]  # fmt: skip


def test_convert_from_an_original_finds_the_recipe_that_converts_it(tmp_path, monkeypatch):
    """`convert --from NAME` uses the recipes/X/convert.py that declares ORIGINAL = "NAME", found
    by where it lives; `--to NAME` writes the original's format; an unknown name lists the known."""
    import recipes
    from accel_common.tools import originals

    folder = tmp_path / "recipes"
    (folder / "zzorig").mkdir(parents=True)
    (folder / "zzorig" / "__init__.py").write_text("")
    (folder / "zzorig" / "convert.py").write_text(
        'import torch\nORIGINAL = "zz-original"\n\n'
        "def import_checkpoint(source):\n"
        "    state = torch.load(source, weights_only=True)['model_state']\n"
        "    return state, {'width': 2}\n\n"
        "def export_checkpoint(model_dir, target):\n"
        "    (target).write_text('original format')\n"
        "    return target\n"
    )
    monkeypatch.setattr(originals, "RECIPES", folder)
    monkeypatch.setattr(recipes, "__path__", [*recipes.__path__, str(folder)])
    assert originals.originals() == {"zz-original": "zzorig"}
    checkpoint = tmp_path / "ckpt.pt"
    torch.save({"model_state": {"w": torch.ones(2)}}, checkpoint)
    out = tmp_path / "export"
    result = runner.invoke(app, ["convert", str(checkpoint), str(out), "--from", "zz-original"])
    assert result.exit_code == 0, result.output
    meta = read_export_metadata(out)
    assert meta["recipe"] == "zzorig" and meta["config"] == {"width": 2}
    assert torch.equal(load_file(str(out / "model.safetensors"))["w"], torch.ones(2))
    again = runner.invoke(app, ["convert", str(checkpoint), str(out), "--from", "zz-original"])
    assert again.exit_code == 2 and "pass --force" in again.output
    back = tmp_path / "back.pt"
    result = runner.invoke(app, ["convert", str(out), str(back), "--to", "zz-original"])
    assert result.exit_code == 0 and back.read_text() == "original format"
    unknown = runner.invoke(app, ["convert", str(checkpoint), str(out), "--from", "nope"])
    assert "no recipe converts it; choose one of: zz-original" in unknown.output
    # a converter written before --set existed: --set is refused naming it, in one line
    refused = runner.invoke(
        app, ["convert", str(checkpoint), str(tmp_path / "set"), "--from", "zz-original",
              "--set", "width=3"],
    )  # fmt: skip
    assert refused.exit_code != 0 and len(refused.output.strip().splitlines()) == 1
    assert "import_checkpoint(source) takes no settings" in refused.output
