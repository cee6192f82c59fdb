"""`--help`'s panels: the groups a training command shows its flags in. The recipe's own settings
come first, in a panel named for the recipe ("Template settings"), then the shared ones in
`ORDER`. Each setting names its panel where it is declared (`setting(..., panel=SCHEDULE)` in
accel_common.recipe_cli.options; a recipe's own setting may name one of these too), so there is
no second table of flags to keep in step.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

DATA = "Data and output"
TRAINING = "Training"
BATCH_LR = "Batch and LR"
SCHEDULE = "LR schedule"
SPEED = "Precision and speed"
PROCESSES = "Devices and processes"
CHECKPOINTS = "Checkpoints and resume"
LOGGING = "Logging and tracking"
COMMAND = "Config file, dry run and help"  # --config, --dry-run, --processes, --help
ORDER = (DATA, TRAINING, BATCH_LR, SCHEDULE, SPEED, PROCESSES, CHECKPOINTS, LOGGING, COMMAND)


def recipe_panel(recipe: str) -> str:
    """The panel of a recipe's own settings: 'Template settings' for recipes/train_template.py."""
    return f"{recipe[:1].upper()}{recipe[1:]} settings"


def in_panel_order(parameters: Sequence[inspect.Parameter], first: str) -> list[inspect.Parameter]:
    """`parameters` (Typer options) ordered as `--help` shows their panels, which is the order
    each panel first appears in: `first` (the recipe's own), then any other panel a recipe's
    setting names, then `ORDER`'s; within a panel, as declared (a recipe's own first)."""

    def rank(parameter: inspect.Parameter) -> int:
        panel = getattr(parameter.default, "rich_help_panel", None)
        if panel == first:
            return 0
        return 2 + ORDER.index(panel) if panel in ORDER else 1

    return sorted(parameters, key=rank)
