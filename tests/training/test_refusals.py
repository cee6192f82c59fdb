"""Every refusal of a run's start in one place: a resume of another run's checkpoint (another
recipe, global batch, settings or data), one past the run's end, a corrupt or incomplete one, an
older checkpoint without --overwrite-later, an occupied --output-dir without --overwrite. Each
refusal names the flag that resolves it (accel_common.training.run)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from accel_common.batch_lr.batching import plan_batch
from accel_common.checkpoints.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from accel_common.errors import CheckpointError, ConfigError, DataError
from accel_common.settings import describe_differences
from accel_common.training.run import RunCheck
from tests.checkpoints.test_checkpoint import Net, at_step
from tests.processes import run_recipe
from tests.recipes.template.conftest import finished_run  # noqa: F401 (a fixture)
from tests.recipes.template.helpers import digest
from tests.results import exported_params
from tests.training.test_loop import run, train  # noqa: F401 (run: a fixture)
from tests.training.test_resume import snapshot, template_run


@pytest.mark.slow
def test_corrupt_checkpoint_is_refused_and_left_alone(finished_run, template_data, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    checkpoint = sorted((out / "checkpoints").iterdir())[-1]
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    before = digest(out)
    flags = ["--data", str(template_data), "--output-dir", str(out), "--resume", str(checkpoint)]
    result = run_recipe(flags, cwd=tmp_path, check=False)
    assert result.returncode == 2
    assert f"{weights} is truncated or was changed after the save" in result.stderr
    assert "Traceback" not in result.stderr
    assert digest(out) == before


def test_corrupt_checkpoint_is_refused_with_advice(tmp_path, accelerator):
    accelerator.prepare(Net())
    plan = plan_batch(1, global_batch_size=8)
    path = save_checkpoint(accelerator, tmp_path, at_step(1), plan=plan)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])
    with pytest.raises(CheckpointError, match="truncated or was changed after the save"):
        load_checkpoint(accelerator, path, plan)
    (path / "manifest.json").unlink()  # unverified: the loader itself names the file
    with pytest.raises(CheckpointError, match=r"model\.safetensors is corrupt or truncated"):
        load_checkpoint(accelerator, path, plan, allow_unverified=True)


def test_resume_with_another_global_batch_is_refused(tmp_path, accelerator):
    accelerator.prepare(Net())
    path = save_checkpoint(
        accelerator, tmp_path, at_step(1), plan=plan_batch(1, global_batch_size=8)
    )
    with pytest.raises(CheckpointError, match="pass --bs 8"):
        load_checkpoint(
            accelerator, path, small := plan_batch(1, global_batch_size=16), accept=RunCheck(small)
        )


def test_resume_path_without_progress_is_refused(tmp_path):
    (tmp_path / "half").mkdir()
    with pytest.raises(CheckpointError, match="never completed"):
        resolve_resume(str(tmp_path / "half"), tmp_path)
    assert resolve_resume("latest", tmp_path / "empty") is None


def test_resume_past_the_end_of_a_shorter_schedule_is_refused(tmp_path, accelerator):
    accelerator.prepare(Net())
    plan = plan_batch(1, global_batch_size=8)
    path = save_checkpoint(accelerator, tmp_path, at_step(1400), plan=plan)
    with pytest.raises(CheckpointError, match=r"at optimizer step 1400, past the 640 steps"):
        load_checkpoint(accelerator, path, plan, accept=RunCheck(plan, total_steps=640))


def test_another_runs_checkpoint_is_refused_naming_what_differs(tmp_path, accelerator):
    accelerator.prepare(Net())
    plan = plan_batch(1, global_batch_size=8)
    saved = {"recipe": "template", "epochs": 20, "hidden": 64, "lr": 0.003}
    path = save_checkpoint(
        accelerator, tmp_path, at_step(64), plan=plan,
        run={"id": "abc", "identity": saved},
    )  # fmt: skip
    now = {**saved, "epochs": 100, "hidden": 128}
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(accelerator, path, plan, accept=RunCheck(plan, now))
    message = str(error.value)
    assert "another run (id abc)" in message
    assert (
        "--epochs 20 in the checkpoint, 100 now; --hidden 64 in the checkpoint, 128 now" in message
    )
    assert "lr" not in message.split(":", 1)[1].split(";")[0]  # only what differs is named
    progress, record = load_checkpoint(accelerator, path, plan, accept=RunCheck(plan, dict(saved)))
    assert (progress.step, record["id"]) == (64, "abc")


def test_a_checkpoint_of_other_data_is_refused_naming_the_data(tmp_path, accelerator):
    accelerator.prepare(Net())
    plan = plan_batch(1, global_batch_size=8)
    saved = {"recipe": "template", "hidden": 64, "data_fingerprint": "read-sha256:aaaa"}
    path = save_checkpoint(
        accelerator, tmp_path, at_step(64), plan=plan,
        run={"id": "abc", "identity": saved},
    )  # fmt: skip
    now = {**saved, "data_fingerprint": "read-sha256:bbbb"}
    with pytest.raises(CheckpointError, match=r"^--data D: its files' contents differ from the "):
        load_checkpoint(accelerator, path, plan, accept=RunCheck(plan, now, data_dir=Path("D")))
    # an earlier version's fingerprints (names and sizes; the whole --data folder's contents)
    # cannot be compared with one of the files read
    for step, earlier in ((65, "0123456789abcdef"), (66, "sha256:0123456789abcdef")):
        old = save_checkpoint(
            accelerator, tmp_path, at_step(step), plan=plan,
            run={"id": "abc", "identity": {**saved, "data_fingerprint": earlier}},
        )  # fmt: skip
        assert load_checkpoint(accelerator, old, plan, accept=RunCheck(plan, now))[0].step == step
    # with each file's digest recorded, the refusal names the files that differ
    listed = save_checkpoint(
        accelerator, tmp_path, at_step(67), plan=plan,
        run={"id": "abc", "identity": saved, "data_files": {"a.csv": "1", "b.csv": "2"}},
    )  # fmt: skip
    digests = {"a.csv": "1", "b.csv": "3", "/elsewhere/c.png": "4"}
    check = RunCheck(plan, now, data_dir=Path("D"), data_digests=digests)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(accelerator, listed, plan, accept=check)
    assert "(changed: b.csv; added: /elsewhere/c.png; fingerprint read-sha256:aaaa then, " in str(
        error.value
    )


def test_another_recipes_checkpoint_is_refused_naming_the_recipe_before_the_batch(
    tmp_path, accelerator
):
    """Issue 27: resuming in another recipe's output folder first asked for `--bs 8`."""
    accelerator.prepare(Net())
    saved = {"recipe": "pointcloud", "width": 16, "global_batch_size": 8}
    path = save_checkpoint(
        accelerator, tmp_path, at_step(45), plan=plan_batch(1, global_batch_size=8),
        run={"id": "abc", "identity": saved},
    )  # fmt: skip
    now = {"recipe": "template", "hidden": 64, "global_batch_size": 64}
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(
            accelerator, path, big := plan_batch(1, global_batch_size=64), accept=RunCheck(big, now)
        )
    assert str(error.value) == (
        f"{path} is a checkpoint of the pointcloud recipe, not of template; resume it with "
        "recipes/train_pointcloud.py, or give this template run its own --output-dir"
    )


