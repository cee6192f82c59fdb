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
from accel_common.errors import ConfigError, exit_on_error
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


class Writes:
    """A stderr that keeps each write call apart, as an unbuffered pipe does."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_refusal_is_one_write_so_ranks_lines_do_not_run_together(monkeypatch, rank):
    """Under PYTHONUNBUFFERED print writes a line's text and its newline apart: two ranks'
    lines came out as `error (rank 1): ...error (rank 0): ...` and two blank lines."""
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr("accel_common.errors.PEER_GRACE_SECONDS", 0)
    stderr = Writes()
    monkeypatch.setattr("sys.stderr", stderr)

    @exit_on_error
    def refuse() -> None:
        raise ConfigError("--flag: refused")

    with pytest.raises(SystemExit):
        refuse()
    line = "error: --flag: refused\n" if rank == "0" else "error (rank 1): --flag: refused\n"
    assert stderr.calls == [line]
