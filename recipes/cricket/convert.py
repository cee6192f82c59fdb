"""Checkpoints of lyndonkl/cricketmodel (@a97d68e) in and out: `accel-recipes convert --from
cricketmodel CKPT OUT` and `--to cricketmodel MODEL_DIR OUT.pt`.

The original's trainer saves `{'epoch', 'global_step', 'model_state_dict', 'optimizer_state_dict',
'scheduler_state_dict', 'best_val_loss', 'config'}` with `torch.save`, its `config` being the
TrainingConfig (lr, weight decay, huber_delta, ...), not the model's: the network's sizes are
read from the tensors themselves (embedding rows: the vocabulary; the query vector: the width;
the blocks: the depth; an attention vector: the heads; a matchup MLP: the Full model). The
state dict's names are this recipe's (recipes/cricket/model.py is module for module the
original's), so the mapping is one to one. Read with `weights_only=True`: nothing arbitrary is
unpickled.

The original's vocabulary is its `EntityMapper`, pickled as a dict of plain dicts
(`src/data/entity_mapper.py` save/load: names -> ids of venues, teams, players; ids -> names;
each player's most frequent team, role and bowling type; the next free ids) to
`data/processed/entity_mapper.pkl` (train.py's --processed-dir). `--from` reads it, beside the
checkpoint or in that layout (`checkpoints/best_model.pt` -> `data/processed/`), with an
unpickler that builds nothing but dicts, strings and numbers, and writes it beside the export
as this recipe's vocab.json (players by name, as the original keys them, `"player_key":
"name"`); `--to` writes entity_mapper.pkl beside the checkpoint from such a vocab.json (this
recipe's own keys players by Cricsheet registry id, which the original's code cannot look up).
"""

from __future__ import annotations

import io
import json
import pickle
import re
import sys
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
    require_tensors,
    save_file_atomically,
    settle_unrecorded,
    tell,
)
from recipes.cricket.model import MODELS
from recipes.cricket.settings import CricketSettings, network
from recipes.cricket.vocab import VOCAB_FILE

ORIGINAL = "cricketmodel"
STATE_KEY = "model_state_dict"
# the original TrainingConfig's names -> this recipe's settings
TRAINING_KEYS = {"huber_delta": "huber_delta", "patience": "patience", "min_epochs": "min_epochs"}
# the original's graph keeps every earlier ball; the longest T20 innings has 144 deliveries
ALL_BALLS = 150
MAPPER_FILE = "entity_mapper.pkl"
# what its checkpoint does not record (ModelConfig's, not TrainingConfig's), at train.py's
# defaults; its HP search's best_params.json (train.py --config) may give them
UNRECORDED = {"dropout": 0.1}
BEST_PARAMS = "best_params.json"
# best_params.json's network sizes: {its key: architecture()'s}
BEST_PARAMS_SIZES = {"hidden_dim": "hidden", "num_layers": "layers", "num_heads": "heads",
                     "model_class": "model"}  # fmt: skip
# its TrainingConfig's defaults, which train.py --test-only builds its Trainer's optimizer from:
# AdamW at lr 1e-3, weight decay 0.01; CosineAnnealingLR over epochs 100 - warmup_epochs 5
ORIGINAL_LR, ORIGINAL_WD, ORIGINAL_T_MAX = 1e-3, 0.01, 95
# what the original's graphs and target fix, as this recipe's flags: {setting: the original's}
ORIGINAL_FIXED = {"retired_is_wicket": True, "unknown_player_team": False, "target": "original"}
# EntityMapper.save's dicts of names and ids: {its key: this recipe's vocab.json key}
MAPPER_IDS = {"player_to_id": "players", "venue_to_id": "venues", "team_to_id": "teams"}
MAPPER_NAMES = {"player_to_team": "player_teams", "player_to_role": "player_roles",
                "player_to_bowling_type": "player_bowling_types"}  # fmt: skip
# what an EntityMapper pickle may build: plain containers and scalars, nothing callable
PLAIN_BUILTINS = frozenset({"dict", "list", "tuple", "str", "int", "float", "bool"})


