"""Runs that heal themselves: 2 CPU processes end bit-equal to an uninterrupted run after a rank
is killed (the launcher restarts the group) or the job is preempted (a checkpoint of the step in
progress, exit 75, a requeue that resumes by itself).

The restart test kills a rank twice in one job (--max_restarts 2): first rank 0, the writer, while
a checkpoint is being written (both workers are frozen with SIGSTOP as soon as `step_N.tmp`
appears, so the test knows the save is unfinished when it kills), then rank 1 just after a later
periodic checkpoint. Each
restarted group must resume, with no flag from the user, from the newest COMPLETE checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from accel_common.checkpoints.checkpoint import list_checkpoints
from accel_common.errors import EXIT_PREEMPTED
from tests.processes import (
    ACCELERATE_LAUNCH,
    BIN,
    CPU_2PROC,
    TEMPLATE,
    free_port,
    launch_command,
    recipe_env,
    run_recipe,
)
from tests.results import exported_params, metrics_log

pytestmark = pytest.mark.dist

# 40 steps at global batch 32; a model big enough that a save takes some milliseconds
COMMON = ["--bs", "32", "--max-steps", "40", "--hidden", "512", "--depth", "3"]
TIMEOUT = 240


def accelerate(args: list[str], *extra: str) -> list[str]:
    return [
        *ACCELERATE_LAUNCH, "--config_file", str(CPU_2PROC),
        "--main_process_port", str(free_port()), *extra, str(TEMPLATE), *args,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, template_data) -> Path:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    out = tmp / "out"
    run_recipe(["--data", str(template_data), "--output-dir", str(out), *COMMON], cwd=tmp, nproc=2)
    return out


def workers(launcher: subprocess.Popen) -> dict[int, psutil.Process]:
    """The launcher's training processes by global rank (both must be up)."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        found = {}
        for child in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if str(TEMPLATE) in " ".join(child.cmdline()):
                    found[int(child.environ()["RANK"])] = child
            except (psutil.NoSuchProcess, KeyError):
                continue
        if len(found) == 2:
            return found
        assert time.monotonic() < deadline and launcher.poll() is None, "no workers"
        time.sleep(0.05)


def wait_until(condition, launcher: subprocess.Popen, what: str, poll: float = 0.05) -> None:
    """Poll `condition`; a short `poll` only where a race must be caught (it costs CPU that the
    job under test needs: at 0.5 ms, globbing the checkpoints took a good part of a core)."""
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert launcher.poll() is None, f"the job ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {TIMEOUT} s"
        time.sleep(poll)


def assert_bit_equal(expected: Path, actual: Path) -> None:
    a, b = exported_params(expected), exported_params(actual)
    assert a.keys() == b.keys()
    for key in a:
        assert (a[key] == b[key]).all(), key


def test_killed_ranks_are_restarted_from_the_newest_complete_checkpoint(
    tmp_path, template_data, uninterrupted
):
    out, checkpoints = tmp_path / "out", tmp_path / "out" / "checkpoints"
    args = ["--data", str(template_data), "--output-dir", str(out), *COMMON, "--save-every", "5"]
    log = (tmp_path / "job.log").open("w")
    job = subprocess.Popen(
        accelerate(args, "--max_restarts", "2"), cwd=tmp_path, env=recipe_env(tmp_path),
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        # 1. kill rank 1 while a save after the first is unfinished: freeze both workers once
        # step_N.tmp shows (N >= 10, so that a complete checkpoint precedes it)
        def unfinished() -> list[Path]:
            tmp = checkpoints.glob("step_*.tmp")
            return [p for p in tmp if int(p.stem.removeprefix("step_")) >= 10]

        first = checkpoints / "step_5" / "progress.json"
        wait_until(first.exists, job, "the first checkpoint")  # the start-up, polled slowly
        while True:
            wait_until(lambda: bool(unfinished()), job, "a save", poll=0.0005)
            ranks = workers(job)
            for worker in ranks.values():
                worker.suspend()
            caught = [p for p in unfinished() if not p.with_suffix("").exists()]
            if caught:
                break
            for worker in ranks.values():  # the save completed before the freeze: next one
                worker.resume()
            wait_until(lambda: not unfinished(), job, "the end of that save", poll=0.0005)
        during = int(caught[0].stem.removeprefix("step_"))
        ranks[0].kill()  # the writer: nothing more of that save can be written
        ranks[1].resume()
        # 2. after the restart, kill rank 1 again just after a later periodic checkpoint
        later = checkpoints / f"step_{during + 10}" / "progress.json"
        wait_until(later.exists, job, f"checkpoint step_{during + 10}", poll=0.0005)
        workers(job)[1].kill()
        assert job.wait(timeout=TIMEOUT) == 0
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        log.close()
    text = (tmp_path / "job.log").read_text()
    assert "restart 1 of 2 by the launcher: continuing from the newest complete checkpoint" in text
    assert f"resumed from {checkpoints / f'step_{during - 5}'}:" in text  # not the unfinished one
    assert "restart 2 of 2 by the launcher" in text
    resumed = [int(line.split("step_")[1].split(":")[0]) for line in text.splitlines()
               if line.startswith(f"resumed from {checkpoints}")]  # fmt: skip
    assert resumed[0] == during - 5 and resumed[1] >= during + 10
    assert_bit_equal(uninterrupted, out)


def test_preemption_saves_the_step_in_progress_and_the_requeued_job_resumes(
    tmp_path, template_data, uninterrupted
):
    out = tmp_path / "out"
    args = ["--data", str(template_data), "--output-dir", str(out), *COMMON, "--log-every", "1"]
    job = subprocess.Popen(
        [str(BIN / "accel-recipes"), "launch", "--", *accelerate(args)], cwd=tmp_path,
        env=recipe_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        logged = out / "logs" / "metrics.jsonl"
        wait_until(
            lambda: logged.exists() and logged.read_text().count('"train/loss"') >= 8,
            job,
            "step 8",
            poll=0.01,
        )
        job.send_signal(signal.SIGUSR1)  # what SLURM sends; the wrapper passes it on
        _, stderr = job.communicate(timeout=TIMEOUT)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == EXIT_PREEMPTED, stderr
    (line,) = [ln for ln in stderr.splitlines() if ln.startswith("preempted: SIGUSR1 arrived")]
    step = int(line.split("optimizer step ")[1].split(";")[0])
    # the checkpoint is at exactly the step the signal arrived in, and nothing trained past it
    assert [p.name for p in list_checkpoints(out)] == [f"step_{step}"]
    trained = [r["step"] for r in metrics_log(out) if "train/loss" in r]
    assert trained[-1] == step < 40
    assert not (out / "model").exists()

    requeued = {**recipe_env(tmp_path), "SLURM_RESTART_COUNT": "1"}  # what a requeue sets
    result = subprocess.run(
        launch_command(TEMPLATE, args, nproc=2), cwd=tmp_path, env=requeued,
        capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "SLURM requeue 1: continuing from the newest complete checkpoint" in result.stdout
    assert f"resumed from {out / 'checkpoints' / f'step_{step}'}:" in result.stdout
    assert json.loads((out / "model" / "model.json").read_text())["step"] == 40
    assert_bit_equal(uninterrupted, out)
    # the one epoch's mean loss spans the preemption: each rank's running sum was saved (issue
    # 43: it covered the steps since the requeue only)
    metrics = [json.loads((run / "model" / "model.json").read_text())["metrics"]
               for run in (uninterrupted, out)]  # fmt: skip
    for exported in metrics:
        del exported["train_seconds"]
    assert metrics[0] == metrics[1]