def test_a_refused_resume_names_settings_as_flags_and_data_statistics_as_such():
    saved = {"recipe": "crystal", "width": 64, "mean": -0.5}
    now = {"recipe": "crystal", "width": 32, "mean": -0.4}
    assert describe_differences(saved, now, frozenset({"mean"})) == (
        "mean (computed from the data): -0.5 in the checkpoint, -0.4 now; "
        "--width 64 in the checkpoint, 32 now"
    )


def test_a_new_run_refuses_a_folder_that_holds_another_run(run, tmp_path):  # noqa: F811
    accelerator, model, optimizer, loop, _ = run()
    train(accelerator, model, optimizer, loop)
    loop.finish(model)
    with pytest.raises(CheckpointError, match=r"already holds another run .*--resume latest"):
        run()
    # a run that died before its first save starts over under --resume latest
    interrupted = tmp_path.parent / f"{tmp_path.name}-interrupted"
    (interrupted / "logs").mkdir(parents=True)
    (interrupted / "logs" / "metrics.jsonl").write_text("{}\n")
    assert run(resume="latest", out=interrupted)[3].step == 0
    with pytest.raises(CheckpointError, match=r"another run .*--hidden unset in the checkpoint"):
        run(resume="latest", config={"lr": 1e-3, "hidden": 16})
    loop = run(resume="latest", config={"lr": 2e-4})[3]  # rescuing a run with a lower LR is fine
    assert loop.step == 12
    _, model, _, loop, _ = run(overwrite=True)  # moves the old run aside, deletes nothing
    aside = [p for p in tmp_path.parent.iterdir() if p.name.startswith(f"{tmp_path.name}.replaced")]
    assert len(aside) == 1
    assert (aside[0] / "model" / "model.safetensors").is_file()
    assert [p.name for p in list_checkpoints(aside[0])] == ["step_4", "step_8", "step_12"]
    assert list_checkpoints(tmp_path) == [] and not (tmp_path / "model").exists()


