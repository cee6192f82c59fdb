"""One writer per output (accel_common/outputs.py): two processes started together never both
write one output. A run holds its output folder (a second run or resume is refused, naming the
holder; a SIGKILLed holder blocks nothing); make-data, --out files and convert outputs are
created exclusively (the loser of a race is told, the winner's result intact)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from accel_common.checkpoint import checkpoint_step, list_checkpoints
from accel_common.outputs import LOCK_FILE, lock_folder
from tests import forked
from tests.processes import TEMPLATE, recipe_env, run_recipe

HOLD_LOCK = """
import sys, time
from pathlib import Path
from accel_common.outputs import lock_folder
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
