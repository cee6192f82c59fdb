"""Old paths of names that moved or were renamed keep working for at least one minor version, with
a DeprecationWarning naming the new path (CHANGELOG.md says what moved), so that a recipe copied
from an earlier version keeps running after `git pull`.

Two kinds of old path:
- a module that moved (0.3.0 laid accel_common out by concern: `accel_common.loop` is now
  `accel_common.training.loop`): `OldModulePaths`, a finder on sys.meta_path, answers the old name
  with a module whose attributes are the new module's, each use warning;
- a name that left a module that still exists (`recipes.crystal.api`): the module's PEP 562
  `__getattr__` calls `moved_attribute` with its table {name: new module}.
The new module is imported when an old path is used, not before: no import circle, no cost.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Mapping
from typing import Any

PACKAGE = "accel_common"
# 0.3.0: every module that was directly under accel_common/, and its subpackage now
MOVED_MODULES = {
    "batch_lr": ("batching", "balance", "lr", "onecycle", "losses", "batchnorm", "memory"),
    "training": ("loop", "policy", "evaluation", "nonfinite", "stop_signals", "run"),
    "monitoring": ("tracking", "throughput", "sync_wait"),
    "checkpoints": ("checkpoint", "checkpoint_files", "progress", "dcp_reader", "ties", "export"),
    "conversion": ("convert",),
    "run_folder": ("outputs", "lock_holder"),
    "hardware": (
        "accelerator", "launch_guard", "speed", "compilation", "determinism", "sharding",
        "parameters",
    ),
    "recipe_cli": ("options", "command_line", "command", "dry_run", "entry"),
}  # fmt: skip
OLD_MODULES = {
    f"{PACKAGE}.{module}": f"{PACKAGE}.{group}.{module}"
    for group, modules in MOVED_MODULES.items()
    for module in modules
}
# names that had left an old module before it moved (0.2.0), now found in the public API
LEFT_BEFORE = {f"{PACKAGE}.options": frozenset({"model_option", "train_command"})}


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


def public_path(name: str, value: Any, module: str) -> str:
    """Where to import `name` from now: the public API (accel_common or accel_common.data) when
    it is there, else the module that defines it."""
    for face in (PACKAGE, f"{PACKAGE}.data"):
        if name in getattr(importlib.import_module(face), "__all__", ()):
            return f"{face}.{name}"
    return f"{getattr(value, '__module__', None) or module}.{name}"


class OldModulePaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import accel_common.loop` (a 0.2 path): a module that hands out the attributes of
    accel_common.training.loop, each with a DeprecationWarning at the line that uses it. A name
    that left the old module before it moved (options' `model_option`) is found in the public
    API. It forwards reads only: patch the new module, not the old path."""

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in OLD_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None  # a plain module, filled by exec_module

    def exec_module(self, module: types.ModuleType) -> None:
        old, new = module.__name__, OLD_MODULES[module.__name__]
        module.__doc__ = f"The 0.2 path of {new}, kept with a DeprecationWarning."

        def __getattr__(name: str) -> Any:
            if name.startswith("__"):  # the import system's and tools' probes: not a user's name
                raise AttributeError(name)
            with warnings.catch_warnings():  # one warning, naming the final home
                warnings.simplefilter("ignore", DeprecationWarning)
                target = importlib.import_module(new)
                if hasattr(target, name):
                    value = getattr(target, name)
                elif name in LEFT_BEFORE.get(old, ()):
                    value = getattr(importlib.import_module(PACKAGE), name)
                else:
                    raise AttributeError(f"module {old!r} has no attribute {name!r}")
            warn_deprecated(f"{old}.{name}", public_path(name, value, new), stacklevel=2)
            return value

        def __dir__() -> list[str]:
            return dir(importlib.import_module(new))

        module.__getattr__ = __getattr__  # type: ignore[method-assign]
        module.__dir__ = __dir__  # type: ignore[method-assign]


def install_old_module_paths() -> None:
    """Put the finder of 0.2's module paths on sys.meta_path, once."""
    if not any(isinstance(finder, OldModulePaths) for finder in sys.meta_path):
        sys.meta_path.append(OldModulePaths())


def public_face(
    package: str, face: Mapping[str, tuple[str, ...]], name: str, namespace: dict[str, Any]
) -> Any:
    """A package's public `name`, imported from its module in `face` on first use and kept in
    the package's `namespace`; AttributeError for any other name (so that `from package import
    submodule` still imports the submodule). For the faces' PEP 562 `__getattr__`."""
    for module, names in face.items():
        if name in names:
            value = getattr(importlib.import_module(module), name)
            namespace[name] = value
            return value
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
