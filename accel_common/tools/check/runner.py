"""`accel-recipes check`: run the chosen promises on one recipe, print progress and the table."""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from accel_common.errors import RecipeError
from accel_common.tools.check.promises import NOT_HELD, PROMISES, Outcome
from accel_common.tools.check.recipe import find_recipe
from accel_common.tools.check.session import Session


def chosen(only: str | None) -> list[str]:
    """The promises `--only a,b` selects (all without it), in order."""
    if only is None:
        return list(PROMISES)
    letters = [letter.strip() for letter in only.split(",") if letter.strip()]
    unknown = [letter for letter in letters if letter not in PROMISES]
    if unknown or not letters:
        raise RecipeError(f"--only {only}: give letters among {','.join(PROMISES)}, e.g. a,d")
    return [letter for letter in PROMISES if letter in letters]


def run_check(recipe: str, only: str | None, console: Console) -> int:
    """Check `recipe` (a name or a script's path); print progress and the table; 1 if a promise
    does not hold, else 0."""
    letters = chosen(only)
    found = find_recipe(recipe)
    table = Table(title=f"accel-recipes check {found.name}")
    for column in ("", "promise", "result", "measured", "why"):
        table.add_column(column)
    failed = False
    with tempfile.TemporaryDirectory(prefix=f"check-{found.name}-") as tmp:
        session = Session(found, Path(tmp))
        for letter in letters:
            title, promise = PROMISES[letter]
            console.print(f"check {found.name}: {title} ...")
            start = time.monotonic()
            try:
                outcome = promise(session)
            except subprocess.TimeoutExpired as err:  # a row of the table, not a traceback
                outcome = Outcome(NOT_HELD, "", f"a run took over {err.timeout:.0f} s")
            except (RuntimeError, ValueError, OSError) as err:  # a run failed, tensors differ
                outcome = Outcome(NOT_HELD, "", str(err).splitlines()[0] if str(err) else "")
            seconds = time.monotonic() - start
            failed |= outcome.status == NOT_HELD
            style = {"held": "green", "not held": "red"}.get(outcome.status, "yellow")
            result = f"[{style}]{outcome.status}[/{style}]"
            table.add_row(letter, title, result, outcome.measured, outcome.why)
            console.print(f"  {outcome.status} ({seconds:.0f} s)")
    console.print(table)
    return 1 if failed else 0
