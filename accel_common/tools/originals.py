"""`accel-recipes convert --from ORIGINAL` / `--to ORIGINAL`: checkpoints of the original projects.

Each recipe with an original owns its conversion, beside its model: `recipes/X/convert.py` names
the original (`ORIGINAL = "pcdiff"`) and defines

    import_checkpoint(source: Path, given: Mapping[str, str]) -> tuple[dict[str, Tensor], dict]
        the original's checkpoint as this recipe's state dict (loads strictly into its model) and
        the export's config (the settings, and derived values, its commands rebuild the model
        from); `given` is `--set NAME=VALUE`: the settings the checkpoint does not record, which
        it passes with what it assumed to accel_common.settle_unrecorded (one line
        naming them). A converter with `import_checkpoint(source)` alone still converts; `--set`
        is then refused naming it
    export_checkpoint(model_dir: Path, target: Path) -> Path
        this recipe's export as a file the original's code loads
    export_files(source: Path) -> dict[str, str]   (optional)
        {file name: text} written beside the imported export (e.g. the original's vocabulary)
    side_files(model_dir: Path, target: Path) -> list[Path]   (optional)
        the files export_checkpoint writes beside `target` (e.g. the original's config.json)

`convert` replaces none of these, nor the file named, unless --force (they may belong to another
export in the same folder).

Found by where it lives, like make-data's generators: adding an original edits no registry, and
listing the names reads the files without importing any recipe.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from accel_common.errors import RecipeError

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
DECLARATION = re.compile(r'^ORIGINAL = "([\w.-]+)"', re.MULTILINE)


def originals() -> dict[str, str]:
    """{original's name: recipe} for every recipes/X/convert.py."""
    found = {}
    for path in sorted(RECIPES.glob("*/convert.py")):
        match = DECLARATION.search(path.read_text())
        if match:
            found[match.group(1)] = path.parent.name
    return found


def converter(original: str) -> tuple[str, ModuleType]:
    """The recipe that trains `original`'s network, and its convert module."""
    known = originals()
    if original not in known:
        choices = ", ".join(known) or "none yet"
        raise RecipeError(
            f"--from/--to {original}: no recipe converts it; choose one of: {choices}"
        )
    recipe = known[original]
    return recipe, importlib.import_module(f"recipes.{recipe}.convert")


def import_from(module: ModuleType, source: Path, given: Mapping[str, str]) -> tuple[dict, Any]:
    """`module.import_checkpoint` of `source`, passed `given` (--set) where it takes them."""
    takes = len(inspect.signature(module.import_checkpoint).parameters) > 1
    if takes:
        return module.import_checkpoint(source, given)
    if given:
        raise RecipeError(
            f"--set {', '.join(given)}: {module.__file__}'s import_checkpoint(source) takes no "
            "settings; give it a second parameter, `given` (see accel_common/tools/originals.py)"
        )
    return module.import_checkpoint(source)
