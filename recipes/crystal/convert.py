"""ComFormer checkpoints <-> this recipe's export (`accel-recipes convert --from/--to comformer`).

The original (jwchen25/comformer @7241ae8, train.py 355-367) saves `best_model.pt` as
`{"model": net.state_dict()}` and its training config as `config.json` in the same folder
(train.py 217-230: the model section, the graph settings and the target's `mean_train` /
`std_train`). The state dict's keys are this recipe's own (recipes/crystal/model.py keeps the
original's module names), so the import is a strict load with no renaming. It is read with
`torch.load(weights_only=True)`: tensors and plain containers only, never arbitrary objects.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from accel_common import (
    CheckpointError,
    ConfigError,
    load_original_checkpoint,
    read_export_weights,
    read_recipe_export,
    require_same_tensors,
    save_file_atomically,
    settle_unrecorded,
    strip_wrapper_prefixes,
    tell,
)
from recipes.crystal.model import VARIANTS, build_network
from recipes.crystal.settings import CrystalSettings

ORIGINAL = "comformer"
CONFIG = "config.json"  # the original's training config, beside best_model.pt
# config.json's numbers this import reads, and what each should be
# what a best_model.pt without config.json (or one lacking them) does not record, at the
# original's defaults: its API's graphs (custom_train.py 888-889) and its unscaled target (train.py
# 206-215: mean 0, std 1)
ORIGINAL_DEFAULTS = {"cutoff": 6.0, "max_neighbors": 25, "mean": 0.0, "std": 1.0}
NUMBERS = {
    "mean_train": "set it to the training target's mean (or remove it)",
    "std_train": "set it to the training target's standard deviation (or remove it)",
    "cutoff": "set it to the training's graph cutoff in Angstrom",
    "max_neighbors": "set it to the training's neighbour count",
}


def architecture(state: dict[str, torch.Tensor], source: Path) -> dict[str, Any]:
    """The network a state dict was made with, iComformer or eComformer (it has `equi_update`),
    and its sizes, read from its tensors' shapes."""
    model = "eComformer" if any(k.startswith("equi_update.") for k in state) else "iComformer"
    try:
        width = state["atom_embedding.weight"].shape[0]
        layers = len({k.split(".")[1] for k in state if k.startswith("att_layers.")})
        sizes = {
            "model": model,
            "width": width,
            "layers": layers,
            "heads": state["att_layers.0.lin_key.weight"].shape[0] // width,
            "rbf_bins": state["rbf.1.weight"].shape[1],
            "fc_features": state["fc.0.weight"].shape[0],
        }
        if model == "iComformer":  # eComformer has no angle RBF: its size is the config's
            sizes["angle_bins"] = state["rbf_angle.1.weight"].shape[1]
        return sizes
    except (KeyError, IndexError) as err:
        raise CheckpointError(
            f"{source}: not an iComformer or eComformer state dict (no {err}); other "
            "architectures are not built by this recipe"
        ) from None


def _original_config(source: Path) -> dict[str, Any]:
    path = source.parent / CONFIG
    if not path.is_file():
        return {}
    try:
        original = json.loads(path.read_text())
    except ValueError as err:
        raise CheckpointError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(original, dict) or not isinstance(original.get("model", {}), dict):
        raise CheckpointError(f"{path}: not ComFormer's training config (a JSON object)")
    return original


def _check_model_section(model: dict[str, Any], sizes: dict[str, int], path: Path) -> None:
    """The original's config must describe the network the tensors are."""
    name = model.get("name", "iComformer")
    if name not in VARIANTS:
        raise CheckpointError(f"{path}: model {name!r}; this recipe builds {', '.join(VARIANTS)}")
    if name != sizes["model"]:
        raise CheckpointError(
            f"{path}: model {name!r} but the checkpoint's tensors are {sizes['model']}'s"
        )
    fixed = {"atom_input_features": 92, "output_features": 1, "classification": False}
    fixed |= {"link": "identity", "zero_inflated": False}
    for key, value in fixed.items():
        if key in model and model[key] != value:
            raise CheckpointError(f"{path}: model {key} {model[key]!r}; this recipe has {value!r}")
    names = {"node_features": "width", "conv_layers": "layers", "node_layer_head": "heads"}
    names |= {"edge_features": "rbf_bins", "triplet_input_features": "angle_bins"}
    names |= {"fc_features": "fc_features"}
    for key, ours in names.items():
        if key in model and ours in sizes and model[key] != sizes[ours]:
            raise CheckpointError(
                f"{path}: model {key} {model[key]} but the checkpoint's tensors have {sizes[ours]}"
            )


