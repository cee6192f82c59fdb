"""The tests' own run helpers (tests/processes.py, tests/forked.py): both ways of starting a run,
forked from the server (the CPU suite) and as a fresh interpreter (the GPU suite, where a fork of
a process that initialised CUDA dies), behave as `python script args`; and the export comparison
holds integer buffers to equality."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tests import forked
from tests.processes import kill_once_written, recipe_env, run_processes, run_together
from tests.results import max_relative_difference

# a run that shows what it was started with, and one that leaves a grandchild in its session
SHOW = """import os, sys
print("argv", sys.argv[1:], "cwd", os.getcwd(), "marker", os.environ.get("RUN_MARKER"))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""
LINGER = """import os, subprocess, sys, time
from pathlib import Path
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
Path("worker.pid").write_text(str(worker.pid))
Path("written").write_text("")
time.sleep(600)
"""


@pytest.fixture(params=forked.RUN_MODES)
def run_mode(request, monkeypatch) -> str:
    monkeypatch.setenv("RECIPE_RUNS", request.param)
    return request.param


def test_a_run_gets_its_arguments_folder_environment_outputs_and_exit_code(run_mode, tmp_path):
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    work = tmp_path / "work"
    work.mkdir()
    env = {**recipe_env(work), "RUN_MARKER": run_mode}
    result = run_processes(script, ["3", "x"], 1, cwd=work, env=env, timeout=120)
    assert result.returncode == 3
    assert result.stdout == f"argv ['3', 'x'] cwd {work} marker {run_mode}\n"
    assert result.stderr == "to stderr\n"
    assert forked.fresh_interpreters() is (run_mode == "fresh")


def alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for its reaper."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_kill_once_written_kills_the_run_and_what_it_started(run_mode, tmp_path):
    """SIGKILL reaches the whole session: a data-loader worker does not outlive its run."""
    script = tmp_path / "linger.py"
    script.write_text(LINGER)
    kill_once_written(script, [], cwd=tmp_path, marker=tmp_path / "written")
    worker = int((tmp_path / "worker.pid").read_text())
    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive(worker):
        os.kill(worker, signal.SIGKILL)
        pytest.fail(f"the run's worker {worker} outlived the kill ({run_mode})")


def test_an_unknown_run_mode_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("RECIPE_RUNS", "spawn")
    with pytest.raises(ValueError, match="RECIPE_RUNS='spawn'"):
        forked.fresh_interpreters()


def test_integer_buffers_are_compared_exactly_and_floats_relatively():
    floats = {"w": torch.tensor([3.0, 4.0]), "num_batches_tracked": torch.tensor(7)}
    assert max_relative_difference(floats, dict(floats)) == 0.0
    moved = {**floats, "w": torch.tensor([3.0, 4.5])}
    assert max_relative_difference(floats, moved) == pytest.approx(0.1)
    counted = {**floats, "num_batches_tracked": torch.tensor(8)}
    with pytest.raises(ValueError, match="num_batches_tracked"):
        max_relative_difference(floats, counted)


def test_runs_together_all_end_and_the_failed_one_is_named_with_its_output(tmp_path):
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    run_together({"one": (script, ["0"], tmp_path), "two": (script, ["0"], tmp_path)})
    with pytest.raises(AssertionError, match=r"run bad failed \(5\):\nargv \['5'\]"):
        run_together({"good": (script, ["0"], tmp_path), "bad": (script, ["5"], tmp_path)})
