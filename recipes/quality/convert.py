"""Checkpoints of the original, hituldesai03/crowd-bt (@b3412bd), and this recipe's exports.

Its trainer saves (train.py `save_checkpoint`) a torch.save dict:

    {'epoch', 'model': QualityScorer.state_dict(), 'optimizer', 'scheduler', 'metrics',
     'config': {'backbone_name', 'input_size'}, 'eta_logit': float}

`model` has this recipe's scorer keys exactly (backbone.backbone.*, head.*: one to one, no
renaming); `eta_logit` is its one shared reliability, eta = 0.5 + 0.5 sigmoid(eta_logit), which
becomes this recipe's single annotator logit under --reliability global (the same
parametrisation). Read with torch.load(weights_only=True): nothing arbitrary is unpickled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from accel_common import (
    CheckpointError,
    load_original_checkpoint,
    read_export_weights,
    read_recipe_export,
    require_same_tensors,
    save_file_atomically,
    settle_unrecorded,
    tell,
)
from recipes.quality.model import RELIABILITY_KEY, QualityScorer, is_timm_model

ORIGINAL = "crowd-bt"
ANNOTATOR = "crowd-bt"  # the one reliability an imported checkpoint carries
DEFAULT_ETA_LOGIT = math.log(0.6 / 0.4)  # the original's eta_init 0.8 (loss.py 68-73)


def scorer_shapes(backbone: str) -> dict[str, tuple[int, ...]]:
    """The original's QualityScorer(backbone) state-dict shapes, built on the meta device."""
    with torch.device("meta"):
        model = QualityScorer(backbone, 1, 0.2)
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if k != RELIABILITY_KEY}


def check_state(state: dict[str, torch.Tensor], backbone: str, source: Path) -> None:
    """Strict: every key the scorer has, no other, each of the same shape."""
    where = f"{source}: not the original's QualityScorer({backbone})"
    require_same_tensors(state, scorer_shapes(backbone), where)


def import_checkpoint(
    source: Path, given: Mapping[str, str] = MappingProxyType({})
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The original's checkpoint as this recipe's state dict and export config. Its trainer
    records the backbone, the input size and eta_logit; one that lacks any of them (an older
    or hand-made save) gets --set's value, else train.py's default, and the line printed says
    which."""
    source = Path(source)
    checkpoint = load_original_checkpoint(source, ORIGINAL, "model")
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{source}: expected the dict crowd-bt's train.py saves")
    # model.py load_model: {'model': ...}, {'state_dict': ...} or the state dict itself
    state = checkpoint.get("model", checkpoint.get("state_dict", checkpoint))
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{source}: its 'model' entry is not a state dict of tensors")
    config = checkpoint.get("config") or {}
    if not isinstance(config, dict):
        raise CheckpointError(f"{source}: its 'config' is {type(config).__name__}, not a dict")
    assumed = {"backbone": "efficientnet_b4", "image_size": 448}  # train.py's --backbone, ...
    assumed["eta_logit"] = DEFAULT_ETA_LOGIT
    recorded = {"backbone": config.get("backbone_name"), "image_size": config.get("input_size")}
    recorded["eta_logit"] = checkpoint.get("eta_logit")
    lacking = {k: v for k, v in assumed.items() if recorded[k] is None}
    values, note = settle_unrecorded(source, lacking, given)
    recorded |= values
    backbone = recorded["backbone"]
    if not isinstance(backbone, str) or not is_timm_model(backbone):
        raise CheckpointError(
            f"{source}: its config's backbone_name {backbone!r} is not a timm model name, so "
            "the network it was saved from is unknown; set it to the backbone it was trained with"
        )
    image_size = recorded["image_size"]
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 8:
        raise CheckpointError(
            f"{source}: its config's input_size {image_size!r} is not an image size (a whole "
            "number of pixels, at least 8); set it to the size it was trained at"
        )
    check_state(state, backbone, source)
    eta_logit = float(recorded["eta_logit"])
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    state[RELIABILITY_KEY] = torch.tensor([eta_logit])
    export_config = {
        "backbone": backbone,
        "image_size": image_size,
        "dropout": 0.2,  # model.py 29: not configurable in the original's trainer
        "reliability": "global",
        "draw_weight": 0.5,
        "annotators": [ANNOTATOR],
    }
    tell(note)
    return state, export_config


def export_checkpoint(model_dir: Path, target: Path) -> Path:
    """This recipe's export as the dict the original's code loads (model.py load_model,
    infer.py, evaluate.py, export.py): 'model' with its keys, 'config', 'eta_logit'. No
    optimizer or scheduler state: its trainer cannot resume from it, only start from it."""
    model_dir, target = Path(model_dir), Path(target)
    config = read_recipe_export(model_dir, "quality", flag="SOURCE")
    path = model_dir / "model.safetensors" if model_dir.is_dir() else model_dir
    state = read_export_weights(path)
    logits = state.pop(RELIABILITY_KEY, None)
    check_state(state, config["backbone"], path)
    # the original has one shared eta in [0.5, 1]: the global mode's logit is it; a per-annotator
    # Crowd-BT model has no such value, and its trainer's default stands in
    global_logit = logits is not None and config.get("reliability") == "global"
    checkpoint = {
        "epoch": 0,
        "model": state,
        "metrics": {},
        "config": {"backbone_name": config["backbone"], "input_size": config["image_size"]},
        "eta_logit": float(logits[0]) if global_logit else DEFAULT_ETA_LOGIT,
    }
    return save_file_atomically(target, lambda file: torch.save(checkpoint, file), "convert again")
