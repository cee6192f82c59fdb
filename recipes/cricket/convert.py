"""Checkpoints of lyndonkl/cricketmodel (@a97d68e) in and out: `accel-recipes convert --from
cricketmodel CKPT OUT` and `--to cricketmodel MODEL_DIR OUT.pt`.

The original's trainer saves `{'epoch', 'global_step', 'model_state_dict', 'optimizer_state_dict',
'scheduler_state_dict', 'best_val_loss', 'config'}` with `torch.save`, its `config` being the
TrainingConfig (lr, weight decay, huber_delta, ...), not the model's: the network's sizes are
read from the tensors themselves (embedding rows: the vocabulary; the query vector: the width;
the blocks: the depth; an attention vector: the heads; a matchup MLP: the Full model). The
state dict's names are this recipe's (recipes/cricket/model.py is module for module the
original's), so the mapping is one to one. Read with `weights_only=True`: nothing arbitrary is
unpickled. The original's vocabulary (entity_mapper.pkl, a pickle) is not read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from accel_common.checkpoint import require_same_tensors
from accel_common.errors import CheckpointError

ORIGINAL = "cricketmodel"
STATE_KEY = "model_state_dict"
# the original TrainingConfig's names -> this recipe's settings
TRAINING_KEYS = {"huber_delta": "huber_delta", "patience": "patience"}


def _read(source: Path) -> dict[str, Any]:
    try:
        checkpoint = torch.load(Path(source), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{source}: no such file") from None
    except Exception as err:
        raise CheckpointError(
            f"{source}: not a checkpoint of cricketmodel's trainer that loads with "
            f"weights_only=True ({str(err).splitlines()[0]})"
        ) from None
    if not isinstance(checkpoint, dict) or STATE_KEY not in checkpoint:
        raise CheckpointError(
            f"{source}: no '{STATE_KEY}' in it; cricketmodel's trainer saves a dict with "
            "model_state_dict and config"
        )
    return checkpoint


def architecture(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The model class, vocabulary sizes, width, depth and heads that `state` was made with."""
    try:
        rows = {
            "venues": state["encoders.venue_encoder.embedding.weight"].shape[0] - 1,
            "teams": state["encoders.team_encoder.embedding.weight"].shape[0] - 1,
            "players": state["encoders.player_encoder.player_embed.weight"].shape[0] - 1,
        }
        hidden = state["encoders.query_encoder.embedding"].shape[1]
        # a GATv2 attention vector (1, heads, per head), whatever PyG names the edge type
        heads = next(v.shape[1] for k, v in state.items()
                     if k.startswith("conv_stack.0.conv.") and k.endswith(".att"))  # fmt: skip
    except (KeyError, StopIteration) as err:
        raise CheckpointError(
            f"no tensor {err or 'conv_stack.0.conv.convs.*.att'} in the checkpoint: not a "
            "CricketHeteroGNN or CricketHeteroGNNFull"
        ) from None
    layers = 1 + max(int(m.group(1)) for k in state if (m := re.match(r"conv_stack\.(\d+)\.", k)))
    model = "CricketHeteroGNNFull" if "matchup_mlp.0.weight" in state else "CricketHeteroGNN"
    return {"model": model, "vocab_sizes": rows, "hidden": hidden, "layers": layers, "heads": heads}


def import_checkpoint(source: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The original's checkpoint as this recipe's state dict and export config."""
    from recipes.train_cricket import CricketSettings, network

    checkpoint = _read(source)
    state = {k.removeprefix("module."): v for k, v in checkpoint[STATE_KEY].items()}
    shape = architecture(state)
    training = checkpoint.get("config") or {}
    overrides = {ours: training[theirs] for theirs, ours in TRAINING_KEYS.items()
                 if theirs in training}  # fmt: skip
    settings = CricketSettings(
        model=shape["model"], hidden=shape["hidden"], layers=shape["layers"],
        heads=shape["heads"], **overrides,
    )  # fmt: skip
    with torch.device("meta"):
        model = network(settings, shape["vocab_sizes"])
    where = f"{source}: not {settings.model} at these sizes"
    require_same_tensors(state, model.state_dict(), where)
    config = settings.as_config() | {
        "vocab_sizes": shape["vocab_sizes"],
        "mean": 0.0,  # the original keeps no target statistics: the baselines are unknown
        "std": 1.0,
        "baseline": [0.0] * 220,
        "original_training_config": training,
    }
    return {k: v.contiguous() for k, v in state.items()}, config


def export_checkpoint(model_dir: Path, target: Path) -> Path:
    """This recipe's export as a checkpoint cricketmodel's code loads
    (`model.load_state_dict(torch.load(target)['model_state_dict'])`, its ModelConfig at
    the sizes in 'model_config')."""
    model_dir = Path(model_dir)
    weights = model_dir / "model.safetensors" if model_dir.is_dir() else model_dir
    meta_path = weights.with_suffix(".json") if not model_dir.is_dir() else model_dir / "model.json"
    if not weights.is_file() or not meta_path.is_file():
        raise CheckpointError(
            f"{model_dir}: no model.safetensors and model.json (a cricket export)"
        )
    config = json.loads(meta_path.read_text()).get("config", {})
    state = load_file(str(weights))
    shape = architecture(state)
    sizes = shape["vocab_sizes"]
    checkpoint = {
        "epoch": 0,
        "global_step": int(config.get("step", 0) or 0),
        STATE_KEY: state,
        "config": {"huber_delta": float(config.get("huber_delta", 10.0))},
        "model_class": shape["model"],
        "model_config": {
            "num_venues": sizes["venues"], "num_teams": sizes["teams"],
            "num_players": sizes["players"], "hidden_dim": shape["hidden"],
            "num_layers": shape["layers"], "num_heads": shape["heads"],
            "dropout": float(config.get("dropout", 0.1)),
        },
    }  # fmt: skip
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, target)
    return target
