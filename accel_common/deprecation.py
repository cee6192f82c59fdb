"""Old paths of names that moved or were renamed keep working for at least one minor version, with
a DeprecationWarning naming the new path (CHANGELOG.md says what moved), so that a recipe copied
from an earlier version keeps running after `git pull`.

A module that a name left gets a PEP 562 `__getattr__` that calls `moved_attribute` with its own
table {name: new module}. The new module is imported by name when an old path is used, not when
the old module loads: a new module that imports the old one (accel_common.command imports
accel_common.options) makes no import circle.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping
from typing import Any


def warn_deprecated(old: str, new: str, stacklevel: int = 2) -> None:
    """A DeprecationWarning that `old` is now `new`; `stacklevel` as warnings.warn counts it from
    the caller, so that the warning points at the user's line, not at the shim."""
    warnings.warn(
        f"{old} is deprecated: use {new} (CHANGELOG.md says what moved); the old path keeps "
        "working for at least one minor version",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


def moved_attribute(module: str, name: str, new_homes: Mapping[str, str]) -> Any:
    """`module.name` found in `new_homes[name]`, its module now, with a DeprecationWarning at the
    line that used the old path; AttributeError for a name that never moved. Call it from the
    old module's `__getattr__`."""
    if name not in new_homes:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new_module = new_homes[name]
    # 3: this function, the module's __getattr__, then the user's import or attribute access
    warn_deprecated(f"{module}.{name}", f"{new_module}.{name}", stacklevel=3)
    return getattr(importlib.import_module(new_module), name)
