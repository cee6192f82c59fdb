"""A run killed with SIGKILL and resumed ends exactly where the uninterrupted run ends."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from accel_common.checkpoints.checkpoint import list_checkpoints
from accel_common.run_folder.outputs import LOCK_FILE
from accel_common.tools.check.recipe import discovered, find_recipe
from tests.processes import kill_once_written, run_recipe, run_to_the_end
from tests.results import exported_params, metrics_log

pytestmark = pytest.mark.slow

EPOCHS = 2  # killed in the second: a resume into the middle of an epoch, after an evaluation


def kill_step(total_steps: int) -> int:
    """Where the killed run dies: three quarters into the uninterrupted run, so inside its second
    epoch whatever the recipe's epoch length (the test checks that it is)."""
    return max(1, 3 * total_steps // 4)


@pytest.mark.parametrize("recipe", discovered())
def test_sigkill_mid_epoch_then_resume_matches_uninterrupted_run(
    recipe, tmp_path, check_example, capsys, monkeypatch
):
    """Every recipe there is (recipes/train_*.py), on its example at the size it declares for
    `accel-recipes check` (CHECK_DATA), run as CHECK_ARGS and then CHECK_RESUME ask (randomness
    and state one process must restore: dropout, augmentation, an EMA of the weights, an
    evaluation that samples).

    Issue 27: after a resume the weights were bit-equal but the point-cloud export's Chamfer
    distance was not (61.82 vs 59.31 mm): how many evaluations a process had run decided which
    random numbers the next one drew. Issue 43: the training loss of the epoch the kill cut
    covered only the steps since the resume."""
    found = find_recipe(recipe)
    args = ["--data", str(check_example(recipe)), *found.resume_args, "--epochs", str(EPOCHS)]
    full = tmp_path / "full"
    run_to_the_end(found, [*args, "--output-dir", str(full)], tmp_path, capsys, monkeypatch)
    # its last step: the checkpoint saved at its end (the export may be an earlier, best epoch)
    total_steps = int(list_checkpoints(full)[-1].name.removeprefix("step_"))

    # a checkpoint at the kill step only (--save-every changes when a run saves, not what it
    # trains): the run is killed as soon as it is complete
    kill_at = kill_step(total_steps)
    args += ["--save-every", str(kill_at)]
    killed = tmp_path / "killed"
    marker = killed / "checkpoints" / f"step_{kill_at}" / "progress.json"
    kill_once_written(
        found.script, [*args, "--output-dir", str(killed)], cwd=tmp_path, marker=marker
    )
    assert [p.name for p in list_checkpoints(killed)] == [f"step_{kill_at}"]
    assert not (killed / "model").exists()  # it really died before finishing
    progress = json.loads(marker.read_text())["progress"]
    where = (
        f"killed at step {kill_at} of {total_steps}, epoch {progress['epoch'] + 1} sample "
        f"{progress['samples_in_epoch']}: not inside the second epoch; declare a CHECK_DATA (or "
        "CHECK_RESUME --bs) that makes an epoch several optimizer steps"
    )
    assert progress["epoch"] == 1 and progress["samples_in_epoch"] > 0, where

    resume = [*args, "--output-dir", str(killed), "--resume", "latest"]
    printed = run_to_the_end(found, resume, tmp_path, capsys, monkeypatch)
    assert f"resumed from {marker.parent}" in printed
    expected, resumed = exported_params(full), exported_params(killed)
    assert expected.keys() == resumed.keys()
    for key in expected:
        assert (expected[key] == resumed[key]).all(), key  # bit-identical on the same machine
    # every evaluation alike, the training loss of the epoch the kill cut included (issue 43: it
    # covered only the steps since the resume; the checkpoint now carries the running sums),
    # and so the export's metrics
    logged = [evaluations(run) for run in (full, killed)]
    assert max(logged[0]) == total_steps
    assert logged[0] == logged[1]
    exports = [json.loads((run / "model" / "model.json").read_text()) for run in (full, killed)]
    for export in exports:
        del export["metrics"]["train_seconds"]
    assert exports[0]["metrics"] == exports[1]["metrics"]


def evaluations(output_dir: Path) -> dict[int, dict]:
    """The logged evaluations (training loss included) by step; of a step logged twice (by the
    killed run and the resumed one), the later."""
    return {
        record["step"]: {k: v for k, v in record.items() if k != "time"}
        for record in metrics_log(output_dir)
        if "train/epoch_loss" in record
    }


def refuse(constant: str) -> None:
    raise AssertionError(f"{constant} in a JSON file")


def test_resuming_a_finished_template_run_leaves_its_export_byte_identical(tmp_path, template_data):
    """Issue 27: the resume rewrote model.json with `train_loss: NaN` (not JSON),
    `train_seconds: 0.0` and its own process count, and printed `train_loss nan`."""
    out = tmp_path / "out"
    args = ["--data", str(template_data), "--output-dir", str(out), "--bs", "256", "--epochs", "1"]
    args += ["--hidden", "8", "--depth", "1"]
    run_recipe(args, cwd=tmp_path)
    export = out / "model"
    before = {name: (export / name).read_bytes() for name in ("model.json", "model.safetensors")}
    assert json.loads(before["model.json"], parse_constant=refuse)["step"] == 8

    again = run_recipe([*args, "--resume", "latest"], cwd=tmp_path)
    assert f"the run in {out} already finished at step 8; its export in {export} is unchanged" in (
        again.stdout
    )
    assert "train_loss nan" not in again.stdout and "epoch 1:" not in again.stdout
    assert {name: (export / name).read_bytes() for name in before} == before
    assert [p.name for p in list_checkpoints(out)] == ["step_8"]


# ------------------------------------------------------------------ edited data, older steps

TEMPLATE_SMALL = ["--bs", "256", "--epochs", "2", "--hidden", "8", "--depth", "1"]


def template_run(tmp_path: Path, template_data: Path) -> tuple[Path, list[str]]:
    """A finished 16-step template run with checkpoints at steps 4, 8, 12 and 16, on its own
    copy of the data."""
    data = tmp_path / "data"
    shutil.copytree(template_data, data)
    out = tmp_path / "out"
    args = ["--data", str(data), "--output-dir", str(out), *TEMPLATE_SMALL]
    args += ["--save-every", "4", "--keep-last", "5"]
    run_recipe(args, cwd=tmp_path)
    assert [p.name for p in list_checkpoints(out)] == ["step_4", "step_8", "step_12", "step_16"]
    return out, args


def snapshot(out: Path) -> dict[str, bytes]:
    """Every file of a run's folder but its lock (which records the last process to hold it)."""
    files = (p for p in sorted(out.rglob("*")) if p.is_file() and p.name != LOCK_FILE)
    return {str(p.relative_to(out)): p.read_bytes() for p in files}


def test_a_checkpoint_from_before_a_setting_existed_resumes_at_its_default(tmp_path, template_data):
    """A setting added to the recipes after a checkpoint was saved is absent from its recorded
    identity. The run it continues ran as that setting's default, so resuming at the default goes
    on; another value is a different run and is refused, naming the setting."""
    out = tmp_path / "out"
    args = ["--data", str(template_data), "--output-dir", str(out), *TEMPLATE_SMALL]
    args[args.index("--epochs") + 1] = "1"
    run_recipe(args, cwd=tmp_path)
    (checkpoint,) = list_checkpoints(out)
    progress_file = checkpoint / "progress.json"
    record = json.loads(progress_file.read_text())
    for newer in ("hold_epochs", "decay_per_epoch"):  # as a checkpoint saved before they existed
        del record["run"]["identity"][newer]
    del record["manifest_format"], record["progress"]["epoch_samples"]  # which were later too
    progress_file.write_text(json.dumps(record))
    (checkpoint / "manifest.json").unlink()
    args.append("--allow-unverified")

    refused = run_recipe(
        [*args, "--epochs", "2", "--hold-epochs", "1", "--resume", "latest"],
        cwd=tmp_path,
        check=False,
    )
    assert refused.returncode == 2, refused.stderr
    assert "--hold-epochs unset in the checkpoint, 1 now" in refused.stderr

    resumed = run_recipe([*args, "--epochs", "2", "--resume", "latest"], cwd=tmp_path)
    assert f"resumed from {checkpoint}: step 8" in resumed.stdout
    assert [p.name for p in list_checkpoints(out)][-1] == "step_16"
