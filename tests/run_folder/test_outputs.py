"""One writer per output (accel_common/run_folder/outputs.py): two processes started together never
both write one output. A run holds its output folder (a second run or resume is refused, naming the
holder; a SIGKILLed holder blocks nothing); make-data, --out files and convert outputs are
created exclusively (the loser of a race is told, the winner's result intact)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from accel_common.checkpoints.checkpoint import checkpoint_step, list_checkpoints
from accel_common.errors import DataError
from accel_common.run_folder.outputs import (
    LOCK_FILE,
    exclusive_outputs,
    lock_folder,
    new_file,
    new_folder,
    partial_path,
    place_file,
)
from tests import forked
from tests.processes import TEMPLATE, recipe_env, run_recipe

HOLD_LOCK = """
import sys, time
from pathlib import Path
from accel_common.run_folder.outputs import lock_folder
print(lock_folder(Path(sys.argv[1])), flush=True)
time.sleep(float(sys.argv[2]))
"""


def lock_in_another_process(folder: Path, hold_s: float = 0.0) -> subprocess.Popen:
    """A process that takes `folder`'s lock, prints the refusal (or None), holds it `hold_s`."""
    return subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(folder), str(hold_s)],
        stdout=subprocess.PIPE,
        text=True,
        env=recipe_env(folder.parent),
    )


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_lock_file_removed_or_replaced_under_a_live_run_still_refuses(tmp_path, how) -> None:
    """The fault-injection case: `rm .lock` (or a copy moved over it) while a run lived let a
    second run lock the new file, --overwrite move the live run's folder, both write into one.
    The folder itself is locked too, and its inode cannot be swapped."""
    holder = lock_in_another_process(tmp_path / "run", hold_s=60)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "None"
        lock = tmp_path / "run" / LOCK_FILE
        lock.unlink()
        if how == "replaced":
            lock.write_text(json.dumps({"pid": 1, "host": "elsewhere"}))
        refusal = lock_folder(tmp_path / "run")
        assert refusal is not None, "a second run took a live run's folder"
        assert refusal.startswith(f"{tmp_path / 'run'} is in use by another run (pid {holder.pid}")
    finally:
        holder.kill()
        holder.wait()
    assert lock_folder(tmp_path / "run") is None  # the holder is gone: the folder is free


def test_the_lock_is_refused_to_another_process_naming_the_holder(tmp_path: Path) -> None:
    holder = lock_in_another_process(tmp_path / "run", hold_s=60)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "None"
        refusal = lock_folder(tmp_path / "run")
        assert refusal is not None
        assert refusal.startswith(f"{tmp_path / 'run'} is in use by another run (pid {holder.pid}")
        assert "choose another --output-dir" in refusal
    finally:
        holder.kill()
        holder.wait()
    # the holder is dead (SIGKILL): its lock file is still there, and blocks nothing
    assert (tmp_path / "run" / LOCK_FILE).is_file()
    assert lock_folder(tmp_path / "run") is None
    assert lock_folder(tmp_path / "run") is None  # taken again by its holder: a no-op


HOLD_AND_FORK = """
import os, sys, time
from pathlib import Path
from accel_common.run_folder.outputs import lock_folder
assert lock_folder(Path(sys.argv[1])) is None
child = os.fork()
if child == 0:  # a DataLoader worker, say: it outlives its killed parent for a while
    print(os.getpid(), flush=True)  # after the fork's hooks ran in it (the parent's pid print
    time.sleep(60)                  # could come first on a busy machine)
    os._exit(0)
time.sleep(60)
"""


def test_a_forked_child_does_not_keep_a_killed_runs_lock(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_AND_FORK, str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        text=True,
        env=recipe_env(tmp_path),
    )
    assert holder.stdout is not None
    child = int(holder.stdout.readline())
    try:
        assert lock_folder(tmp_path / "run") is not None  # the holder lives: refused
        holder.kill()
        holder.wait()
        assert psutil.pid_exists(child)
        assert lock_folder(tmp_path / "run") is None  # its child lives on, holding nothing
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_filesystem_without_locks_is_named_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    import accel_common.run_folder.outputs as outputs

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(outputs.fcntl, "flock", no_locks)
    assert lock_folder(tmp_path / "run") is None
    warning = capsys.readouterr().err
    assert warning.startswith(f"warning: {tmp_path / 'run'}: its filesystem takes no locks")


