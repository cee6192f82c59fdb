"""`accel-recipes check`: run the chosen promises on one recipe, print progress and the table."""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from accel_common.errors import RecipeError
from accel_common.tools.check.promises import HELD, NOT_HELD, PROMISES, SKIPPED, WAIVED, Outcome
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


def summary(outcomes: dict[str, Outcome]) -> str:
    """`7 held, 1 waived (a)`: how many rows ended each way, the letters of all but the held."""
    parts = []
    for status in (HELD, NOT_HELD, WAIVED, SKIPPED):
        letters = [letter for letter, outcome in outcomes.items() if outcome.status == status]
        if letters:
            named = "" if status == HELD else f" ({','.join(letters)})"
            parts.append(f"{len(letters)} {status}{named}")
    return ", ".join(parts)


def run_check(recipe: str, only: str | None, console: Console) -> int:
    """Check `recipe` (a name or a script's path); print progress, the table and a summary
    line; 1 if a promise does not hold, else 0. A row the recipe waives (CHECK_WAIVE) is not
    run: it shows its reason."""
    letters = chosen(only)
    found = find_recipe(recipe)
    waivers = found.waivers(list(PROMISES))
    table = Table(title=f"accel-recipes check {found.name}")
    for column in ("", "promise", "result", "measured", "why"):
        table.add_column(column)
    outcomes: dict[str, Outcome] = {}
    with tempfile.TemporaryDirectory(prefix=f"check-{found.name}-") as tmp:
        session = Session(found, Path(tmp))
        for letter in letters:
            title, promise = PROMISES[letter]
            if letter in waivers:
                outcomes[letter] = Outcome(WAIVED, "", waivers[letter])
                table.add_row(letter, title, f"[yellow]{WAIVED}[/yellow]", "", waivers[letter])
                continue
            console.print(f"check {found.name}: {title} ...")
            start = time.monotonic()
            try:
                outcome = promise(session)
            except subprocess.TimeoutExpired as err:  # a row of the table, not a traceback
                outcome = Outcome(NOT_HELD, "", f"a run took over {err.timeout:.0f} s")
            except (RuntimeError, ValueError, OSError) as err:  # a run failed, tensors differ
                outcome = Outcome(NOT_HELD, "", str(err).splitlines()[0] if str(err) else "")
            seconds = time.monotonic() - start
            outcomes[letter] = outcome
            style = {"held": "green", "not held": "red"}.get(outcome.status, "yellow")
            result = f"[{style}]{outcome.status}[/{style}]"
            table.add_row(letter, title, result, outcome.measured, outcome.why)
            console.print(f"  {outcome.status} ({seconds:.0f} s)")
    console.print(table)
    console.print(f"accel-recipes check {found.name}: {summary(outcomes)}")
    return 1 if any(outcome.status == NOT_HELD for outcome in outcomes.values()) else 0
