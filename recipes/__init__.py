"""The recipes: `train_X.py` is the script a user launches, `X/` what only workload X needs.

A package so that tests, benchmarks and `accel-recipes` import a recipe as `recipes.train_X`
and a recipe imports its own parts as `recipes.X.model`; `python recipes/train_X.py` still runs
the script directly (the project's install puts the repository on the path). `load_recipe`
finds one by its workload's name.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def load_recipe(name: str) -> ModuleType:
    """recipes/train_NAME.py as a module."""
    return importlib.import_module(f"recipes.train_{name}")
