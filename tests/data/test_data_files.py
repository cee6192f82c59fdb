"""Issue 43: the data's fingerprint covers exactly the files a run reads. Every recipe declares
the files its reader opens (`make_loop(data_files=...)`); each recipe's run here, at a tiny size,
records every file it opens (Python's `open` audit event: builtins.open, Path.open, np.load,
PIL, ase) and must have declared exactly those. A resume on a changed file the run reads, in
--data or outside it, is refused naming the file; a change to a file it does not read is not.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from accelerate.state import AcceleratorState

from accel_common.errors import CheckpointError
from accel_common.recipe_cli.entry import train_in_python
from accel_common.tools.check.opened import data_files_read, files_declared, files_opened
from accel_common.tools.check.recipe import discovered, find_recipe
from tests.processes import (
    CRICKET,
    CRICKET_TINY,
    POINTCLOUD,
    POINTCLOUD_TINY,
    QUALITY,
    TEMPLATE,
)


def train(
    recipe: str, script: Path, argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[set[Path], set[Path]]:
    """Train `recipe` in this process on data under `tmp_path`; returns the data files it opened
    (anything under `tmp_path` but its output and caches) and those it declared."""
    module = __import__(f"recipes.train_{recipe}", fromlist=["train"])
    out, cache = tmp_path / "run", tmp_path / "hf"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))  # the fingerprint's digests
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))  # prepared tables
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with files_opened() as opened, files_declared() as declared:
            train_in_python(module.train, [*argv, "--output-dir", str(out)], out, script=script)
    finally:
        torch.set_num_threads(threads)
        AcceleratorState._reset_state(reset_partial_state=True)
    return (
        data_files_read(opened, tmp_path, [out, cache]),
        {Path(os.path.abspath(p)) for p in declared.values()},
    )


def resume_refused(recipe: str, script: Path, argv: list[str], tmp_path: Path, monkeypatch) -> str:
    """The one-line refusal of `--resume latest` (to train on past the checkpoint)."""
    resume = [*argv, "--resume", "latest", "--max-steps", "3"]
    with pytest.raises(CheckpointError) as error:
        train(recipe, script, resume, tmp_path, monkeypatch)
    message = str(error.value)
    assert "\n" not in message and "its files' contents differ from the data" in message
    return message


# --------------------------------------------------------------------------- each recipe's data


def template_data(tmp_path: Path) -> list[str]:
    from recipes.train_template import write_dataset

    data = write_dataset(tmp_path / "data", train_size=64, test_size=16)
    (data / "README.md").write_text("not read\n")
    return ["--data", str(data), "--hidden", "8", "--bs", "16"]


def pointcloud_data(tmp_path: Path) -> list[str]:
    """One training case lives in another folder, its CSV row an absolute path there."""
    from recipes.pointcloud.data import DEFECTS, SKULL_AND_IMPLANT
    from recipes.pointcloud.example import write_dataset

    data = write_dataset(tmp_path / "data", train_skulls=2, test_skulls=1, points_per_skull=600)
    elsewhere = tmp_path / "elsewhere"
    for kind in SKULL_AND_IMPLANT:
        for defect in DEFECTS:
            (elsewhere / kind / defect).mkdir(parents=True)
            os.replace(
                data / kind / defect / "000_surf.npy", elsewhere / kind / defect / "000_surf.npy"
            )
    csv = data / "train.csv"
    csv.write_text(
        csv.read_text().replace(
            "complete_skull/000_surf.npy", str(elsewhere / "complete_skull" / "000_surf.npy")
        )
    )
    return ["--data", str(data), *POINTCLOUD_TINY, "--bs", "2", "--sample-steps", "2"]


def quality_data(tmp_path: Path) -> list[str]:
    """The images outside --data (--image-dir), one annotator's folder dot-named."""
    from recipes.quality.example import write_dataset

    data = write_dataset(tmp_path / "data", images=12, comparisons_per_annotator=16, size=16)
    os.replace(data / "images", tmp_path / "images")
    os.replace(data / "casual", data / ".casual")
    truth = json.loads((data / "truth.json").read_text())
    truth["reliability"][".casual"] = truth["reliability"].pop("casual")
    (data / "truth.json").write_text(json.dumps(truth))
    args = ["--data", str(data), "--image-dir", str(tmp_path / "images"), "--image-size", "16"]
    return [*args, "--bs", "8"]


def cricket_data(tmp_path: Path) -> list[str]:
    from recipes.cricket.example import write_dataset

    data = write_dataset(tmp_path / "data", matches=12)
    (data / "README.txt").write_text("not read\n")
    args = ["--data", str(data), *CRICKET_TINY, "--bs", "8", "--val-ratio", "0.2"]
    return [*args, "--test-ratio", "0.2", "--graph-cache-dir", str(tmp_path / "hf" / "graphs")]


