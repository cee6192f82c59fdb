"""The cricket recipe's settings, declared once (`CricketSettings`: flags, `--config` keys, the
export's config and the resume check), and the network they describe. recipes/train_cricket.py
and convert.py both build from them, so they live here: the folder never imports the script."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from accel_common import MAX_BLOCKS, ConfigError, Settings, setting
from recipes.cricket.model import MODELS, CricketHeteroGNN, CricketHeteroGNNFull
from recipes.cricket.parsing import DEFAULT_MATCH_TYPES
from recipes.cricket.samples import TARGETS


@dataclass
class CricketSettings(Settings):
    """The workload's settings: each one is a flag, a `--config` key and, unless adjustable, part
    of the run's identity."""

    match_types: str = setting(
        ",".join(DEFAULT_MATCH_TYPES), "Comma-separated info.match_type values."
    )
    strict: bool = setting(
        False, "Stop at a .json that is not a match (else skip it).", adjustable=True
    )
    split_by_date: bool = setting(
        False, "Train on the earliest matches, validate and test on the latest."
    )
    val_ratio: float = setting(0.1, "Share of matches to validate.", min=0.01, max=0.5)
    test_ratio: float = setting(0.1, "Share of matches to test.", min=0.01, max=0.5)
    split_seed: int | None = setting(
        42,
        "Seed of the split by match, cricketmodel's procedure (Python's random.shuffle of the "
        "folder's .json files in name order); none (the presets' `split-seed: null`): --seed's, "
        "as cricketmodel splits with its --seed.",
    )
    min_matches: int = setting(
        2, "Training matches a player, venue or team needs for its own embedding.", min=1
    )
    history: int = setting(
        24, "Earlier deliveries of the innings as ball nodes (the original: all, 150).", min=1
    )
    sample_every: int = setting(
        1,
        "Use every Nth legal delivery of an innings as a sample (neighbours share most of their "
        "5-over window; 1 = all, as the original).",
        min=1,
    )
    target: str = setting(
        "original",
        "What is predicted: 'original' (cricketmodel's: the runs from this delivery to an over "
        "boundary, every delivery after the first a sample) or 'next-balls' (the runs in the "
        "next 5 overs of legal balls, every legal delivery a sample).",
    )
    retired_is_wicket: bool = setting(
        True,
        "Count a retired-hurt or retired-not-out batter as a wicket in the features, as the "
        "original does (--no-retired-is-wicket: not, as the batter may come back).",
    )
    unknown_player_team: bool = setting(
        False,
        "Give a player outside the vocabulary the fallback embedding of the team they play for "
        "in this match (the original: none, team 0, with role 0: its vocabulary holds every "
        "player it knows a team of).",
    )
    model: str = setting(
        "CricketHeteroGNN",
        "cricketmodel's network: CricketHeteroGNN (its train.py default) or CricketHeteroGNNFull "
        "(FiLM, hybrid readout, innings-conditional head; its tuned model).",
    )
    hidden: int = setting(128, "Hidden width (128).", min=8)
    layers: int = setting(3, "HeteroConv layers (3).", min=1, max=MAX_BLOCKS)
    heads: int = setting(4, "Attention heads (4).", min=1)
    dropout: float = setting(0.1, "Dropout (0.1).", min=0.0, max=0.9)
    huber_delta: float = setting(
        10.0,
        "Beta of the SmoothL1 loss, in runs (10), as the original's --huber-delta: the Huber "
        "loss with this delta, divided by it.",
        min=0.01,
    )
    keep_last_batch: bool = setting(
        False,
        "Train on each epoch's last incomplete batch too, as cricketmodel on one GPU (the "
        "presets). One process without accumulation only: on several, Accelerate would fill it "
        "up with repeated deliveries and N processes would no longer take one's steps, so it is "
        "dropped there, as cricketmodel drops it under DDP. Off: every step the global batch.",
    )
    head_bias_init: bool = setting(
        True,
        "Start the head's output bias at the training target's mean (the original starts it "
        "near 0 and needs many epochs to reach ~40 runs).",
    )
    patience: int = setting(
        0,
        "Stop after this many epochs without a better val MAE (0 = never).",
        min=0,
        adjustable=True,
    )
    min_epochs: int = setting(
        0,
        "Early stopping may stop only after more than this many epochs (the original's "
        "--min-epochs, 15: from epoch 16 on).",
        min=0,
        adjustable=True,
    )
    min_delta: float = setting(
        1e-4,
        "An epoch resets the patience count only when its val MAE is lower by more than this "
        "(runs; the original's min_delta); the best model is kept on any lower MAE.",
        min=0,
        adjustable=True,
    )
    init_from: Path | None = setting(
        None,
        "Start from the weights of an export (fine-tuning): this recipe's, or one converted "
        "from cricketmodel's checkpoint with `accel-recipes convert --from cricketmodel`; loaded "
        "strictly, with the vocabulary beside it (vocab.json) in place of --min-matches'.",
    )
    graph_cache_dir: Path | None = setting(
        None,
        "Folder of the preprocessing cache (default: under the datasets cache).",
        adjustable=True,
    )

    def validate(self) -> None:
        super().validate()
        # training gets the rest: none is left, whatever the number of match files
        if self.val_ratio + self.test_ratio >= 1:
            raise ConfigError(
                f"--val-ratio {self.val_ratio:g} and --test-ratio {self.test_ratio:g} leave no "
                "matches for training (it gets 1 minus their sum); lower one of them"
            )


def network(
    settings: CricketSettings, vocab_sizes: dict[str, int], mean: float | None = None
) -> CricketHeteroGNN | CricketHeteroGNNFull:
    """The GNN these settings describe, for a vocabulary; with `mean` and --head-bias-init, its
    output starts at that mean."""
    if settings.model not in MODELS:
        raise ConfigError(f"--model {settings.model}: one of {', '.join(MODELS)}")
    if settings.target not in TARGETS:
        raise ConfigError(f"--target {settings.target}: one of {', '.join(TARGETS)}")
    model = MODELS[settings.model](
        vocab_sizes, settings.hidden, settings.layers, settings.heads, settings.dropout
    )
    if mean is not None and settings.head_bias_init:
        with torch.no_grad():
            model.score_head[-1].bias.fill_(mean)
    return model