def import_checkpoint(
    source: Path, given: Mapping[str, str] = MappingProxyType({})
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A ComFormer `best_model.pt` as this recipe's state dict and export config; the graph
    settings, target and its mean/std come from the `config.json` beside it when there is one.
    What it lacks (all of them without one) comes from --set, else the original's defaults,
    and the line printed names them."""
    source = Path(source)
    loaded = load_original_checkpoint(source, ORIGINAL, "model")
    state = loaded.get("model", loaded) if isinstance(loaded, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{source}: expected {{'model': state_dict}} as best_model.pt holds")
    state = strip_wrapper_prefixes(state)
    sizes = architecture(state, source)
    original = _original_config(source)
    if "model" in original:
        _check_model_section(original["model"], sizes, source.parent / CONFIG)
        if "triplet_input_features" in original["model"]:  # eComformer's, unused but kept
            sizes.setdefault("angle_bins", original["model"]["triplet_input_features"])
    sizes.setdefault("angle_bins", 256)  # the original's default
    model = build_network(**sizes)
    kind = sizes["model"]
    require_same_tensors(state, model.state_dict(), f"{source}: not this recipe's {kind}")
    model.load_state_dict(state, strict=True)
    # the original trains with torch's BatchNorm1d: recorded, so that --init-from runs it too
    settings: dict[str, Any] = dict(sizes) | {"batchnorm": "torch"}
    path = source.parent / CONFIG
    for key, whole in (("cutoff", False), ("max_neighbors", True)):
        if (value := _number(original, key, path)) is not None:
            if value <= 0 or (whole and not isinstance(original[key], int)):
                kind = "whole number" if whole else "number"
                raise CheckpointError(
                    f"{path}: {key} {original[key]!r} is not a positive {kind}; {NUMBERS[key]}"
                )
            settings[key] = original[key]
    if isinstance(original.get("target"), str) and original["target"] not in ("", "target"):
        settings["target"] = original["target"]
    derived = {}
    for key, ours in (("mean_train", "mean"), ("std_train", "std")):
        if (value := _number(original, key, path)) is not None:
            derived[ours] = value
    lacking = {k: v for k, v in ORIGINAL_DEFAULTS.items() if k not in settings | derived}
    given_values, note = settle_unrecorded(source, lacking, given)
    settings |= {k: v for k, v in given_values.items() if k not in ("mean", "std")}
    derived |= {k: v for k, v in given_values.items() if k in ("mean", "std")}
    try:
        parsed = CrystalSettings.from_config(settings)
        parsed.validate()
    except ConfigError as err:  # a value the recipe cannot take: the file is where it came from
        where = path if path.is_file() else source
        raise CheckpointError(f"{where}: {err}") from None
    if derived["std"] <= 0:  # from config.json's std_train or --set std
        raise CheckpointError(f"{source}: target std {derived['std']} is not positive")
    tell(note)
    return model.state_dict(), parsed.as_config() | derived


def _number(original: dict[str, Any], key: str, path: Path) -> float | None:
    """config.json's `key` (the target's training mean or std) as a float, None when absent; a
    value that is no finite number is one line naming the file and key."""
    value = original.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CheckpointError(f"{path}: {key} {value!r} is not a number; {NUMBERS[key]}")
    return float(value)


def side_files(model_dir: Path, target: Path) -> list[Path]:
    """What `--to` writes beside `target`: the original's config.json (accel_common.tools.cli
    refuses to replace it without --force)."""
    return [Path(target).parent / CONFIG]


def export_checkpoint(model_dir: Path, target: Path) -> Path:
    """This recipe's export as `best_model.pt` (`{"model": state_dict}`) and the `config.json`
    beside it that the original's `ComformerPredictor.from_checkpoint` reads."""
    config = read_recipe_export(Path(model_dir), "crystal", flag="SOURCE")
    name = config.get("model", "iComformer")
    if name not in VARIANTS:
        raise CheckpointError(f"{model_dir}: model {name}; only {', '.join(VARIANTS)} convert")
    state = read_export_weights(model_dir)
    state = {re.sub(r"^_orig_mod\.", "", k): v for k, v in state.items()}
    target = Path(target)
    model = {
        "name": name,
        "conv_layers": config["layers"],
        "edge_layers": 1,
        "atom_input_features": 92,
        "edge_features": config["rbf_bins"],
        "triplet_input_features": config["angle_bins"],
        "node_features": config["width"],
        "fc_layers": 1,
        "fc_features": config["fc_features"],
        "output_features": 1,
        "node_layer_head": config["heads"],
        "edge_layer_head": 1,
        "nn_based": False,
        "link": "identity",
        "zero_inflated": False,
        "use_angle": False,
        "angle_lattice": False,
        "classification": False,
    }
    original = {
        "model": model,
        "target": config.get("target", "target"),
        "atom_features": "cgcnn",
        "neighbor_strategy": "k-nearest",
        "cutoff": config["cutoff"],
        "max_neighbors": config["max_neighbors"],
        "use_lattice": True,
        "use_angle": False,
        "mean_train": config.get("mean", 0.0),
        "std_train": config.get("std", 1.0),
    }
    save_file_atomically(target, lambda path: torch.save({"model": state}, path), "convert again")
    text = json.dumps(original, indent=4)
    save_file_atomically(
        target.parent / CONFIG, lambda path: path.write_text(text), "convert again"
    )
    return target
