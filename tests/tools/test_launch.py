"""`accel-recipes launch`: a failed launch reads as the worker's one line and exit code."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from accel_common.checkpoints.checkpoint import list_checkpoints
from accel_common.errors import EXIT_PREEMPTED
from accel_common.tools.launch import Condensed, closing_line, condense
from tests.processes import ACCELERATE_LAUNCH, BIN, CPU_2PROC, TEMPLATE, free_port, recipe_env

# what `accelerate launch` printed when rank 0 refused --lr nan (shortened)
LAUNCHER_STDERR = """\
NVIDIA-SMI has failed: no driver
error: --lr nan: give a positive number
W1123 00:12:28.944000 10860 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 10867 closing signal SIGTERM
E1123 00:12:28.977000 10860 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 2) local_rank: 0 (pid: 10866) of binary: python
Traceback (most recent call last):
  File ".venv/bin/accelerate", line 6, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 10867)  (SIGTERM)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 2 (pid: 10866)
============================================================
"""  # noqa: E501


def test_the_launchers_report_is_held_back_and_its_root_cause_read():
    *shown, summary = condense(LAUNCHER_STDERR.splitlines(keepends=True))
    assert "".join(shown) == (
        "NVIDIA-SMI has failed: no driver\nerror: --lr nan: give a positive number\n"
    )
    assert isinstance(summary, Condensed)
    assert (summary.rank, summary.exit_code) == (0, 2)  # the root cause, not rank 1's SIGTERM


# what `accelerate launch` with one process printed when its worker refused --lr -1 (shortened)
ONE_PROCESS_STDERR = """\
error: --lr -1.0: give a positive number
Traceback (most recent call last):
  File ".venv/bin/accelerate", line 6, in <module>
    raise subprocess.CalledProcessError(returncode=process.returncode, cmd=cmd)
subprocess.CalledProcessError: Command '['python', 'recipes/train_template.py', '--lr', '-1']' \
returned non-zero exit status 2.
"""


def test_a_one_process_launchers_traceback_is_held_back_and_its_exit_code_read():
    *shown, summary = condense(ONE_PROCESS_STDERR.splitlines(keepends=True))
    assert "".join(shown) == "error: --lr -1.0: give a positive number\n"
    assert isinstance(summary, Condensed)
    assert (summary.exit_code, summary.one_process) == (2, True)


@pytest.mark.dist
def test_a_failed_one_process_launch_is_one_line_and_the_workers_exit_code(tmp_path):
    command = [str(BIN / "accel-recipes"), "launch", "--", str(BIN / "accelerate"), "launch"]
    command += ["--config_file", str(CPU_2PROC.with_name("1cpu.yaml"))]
    command += [str(TEMPLATE), "--lr", "-1", "--output-dir", str(tmp_path / "run")]
    result = subprocess.run(
        command, cwd=tmp_path, env=recipe_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stderr
    assert "error: --lr -1.0: give a positive number" in result.stderr
    assert "launcher: the worker failed with exit code 2" in result.stderr
    assert "Traceback" not in result.stderr and "CalledProcessError" not in result.stderr


def test_output_without_a_worker_error_passes_through_whole():
    text = "Traceback (most recent call last):\n  launcher crashed\n"
    *shown, summary = condense(text.splitlines(keepends=True))
    assert "".join(shown) == text and summary.exit_code is None


# what `accelerate launch` printed when it refused its own arguments (shortened)
LAUNCHERS_OWN_ERROR = """\
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File ".venv/lib/python3.11/site-packages/accelerate/commands/launch.py", line 1419, in main
    launch_command(args)
ValueError: You need to use at least 2 processes to use `--multi_gpu`.
"""
# a worker's own traceback: the cause, shown whole
WORKERS_TRACEBACK = """\
Traceback (most recent call last):
  File "/home/me/train_unconditional.py", line 5, in <module>
    raise ValueError("boom")
