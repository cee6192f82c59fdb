"""`accel-recipes launch`: a failed launch reads as the worker's one line and exit code."""

from __future__ import annotations

import re
import subprocess

import pytest

from accel_common.tools.launch import Condensed, condense
from tests.conftest import BIN, CPU_2PROC, TEMPLATE, free_port, recipe_env

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


def test_output_without_a_worker_error_passes_through_whole():
    text = "Traceback (most recent call last):\n  launcher crashed\n"
    *shown, summary = condense(text.splitlines(keepends=True))
    assert "".join(shown) == text and summary.exit_code is None


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
    # both ranks refuse the flag; which one the launcher sees fail first is a race
    assert re.search(r"launcher: rank [01] failed first, with exit code 2", result.stderr)
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr
