"""pcdiff checkpoints <-> this recipe's exports (`accel-recipes convert --from / --to pcdiff`).

The original's trainer saves `{'epoch', 'model_state', 'optimizer_state', 'loss'}`
(CheckpointManager.save, pcdiff/train_completion.py lines 557-579) where `model_state` is its
`Model`'s state dict: the PVCNN2 under `model.`, compiled by default (`model._orig_mod.`), and
wrapped by DDP when trained on several GPUs (`model.module._orig_mod.`). The keys after that prefix
are this recipe's PVCNN2's own, one to one.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import yaml

from accel_common import (
    CheckpointError,
    ConfigError,
    export_paths,
    load_exported,
    load_original_checkpoint,
    read_recipe_export,
    require_same_tensors,
    save_file_atomically,
    settle_unrecorded,
    tell,
)
from recipes.pointcloud.settings import PointCloudSettings, network

ORIGINAL = "pcdiff"
PRESET = Path(__file__).parent / "configs" / "original.yaml"
PREFIXES = ("model.", "module.", "_orig_mod.")
# what the original's PVCNN2 fixes as class constants (sa_blocks, num_n): its radii, its 128
# neighbours and its 10240/2560/640/160 centres (this recipe's at --num-points 30720)
ORIGINAL_FIXED = {"radius_mult": 1.0, "num_neighbors": 128, "num_points": 30720}


def strip_prefixes(key: str) -> str:
    """`model._orig_mod.sa_layers.0...`, `model.module._orig_mod.sa_layers...` -> `sa_layers...`"""
    while prefix := next((p for p in PREFIXES if key.startswith(p)), None):
        key = key[len(prefix) :]
    return key


def read_state(source: Path) -> dict[str, torch.Tensor]:
    """The model state of a pcdiff checkpoint (or a bare state dict), read without unpickling
    anything but tensors and plain containers."""
    loaded = load_original_checkpoint(source, ORIGINAL, "model_state")
    state = loaded.get("model_state", loaded) if isinstance(loaded, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(
            f"{source}: expected pcdiff's {{'model_state': state_dict, ...}} or a state dict"
        )
    cleaned = {}
    for key, value in state.items():
        new = strip_prefixes(key)
        if new in cleaned:
            raise CheckpointError(f"{source}: two keys map onto '{new}' (one is '{key}')")
        cleaned[new] = value
    return cleaned


def settings_for(state: dict[str, torch.Tensor], source: Path) -> PointCloudSettings:
    """The recipe's settings for the original's network these weights come from: its preset
    (original.yaml), with the width multiplier, embedding size and attention read off the
    tensors (the voxel-resolution multiplier changes no tensor: the preset's 1 is assumed)."""
    names = list(PointCloudSettings.hints())
    raw = yaml.safe_load(PRESET.read_text())  # the preset also holds training flags (bs, lr)
    preset = {k.replace("-", "_"): v for k, v in raw.items() if k.replace("-", "_") in names}
    first = state.get("sa_layers.0.0.voxel_layers.0.weight")
    embed = state.get("embedf.0.weight")
    if first is None or embed is None:
        missing = "sa_layers.0.0.voxel_layers.0.weight" if first is None else "embedf.0.weight"
        raise CheckpointError(f"{source}: not a PVCNN2 state dict: it has no '{missing}'")
    preset["width_mult"] = first.shape[0] / 32
    preset["embed_dim"] = embed.shape[0]
    preset["attention"] = "global_att.q.weight" in state
    return PointCloudSettings.from_config(preset)


def import_checkpoint(
    source: Path, given: Mapping[str, str] = MappingProxyType({})
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A pcdiff checkpoint as this recipe's state dict and export config (loads strictly); the
    voxel-resolution multiplier, which it does not record, from --set or the preset's 1 (the
    line printed says which)."""
    state = read_state(Path(source))
    settings = settings_for(state, source)
    assumed = {"vox_res_mult": settings.vox_res_mult}
    values, note = settle_unrecorded(source, assumed, given)
    for name, value in values.items():
        setattr(settings, name, value)
    try:  # a width whose channels GroupNorm cannot split in 8 groups
        settings.validate()
    except ConfigError as err:
        raise CheckpointError(f"{source}: not PVCNN2 at a size it builds: {err}") from None
    expected = network(settings).state_dict()
    require_same_tensors(state, expected, f"{source}: not PVCNN2 at these sizes")
    tell(note)
    return {k: v.to(expected[k].dtype).contiguous() for k, v in state.items()}, settings.as_config()


def export_checkpoint(model_dir: Path, target: Path) -> Path:
    """This recipe's export as a checkpoint pcdiff's evaluation loads
    (`model.load_state_dict(checkpoint['model_state'])`: its uncompiled `Model`, keys `model.*`,
    as test_completion.py builds it). Not a checkpoint its trainer resumes: train_completion.py
    --model also reads `optimizer_state` (its Adam's, with its learning rate and schedule) into a
    compiled model (`model._orig_mod.*`); no Adam state of this recipe's run maps onto it, and a
    fresh one would replace the trainer's learning rate with a made-up one, so none is written
    and the note printed says so (fine-tuning: this recipe's --init-from)."""
    weights, _ = export_paths(model_dir)
    if not weights.is_file():
        raise CheckpointError(
            f"{model_dir}: not an export of the pointcloud recipe (no {weights}); --to pcdiff "
            "takes the model folder training writes (OUTPUT/model)"
        )
    config = read_recipe_export(model_dir, "pointcloud", flag="SOURCE")
    settings = PointCloudSettings.from_config(config)
    model = network(settings)
    load_exported(model_dir, model)
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    target = Path(target)
    if target.is_dir():
        raise CheckpointError(
            f"{target} is a folder; --to pcdiff writes a file, e.g. model_best.pth"
        )
    checkpoint = {"epoch": -1, "model_state": state, "loss": float("nan")}
    save_file_atomically(target, lambda path: torch.save(checkpoint, path), "convert again")
    describe_for_original(settings)
    return target


def describe_for_original(settings: PointCloudSettings) -> None:
    """Print the original's flags that rebuild this network (its checkpoint records none), and
    warn where this recipe's settings differ from what the original's PVCNN2 fixes: the weights
    load there all the same, but compute another function."""
    flags = (
        f"--num_points {settings.num_points} --num_nn {settings.num_nn} "
        f"--width_mult {settings.width_mult} --vox_res_mult {settings.vox_res_mult} "
        f"--embed_dim {settings.embed_dim} --attention {settings.attention} "
        f"--time_num {settings.timesteps}"
    )
    if settings.timesteps != 1000:  # the recipe scales the linear betas by 1000 / T (diffusion.py)
        scale = 1000 / settings.timesteps
        flags += f" --beta_start {1e-4 * scale:g} --beta_end {0.02 * scale:g}"
    print(
        f"note: run the original's test_completion.py with {flags} (its train_completion.py "
        "--model resumes only its own checkpoints: their compiled key names and Adam state; to "
        "train on from these weights, use this recipe's --init-from)",
        file=sys.stderr,
    )
    differing = [
        f"--{name.replace('_', '-')} {getattr(settings, name)}"
        for name, fixed in ORIGINAL_FIXED.items()
        if getattr(settings, name) != fixed
    ]
    if differing:
        print(
            f"warning: this model was trained with {', '.join(differing)}; the original's PVCNN2 "
            "fixes radii 0.1-0.8, 128 neighbours and 10240/2560/640/160 centres: it loads these "
            "weights but computes another function",
            file=sys.stderr,
        )
