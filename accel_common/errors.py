"""Errors a user can fix, reported as one clear line and a non-zero exit instead of a traceback."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

EXIT_USER_ERROR = 2


class RecipeError(Exception):
    """Bad input or configuration: the message says what is wrong and what to do."""


class ConfigError(RecipeError, ValueError):
    """A flag value that cannot work (non-positive LR, unsplittable batch, ...)."""


class DataError(RecipeError):
    """A data file that is missing or malformed; the message names the file and record."""


class CheckpointError(RecipeError):
    """A checkpoint or model file that cannot be read safely."""


def is_main_launch_process() -> bool:
    """True on global rank 0, readable before any process group exists."""
    return int(os.environ.get("RANK", "0")) == 0


def exit_on_error(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn a RecipeError into `error: ...` on stderr (printed once, by rank 0) and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except RecipeError as err:
            if is_main_launch_process():
                print(f"error: {err}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)

    return wrapper