def test_edited_data_of_the_same_size_is_refused_on_resume(tmp_path, template_data):
    """Issue 27: values changed in train.csv at the same byte size resumed silently (the run's
    identity held the files' names and sizes only) and trained on the new data."""
    out, args = template_run(tmp_path, template_data)
    train_csv = tmp_path / "data" / "train.csv"
    data = train_csv.read_bytes()
    row = data.splitlines()[1]
    x0, rest = row.split(b",", 1)  # a feature, not y: the template records y's mean
    edited = x0.replace(b"1", b"7").replace(b"2", b"1") + b"," + rest  # same length
    assert edited != row and len(edited) == len(row)
    train_csv.write_bytes(data.replace(row, edited, 1))
    assert train_csv.stat().st_size == len(data)
    before = snapshot(out)
    result = run_recipe([*args, "--resume", "latest"], cwd=tmp_path, check=False)
    assert result.returncode == 2, result.stderr
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert f"--data {tmp_path / 'data'}: its files' contents differ from the data" in line
    assert "step_16 was trained on" in line and "--output-dir" in line
    assert snapshot(out) == before  # nothing trained, saved, exported or logged


def test_resuming_an_older_checkpoint_is_refused_unless_told_to_move_later_results_aside(
    tmp_path, template_data
):
    """Issue 27: `--resume .../step_8` of a finished run trained on and overwrote the run's
    later checkpoints and its export."""
    out, args = template_run(tmp_path, template_data)
    older = out / "checkpoints" / "step_8"
    before = snapshot(out)
    result = run_recipe([*args, "--resume", str(older)], cwd=tmp_path, check=False)
    assert result.returncode == 2, result.stderr
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert f"--resume {older}: {out} holds later results of this run" in line
    assert "(step_12, step_16, the export of step 16 (" in line
    assert "--overwrite-later" in line and "--resume latest" in line
    assert snapshot(out) == before

    result = run_recipe([*args, "--resume", str(older), "--overwrite-later"], cwd=tmp_path)
    assert "moved aside" in result.stdout
    assert [p.name for p in list_checkpoints(out)] == ["step_4", "step_8", "step_12", "step_16"]
    # the same trajectory again: the new export equals the one moved aside, bit for bit
    (aside,) = [p for p in out.iterdir() if p.name.startswith("model.replaced-")]
    assert (aside / "model.safetensors").read_bytes() == before["model/model.safetensors"]
    assert exported_params(out).keys() == load_file(str(aside / "model.safetensors")).keys()
    assert all(
        (exported_params(out)[k] == load_file(str(aside / "model.safetensors"))[k]).all()
        for k in exported_params(out)
    )
    moved = sorted(p.name.split(".")[0] for p in (out / "checkpoints").glob("step_*.replaced-*"))
    assert moved == ["step_12", "step_16"]


def test_overwrite_with_resume_is_refused_naming_both_flags(run, tmp_path):  # noqa: F811
    with pytest.raises(
        ConfigError, match=r"^--overwrite starts a new run; it cannot go with --resume$"
    ):
        run(resume="latest", overwrite=True)
    assert not (tmp_path / "checkpoints").exists()


def test_overwrite_later_without_resume_is_refused(run, tmp_path):  # noqa: F811
    with pytest.raises(ConfigError, match=r"^--overwrite-later goes with --resume CHECKPOINT"):
        run(overwrite_later=True)
    assert not (tmp_path / "checkpoints").exists()


# single-device commands that write --out, with their other arguments: the model named is
# missing, so only an --out checked before the model is read is refused for --out
SINGLE_DEVICE_COMMANDS = [
    ("captioning", "caption", ["--images", "images"], "captions.tsv"),
    ("cricket", "predict", ["--match", "match.json"], "predictions.csv"),
    ("crystal", "predict", ["--data", "structures.extxyz"], "predictions.csv"),
    ("quality", "score_folder", ["--images", "images"], "scores.csv"),
    ("quality", "export_onnx", [], "scorer.onnx"),
    ("pointcloud", "complete", ["--skull", "skull.npy"], "implant.npy"),
]


