"""The Hugging Face layouts `accel-recipes convert` reads: a diffusers or transformers
`save_pretrained` folder (config.json + diffusion_pytorch_model.safetensors / model.safetensors /
their .bin, or their shards with the `*.index.json` whose `weight_map` names each tensor's
shard), a diffusers pipeline folder (model_index.json + one subfolder per component), and an
`accelerator.save_state` folder whose model a save hook wrote into a subfolder (diffusers'
training examples: checkpoint-N/unet/). Files are read as convert reads any other (safetensors,
or torch.load with weights_only), never unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from accel_common.errors import CheckpointError

# the weights file names of save_pretrained, safetensors first (diffusers', then transformers')
WEIGHT_FILES = (
    "diffusion_pytorch_model.safetensors",
    "model.safetensors",
    "diffusion_pytorch_model.bin",
    "pytorch_model.bin",
)
INDEX_SUFFIX = ".index.json"
PIPELINE_INDEX = "model_index.json"
CONFIG_FILE = "config.json"
# the components of a pipeline that training changes (a text encoder or VAE is usually frozen)
TRAINABLE = ("unet", "transformer", "prior", "decoder", "controlnet")

Reader = Callable[[Path], dict[str, torch.Tensor]]


def is_pretrained_folder(folder: Path) -> bool:
    """Whether `folder` holds a save_pretrained model: a config.json and weights (or shards)."""
    return (folder / CONFIG_FILE).is_file() and _weights_in(folder) is not None


def _weights_in(folder: Path) -> Path | None:
    """The weights file, or the shards' index, of a save_pretrained folder."""
    for name in WEIGHT_FILES:
        if (folder / (name + INDEX_SUFFIX)).is_file():
            return folder / (name + INDEX_SUFFIX)
        if (folder / name).is_file():
            return folder / name
    return None


def describe(folder: Path) -> str:
    """'diffusers UNet2DModel' / 'transformers BertModel' from the folder's config.json."""
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        config = {}
    if not isinstance(config, dict):
        config = {}
    if "_diffusers_version" in config or "_class_name" in config:
        return f"diffusers {config.get('_class_name', 'model')}"
    architectures = config.get("architectures") or []
    name = architectures[0] if isinstance(architectures, list) and architectures else None
    return f"transformers {name or config.get('model_type', 'model')}"


def read_pretrained(folder: Path, read: Reader) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors of a save_pretrained folder, and the line saying what was read."""
    weights = _weights_in(folder)
    if weights is None:
        raise CheckpointError(
            f"{folder}: {CONFIG_FILE} but none of {', '.join(WEIGHT_FILES)} (or their "
            f"{INDEX_SUFFIX}) beside it; was the save interrupted?"
        )
    if weights.name.endswith(INDEX_SUFFIX):
        state, shards = read_shards(weights, read)
        where = f"{weights} ({shards} shards, {{n}} tensors)"
    else:
        state = read(weights)
        where = f"{weights} ({{n}} tensors)"
    return state, f"read {describe(folder)} weights from {where.format(n=len(state))}"


def read_shards(index: Path, read: Reader) -> tuple[dict[str, torch.Tensor], int]:
    """Every shard an index names, each holding exactly the tensors its `weight_map` puts there;
    a missing shard, or a tensor missing from or added to one, is one line naming it."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(
            f"{index}: not a readable shard index (a JSON object with a weight_map of tensor "
            "name to shard file)"
        ) from None
    by_shard: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, set()).add(name)
    missing = sorted(s for s in by_shard if not (index.parent / s).is_file())
    if missing:
        raise CheckpointError(
            f"{index.parent}: shard {missing[0]} is missing ({len(missing)} of {len(by_shard)} "
            f"shards the index {index.name} lists are absent); copy the whole folder again"
        )
    state: dict[str, torch.Tensor] = {}
    for shard, names in sorted(by_shard.items()):
        tensors = read(index.parent / shard)
        absent, extra = sorted(names - set(tensors)), sorted(set(tensors) - names)
        if absent or extra:
            what = f"lacks {absent[0]}" if absent else f"holds {extra[0]}, which"
            rest = "" if absent else " the index puts in no shard or another"
            raise CheckpointError(
                f"{index.parent / shard} {what}{rest} (its index {index.name} disagrees with it: "
                "a shard from another save?)"
            )
        state.update(tensors)
    return state, len(by_shard)


def pipeline_components(folder: Path) -> list[str]:
    """The components of a diffusers pipeline folder that hold weights, in model_index order."""
    try:
        index = json.loads((folder / PIPELINE_INDEX).read_text())
    except (OSError, ValueError):
        raise CheckpointError(f"{folder / PIPELINE_INDEX}: not readable JSON") from None
    names = [k for k in index if not k.startswith("_")] if isinstance(index, dict) else []
    return [name for name in names if is_pretrained_folder(folder / name)]


def hooked_components(folder: Path) -> list[str]:
    """The subfolders of a save_state folder that a save hook wrote a model into."""
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and is_pretrained_folder(p))


def choose(folder: Path, found: list[str], component: str | None, what: str) -> str:
    """`component` if `found` has it, else the one trainable component, else one line."""
    flag = "--component NAME"
    if component is not None:
        if component not in found:
            raise CheckpointError(
                f"--component {component}: {folder} has no such {what} holding weights; it has "
                f"{', '.join(found) or 'none'}"
            )
        return component
    trainable = [name for name in found if name in TRAINABLE]
    if len(found) == 1:
        return found[0]
    if len(trainable) == 1:
        return trainable[0]
    raise CheckpointError(
        f"{folder} is a {what} folder with several models ({', '.join(found)}); pick one with "
        f"{flag}, e.g. --component {found[0]}"
    )


def read_hf_folder(
    folder: Path, read: Reader, component: str | None = None, hooked: bool = True
) -> tuple[dict[str, torch.Tensor], str] | None:
    """The weights of a Hugging Face layout in `folder` and the line saying what was read, or
    None when `folder` is none of them (an Accelerate or DCP folder: convert's own readers).
    `hooked`: also a save_state folder whose model a hook saved into a subfolder (checked
    after Accelerate's own model files, which such a folder lacks)."""
    folder = Path(folder)
    if (folder / PIPELINE_INDEX).is_file():
        found = pipeline_components(folder)
        if not found:
            raise CheckpointError(
                f"{folder}: a diffusers pipeline whose {PIPELINE_INDEX} lists no component "
                "folder holding weights (config.json + weights)"
            )
        return read_pretrained(folder / choose(folder, found, component, "pipeline"), read)
    if is_pretrained_folder(folder):
        if component is not None:
            raise CheckpointError(
                f"--component {component}: {folder} is one model's folder, not a pipeline"
            )
        return read_pretrained(folder, read)
    found = hooked_components(folder) if hooked else []
    if found:  # save_state with a hook: checkpoint-N/unet/ beside optimizer.bin, ...
        return read_pretrained(folder / choose(folder, found, component, "save_state"), read)
    if component is not None and hooked:
        raise CheckpointError(
            f"--component {component}: {folder} is no diffusers pipeline, nor a save_state "
            "folder with models in subfolders"
        )
    return None
