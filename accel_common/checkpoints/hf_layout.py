"""The Hugging Face layout of an export: when a recipe's model is a diffusers `ModelMixin` or a
transformers `PreTrainedModel`, its export folder is also what that library's `save_pretrained`
writes (config.json beside the weights under the file name the library expects), so
`UNet2DModel.from_pretrained(run/model)` loads the exported weights as they are.

Which library a model belongs to is read from its classes' modules (`type(model).__mro__`), so
nothing here imports diffusers or transformers: a model of theirs means they are imported.
"""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# library -> (module defining its base model class, that class, the weights file it loads)
BASES = {
    "diffusers": (
        "diffusers.models.modeling_utils",
        "ModelMixin",
        "diffusion_pytorch_model.safetensors",
    ),
    "transformers": ("transformers.modeling_utils", "PreTrainedModel", "model.safetensors"),
}
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"  # transformers, for a model that generates
LAYOUT_FILES = (CONFIG_FILE, GENERATION_CONFIG_FILE)
# what tells each library's config.json from another (an original's config.json from convert)
VERSION_KEYS = {"diffusers": "_diffusers_version", "transformers": "transformers_version"}


@dataclass(frozen=True)
class HFLayout:
    """What an export adds for `library`: `files` (config.json, ... as bytes) and the weights
    file name `library` loads (`weights_name`; transformers' is the export's own model.safetensors).
    `model_class` is the class `from_pretrained` is called on."""

    library: str
    model_class: str
    weights_name: str
    files: Mapping[str, bytes] = field(default_factory=dict)


def hf_library(model: torch.nn.Module) -> str | None:
    """'diffusers' or 'transformers' when `model` (unwrapped) is one of their models, else None."""
    for cls in type(model).__mro__:
        for library, (module, name, _weights) in BASES.items():
            if cls.__module__ == module and cls.__qualname__ == name:
                return library
    return None


def hf_layout(model: torch.nn.Module) -> HFLayout | None:
    """The Hugging Face files of `model`'s export, written by the library's own `save_config` /
    `config.save_pretrained` (into a private folder, read back: the export places them); None
    for a model of neither library."""
    library = hf_library(model)
    if library is None:
        return None
    with tempfile.TemporaryDirectory(prefix="accel-hf-config-") as folder:
        if library == "diffusers":
            model.save_config(folder)  # type: ignore[operator]
        else:
            # as PreTrainedModel.save_pretrained does, on a copy (the model's config is left as is)
            config = copy.deepcopy(model.config)  # type: ignore[union-attr]
            config.dtype = str(model.dtype).split(".")[1]  # type: ignore[union-attr]
            config.architectures = [type(model).__name__.removeprefix("FSDP")]
            config.save_pretrained(folder)
            if model.can_generate():  # type: ignore[operator]
                model.generation_config.save_pretrained(folder)  # type: ignore[union-attr]
        files = {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}
    return HFLayout(library, type(model).__name__, BASES[library][2], files)


def read_hf_layout(folder: Path) -> HFLayout | None:
    """The Hugging Face layout of an export already written (the best epoch's, copied to the
    run's export), or None: told by its config.json's library version key."""
    config_path = Path(folder) / CONFIG_FILE
    if not config_path.is_file():
        return None
    try:
        config: Any = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for library, key in VERSION_KEYS.items():
        if key in config:
            model_class = config.get("_class_name") or (config.get("architectures") or ["?"])[0]
            files = {
                name: (Path(folder) / name).read_bytes()
                for name in LAYOUT_FILES
                if (Path(folder) / name).is_file()
            }
            return HFLayout(library, str(model_class), BASES[library][2], files)
    return None
