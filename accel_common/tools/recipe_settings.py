"""`accel-recipes convert SRC OUT --recipe X --set NAME=VALUE`: the settings a foreign checkpoint
does not record, given so that recipe X's commands (evaluate, predict, ...) can rebuild its model
from the export. A NAME is one of X's settings (its Settings class, typed and checked as its flag
is) or a value X's training derives from the data (the keys of the `derived = {...}` it passes to
`make_loop`, e.g. the template's `target_mean`: a number, or JSON such as a list). What is not
given is named in one line with the flag to give; the export records what was given as its
`config`, which `read_recipe_export` hands back as a `RecordedConfig`.
"""

from __future__ import annotations

import ast
import importlib
import json
import math
from dataclasses import fields
from pathlib import Path
from typing import Any

from accel_common.checkpoints.export import UNNAMED_RECIPE
from accel_common.errors import ConfigError, RecipeError
from accel_common.settings import CONFIG_FROM_SET, Settings, base_type
from accel_common.tools.originals import RECIPES

__all__ = ["CONFIG_FROM_SET", "foreign_config", "unrecorded_note"]


def known_recipes() -> list[str]:
    """The recipes of this checkout (recipes/train_X.py)."""
    return sorted(p.stem.removeprefix("train_") for p in RECIPES.glob("train_*.py"))


def is_recipe(recipe: str) -> bool:
    return recipe in known_recipes()


def settings_class(recipe: str) -> type[Settings]:
    """The Settings class of recipe X's train command (recipes/train_X.py)."""
    module = importlib.import_module(f"recipes.train_{recipe}")
    return module.train.settings_class


def derived_names(recipe: str) -> list[str]:
    """The names recipe X's training derives from the data and records beside its settings:
    the string keys of every `derived = {...}` (and `derived["name"] = ...`) in its modules."""
    paths = [RECIPES / f"train_{recipe}.py", *sorted((RECIPES / recipe).glob("*.py"))]
    names: list[str] = []
    for path in paths:
        if not path.is_file():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name) and target.id == "derived":
                        if isinstance(node.value, ast.Dict):
                            names += [k.value for k in node.value.keys if _is_text(k)]
                    elif (
                        isinstance(target, ast.Subscript)
                        and isinstance(target.value, ast.Name)
                        and target.value.id == "derived"
                        and _is_text(target.slice)
                    ):
                        names.append(target.slice.value)  # type: ignore[attr-defined]
    return list(dict.fromkeys(names))


def _is_text(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def model_settings(cls: type[Settings]) -> list[str]:
    """The settings a recipe's commands rebuild its model from, as far as the class tells: not
    the adjustable ones (cadence, workers, ...) nor paths (--init-from, caches)."""
    hints = cls.hints()
    return [
        f.name
        for f in fields(cls)
        if not f.metadata.get("adjustable") and base_type(hints[f.name]) is not Path
    ]


def foreign_config(recipe: str, given: dict[str, str]) -> dict[str, Any]:
    """The export's config from `--set NAME=VALUE` for recipe X: each a setting of X (typed and
    checked as its flag) or a value its training derives; any other name, or a bad value, is
    one line naming it."""
    if not given:
        return {}
    if not is_recipe(recipe):
        choices = ", ".join(known_recipes())
        named = "no --recipe" if recipe == UNNAMED_RECIPE else f"--recipe {recipe}, which is none"
        raise RecipeError(
            f"--set {next(iter(given))}: records a setting of a recipe's, but {named} of this "
            f"checkout's recipes; give --recipe NAME ({choices}), or use it with --from "
            "ORIGINAL for an original's checkpoint"
        )
    cls, derived = settings_class(recipe), derived_names(recipe)
    own = [f.name for f in fields(cls)]
    config: dict[str, Any] = {}
    for name, raw in given.items():
        if name in own:
            config[name] = _setting_value(cls, name, raw)
        elif name in derived:
            config[name] = _derived_value(name, raw)
        else:
            raise RecipeError(
                f"--set {name}: the {recipe} recipe has no such setting; --set takes its "
                f"settings ({', '.join(own)}) and what its training derives from the data "
                f"({', '.join(derived) or 'nothing'})"
            )
    return config


def _setting_value(cls: type[Settings], name: str, raw: str) -> Any:
    """`raw` as setting `name` of `cls`, checked as its flag is."""
    kind = base_type(cls.hints()[name])
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false"):
                raise ValueError
            value: Any = raw.lower() == "true"
        elif raw.lower() == "none" and kind is not str:
            value = None
        else:
            value = kind(raw) if isinstance(kind, type) else raw
        cls.from_config({name: value}).validate()
    except ConfigError as err:  # a ValueError too: first
        reason = str(err).split(": ", 1)[-1]
        raise RecipeError(f"--set {name}={raw}: {reason}") from None
    except (ValueError, TypeError):
        what = getattr(kind, "__name__", str(kind))
        raise RecipeError(f"--set {name}={raw}: not a valid {what}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise RecipeError(f"--set {name}={raw}: not a finite number")
    return value.value if hasattr(value, "value") and not isinstance(value, bool) else value


def _derived_value(name: str, raw: str) -> Any:
    """A derived value: JSON (a number, a list, ...) or else the text as it is."""
    try:
        number = float(raw)
    except ValueError:
        number = 0.0
    if not math.isfinite(number):  # nan, inf: which JSON cannot hold
        raise RecipeError(f"--set {name}={raw}: not a finite number")
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def unrecorded_note(recipe: str, config: dict[str, Any], target: Path) -> str:
    """One line naming what a plain convert's export for recipe X does not record that X's
    commands rebuild its model from ('' when it records all, or X is no recipe of this
    checkout's)."""
    if not is_recipe(recipe):
        return ""
    cls = settings_class(recipe)
    lacking = [n for n in model_settings(cls) + derived_names(recipe) if n not in config]
    if not lacking:
        return ""
    flags = " ".join(f"--set {name}=..." for name in lacking)
    return (
        f"note: {target} records no {recipe} {', '.join(lacking)}; its evaluate/predict "
        f"commands rebuild the model from them (a setting not given: the {recipe} default): "
        f"convert again with {flags} to give the values it was trained with"
    )