class PlainUnpickler(pickle.Unpickler):
    """Unpickles containers and scalars only; any other class is refused, so a crafted pickle
    cannot run code."""

    def __init__(self, data: bytes, source: Path) -> None:
        super().__init__(io.BytesIO(data))
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in PLAIN_BUILTINS:
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self.source}: refused to unpickle {module}.{name}; an entity_mapper.pkl holds only "
            "dicts of names and ids"
        )


def find_mapper(checkpoint: Path) -> Path | None:
    """The original's entity_mapper.pkl for `checkpoint`: beside it, or where train.py's defaults
    put it (checkpoints/best_model.pt -> data/processed/entity_mapper.pkl)."""
    folder = Path(checkpoint).resolve().parent
    for candidate in (folder / MAPPER_FILE, folder.parent / "data" / "processed" / MAPPER_FILE):
        if candidate.is_file():
            return candidate
    return None


def read_mapper(path: Path, sizes: dict[str, int]) -> dict[str, Any]:
    """The pickled EntityMapper as this recipe's vocabulary, checked against the checkpoint's
    embedding sizes."""
    try:
        data = PlainUnpickler(Path(path).read_bytes(), path).load()
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"{path}: not a readable pickle ({err})") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), dict) for k in MAPPER_IDS):
        raise CheckpointError(
            f"{path}: not an EntityMapper save (a dict with {', '.join(MAPPER_IDS)})"
        )
    vocab: dict[str, Any] = {"player_key": "name"}
    for theirs, ours in MAPPER_IDS.items():
        ids = data[theirs]
        if sorted(ids.values()) != list(range(1, len(ids) + 1)):
            raise CheckpointError(f"{path}: {theirs} does not number its names 1..{len(ids)}")
        if len(ids) != sizes[ours]:
            raise CheckpointError(
                f"{path}: {len(ids)} {ours}, but the checkpoint's embedding has rows for "
                f"{sizes[ours]}; give the entity_mapper.pkl of the run that saved it"
            )
        vocab[ours] = {str(name): int(index) for name, index in ids.items()}
    for theirs, ours in MAPPER_NAMES.items():
        vocab[ours] = {str(k): str(v) for k, v in (data.get(theirs) or {}).items()}
    return vocab


def export_files(source: Path) -> dict[str, str]:
    """Files `convert --from cricketmodel` writes beside the export: the vocabulary (vocab.json)
    from the original's entity_mapper.pkl, when there is one."""
    mapper = find_mapper(source)
    if mapper is None:
        return {}
    sizes = architecture(_read(source)[STATE_KEY], source)["vocab_sizes"]
    return {VOCAB_FILE: json.dumps(read_mapper(mapper, sizes))}


def _read(source: Path) -> dict[str, Any]:
    checkpoint = load_original_checkpoint(source, ORIGINAL, STATE_KEY)
    if not isinstance(checkpoint, dict) or STATE_KEY not in checkpoint:
        raise CheckpointError(
            f"{source}: no '{STATE_KEY}' in it; cricketmodel's trainer saves a dict with "
            "model_state_dict and config"
        )
    checkpoint[STATE_KEY] = require_tensors(checkpoint[STATE_KEY], source, f"its '{STATE_KEY}'")
    if not isinstance(checkpoint.get("config") or {}, dict):
        raise CheckpointError(f"{source}: its 'config' is not a dict (the TrainingConfig's)")
    return checkpoint


def architecture(state: dict[str, torch.Tensor], source: Path) -> dict[str, Any]:
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
            f"{source}: no tensor {err or 'conv_stack.0.conv.convs.*.att'}: not a "
            "CricketHeteroGNN or CricketHeteroGNNFull"
        ) from None
    layers = 1 + max(int(m.group(1)) for k in state if (m := re.match(r"conv_stack\.(\d+)\.", k)))
    model = "CricketHeteroGNNFull" if "matchup_mlp.0.weight" in state else "CricketHeteroGNN"
    return {"model": model, "vocab_sizes": rows, "hidden": hidden, "layers": layers, "heads": heads}


