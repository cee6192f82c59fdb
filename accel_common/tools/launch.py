"""`accel-recipes launch -- accelerate launch ...`: a launcher whose failure reads as one line.

When a worker stops on a user error, it prints `error: ...` and exits 2 (3 for a failed
collective, 4 when its launcher died). `accelerate launch` and `torchrun` then append their own
report, about 40 lines (a Python traceback of `ChildFailedError` and a table of every rank), and
exit 1, so a user sees the cause buried above a wall of launcher text and a script sees 1 for
every kind of failure. Nothing inside the worker can change what the launcher prints; this
wrapper runs the launcher, passes its output through until a worker has reported an error, then
replaces the launcher's report by one line naming the rank that failed first, and exits with
that rank's exit code. `ACCEL_RECIPES_FULL_REPORT=1` passes everything through unchanged.

Preemption: SIGTERM/SIGUSR1 sent to this wrapper is passed to the launcher, whose torch elastic
agent passes it on to every worker (PET_SIGNALS_TO_HANDLE, set here, is torchrun's
--signals-to-handle, which `accelerate launch` reads too: it adds SIGUSR1 to the signals the agent
handles; by default SIGUSR1 would kill the agent and orphan its workers). The
workers save a checkpoint and rank 0 reports `preempted: ...`; the agent itself then exits 1
with a traceback, which this wrapper turns into exit code 75 (EXIT_PREEMPTED: requeue me).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from accel_common.errors import EXIT_PREEMPTED

WORKER_ERROR = re.compile(r"^error( \(rank \d+\))?: ")
PREEMPTED = re.compile(r"^preempted( \(rank \d+\))?: ")
# torch elastic's default list, plus SIGUSR1: SLURM's warning before the end of a job
AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# torch.distributed.elastic's own log lines, e.g. "E1123 00:12:28.977000 10860 torch/...".
ELASTIC_LOG = re.compile(r"^[WEI]\d{4} [\d:.]+ \d+ .*torch/distributed/elastic/")
ROOT_CAUSE = "Root Cause (first observed failure):"
RANK = re.compile(r"^\s*rank\s*: (\d+)")
EXIT_CODE = re.compile(r"^\s*exitcode\s*: (-?\d+)")


@dataclass
class Condensed:
    """What the filter kept: the lines to show and the failed rank's exit code, if reported."""

    lines: list[str]
    rank: int | None = None
    exit_code: int | None = None
    preempted: bool = False


def condense(stderr: Iterable[str]) -> Iterable[str | Condensed]:
    """Yield the launcher's stderr lines to show as they come, then a Condensed summary.

    Once a worker has printed `error...`, the launcher's log lines and its failure report are
    held back; the report's root-cause block gives the rank and exit code to report instead.
    """
    summary = Condensed(lines=[])
    worker_failed, in_root_cause = False, False
    for line in stderr:
        if WORKER_ERROR.match(line) or PREEMPTED.match(line):
            worker_failed = True
            summary.preempted = summary.preempted or bool(PREEMPTED.match(line))
            yield line
            continue
        if not worker_failed:
            yield line
            continue
        if ELASTIC_LOG.match(line):
            continue
        in_root_cause = in_root_cause or line.strip() == ROOT_CAUSE
        if in_root_cause and (found := RANK.match(line)):
            summary.rank = int(found.group(1))
        if in_root_cause and (found := EXIT_CODE.match(line)):
            summary.exit_code = int(found.group(1))
        summary.lines.append(line)
    yield summary


def run(command: Sequence[str]) -> int:
    """Run the launcher command; return the failed worker's exit code, else the launcher's."""
    env = {"PET_SIGNALS_TO_HANDLE": AGENT_SIGNALS, **os.environ}
    if os.environ.get("ACCEL_RECIPES_FULL_REPORT") == "1":
        return subprocess.call(command, env=env)
    launcher = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, bufsize=1, env=env)
    for name in ("SIGINT", "SIGTERM", "SIGUSR1"):  # Ctrl-C, SLURM: the launcher decides
        signal.signal(getattr(signal, name), lambda sig, _frame: launcher.send_signal(sig))
    summary = Condensed(lines=[])
    for item in condense(launcher.stderr):
        if isinstance(item, Condensed):
            summary = item
        else:
            sys.stderr.write(item)
            sys.stderr.flush()
    code = launcher.wait()
    if code != 0 and summary.preempted:
        sys.stderr.write(
            f"launcher: preempted, the checkpoint is saved; exit code {EXIT_PREEMPTED} (requeue "
            "the job to continue; ACCEL_RECIPES_FULL_REPORT=1 shows the launcher's full report)\n"
        )
        return EXIT_PREEMPTED
    if code == 0 or summary.exit_code is None or summary.exit_code <= 0:
        sys.stderr.writelines(summary.lines)  # not a worker's reported error: show everything
        return code
    sys.stderr.write(
        f"launcher: rank {summary.rank} failed first, with exit code {summary.exit_code}; the "
        "others were stopped (ACCEL_RECIPES_FULL_REPORT=1 shows the launcher's full report)\n"
    )
    return summary.exit_code
