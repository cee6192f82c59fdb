"""Errors a user can fix, reported as one clear line and a non-zero exit instead of a traceback."""

from __future__ import annotations

import functools
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

EXIT_USER_ERROR = 2
EXIT_DIST_FAILURE = 3  # a collective failed: another process died or hangs
EXIT_LAUNCHER_GONE = 4  # the launcher was killed; the worker stopped on its own
# preempted (SIGTERM/SIGUSR1): a checkpoint of the step in progress was saved; requeue the job.
# 75 is EX_TEMPFAIL in sysexits.h, "try again later"; the SLURM scripts requeue on it
EXIT_PREEMPTED = 75
# how long a rank other than 0 waits, after a RecipeError, before it exits: the launcher stops
# every process as soon as one exits, so a rank 1 that left first took rank 0's `error:` line
# with it (CI, 2 loaded cores: the GPU-config refusal printed nothing). Rank 0 prints and exits
# within this; a rank still alive after it raised alone and prints its own line.
PEER_GRACE_SECONDS = 10.0
# torch's refusal under use_deterministic_algorithms(True) (accel_common.hardware.determinism)
_REFUSED = re.compile(r"^(?P<op>\S.*?) does not have a deterministic implementation")


class RecipeError(Exception):
    """Bad input or configuration: the message says what is wrong and what to do."""


class ConfigError(RecipeError, ValueError):
    """A flag value that cannot work (non-positive LR, unsplittable batch, ...)."""


class DataError(RecipeError):
    """A data file that is missing or malformed; the message names the file and record."""


class CheckpointError(RecipeError):
    """A checkpoint or model file that cannot be read safely."""


class NonFiniteError(RecipeError):
    """The loss or the weights became NaN or infinite: nothing more is saved or exported."""


class Preempted(Exception):
    """A stop signal arrived, every process finished the same optimizer step, and the state
    was saved: not an error, so it leaves with its own exit code (EXIT_PREEMPTED)."""


def is_main_launch_process() -> bool:
    """True on global rank 0, readable before any process group exists."""
    return int(os.environ.get("RANK", "0")) == 0


def describe_distributed_failure(err: RuntimeError, dist_timeout: int | None) -> str | None:
    """What a failed collective means and what to do about it; None if `err` is not one.

    gloo raises plain RuntimeErrors whose text names gloo's source file; NCCL and the rendezvous
    store raise torch.distributed.DistError. Either way the real cause is in another process's
    log, which is what a user staring at this process's traceback needs to be told.
    """
    from torch.distributed import DistError  # imported late: torch is heavy for the CLI

    text = str(err).strip()
    if not isinstance(err, DistError) and "gloo" not in text.lower():
        return None
    reason = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0] if text else type(err).__name__)
    if "timed out" in text.lower() or "timeout" in text.lower():
        within = (
            f"--dist-timeout {dist_timeout} s"
            if dist_timeout
            else "the default timeout (30 min on gloo, 10 min on NCCL; --dist-timeout sets it)"
        )
        return (
            f"a collective (gradient all-reduce or barrier) did not complete within {within}: "
            "another process died or stopped responding. Check every node's log for the first "
            "error; if a process was only busy alone (saving, evaluating, preparing data), raise "
            f"--dist-timeout. ({reason})"
        )
    return (
        "lost the connection to another process during a collective: it died (crash, "
        "out-of-memory kill, lost node), so this one stops too. Its log holds the cause. "
        f"({reason})"
    )


def error_message(err: RecipeError) -> str:
    """The error's own message. One raised in a DataLoader worker comes back re-raised by torch
    with the worker's whole traceback folded into its text; its last line is the message."""
    text = str(err).strip()
    if "Original Traceback" not in text:
        return text
    last = text.splitlines()[-1]
    return re.sub(r"^[\w.]+: ", "", last)


def exit_on_error(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn a RecipeError into `error: ...` on stderr (printed once, by rank 0; by another rank
    only if it raised alone, see PEER_GRACE_SECONDS) and exit code 2,
    a failed collective into `error (rank N): ...` from each process that sees it, exit code 3,
    and a preemption into `preempted: ...` (rank 0) and exit code 75.

    A dead or hung peer shows up on the survivors as a gloo/NCCL error deep inside backward();
    one line saying what happened beats a 40-line traceback from the wrong process.
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except RecipeError as err:
            if is_main_launch_process():
                say(f"error: {error_message(err)}")
            else:
                time.sleep(PEER_GRACE_SECONDS)
                rank = os.environ.get("RANK", "?")
                say(f"error (rank {rank}): {error_message(err)}")
            sys.exit(EXIT_USER_ERROR)
        except Preempted as stop:
            if is_main_launch_process():
                say(f"preempted: {stop}")
            elif os.environ.get("LOCAL_RANK") == "0":  # every node's launcher must see it
                rank = os.environ.get("RANK", "?")
                say(f"preempted (rank {rank}): saved too")
            sys.exit(EXIT_PREEMPTED)
        except RuntimeError as err:
            if (op := refused_op(err)) is not None:
                if is_main_launch_process():
                    recipe = Path(sys.argv[0]).stem.removeprefix("train_")
                    say(
                        f"error: --deterministic: {op} has no deterministic implementation on "
                        f"this device, so the {recipe} recipe cannot run deterministically here; "
                        "run without --deterministic (two runs may then differ in the last bits)"
                    )
                sys.exit(EXIT_USER_ERROR)
            message = describe_distributed_failure(err, kwargs.get("dist_timeout"))
            if message is None:
                raise
            rank = os.environ.get("RANK", "0")
            say(f"error (rank {rank}): {message}")
            sys.exit(EXIT_DIST_FAILURE)

    return wrapper


def say(line: str) -> None:
    """`line` on stderr in one write: print writes the text and its newline apart when Python is
    unbuffered (PYTHONUNBUFFERED, as in many containers), and two ranks' lines then run together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def refused_op(err: BaseException) -> str | None:
    """The op that torch refused to run under `use_deterministic_algorithms(True)`, or None if
    `err` is not that refusal."""
    match = _REFUSED.search(str(err).strip())
    return match.group("op") if match else None
