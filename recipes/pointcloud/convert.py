"""pcdiff checkpoints <-> this recipe's exports (`accel-recipes convert --from / --to pcdiff`).

The original's trainer saves `{'epoch', 'model_state', 'optimizer_state', 'loss'}`
(CheckpointManager.save, pcdiff/train_completion.py lines 557-579) where `model_state` is its
`Model`'s state dict: the PVCNN2 under `model.`, compiled by default (`model._orig_mod.`), and
wrapped by DDP when trained on several GPUs (`model.module._orig_mod.`). The keys after that prefix
are this recipe's PVCNN2's own, one to one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml

from accel_common.checkpoint import load_exported, read_recipe_export, require_same_tensors
from accel_common.errors import CheckpointError

ORIGINAL = "pcdiff"
PRESET = Path(__file__).parent / "configs" / "original.yaml"
PREFIXES = ("model.", "module.", "_orig_mod.")


def strip_prefixes(key: str) -> str:
    """`model._orig_mod.sa_layers.0...`, `model.module._orig_mod.sa_layers...` -> `sa_layers...`"""
    while prefix := next((p for p in PREFIXES if key.startswith(p)), None):
        key = key[len(prefix) :]
    return key


def read_state(source: Path) -> dict[str, torch.Tensor]:
    """The model state of a pcdiff checkpoint (or a bare state dict), read without unpickling
    anything but tensors and plain containers."""
    try:
        loaded = torch.load(source, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{source}: no such file") from None
    except Exception as err:  # an unreadable file or one that needs arbitrary unpickling
        raise CheckpointError(
            f"{source}: not a checkpoint readable with weights_only=True ({err.__class__.__name__}"
            f": {str(err).splitlines()[0] if str(err) else ''})"
        ) from None
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


def settings_for(state: dict[str, torch.Tensor]):
    """The recipe's settings for the original's network these weights come from: its preset
    (original.yaml), with the width multiplier, embedding size and attention read off the
    tensors (the voxel-resolution multiplier changes no tensor: the preset's 1 is assumed)."""
    from recipes.train_pointcloud import PointCloudSettings  # the settings live with the recipe

    names = list(PointCloudSettings.hints())
    raw = yaml.safe_load(PRESET.read_text())  # the preset also holds training flags (bs, lr)
    preset = {k.replace("-", "_"): v for k, v in raw.items() if k.replace("-", "_") in names}
    first = state.get("sa_layers.0.0.voxel_layers.0.weight")
    embed = state.get("embedf.0.weight")
    if first is None or embed is None:
        missing = "sa_layers.0.0.voxel_layers.0.weight" if first is None else "embedf.0.weight"
        raise CheckpointError(f"not a PVCNN2 state dict: it has no '{missing}'")
    preset["width_mult"] = first.shape[0] / 32
    preset["embed_dim"] = embed.shape[0]
    preset["attention"] = "global_att.q.weight" in state
    return PointCloudSettings.from_config(preset)


def import_checkpoint(source: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A pcdiff checkpoint as this recipe's state dict and export config (loads strictly)."""
    from recipes.train_pointcloud import network

    state = read_state(Path(source))
    settings = settings_for(state)
    expected = network(settings).state_dict()
    require_same_tensors(state, expected, f"{source}: not PVCNN2 at these sizes")
    return {k: v.to(expected[k].dtype).contiguous() for k, v in state.items()}, settings.as_config()


def export_checkpoint(model_dir: Path, target: Path) -> Path:
    """This recipe's export as a checkpoint pcdiff's evaluation loads
    (`model.load_state_dict(checkpoint['model_state'])`: its uncompiled `Model`, keys `model.*`,
    as test_completion.py and the trainer with --disable_compile build it)."""
    from recipes.train_pointcloud import PointCloudSettings, network

    settings = PointCloudSettings.from_config(read_recipe_export(model_dir, "pointcloud"))
    model = network(settings)
    load_exported(model_dir, model)
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"epoch": -1, "model_state": state, "loss": float("nan")}, target)
    return target
