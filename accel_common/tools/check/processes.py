"""Recipe runs as real processes: one, or N ranks over gloo given the environment torchrun gives
its workers; a run killed with SIGKILL once a file appears. `accel-recipes check` starts fresh
interpreters; the tests start the same runs forked from a server that imported torch already
(tests/forked.py), through the `start` argument."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from accel_common.tools.ports import free_port

REPO = Path(__file__).resolve().parents[3]


class Child(Protocol):
    """A started run: multiprocessing.Process's interface (what tests/forked.py starts too)."""

    pid: int

    @property
    def exitcode(self) -> int | None: ...

    def join(self, timeout: float | None = None) -> None: ...

    def kill(self) -> None: ...


Start = Callable[..., Child]


def recipe_env(tmp: Path) -> dict[str, str]:
    """The environment of a recipe run that shares the machine: one thread, trackers offline,
    caches under `tmp`, the network never waited on, this tree's accel_common first."""
    return {
        **os.environ,
        # one thread: the tests' two pytest-xdist workers keep both cores busy, and a second
        # thread costs more CPU than it saves time (the quality learning run: 44.6 CPU-s on 2,
        # 39.2 on 1)
        "OMP_NUM_THREADS": "1",
        # idle OpenMP threads sleep instead of spinning: beside another busy process, spinning
        # threads made a 2-thread run 2x slower; passive, it ran as fast as alone
        "OMP_WAIT_POLICY": "PASSIVE",
        "PYTHONUNBUFFERED": "1",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "HF_HOME": str(tmp / "hf"),
        "HF_HUB_OFFLINE": "1",  # nothing may wait on the network
        # the tree under test, ahead of any installed copy of accel_common
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }


def rank_env(rank: int, nproc: int, port: str) -> dict[str, str]:
    """What torchrun gives rank `rank` of `nproc` on this machine."""
    where = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc)}
    return where | {"LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}


class FreshRun:
    """`python script args` as a new interpreter, with multiprocessing.Process's interface."""

    def __init__(
        self, script: Path, args: list[str], cwd: Path, env: dict[str, str], logs: Path,
        new_session: bool,
    ) -> None:  # fmt: skip
        with open(Path(logs) / "out", "w") as out, open(Path(logs) / "err", "w") as err:
            self._process = subprocess.Popen(
                [sys.executable, str(script), *args], cwd=cwd, env=env, stdout=out, stderr=err,
                stdin=subprocess.DEVNULL, start_new_session=new_session,
            )  # fmt: skip
        self.pid = self._process.pid

    @property
    def exitcode(self) -> int | None:
        """None while it runs; -N when signal N ended it (as multiprocessing reports)."""
        return self._process.poll()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):  # as Process.join: see exitcode
            self._process.wait(timeout)

    def kill(self) -> None:
        self._process.kill()


def start_fresh(
    script: Path, args: list[str], *, cwd: Path, env: dict[str, str], logs: Path,
    new_session: bool = False,
) -> FreshRun:  # fmt: skip
    """Start `python script args` in `cwd`; `logs` receives `out` and `err`."""
    return FreshRun(script, list(args), cwd, dict(env), logs, new_session)


def run_processes(
    script: Path,
    args: list[str],
    nproc: int,
    *,
    cwd: Path,
    env: dict[str, str],
    timeout: float,
    start: Start = start_fresh,
) -> subprocess.CompletedProcess:
    """`python script args` as one process, or as `nproc` ranks over gloo (see `rank_env`).

    No launcher process: runs that compare N processes with one do not need it. A rank that fails
    has the others stopped 15 s later (they would wait in a collective), and its exit code is the
    run's; stdout and stderr are the ranks' outputs one after the other."""
    port, logs = str(free_port()), Path(tempfile.mkdtemp(prefix="run-"))
    children = []
    for rank in range(nproc):
        (logs / str(rank)).mkdir()
        rank_environment = {**env, **rank_env(rank, nproc, port)} if nproc > 1 else env
        children.append(start(script, args, cwd=cwd, env=rank_environment, logs=logs / str(rank)))
    first_failure, stop_at = None, time.monotonic() + timeout
    while any(child.exitcode is None for child in children):
        if first_failure is None and any(child.exitcode for child in children):
            first_failure = next(child.exitcode for child in children if child.exitcode)
            stop_at = min(stop_at, time.monotonic() + 15)
        if time.monotonic() > stop_at:
            for child in children:
                child.kill()
                child.join()
            if first_failure is None:
                shutil.rmtree(logs)
                raise subprocess.TimeoutExpired([str(script), *args], timeout)
        time.sleep(0.05)
    if first_failure is None:  # they all ended between two looks
        first_failure = next((child.exitcode for child in children if child.exitcode), 0)
    stdout = "".join((logs / str(rank) / "out").read_text() for rank in range(nproc))
    stderr = "".join((logs / str(rank) / "err").read_text() for rank in range(nproc))
    shutil.rmtree(logs)
    return subprocess.CompletedProcess([str(script), *args], first_failure, stdout, stderr)


