"""`accel-recipes launch -- accelerate launch ...`: a launcher whose failure reads as one line.

When a worker stops on a user error, it prints `error: ...` and exits 2 (3 for a failed
collective, 4 when its launcher died). `accelerate launch` and `torchrun` then append their own
report, about 40 lines (a Python traceback of `ChildFailedError` and a table of every rank), and
exit 1, so a user sees the cause buried above a wall of launcher text and a script sees 1 for
every kind of failure. Nothing inside the worker can change what the launcher prints; this
wrapper runs the launcher, passes its output through until a worker has reported an error, then
replaces the launcher's report by one line naming the rank that failed first, and exits with
that rank's exit code. A worker that fails without an `error:` line (a usage box, an exception)
or is killed by a signal ends the same way, its last line or the signal named; a traceback is
held until its frames say whether it is a worker's (shown) or the launcher's (replaced, and where
the launcher failed by itself, its exception named). `ACCEL_RECIPES_FULL_REPORT=1` passes
everything through unchanged (the exit code and the closing line stay the same).

A config with `use_cpu: true` gets ACCELERATE_USE_CPU=true in the launcher's environment
(`cpu_environment`): Accelerate does not pass it on to its multi-process workers, so a script
other than ours (its Accelerator() without cpu=True) would run there as N one-process jobs.

Before it starts anything, an `accelerate launch` command's config is read as Accelerate would
read it: a missing or malformed YAML file, a value Accelerate would fail on after starting
(`bad_value`: process counts, dynamo settings), or a DeepSpeed launch without DeepSpeed installed,
is one `error:` line (the checks `accel-recipes doctor --config-file` makes), not a traceback after
the launcher has started; so is a launcher that does not exist.

Preemption: SIGTERM/SIGUSR1 sent to this wrapper is passed to the launcher, whose torch elastic
agent passes it on to every worker (PET_SIGNALS_TO_HANDLE, set here, is torchrun's
--signals-to-handle, which `accelerate launch` reads too: it adds SIGUSR1 to the signals the agent
handles; by default SIGUSR1 would kill the agent and orphan its workers). The
workers save a checkpoint and rank 0 reports `preempted: ...`; the agent itself then exits 1
with a traceback, which this wrapper turns into exit code 75 (EXIT_PREEMPTED: requeue me). A bare
`accelerate launch` or `torchrun` exits 1 there: only this wrapper knows the workers saved.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accel_common.errors import EXIT_PREEMPTED, RecipeError

WORKER_ERROR = re.compile(r"^error( \(rank \d+\))?: ")
PREEMPTED = re.compile(r"^preempted( \(rank \d+\))?: ")
# torch elastic's default list, plus SIGUSR1: SLURM's warning before the end of a job
AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# torch.distributed.elastic's own log lines, e.g. "E1123 00:12:28.977000 10860 torch/...".
ELASTIC_LOG = re.compile(r"^[WEI]\d{4} [\d:.]+ \d+ .*torch/distributed/elastic/")
ROOT_CAUSE = "Root Cause (first observed failure):"
RANK = re.compile(r"^\s*rank\s*: (\d+)")
EXIT_CODE = re.compile(r"^\s*exitcode\s*: (-?\d+)")
# `accelerate launch` with one process runs the worker itself and reports its failure as a
# traceback ending in this line
ONE_PROCESS_EXIT = re.compile(
    r"^subprocess\.CalledProcessError: .* (?:returned non-zero exit status (\d+)|died with "
    r"<Signals\.\w+: (\d+)>)\."
)
# torch elastic's lines that belong to a failure report (not progress, such as a restart)
ELASTIC_FAILURE = re.compile(ELASTIC_LOG.pattern + r".*(closing signal|failed \(exitcode)")
TRACEBACK = "Traceback (most recent call last):"
# the line between a chained exception's two parts (Accelerate 1.16's one-process launcher raises
# its CalledProcessError from the worker's stderr): the launcher's, never a worker's last line
CHAINED = re.compile(r"^(The above exception was the direct cause|During handling of the above)")
# a traceback's last line, the exception (frames are indented; chained ones are announced)
EXCEPTION_LINE = re.compile(r"^(?!Traceback|During handling|The above exception)[^\s]")
# a frame of the launcher's own code: the traceback is its failure report, not a worker's
LAUNCHER_FRAME = re.compile(
    r'^\s*File ".*(accelerate/commands/|torch/distributed/(run\.py|launcher/)|'
    r'bin/(accelerate|accelerate-launch|torchrun)")'
)
PENDING_LIMIT = 500  # lines a traceback is held for before it is shown as a worker's
BOX = " \t\r\n│┃╭╮╰╯─━"  # a rich error box around a worker's message (Typer's usage errors)
STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")  # Ctrl-C, SLURM: the launcher decides
EXAMPLE = (
    "accel-recipes launch -- accelerate launch --config_file accelerate_configs/cpu_2proc.yaml "
    "recipes/train_template.py"
)


@dataclass
class Condensed:
    """What the filter kept: the lines to show and the failed rank's exit code, if reported;
    the launcher's own error (its exception line) and the workers' last line, to name a cause
    no `error:` line named."""

    lines: list[str]
    rank: int | None = None
    exit_code: int | None = None
    preempted: bool = False
    one_process: bool = False
    reported: bool = False  # a worker printed `error: ...`
    launcher_error: str | None = None
    last_output: str | None = None


def condense(
    stderr: Iterable[str], full: bool = False, stopping: Callable[[], bool] = lambda: False
) -> Iterator[str | Condensed]:
    """Yield the launcher's stderr lines to show as they come, then a Condensed summary.

    Once a worker has printed `error...`, once `stopping()` (a stop signal was passed on), or once
    the launcher's own traceback begins, the launcher's log lines and its failure report are held
    back; the report's root-cause block gives the rank and exit code to report instead (a
    one-process launch: its traceback's last line). A traceback is held until its frames show
    whose it is: a worker's (a script that raised) is shown whole, the launcher's is not. `full`
    shows every line and still reads the report.
    """
    reader = _Reader(Condensed(lines=[]), full, stopping)
    for line in stderr:
        yield from reader.take(line)
    yield from reader.flush()
    yield reader.summary


@dataclass
class _Reader:
    """condense's state: what has happened so far in the launcher's stderr."""

    summary: Condensed
    full: bool
    stopping: Callable[[], bool]
    worker_failed: bool = False
    in_root_cause: bool = False
    report: bool = False  # the launcher's own traceback has begun: everything after is its
    pending: list[str] | None = None  # a traceback whose frames have not yet said whose it is

    def take(self, line: str) -> Iterator[str]:
        if self.pending is not None:
            self.pending.append(line)
            if EXCEPTION_LINE.match(line) or len(self.pending) > PENDING_LIMIT:
                block, self.pending = self.pending, None
                if any(LAUNCHER_FRAME.match(held) for held in block):
                    self.report = True
                    self.summary.launcher_error = line.strip()
                yield from self.flush(block)
        elif line.startswith(TRACEBACK) and not self.report:
            self.pending = [line]
        else:
            yield from self.show(line)

    def flush(self, block: list[str] | None = None) -> Iterator[str]:
        block, self.pending = (block if block is not None else self.pending or []), None
        for line in block:
            yield from self.show(line)

    def show(self, line: str) -> Iterator[str]:
        summary = self.summary
        if WORKER_ERROR.match(line) or PREEMPTED.match(line):
            self.worker_failed = True
            summary.reported = summary.reported or bool(WORKER_ERROR.match(line))
            summary.preempted = summary.preempted or bool(PREEMPTED.match(line))
            yield line
            return
        held = self.worker_failed or self.report or self.stopping()
        failure_log = bool(ELASTIC_FAILURE.match(line))  # part of a report, not progress
        if self.full or not (held or failure_log):
            yield line
        if not (held or failure_log):
            text = line.strip(BOX)
            if text and not ELASTIC_LOG.match(line) and not CHAINED.match(text):
                summary.last_output = text
            return
        if ELASTIC_LOG.match(line):
            if not held and not self.full:  # shown at the end unless a report replaces it
                summary.lines.append(line)
            return
        self.in_root_cause = self.in_root_cause or line.strip() == ROOT_CAUSE
        if self.in_root_cause and (found := RANK.match(line)):
            summary.rank = int(found.group(1))
        if self.in_root_cause and (found := EXIT_CODE.match(line)):
            summary.exit_code = int(found.group(1))
        if found := ONE_PROCESS_EXIT.match(line):
            code = found.group(1) or f"-{found.group(2)}"  # "died with <Signals.SIGKILL: 9>"
            summary.rank, summary.exit_code = 0, int(code)
            summary.one_process = True
        if not self.full:
            summary.lines.append(line)


def accelerate_launch_args(command: Sequence[str]) -> list[str] | None:
    """The arguments of `accelerate launch ARGS` (or `python -m accelerate.commands.launch ARGS`,
    or `accelerate-launch ARGS`); None for any other launcher."""
    for i, word in enumerate(command):
        name = Path(word).name
        if name == "accelerate" and command[i + 1 : i + 2] == ["launch"]:
            return list(command[i + 2 :])
        if name == "accelerate-launch" or (
            word == "accelerate.commands.launch" and command[i - 1 : i] == ["-m"]
        ):
            return list(command[i + 1 :])
    return None


def accelerate_config(args: list[str]) -> tuple[Any, Path | None, str]:
    """Accelerate's own reading of the launch arguments, the config file it would load (None:
    none) and how to name that file in a message; (None, None, "") where the arguments do not
    parse: the launcher then says why itself."""
    from accelerate.commands.config import default_config_file
    from accelerate.commands.launch import launch_command_parser

    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            parsed = launch_command_parser().parse_args(args)
    except SystemExit:  # --help, or arguments accelerate refuses with its own message
        return None, None, ""
    if parsed.config_file is not None:
        return parsed, Path(parsed.config_file), "--config_file"
    if Path(default_config_file).is_file() and not parsed.cpu:  # as `accelerate launch` decides
        return parsed, Path(default_config_file), "accelerate's default config"
    return parsed, None, ""


def preflight(command: Sequence[str]) -> dict[str, Any]:
    """Refuse, before anything starts, an `accelerate launch` that would die with a traceback:
    its config missing or not valid YAML, or DeepSpeed asked for and not installed. The checks
    and their wording are the doctor's (`accel-recipes doctor --config-file`). Returns the
    config the launch will use ({}: none, or not an `accelerate launch`)."""
    args = accelerate_launch_args(command)
    if args is None:
        return {}
    from accel_common.tools.doctor.config import load_config, missing_deepspeed  # torch: here

    parsed, path, flag = accelerate_config(args)
    if parsed is None:
        return {}
    config = load_config(path, flag) if path is not None else {}
    others = ("multi_gpu", "use_fsdp", "tpu", "use_megatron_lm")
    if parsed.use_deepspeed:
        wants, name = True, "--use_deepspeed"
    else:  # a config's distributed_type counts unless a flag picks another kind
        wants = config.get("distributed_type") == "DEEPSPEED"
        wants = wants and not any(getattr(parsed, other, False) for other in others)
        name = path.name if path is not None else ""
    if wants and (problem := missing_deepspeed(name)) is not None:
        raise RecipeError(f"{problem.message}: {problem.advice}")
    return config


def cpu_environment(config: dict[str, Any]) -> dict[str, str]:
    """ACCELERATE_USE_CPU=true for a config that asks for the CPU (`use_cpu: true`).

    `accelerate launch` exports it on its one-process path only; the N workers it starts for
    cpu_2proc.yaml (MULTI_GPU + use_cpu, through torchrun) are not told, so an `Accelerator()`
    there without cpu=True finds no GPU and runs alone: N separate one-process jobs. No key of
    the config file can make the launcher pass it on; the recipes pass cpu=True themselves."""
    return {"ACCELERATE_USE_CPU": "true"} if config.get("use_cpu") is True else {}


def start(command: Sequence[str], **options: Any) -> subprocess.Popen:
    """Popen, with a launcher that cannot be run reported as one line."""
    try:
        return subprocess.Popen(command, **options)
    except FileNotFoundError:
        where = "file" if os.sep in command[0] else "command on PATH"
        raise RecipeError(
            f"{command[0]}: no such {where}; give the launcher after --, e.g. {EXAMPLE}"
        ) from None
    except OSError as err:  # not executable, a folder, not a program
        raise RecipeError(
            f"{command[0]}: cannot run it ({err.strerror}); give the launcher after --, e.g. "
            f"{EXAMPLE}"
        ) from None


def run(command: Sequence[str]) -> int:
    """Run the launcher command; return the failed worker's exit code, else the launcher's.

    Stop signals that reach this process (SIGINT, SIGTERM, SIGUSR1) are passed to the launcher,
    also those that arrive while it starts; once it has exited, the previous handlers return."""
    config = preflight(command)
    env = {"PET_SIGNALS_TO_HANDLE": AGENT_SIGNALS, **os.environ, **cpu_environment(config)}
    full = os.environ.get("ACCEL_RECIPES_FULL_REPORT") == "1"
    launcher: subprocess.Popen | None = None
    received: list[int] = []

    def forward(sig: int, _frame: object) -> None:
        received.append(sig)
        if launcher is not None:
            launcher.send_signal(sig)

    previous = {name: signal.signal(getattr(signal, name), forward) for name in STOP_SIGNALS}
    try:
        launcher = start(command, stderr=subprocess.PIPE, text=True, bufsize=1, env=env)
        for sig in list(received):  # arrived while it started
            launcher.send_signal(sig)
        summary = Condensed(lines=[])
        for item in condense(launcher.stderr, full=full, stopping=lambda: bool(received)):
            if isinstance(item, Condensed):
                summary = item
            else:
                sys.stderr.write(item)
                sys.stderr.flush()
        code = launcher.wait()
    finally:
        for name, handler in previous.items():  # None: a handler not set from Python
            signal.signal(getattr(signal, name), signal.SIG_DFL if handler is None else handler)
    if code == 0:
        sys.stderr.writelines(summary.lines)  # held, and no failure report replaced them
        return code
    line, code = closing_line(summary, code, received, command[0])
    hint = "" if full else " (ACCEL_RECIPES_FULL_REPORT=1 shows the launcher's full report)"
    sys.stderr.write(f"launcher: {line}{hint}\n")
    return code


def closing_line(
    summary: Condensed, code: int, received: Sequence[int], launcher: str
) -> tuple[str, int]:
    """The one line that replaces a failed launch's report, and the exit code to leave with:
    the failed worker's (128 + N for a signal N), or the launcher's where no worker failed."""
    failed = summary.exit_code
    said = summary.reported or summary.last_output is None
    cause = "" if said else f" (its last line: {summary.last_output})"
    who = "the worker" if summary.one_process else f"rank {summary.rank}"
    if summary.preempted:
        return (
            f"preempted, the checkpoint is saved; exit code {EXIT_PREEMPTED}: requeue the job to "
            "continue",
            EXIT_PREEMPTED,
        )
    if failed is not None and failed > 0:
        others = "" if summary.one_process else "; the others were stopped"
        first = "failed" if summary.one_process else "failed first,"
        return f"{who} {first} with exit code {failed}{cause}{others}", failed
    if received:  # stopped before the workers could save: while they started
        name, stopped = signal.Signals(received[0]).name, 128 + received[0]
        return (
            f"stopped by {name} before any worker reported a saved checkpoint (a signal while "
            f"they start is not caught); exit code {stopped}: relaunch with --resume latest to "
            "continue from the newest complete checkpoint",
            stopped,
        )
    if failed is not None and failed < 0:
        name = signal_name(-failed)
        memory = " (SIGKILL without a message: most often the out-of-memory killer)"
        memory = memory if name == "SIGKILL" else ""
        return f"{who} was killed by {name}{memory}; exit code {128 - failed}", 128 - failed
    if summary.launcher_error is not None:
        return f"the launcher itself failed: {summary.launcher_error}; exit code {code}", code
    sys.stderr.writelines(summary.lines)  # held lines no report explained: show them
    return f"{launcher} exited with code {code}{cause}", code


def signal_name(number: int) -> str:
    """SIGKILL for 9; `signal 99` for a number no signal has."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