def exactly_declared(opened: set[Path], declared: set[Path]) -> None:
    """A file opened but not declared resumes silently on changed data; one declared but not
    read (a README) refuses a resume for nothing."""
    assert opened, "the run opened no data file: the recording is broken"
    assert sorted(opened - declared) == [], "opened, not in the fingerprint"
    assert sorted(declared - opened) == [], "in the fingerprint, not opened"


@pytest.mark.parametrize("recipe", discovered())
def test_each_recipe_declares_exactly_the_files_its_run_opens(recipe, tmp_path, monkeypatch):
    """Every recipe there is (recipes/train_*.py), on its example at the size it declares for
    `accel-recipes check` (CHECK_DATA, CHECK_ARGS)."""
    found = find_recipe(recipe)
    data = found.write_example(tmp_path / "data")
    argv = ["--data", str(data), *found.args, "--max-steps", "1"]
    exactly_declared(*train(recipe, found.script, argv, tmp_path, monkeypatch))


def test_pointcloud_refuses_a_resume_on_a_changed_file_its_csv_lists_elsewhere(
    tmp_path, monkeypatch
):
    argv = [*pointcloud_data(tmp_path), "--max-steps", "1"]
    train("pointcloud", POINTCLOUD, argv, tmp_path, monkeypatch)
    implant = tmp_path / "elsewhere" / "implant" / "bilateral" / "000_surf.npy"
    np.save(implant, np.load(implant) * 1.01)
    message = resume_refused("pointcloud", POINTCLOUD, argv, tmp_path, monkeypatch)
    assert f"(changed: {implant}; fingerprint " in message


def test_quality_refuses_a_resume_on_changed_images_outside_data_or_a_dot_named_annotator(
    tmp_path, monkeypatch
):
    argv = [*quality_data(tmp_path), "--max-steps", "1"]
    train("quality", QUALITY, argv, tmp_path, monkeypatch)
    image = tmp_path / "images" / "img_003.png"
    original = image.read_bytes()
    shutil.copy(tmp_path / "images" / "img_004.png", image)
    message = resume_refused("quality", QUALITY, argv, tmp_path, monkeypatch)
    assert "(changed: --image-dir/img_003.png; fingerprint " in message
    image.write_bytes(original)

    votes = tmp_path / "data" / ".casual" / "comparison_data.json"
    records = json.loads(votes.read_text())
    first = records["comparisons"][0]
    first["choice"] = {"left": "right", "right": "left"}.get(first["choice"], "left")
    votes.write_text(json.dumps(records, indent=1))
    message = resume_refused("quality", QUALITY, argv, tmp_path, monkeypatch)
    assert "(changed: .casual/comparison_data.json; fingerprint " in message


def test_a_file_the_run_does_not_read_may_change_between_resumes(tmp_path, monkeypatch):
    argv = [*template_data(tmp_path), "--max-steps", "1"]
    train("template", TEMPLATE, argv, tmp_path, monkeypatch)
    (tmp_path / "data" / "README.md").write_text("edited, still not read\n")
    (tmp_path / "data" / "notes.csv").write_text("a,b\n1,2\n")
    train(
        "template",
        TEMPLATE,
        [*argv, "--resume", "latest", "--max-steps", "2"],
        tmp_path,
        monkeypatch,
    )
    assert (tmp_path / "run" / "checkpoints" / "step_2").is_dir()
    csv = tmp_path / "data" / "test.csv"
    header, row, rest = csv.read_text().split("\n", 2)
    x0, others = row.split(",", 1)
    edited = x0[:-1] + ("2" if x0[-1] == "1" else "1")  # a value's last digit
    csv.write_text("\n".join([header, f"{edited},{others}", rest]))
    message = resume_refused("template", TEMPLATE, argv, tmp_path, monkeypatch)
    assert "(changed: test.csv; fingerprint " in message


def test_cricket_declares_the_files_it_opens_also_when_fine_tuning(tmp_path, monkeypatch):
    """--init-from's vocab.json decides the features as much as the matches do."""
    argv = [*cricket_data(tmp_path), "--max-steps", "1"]
    exactly_declared(*train("cricket", CRICKET, argv, tmp_path, monkeypatch))
    shutil.copytree(tmp_path / "run" / "model", tmp_path / "start")
    shutil.rmtree(tmp_path / "run")
    tuned = [*argv, "--init-from", str(tmp_path / "start")]
    opened, declared = train("cricket", CRICKET, tuned, tmp_path, monkeypatch)
    assert tmp_path / "start" / "vocab.json" in opened
    # the export's own files are the model, not data: its metadata is read to check the export
    # is cricket's (its weights too, by safetensors, unseen here); the run restores neither
    exactly_declared(opened - {tmp_path / "start" / "model.json"}, declared)