def kill_once_written(
    script: Path,
    args: list[str],
    *,
    cwd: Path,
    marker: Path,
    start: Start = start_fresh,
    timeout: float = 300,
) -> str | None:
    """Run `python script args` and SIGKILL it, its whole session, as soon as `marker` exists
    (a checkpoint's last file): a crash at whatever point the run had reached by then. Returns
    None once killed, else why not (the run ended first, or no marker in time)."""
    logs = Path(tempfile.mkdtemp(prefix="killed-"))
    child = start(script, args, cwd=cwd, env=recipe_env(cwd), logs=logs, new_session=True)
    deadline, why = time.monotonic() + timeout, None
    while not marker.exists():
        if child.exitcode is not None:
            why = f"the run ended (exit {child.exitcode}) before {marker.name} appeared"
            break
        if time.monotonic() > deadline:
            why = f"no {marker} after {timeout:g} s"
            break
        time.sleep(0.002)
    if child.exitcode is None:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile: said below
            os.killpg(child.pid, signal.SIGKILL)
    child.join()
    if why is None and child.exitcode != -signal.SIGKILL:
        why = f"the run ended (exit {child.exitcode}) before it could be killed"
    shutil.rmtree(logs)
    return why


def finished(result: subprocess.CompletedProcess, what: str) -> Any:
    """`result`, or a RuntimeError naming `what` and the line that says why it failed."""
    if result.returncode != 0:
        why = failure_line(result.stderr)
        raise RuntimeError(f"{what} failed (exit {result.returncode}): {why}")
    return result


# the library's own one-line errors: `error: ...`, `error (rank N): ...`
WORKER_ERROR = re.compile(r"^error( \(rank \d+\))?: ")
# a line that says what went wrong: an exception (a traceback's last line; torch prefixes a
# worker's uncaught one with its rank), C++'s std::terminate, a fatal Python error
ERROR_LINE = re.compile(
    r"^(\[rank\d+\]:\s*)?"
    r"([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b|terminate called|Fatal Python error)"
)
# torch elastic's report (a launch through `accelerate launch` or `torchrun`): its log lines, and
# the first failed rank's block, whose exit code and signal the report names
ELASTIC_LOG = re.compile(r"^[WEI]\d{4} [\d:.]+ \d+ .*torch/distributed/elastic/")
ROOT_CAUSE = "Root Cause (first observed failure):"
ROOT_CAUSE_LINE = re.compile(r"^(rank|exitcode|traceback)\s*: ")


def failure_line(stderr: str) -> str:
    """The line of a failed run's stderr that says why: a worker's `error: ...`; else the last
    error line the workers printed (an exception, `terminate called ...`), with the exit code or
    signal of the rank torch elastic's report names first, where there is one (`rank 1: exitcode
    -6, Signal 6 (SIGABRT) received by PID 42`); else the last line that is not a rule of `=` or
    `-` (the report's frame, which says nothing)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip(" \t=-")]
    if errors := [line for line in lines if WORKER_ERROR.match(line)]:
        return errors[-1]
    root_cause = elastic_root_cause(stderr)
    # the workers' own lines come before the launcher's report (its log lines and traceback)
    report = next((i for i, line in enumerate(lines) if ELASTIC_LOG.match(line)), len(lines))
    own = lines[:report] if root_cause else lines
    errors = [line for line in own if ERROR_LINE.match(line)]
    if root_cause:
        return f"{errors[-1]} ({root_cause})" if errors else root_cause
    return errors[-1] if errors else (lines[-1] if lines else "")


def elastic_root_cause(stderr: str) -> str:
    """The first failed rank in torch elastic's report, as `rank 1: exitcode -6, Signal 6
    (SIGABRT) received by PID 42` (its traceback line only where it names a signal); '' where
    the stderr holds no such report."""
    found: dict[str, str] = {}
    lines = stderr.splitlines()
    if ROOT_CAUSE not in (line.strip() for line in lines):
        return ""
    start = next(i for i, line in enumerate(lines) if line.strip() == ROOT_CAUSE)
    for line in lines[start + 1 :]:
        if not line.strip(" \t=-"):
            break  # the report's closing rule
        if match := ROOT_CAUSE_LINE.match(line.strip()):
            found[match.group(1)] = line.strip()[match.end() :].strip()
    rank = found.get("rank", "?").split()[0]
    exitcode = found.get("exitcode", "?").split(" (pid")[0]
    killed = found.get("traceback", "")  # "Signal 6 (SIGABRT) received by PID 42", or a hint
    said = f", {killed}" if killed.startswith("Signal") else ""
    return f"rank {rank}: exitcode {exitcode}{said}"
