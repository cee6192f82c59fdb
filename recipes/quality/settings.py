"""The quality recipe's name and settings, declared once (`QualitySettings`: flags, `--config`
keys, the export's config and the resume check). recipes/train_quality.py trains with them and the
single-device commands (commands.py) rebuild an export's scorer from them, so they live here: the
folder never imports the script."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from accel_common import ConfigError, Settings, setting
from recipes.quality.model import require_known_backbone

RECIPE = "quality"
RELIABILITY = ("full", "global", "fixed", "gold")
CHOICES = {"reliability": RELIABILITY, "head_init": ("kaiming", "torch")}
CHOICES["pair_forward"] = ("joint", "separate")
CHOICES["split"] = ("stratified", "plain")


@dataclass
class QualitySettings(Settings):
    """The workload's settings: each is a flag, a `--config` key and, unless adjustable, part of
    the run's identity that --resume checks."""

    backbone: str = setting(
        "test_efficientnet_gn",
        "timm model name; the default is timm's tiny GroupNorm EfficientNet for CPUs "
        "(original: efficientnet_b3..b5).",
    )
    pretrained: bool = setting(False, "Start from timm's pretrained weights (network).")
    weights: Path | None = setting(
        None, "Local backbone weights (.safetensors/.pt) to start from.", adjustable=True
    )
    init_from: Path | None = setting(
        None,
        "Start from an export's scorer weights (this recipe's, or one converted from the "
        "original with `accel-recipes convert --from crowd-bt`).",
    )
    image_size: int = setting(32, "Images are resized to this square size.", min=8)
    dropout: float = setting(0.2, "Dropout in the MLP head.", min=0.0, max=0.99)
    head_init: str = setting(
        "torch",
        "Head weights at the start: kaiming (the original's _init_head: Kaiming-normal, fan_out) "
        "or torch (nn.Linear's own, which learns faster on the small CPU default).",
    )
    reliability: str = setting(
        "full",
        "full: Crowd-BT, eta per annotator in [0, 1], learned; the original's likelihood "
        "eta s(d) + (1 - eta) / 2 with eta in [0.5, 1]: global (one learned eta, its reduced "
        "form), fixed (--fixed-eta) or gold (each annotator's accuracy on gold_gold pairs, "
        "fixed; annotators under 0.5 left out: its S3 runs).",
    )
    fixed_eta: float = setting(
        0.8,
        "eta for --reliability fixed, in [0.5, 1] (the original's fallback 0.8).",
        min=0.5,
        max=1,
    )
    augment: bool = setting(
        True,
        "The original's training augmentation: flips both ways, rotation up to 15 degrees, "
        "colour jitter (dataset.py 35-43); --no-augment turns it off.",
    )
    draw_weight: float = setting(0.1, "Penalty on |s_i - s_j| for a draw.", min=0.0)
    pair_forward: str = setting(
        "joint",
        "'separate': the i sides, then the j sides, as the original (BatchNorm statistics per "
        "side, running ones updated twice a step); 'joint': one pass over both sides.",
    )
    eta_lr: float = setting(
        2e-2, "Learning rate of the annotator reliabilities (no weight decay).", min=0.0
    )
    held_out: float = setting(
        0.15,
        "Share of comparisons held out for evaluation (the original's 1 - train_split).",
        min=0.01,
        max=0.9,
    )
    split: str = setting(
        "stratified",
        "Which comparisons are held out, by the original's split_comparisons (dataset.py "
        "260-308) at --seed, the same records as its runs: stratified (its train.py's: each "
        "pair type apart, so gold and real pairs keep their shares on both sides) or plain (one "
        "shuffle of all: for many small pair types, which rounding down per type would send "
        "wholly to the held-out side).",
    )
    image_dir: Path | None = setting(
        None,
        "Folder the records' img1/img2 names are relative to (the original's --image-dir, "
        "e.g. data/iter_0). Default: DATA/images.",
        adjustable=True,
    )
    skip_missing_images: bool = setting(
        False,
        "Drop records naming images that are not under --image-dir, as the original did "
        "silently, instead of stopping with a list of them.",
    )
    skip_invalid_records: bool = setting(
        False,
        "Drop records with a null, empty or unknown choice or without img1/img2, as the "
        "original did silently, instead of stopping at the first one.",
    )

    def validate(self) -> None:
        super().validate()
        for flag, choices in CHOICES.items():
            if getattr(self, flag) not in choices:
                raise ConfigError(f"--{flag.replace('_', '-')} {getattr(self, flag)}: choose "
                                  f"{', '.join(choices[:-1])} or {choices[-1]}")  # fmt: skip
        require_known_backbone(self.backbone)  # here: the dry run refuses it as the run does