def test_a_folder_moved_aside_is_locked_again_under_its_name(tmp_path: Path) -> None:
    """--overwrite moves the old run aside, lock file and all: the run locks the new folder."""
    run = tmp_path / "run"
    assert lock_folder(run) is None
    run.rename(tmp_path / "run.replaced")
    run.mkdir()
    assert lock_folder(run) is None
    other = lock_in_another_process(run)
    assert other.communicate(timeout=60)[0].startswith(f"{run} is in use by another run")
    aside = lock_in_another_process(tmp_path / "run.replaced")  # released with the move
    assert aside.communicate(timeout=60)[0].strip() == "None"


@pytest.mark.slow
def test_two_runs_into_one_folder_at_once_one_trains_and_a_killed_run_blocks_no_resume(
    tmp_path: Path, template_data: Path
) -> None:
    """Two runs started together: one trains, the other is refused naming its pid; so is a
    --resume latest while it lives. SIGKILLed after a checkpoint, it leaves a lock file that
    blocks nothing: --resume latest continues from its checkpoint."""
    args = ["--data", str(template_data), "--output-dir", "out", "--epochs", "1000"]
    args += ["--save-every", "2", "--bs", "64"]
    logs = Path(tempfile.mkdtemp(prefix="two-runs-"))
    for name in ("a", "b"):
        (logs / name).mkdir()
    env = recipe_env(tmp_path)
    runs = [
        forked.start(TEMPLATE, args, cwd=tmp_path, env=env, logs=logs / name, new_session=True)
        for name in ("a", "b")
    ]
    try:
        deadline = time.monotonic() + 120
        while all(run.exitcode is None for run in runs):
            assert time.monotonic() < deadline, "neither run was refused"
            time.sleep(0.05)
        lost = next(i for i, run in enumerate(runs) if run.exitcode is not None)
        winner = runs[1 - lost]
        error = (logs / "ab"[lost] / "err").read_text()
        assert runs[lost].exitcode == 2, error
        assert f"error: out is in use by another run (pid {winner.pid} on host" in error
        assert winner.exitcode is None, "the winner must still be training"

        resume = run_recipe([*args, "--resume", "latest"], cwd=tmp_path, check=False)
        assert resume.returncode == 2
        assert f"out is in use by another run (pid {winner.pid} on host" in resume.stderr

        while not list_checkpoints(tmp_path / "out"):
            assert winner.exitcode is None and time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(winner.pid, signal.SIGKILL)
        winner.join()
    finally:
        for run in runs:
            if run.exitcode is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.join()
        shutil.rmtree(logs)
    step = checkpoint_step(list_checkpoints(tmp_path / "out")[-1])
    assert (tmp_path / "out" / LOCK_FILE).is_file()
    more = ["--resume", "latest", "--max-steps", str(step + 1)]
    resumed = run_recipe([*args, *more], cwd=tmp_path)
    assert f"step {step}" in resumed.stdout


# --------------------------------------------------------------------------- exclusive creation


def test_a_file_written_meanwhile_is_never_replaced(tmp_path: Path) -> None:
    """The move into place, not the check before the work, decides: a file another process
    wrote during this one's work is kept, and this one is told, naming it."""
    out = tmp_path / "scores.csv"
    taken = f"^--out {re.escape(str(out))}: another process wrote it meanwhile"
    with pytest.raises(DataError, match=taken), new_file(out) as partial:
        partial.write_text("mine")
        out.write_text("theirs")  # the other process, after this one's check
    assert out.read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scores.csv"]  # no partial left
    with new_file(tmp_path / "implant.npy") as partial:
        assert partial.suffix == ".npy" and partial.parent == tmp_path  # np.save keeps the name
        partial.write_bytes(b"ok")
    assert (tmp_path / "implant.npy").read_bytes() == b"ok"


def test_place_file_replaces_only_outside_exclusive_outputs(tmp_path: Path) -> None:
    """A training run's own export is replaced (under the run's lock); convert without --force
    never replaces."""
    target = tmp_path / "model.safetensors"
    target.write_text("old")
    for exclusive, expected in ((True, "old"), (False, "new")):
        partial = partial_path(target)
        partial.write_text("new")
        with exclusive_outputs(exclusive), contextlib.suppress(DataError):
            place_file(partial, target, "OUTPUT")
        assert target.read_text() == expected and not partial.exists()