@pytest.mark.parametrize(("recipe", "command", "args", "name"), SINGLE_DEVICE_COMMANDS)
def test_an_out_in_a_read_only_folder_is_refused_before_the_work(
    recipe, command, args, name, tmp_path, read_only_folder
):
    """Issue 43: an existing read-only folder for --out was found only when the result was
    written, after the work, in a traceback."""
    import importlib

    from accel_common.errors import exit_on_error
    from tests.processes import invoke_train

    module = importlib.import_module(f"recipes.train_{recipe}")
    out = read_only_folder / name
    flags = [*args, "--model", str(tmp_path / "missing"), "--out", str(out)]
    result = invoke_train(exit_on_error(getattr(module, command)), flags)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: --out {out}: cannot write in {read_only_folder}")
    assert result.stderr.count("\n") == 1


def test_export_onnx_names_a_wrong_model_before_asking_for_onnx(tmp_path):
    """A missing --model was reported as 'export-onnx needs onnx' where onnx was not installed:
    installing it would not have helped."""
    from accel_common.errors import exit_on_error
    from recipes.quality.commands import export_onnx
    from tests.processes import invoke_train

    flags = ["--model", str(tmp_path / "missing"), "--out", str(tmp_path / "scorer.onnx")]
    result = invoke_train(exit_on_error(export_onnx), flags)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: --model {tmp_path / 'missing'}"), result.stderr


def test_prepare_into_a_read_only_folder_is_refused_before_any_volume(tmp_path, read_only_folder):
    pytest.importorskip("mcubes")
    from recipes.pointcloud.prepare import prepare_skullbreak

    (tmp_path / "raw").mkdir()
    with pytest.raises(DataError, match=f"^--out {read_only_folder}: cannot write in"):
        prepare_skullbreak(tmp_path / "raw", read_only_folder, points=8, workers=1, overwrite=False)


# the recipes that start from an export (--init-from), and the original each converts
INIT_FROM_RECIPES = {
    "crystal": "comformer",
    "quality": "crowd-bt",
    "cricket": "cricketmodel",
    "pointcloud": "pcdiff",
}


@pytest.mark.parametrize("recipe", INIT_FROM_RECIPES)
def test_init_from_an_original_checkpoint_or_another_recipes_export_says_which(recipe, tmp_path):
    """Issue 43: --init-from an original's checkpoint ended in a traceback (or a safetensors
    parse error), and another recipe's export asked about width/depth flags. One line: the
    convert command that makes an original's checkpoint an export; the other export's recipe.
    Both are refused before any data is read (--data names a folder that does not exist)."""
    import importlib

    import torch

    from accel_common.checkpoints.export import write_export
    from accel_common.recipe_cli.entry import train_in_python
    from tests.processes import REPO

    module = importlib.import_module(f"recipes.train_{recipe}")
    original = INIT_FROM_RECIPES[recipe]
    checkpoint = tmp_path / "best_model.pt"
    torch.save({"model": {"w": torch.zeros(2)}}, checkpoint)
    other = "template" if recipe != "template" else "crystal"
    write_export({"w": torch.zeros(2)}, tmp_path / "other", {"recipe": other, "config": {}})
    says = {
        checkpoint: f"--init-from {checkpoint}: not an export but {original}'s checkpoint",
        tmp_path: f"--init-from {tmp_path}: no export there but checkpoint files (best_model.pt)",
        tmp_path / "other": f"--init-from {tmp_path / 'other'} is the {other} recipe's export",
    }
    for source, message in says.items():
        argv = ["--data", str(tmp_path / "no-data"), "--init-from", str(source)]
        with pytest.raises(ConfigError) as refused:
            train_in_python(
                module.train, argv, tmp_path / "run", script=REPO / f"recipes/train_{recipe}.py"
            )
        assert str(refused.value).startswith(message), str(refused.value)
        if source != tmp_path / "other":
            assert f"accel-recipes convert --from {original} {source}" in str(refused.value)
        assert "width" not in str(refused.value) and "\n" not in str(refused.value)


def test_init_from_a_truncated_export_is_one_line_naming_the_file(tmp_path):
    """Fault-injection pass: a truncated model.safetensors given to quality's or cricket's
    --init-from ended in safetensors' traceback ('invalid header length') after the data was
    read; crystal and pointcloud named the file. Now all four do."""
    import torch

    from accel_common.checkpoints.export import write_export
    from accel_common.errors import CheckpointError
    from recipes.quality.model import start_from
    from recipes.train_cricket import read_start

    export = tmp_path / "model"
    write_export({"w": torch.zeros(64)}, export, {"recipe": "cricket", "config": {}})
    (export / "vocab.json").write_text("{}")
    weights = export / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])
    # quality reads the file before it touches the model, so none is built here
    for start in (read_start, lambda path: start_from(None, path)):
        with pytest.raises(CheckpointError, match=f"{weights} is not a readable safetensors"):
            start(export)