ValueError: boom
"""


def test_the_launchers_own_traceback_becomes_one_line_naming_its_error():
    *shown, summary = condense(LAUNCHERS_OWN_ERROR.splitlines(keepends=True))
    assert shown == []
    line, code = closing_line(summary, 1, [], "accelerate")
    assert (line, code) == (
        "the launcher itself failed: ValueError: You need to use at least 2 processes to use "
        "`--multi_gpu`.; exit code 1",
        1,
    )


def test_a_workers_traceback_is_shown_and_named_in_the_closing_line():
    launchers_report = ONE_PROCESS_STDERR.split("\n", 1)[1]  # without the `error:` line
    *shown, summary = condense((WORKERS_TRACEBACK + launchers_report).splitlines(True))
    assert "".join(shown) == WORKERS_TRACEBACK
    assert closing_line(summary, 1, [], "accelerate") == (
        "the worker failed with exit code 2 (its last line: ValueError: boom)",
        2,
    )


def test_a_worker_killed_by_a_signal_leaves_with_128_plus_the_signal():
    killed = ONE_PROCESS_STDERR.split("\n", 1)[1]  # no message: what the OOM killer leaves
    killed = killed.replace("returned non-zero exit status 2", "died with <Signals.SIGKILL: 9>")
    *_, summary = condense(killed.splitlines(keepends=True))
    line, code = closing_line(summary, 1, [], "accelerate")
    assert code == 137 and line.startswith("the worker was killed by SIGKILL")


@pytest.mark.dist
@pytest.mark.parametrize("config", ["1cpu.yaml", "cpu_2proc.yaml"])
def test_a_worker_that_fails_without_an_error_line_is_still_one_closing_line(tmp_path, config):
    """A Typer usage error (a box, no `error:` line): before, the launcher's traceback followed
    it and the exit code was the launcher's 1."""
    command = [str(BIN / "accel-recipes"), "launch", "--", *ACCELERATE_LAUNCH]
    command += ["--config_file", str(CPU_2PROC.with_name(config))]
    command += ["--main_process_port", str(free_port()), str(TEMPLATE), "--no-such-flag"]
    result = subprocess.run(
        command, cwd=tmp_path, env=recipe_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stderr
    for launchers in ("Traceback", "CalledProcessError", "ChildFailedError", "torch/distributed"):
        assert launchers not in result.stderr
    (closing,) = [line for line in result.stderr.splitlines() if line.startswith("launcher:")]
    assert result.stderr.splitlines()[-1] == closing
    assert "with exit code 2 (its last line: No such option: --no-such-flag)" in closing


@pytest.mark.dist
def test_a_failed_two_process_launch_is_one_line_and_the_workers_exit_code(tmp_path):
    command = [str(BIN / "accel-recipes"), "launch", "--", str(BIN / "accelerate"), "launch"]
    command += ["--config_file", str(CPU_2PROC), "--main_process_port", str(free_port())]
    command += [str(TEMPLATE), "--lr", "nan", "--output-dir", str(tmp_path / "run")]
    result = subprocess.run(
        command, cwd=tmp_path, env=recipe_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stderr  # the worker's code, not the launcher's 1
    assert "error: --lr nan: give a positive number" in result.stderr
    # both ranks refuse the flag; rank 1 waits for rank 0's line (PEER_GRACE_SECONDS)
    assert "launcher: rank 0 failed first, with exit code 2" in result.stderr, result.stderr
    assert "error (rank 1)" not in result.stderr
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr


def processes_of(run: Path) -> list[psutil.Process]:
    """Live processes whose command line names the run's output folder (launcher, workers)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if str(run) in " ".join(process.info["cmdline"] or []) and process.status() != "zombie":
                found.append(process)
        except psutil.Error:
            continue
    return found


@pytest.mark.dist
@pytest.mark.parametrize("full_report", [False, True], ids=["condensed", "full-report"])
def test_sigterm_to_the_launch_saves_the_step_and_exits_75(tmp_path, template_data, full_report):
    """The documented launch, `accel-recipes launch -- accelerate launch ...` (the Makefile, the
    SLURM node step), stopped by SIGTERM mid-run: the workers save the step in progress and the
    command exits 75 (requeue me) with one line, also when the launcher's full report is asked
    for; a bare `accelerate launch` would exit 1 with a traceback."""
    out = tmp_path / "run"
    command = [str(BIN / "accel-recipes"), "launch", "--", *ACCELERATE_LAUNCH]
    command += ["--config_file", str(CPU_2PROC), "--main_process_port", str(free_port())]
    command += [str(TEMPLATE), "--data", str(template_data), "--output-dir", str(out)]
    # long enough that the signal always arrives mid-run, however fast the machine
    command += ["--bs", "32", "--epochs", "400", "--max-steps", "20000", "--save-every", "5"]
    env = {**recipe_env(tmp_path), "ACCEL_RECIPES_FULL_REPORT": "1" if full_report else "0"}
    job = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        # mid-run: a checkpoint written (any: keep-last prunes the first ones), far from the end
        while not list(out.glob("checkpoints/step_*/progress.json")):
            assert job.poll() is None and time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.05)
        job.send_signal(signal.SIGTERM)  # to the command only, as a scheduler or `kill` does
        _, stderr = job.communicate(timeout=240)
        time.sleep(1)
        left = processes_of(out)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)  # anything left over, the test has failed
    assert job.returncode == EXIT_PREEMPTED, stderr
    assert left == [], f"still running after the launch exited: {left}"
    (line,) = [ln for ln in stderr.splitlines() if ln.startswith("preempted: SIGTERM arrived")]
    step = int(line.split("optimizer step ")[1].split(";")[0])
    checkpoints = list_checkpoints(out)
    assert checkpoints[-1].name == f"step_{step}" and 5 <= step < 20000
    assert (checkpoints[-1] / "progress.json").exists() and not (out / "model").exists()
    last = stderr.splitlines()[-1]
    assert last.startswith("launcher: preempted, the checkpoint is saved; exit code 75")
    # the launcher's own traceback (SignalException: Accelerate 1.15; 1.16 prints none) only
    # where the full report was asked for
    if not full_report:
        assert "Traceback" not in stderr


# a launcher whose workers have not started training: on SIGTERM it stops them and exits 1 with
# a traceback, as torch elastic's agent does (workers that die of the signal save nothing)
STARTING_LAUNCHER = """
import pathlib, signal, sys, time
def stop(sig, frame):
    print("W1124 09:24:49.731000 25779 torch/distributed/elastic/agent/server/api.py:753] "
          f"Received {sig} death signal, shutting down workers", file=sys.stderr, flush=True)
    raise RuntimeError(f"Process 1 got signal: {sig}")
signal.signal(signal.SIGTERM, stop)
pathlib.Path(sys.argv[1]).touch()
time.sleep(120)
"""


def test_a_stop_signal_before_the_workers_saved_is_one_line(tmp_path):
    launcher, ready = tmp_path / "launcher.py", tmp_path / "ready"
    launcher.write_text(STARTING_LAUNCHER)
    job = subprocess.Popen(
        [str(BIN / "accel-recipes"), "launch", "--", sys.executable, str(launcher), str(ready)],
        env=recipe_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.05)
        job.send_signal(signal.SIGTERM)
        _, stderr = job.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 128 + signal.SIGTERM, stderr
    assert stderr.splitlines() == [
        "launcher: stopped by SIGTERM before any worker reported a saved checkpoint (a signal "
        "while they start is not caught); exit code 143: relaunch with --resume latest to "
        "continue from the newest complete checkpoint (ACCEL_RECIPES_FULL_REPORT=1 shows the "
        "launcher's full report)"
    ]