def read_best_params(path: Path, shape: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """The unrecorded settings a best_params.json beside the checkpoint gives (its HP search's
    file, which its train.py --config reads: the values under "best_params", or at the top), as
    {setting: (value, file name)}; its network sizes must be the checkpoint's."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as err:
        raise CheckpointError(f"{path}: not readable JSON ({err})") from None
    params = data.get("best_params", data) if isinstance(data, dict) else None
    if not isinstance(params, dict):
        raise CheckpointError(f"{path}: not the HP search's best_params.json (a JSON object)")
    for theirs, ours in BEST_PARAMS_SIZES.items():
        if theirs in params and params[theirs] != shape[ours]:
            raise CheckpointError(
                f"{path}: {theirs} {params[theirs]!r} but the checkpoint's tensors have "
                f"{shape[ours]}: give the best_params.json of the run that saved it"
            )
    supplied = {}
    if "dropout" in params:
        dropout = params["dropout"]
        if (
            isinstance(dropout, bool)
            or not isinstance(dropout, int | float)
            or not (0 <= dropout <= 0.9)
        ):
            raise CheckpointError(f"{path}: dropout {dropout!r} is not a number in [0, 0.9]")
        supplied["dropout"] = (float(dropout), path.name)
    return supplied


def import_checkpoint(
    source: Path, given: Mapping[str, str] = MappingProxyType({})
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The original's checkpoint as this recipe's state dict and export config. Its config is
    the TrainingConfig, not the model's: the dropout (ModelConfig's) comes from --set, else a
    best_params.json beside it, else the original train.py's default, and the line printed says
    which."""
    checkpoint = _read(source)
    state = {k.removeprefix("module."): v for k, v in checkpoint[STATE_KEY].items()}
    shape = architecture(state, source)
    training = checkpoint.get("config") or {}
    overrides = {ours: training[theirs] for theirs, ours in TRAINING_KEYS.items()
                 if theirs in training}  # fmt: skip
    best = Path(source).parent / BEST_PARAMS
    supplied = read_best_params(best, shape) if best.is_file() else {}
    values, note = settle_unrecorded(source, UNRECORDED, given, supplied)
    overrides |= values
    settings = CricketSettings(
        model=shape["model"], hidden=shape["hidden"], layers=shape["layers"],
        heads=shape["heads"], history=ALL_BALLS, **overrides,
    )  # fmt: skip
    try:
        settings.validate()
    except ConfigError as err:
        raise CheckpointError(f"{source}: {err}") from None
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
    tell(note)
    return {k: v.contiguous() for k, v in state.items()}, config


def read_vocabulary(path: Path) -> dict[str, Any]:
    """An export's vocab.json; one that is not JSON (cut short, not UTF-8) or not an object is
    one line naming it."""
    try:
        vocab = json.loads(Path(path).read_bytes())
    except (OSError, ValueError, RecursionError) as err:  # RecursionError: nested too deeply
        raise CheckpointError(f"{path}: not a readable vocabulary ({err})") from None
    if not isinstance(vocab, dict):
        raise CheckpointError(f"{path}: not a vocabulary (a JSON object)")
    return vocab


def name_vocabulary(model_dir: Path) -> tuple[Path, dict[str, Any] | None]:
    """The export's vocab.json and its contents when it keys players by name, as the original's
    EntityMapper does (only one imported from cricketmodel does), else None."""
    model_dir = Path(model_dir)
    vocab_path = (model_dir if model_dir.is_dir() else model_dir.parent) / VOCAB_FILE
    vocab = read_vocabulary(vocab_path) if vocab_path.is_file() else {}
    return vocab_path, vocab if vocab.get("player_key") == "name" else None


def side_files(model_dir: Path, target: Path) -> list[Path]:
    """What `--to` writes beside `target`: the original's entity_mapper.pkl, when the export has
    a vocabulary of names (accel_common.tools.cli refuses to replace it without --force)."""
    return [Path(target).parent / MAPPER_FILE] if name_vocabulary(model_dir)[1] is not None else []


def fresh_training_states(shape: dict[str, Any]) -> dict[str, Any]:
    """What the original's Trainer.load_checkpoint reads besides the weights (train.py --test-only
    and resuming call it): the state of a fresh AdamW and CosineAnnealingLR as its Trainer builds
    them at TrainingConfig's defaults, over this network's parameters, and no best loss yet."""
    sizes = shape["vocab_sizes"]
    with torch.device("meta"):  # only the parameters' number and order matter
        model = MODELS[shape["model"]](sizes, shape["hidden"], shape["layers"], shape["heads"], 0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=ORIGINAL_LR, weight_decay=ORIGINAL_WD)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=ORIGINAL_T_MAX)
    return {
        "optimizer_state_dict": optimizer.state_dict(),
        "scheduler_state_dict": scheduler.state_dict(),
        "best_val_loss": float("inf"),
    }