def test_convert_never_replaces_an_export_written_after_its_check(tmp_path, monkeypatch):
    import accel_common.conversion.convert as convert

    source, out = tmp_path / "ckpt.pt", tmp_path / "out"
    torch.save({"w": torch.ones(2)}, source)
    read = convert.read_weights  # what convert_checkpoint reads its source with

    def read_then_another_writes(*args: Any) -> Any:
        out.mkdir()
        (out / "model.safetensors").write_text("theirs")
        return read(*args)

    monkeypatch.setattr(convert, "read_weights", read_then_another_writes)
    target = out / "model.safetensors"
    with pytest.raises(DataError, match=f"^OUTPUT {re.escape(str(target))}: another process"):
        convert.convert_checkpoint(source, out)
    assert target.read_text() == "theirs" and sorted(p.name for p in out.iterdir()) == [
        "model.safetensors"
    ]


def test_a_folder_filled_meanwhile_is_never_mixed_into(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()  # an empty folder is filled (replaced by the written one)
    with new_folder(data) as partial:
        partial.mkdir()
        (partial / "train.csv").write_text("mine")
    assert [p.name for p in data.iterdir()] == ["train.csv"]
    other = tmp_path / "other"
    taken = f"^DIR {re.escape(str(other))}: another process wrote into it"
    with pytest.raises(DataError, match=taken), new_folder(other) as partial:
        partial.mkdir()
        (partial / "train.csv").write_text("mine")
        other.mkdir()
        (other / "1000001.json").write_text("theirs")
    assert [p.name for p in other.iterdir()] == ["1000001.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "other"]  # no partial left


WRITE_AT_ONCE = """
import sys, time
from pathlib import Path
from accel_common.run_folder.outputs import new_file
out, me, ready = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
with new_file(out) as partial:
    partial.write_text(me)
    (ready / me).touch()
    while len(list(ready.iterdir())) < 2:  # both have written: now both move into place
        time.sleep(0.01)
"""


def test_two_writers_of_one_out_file_at_once_one_wins_intact(tmp_path: Path) -> None:
    """What every --out writer (predict, caption, score, complete, export-onnx) does, in two
    processes that finish writing together: one file wins whole, the other names it."""
    out, ready = tmp_path / "predictions.csv", tmp_path / "ready"
    ready.mkdir()
    writers = {
        name: subprocess.Popen(
            [sys.executable, "-c", WRITE_AT_ONCE, str(out), name, str(ready)],
            stderr=subprocess.PIPE,
            text=True,
            env=recipe_env(tmp_path),
        )
        for name in ("a", "b")
    }
    errors = {name: w.communicate(timeout=120)[1] for name, w in writers.items()}
    codes = {name: w.returncode for name, w in writers.items()}
    assert sorted(codes.values()) == [0, 1], errors
    (winner,) = [name for name, code in codes.items() if code == 0]
    (loser,) = [name for name, code in codes.items() if code != 0]
    assert f"--out {out}: another process wrote it meanwhile" in errors[loser]
    assert out.read_text() == winner
    assert sorted(p.name for p in tmp_path.iterdir()) == ["predictions.csv", "ready"]


MAKE_DATA_AT_ONCE = """
import importlib, sys, time
from pathlib import Path
from accel_common.tools.cli import app
from accel_common.tools.example_data import generator_module
name, data, ready = sys.argv[1], sys.argv[2], Path(sys.argv[3])
importlib.import_module(generator_module(name))  # imported: both start the command together
(ready / name).touch()
while len(list(ready.iterdir())) < 2:
    time.sleep(0.01)
app(["make-data", name, data])
"""


@pytest.mark.slow
def test_two_make_data_into_one_folder_at_once_one_set_wins_whole(tmp_path: Path) -> None:
    """Two recipes' example data into one folder, `accel-recipes make-data` started together
    (once both have imported what they need): exactly one succeeds and the folder holds its
    data alone."""
    data, ready = tmp_path / "data", tmp_path / "ready"
    ready.mkdir()
    jobs = {
        name: subprocess.Popen(
            [sys.executable, "-c", MAKE_DATA_AT_ONCE, name, str(data), str(ready)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=recipe_env(tmp_path),
        )
        for name in ("template", "cricket")
    }
    outputs = {name: job.communicate(timeout=300) for name, job in jobs.items()}
    codes = {name: job.returncode for name, job in jobs.items()}
    assert sorted(codes.values()) == [0, 2], outputs
    (winner,) = [name for name, code in codes.items() if code == 0]
    (loser,) = [name for name, code in codes.items() if code != 0]
    error = outputs[loser][1]
    assert error.startswith("error: ") and str(data) in error, error
    names = sorted(p.name for p in data.iterdir())
    if winner == "template":
        assert names == ["test.csv", "train.csv"]
    else:
        assert "train.csv" not in names and "README.txt" in names
    assert not [p.name for p in tmp_path.iterdir() if ".partial-" in p.name]  # loser's removed
