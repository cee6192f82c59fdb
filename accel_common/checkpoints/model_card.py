"""An export's README.md: a Hub-style model card (YAML front matter: `library_name`, `tags`) with
the recipe, the command that trained it, the final metrics, the settings and how to load it, so
an export folder can be uploaded to the Hub as it is. Written from the export's metadata
(model.json), so the best epoch's export, given the run's final metrics, gets its card anew.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from typing import Any

from accel_common.checkpoints.hf_layout import HFLayout
from accel_common.setting_lists import shown
from accel_common.settings import NOT_FLAGS, flag

CARD_FILE = "README.md"


def _yaml(value: str) -> str:
    """A YAML scalar: a JSON string is a valid double-quoted YAML one."""
    return json.dumps(value)


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return f"`{text}`".replace("|", "\\|").replace("\n", " ")


def training_command(meta: Mapping[str, Any]) -> str:
    """The command that trained the export, as the run recorded it (`command`); else the
    recipe's script with the recorded settings as flags (not the values computed from the data,
    listed as `derived`, nor tables, which a flag cannot hold; a list setting's items as its
    flag takes them, `--widths 32,64`)."""
    recorded = meta.get("command")
    if isinstance(recorded, list):
        return shlex.join(str(part) for part in recorded)
    if isinstance(recorded, str):
        return recorded
    config = meta.get("config") if isinstance(meta.get("config"), Mapping) else {}
    derived = set(meta.get("derived") or ())
    parts = ["python", f"recipes/train_{meta.get('recipe', 'RECIPE')}.py"]
    for key, value in config.items():
        if key in NOT_FLAGS or key in derived or value is None:
            continue
        if isinstance(value, bool):
            parts.append(flag(key) if value else "--no-" + flag(key)[2:])
        elif isinstance(value, (int, float, str)):
            parts += [flag(key), str(value)]
        elif isinstance(value, list) and all(flag_item(item) for item in value):
            parts += [flag(key), shown(value) if value else ""]
    return shlex.join(parts)


def flag_item(item: Any) -> bool:
    """An item a list flag can hold: a number, or text without a comma."""
    if isinstance(item, str):
        return "," not in item
    return isinstance(item, int | float) and not isinstance(item, bool)


def _load_snippet(folder: str, recipe: str, layout: HFLayout | None) -> str:
    plain = (
        "```python\nfrom accel_common import load_exported\n\n"
        f"# model: the {recipe} recipe's network, built with the settings below\n"
        f"meta = load_exported({folder!r}, model)  # strict load; returns model.json\n```\n"
    )
    if layout is None:
        return plain
    return (
        f"```python\nfrom {layout.library} import {layout.model_class}\n\n"
        f"model = {layout.model_class}.from_pretrained({folder!r})\n```\n\n"
        f"or, with the recipe's own loader (the same weights, in `model.safetensors`):\n\n{plain}"
    )


def model_card(meta: Mapping[str, Any], folder: str, layout: HFLayout | None = None) -> str:
    """The README.md of the export in `folder` (as the snippet names it) with metadata `meta`."""
    recipe = str(meta.get("recipe", "unknown"))
    library = layout.library if layout is not None else "pytorch"
    tags = ["accel-recipes", recipe, "safetensors"]
    if layout is not None:
        tags.append(layout.library)
    metrics = meta.get("metrics") if isinstance(meta.get("metrics"), Mapping) else {}
    config = meta.get("config") if isinstance(meta.get("config"), Mapping) else {}
    lines = [
        "---",
        f"library_name: {_yaml(library)}",
        "tags:",
        *(f"- {_yaml(tag)}" for tag in tags),
        "---",
        "",
        f"# {recipe} model",
        "",
        f"Trained by the `{recipe}` recipe of accel-recipes"
        + (f" for {meta['step']} optimizer steps" if isinstance(meta.get("step"), int) else "")
        + (f": a `{layout.model_class}` ({layout.library})." if layout else ".")
        + " The weights are `model.safetensors` (clean keys, every name of tied weights);"
        + " `model.json` records the recipe, settings, batch plan and metrics.",
        "",
        "## How to load it",
        "",
        _load_snippet(folder, recipe, layout),
        "## How it was trained",
        "",
        f"```bash\n{training_command(meta)}\n```",
        "",
        "## Final metrics",
        "",
    ]
    if metrics:
        lines += ["| metric | value |", "| --- | --- |"]
        lines += [f"| {name} | {_cell(value)} |" for name, value in metrics.items()]
    else:
        lines.append("None recorded.")
    lines += ["", "## Settings", ""]
    if config:
        lines += ["| setting | value |", "| --- | --- |"]
        lines += [f"| {name} | {_cell(value)} |" for name, value in config.items()]
    else:
        lines.append("None recorded.")
    return "\n".join(lines) + "\n"