def export_checkpoint(model_dir: Path, target: Path) -> Path:
    """This recipe's export as a checkpoint cricketmodel's code loads: by
    `model.load_state_dict(torch.load(target)['model_state_dict'])` (its ModelConfig at the sizes
    in 'model_config'), and by its Trainer.load_checkpoint (train.py --test-only), which also
    reads an optimizer and a scheduler state: fresh ones, as its Trainer starts with."""
    model_dir, target = Path(model_dir), Path(target)
    config = read_recipe_export(model_dir, "cricket", flag="SOURCE")
    state = read_export_weights(model_dir)
    shape = architecture(state, model_dir)
    sizes = shape["vocab_sizes"]
    checkpoint = {
        "epoch": 0,
        "global_step": int(config.get("step", 0) or 0),
        STATE_KEY: state,
        **fresh_training_states(shape),
        "config": {"huber_delta": float(config.get("huber_delta", 10.0))},
        "model_class": shape["model"],
        "model_config": {
            "num_venues": sizes["venues"], "num_teams": sizes["teams"],
            "num_players": sizes["players"], "hidden_dim": shape["hidden"],
            "num_layers": shape["layers"], "num_heads": shape["heads"],
            "dropout": float(config.get("dropout", 0.1)),
        },
    }  # fmt: skip
    vocab_path, vocab = name_vocabulary(model_dir)  # read before anything is written
    save_file_atomically(target, lambda path: torch.save(checkpoint, path), "convert again")
    warn_for_original(config)
    if vocab is not None:
        mapper = mapper_bytes(vocab)
        save_file_atomically(
            target.parent / MAPPER_FILE, lambda p: p.write_bytes(mapper), "convert again"
        )
    else:  # this recipe keys players by Cricsheet registry id, the original's code by name
        print(
            f"note: no {MAPPER_FILE} written: {vocab_path} is not a vocabulary of player names "
            "(only one imported from cricketmodel is); build the original's with its own code"
        )
    return target


def warn_for_original(config: dict[str, Any]) -> None:
    """Warn, in one line, where the export's settings differ from what the original's code fixes
    (as `--to pcdiff` does): its graph keeps every earlier ball, so a model trained on the last
    --history balls loads there but computes another function."""
    differing = []
    if int(config.get("history", ALL_BALLS)) < ALL_BALLS:
        differing.append(f"--history {config['history']}")
    for name, fixed in ORIGINAL_FIXED.items():
        value = config.get(name, fixed)
        if value != fixed:
            flag = name.replace("_", "-")
            differing.append(f"--{'' if value else 'no-'}{flag}" if isinstance(value, bool)
                             else f"--{flag} {value}")  # fmt: skip
    if differing:
        print(
            f"warning: this model was trained with {', '.join(differing)}; the original's code "
            "keeps every earlier ball of the innings as a ball node, counts a retired batter as "
            "out, gives an unknown player team 0 and predicts the runs to the over's end: it "
            "loads these weights but computes another function",
            file=sys.stderr,
        )


def mapper_bytes(vocab: dict[str, Any]) -> bytes:
    """`vocab` as the pickled dict EntityMapper.save writes (EntityMapper.load reads it back)."""
    data: dict[str, Any] = {}
    for theirs, ours in MAPPER_IDS.items():
        ids = vocab[ours]
        data[theirs] = dict(ids)
        data["id_to_" + theirs.removesuffix("_to_id")] = {v: k for k, v in ids.items()}
        data[f"_next_{theirs.removesuffix('_to_id')}_id"] = len(ids) + 1
    for theirs, ours in MAPPER_NAMES.items():
        data[theirs] = dict(vocab.get(ours, {}))
    return pickle.dumps(data)
