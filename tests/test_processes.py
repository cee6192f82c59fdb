"""Workers never outlive their launcher: a SIGKILLed `accelerate launch` leaves nothing running
and nothing more written. A refusal every rank raises reaches the user even when rank 0 is the
last to raise it."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time

import psutil
import pytest

from accel_common.checkpoints.checkpoint import list_checkpoints
from tests.processes import TEMPLATE, launch_command, recipe_env


@pytest.mark.dist
def test_workers_stop_within_seconds_when_the_launcher_is_killed(tmp_path, template_data):
    out = tmp_path / "run"
    args = ["--data", str(template_data), "--output-dir", str(out), "--epochs", "1000"]
    args += ["--hidden", "256", "--depth", "3", "--save-every", "100", "--keep-last", "1000"]
    launcher = subprocess.Popen(
        launch_command(TEMPLATE, args, nproc=2),
        cwd=tmp_path,
        env=recipe_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the workers get no signal from a process group
    )
    deadline = time.monotonic() + 120
    while not list_checkpoints(out):
        assert launcher.poll() is None, launcher.stderr.read()
        assert time.monotonic() < deadline, "no checkpoint appeared in time"
        time.sleep(0.01)
    workers = [p for p in psutil.Process(launcher.pid).children(recursive=True)]
    assert len([p for p in workers if "train_template.py" in " ".join(p.cmdline())]) == 2
    saved_at_kill = list_checkpoints(out)

    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"still running 10 s after the launcher died: {alive}"
    assert list_checkpoints(out) == saved_at_kill  # nothing newer was written
    assert not (out / "model").exists()
    assert "the launcher (pid" in launcher.stderr.read()


# every rank refuses; rank 0, the one that prints, does so after rank 1 has already exited
LATE_RANK_ZERO = """
import os, time
from accel_common.errors import ConfigError, exit_on_error

@exit_on_error
def main() -> None:
    if os.environ["RANK"] == "0":
        time.sleep(3)
    raise ConfigError("--flag: refused on every rank")

main()
"""


@pytest.mark.dist
def test_a_refusal_is_printed_even_when_rank_zero_raises_it_last(tmp_path):
    """The launcher stops every worker once one exits: CI saw a GPU-config refusal print nothing
    because rank 1 left before rank 0 had written its line."""
    script = tmp_path / "refuse.py"
    script.write_text(textwrap.dedent(LATE_RANK_ZERO))
    result = subprocess.run(
        launch_command(script, [], nproc=2),
        cwd=tmp_path,
        env=recipe_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert errors == ["error: --flag: refused on every rank"], result.stderr
