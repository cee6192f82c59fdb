"""The crystal recipe's Python API until 0.2.0 (`from recipes.crystal.api import
train_from_extxyz`), kept so that code written against it runs, with a DeprecationWarning. The API
runs the script, so it now lives beside it, in recipes/crystal_api.py (the folder holds the script's
parts, which never import it): it is imported from there only when an old name is used.
"""

from __future__ import annotations

from typing import Any

from accel_common import moved_attribute

# the names this module defined before it moved
MOVED = dict.fromkeys(
    (
        "CONFIGS", "PRESETS", "original_defaults", "preset", "original_only_settings", "as_flags",
        "processes_for", "train_from_extxyz", "train_from_list",
    ),
    "recipes.crystal_api",
)  # fmt: skip


def __getattr__(name: str) -> Any:
    """An old name, found in recipes/crystal_api.py with a DeprecationWarning."""
    return moved_attribute(__name__, name, MOVED)
