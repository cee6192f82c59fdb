"""The pointcloud recipe's settings, declared once (`PointCloudSettings`: flags, `--config` keys,
the export's config and the resume check), and the network they describe.
recipes/train_pointcloud.py and convert.py both build from them, so they live here: the folder
never imports the script."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from accel_common import ConfigError, Settings, setting
from recipes.pointcloud.backend import require_usable_kernels
from recipes.pointcloud.diffusion import checked_sample_steps, checked_sampler
from recipes.pointcloud.model import PVCNN2


@dataclass
class PointCloudSettings(Settings):
    """The workload's settings: each is a flag, a `--config` key, recorded with the export, and
    part of the run's identity unless adjustable (what only changes how often or how finely the
    run is scored)."""

    dataset: str = setting("SkullBreak", "Data set layout; SkullBreak is supported.")
    num_points: int = setting(512, "Points per sample, skull + implant (original: 30720).", min=2)
    num_nn: int = setting(64, "Implant points among them (original: 3072).", min=1)
    width_mult: float = setting(
        0.25,
        "Width multiplier of PVCNN2's channels; each scaled count must be a multiple of 8 "
        "(GroupNorm in 8 groups): 0.25, 0.5, 0.75, 1 ... (original: 1).",
        above=0.0,
        aliases=("--width_mult",),
    )
    vox_res_mult: float = setting(
        0.5,
        "Voxel resolution multiplier: grids of 32/16/8 x this (original: 1; the CPU default's "
        "16/8/4: at 0.25 the CPU-sized model does not learn where the implant goes).",
        above=0.0,
        aliases=("--vox_res_mult",),
    )
    embed_dim: int = setting(
        32, "Timestep embedding size (original: 64).", min=4, aliases=("--embed_dim",)
    )
    attention: bool = setting(True, "Self-attention layers of PVCNN2 (original: on).")
    dropout: float = setting(
        0.0,
        "Dropout in the PVConv blocks (original: 0.1; off for the short CPU-sized run).",
        min=0.0,
        max=1.0,
    )
    head_dropout: float = setting(
        0.0,
        "Dropout before the output layer (the original's fixed 0.5; off for the short "
        "CPU-sized run).",
        min=0.0,
        max=1.0,
    )
    radius_mult: float = setting(
        4.0,
        "Ball-query radii 0.1/0.2/0.4/0.8 x this: wider for sparse CPU-sized clouds (original: 1).",
        above=0.0,
    )
    num_neighbors: int = setting(32, "Ball-query neighbours per centre (original: 128).", min=1)
    augment: bool = setting(
        False,
        "Rotate each training sample (skull + implant) by up to 10 degrees about each axis, as "
        "the original's --augment (off by default there too).",
    )
    init_from: str = setting(
        "",
        "Start from the weights of an export (fine-tuning), e.g. one `accel-recipes convert "
        "--from pcdiff` made from the original's checkpoint; loaded strictly.",
    )
    timesteps: int = setting(100, "Diffusion steps T (original: 1000).", min=2)
    sampler: str = setting(
        "ddim",
        "Sampler of the evaluation in training, `evaluate` and `complete`: ddpm (all --timesteps "
        "steps: the original's default, original.yaml) or ddim (--sample-steps steps: the CPU "
        "default, where DDPM scores worse on the small model; docs/recipes/pointcloud.md).",
        adjustable=True,
    )
    sample_steps: int = setting(20, "DDIM steps (with --sampler ddim).", min=1, adjustable=True)
    num_ens: int = setting(
        1,
        "Implants sampled per skull for evaluation (the original's --num_ens): each member is "
        "scored (chamfer_ens<k>) and `chamfer` is their mean.",
        min=1,
        adjustable=True,
        aliases=("--num_ens",),
    )
    eval_every: int = setting(
        15,
        "Evaluate (sample and score) every N epochs, and at the run's end (the original's "
        "--vizIter). Epochs, not the other recipes' optimizer steps.",
        min=1,
        adjustable=True,
    )

    def validate(self) -> None:
        super().validate()
        if self.dataset != "SkullBreak":
            raise ConfigError(f"--dataset {self.dataset}: only the SkullBreak layout is supported")
        scaled = [int(self.width_mult * c) for c in (32, 64, 128, 256, 512)]
        if any(c < 8 or c % 8 for c in scaled):
            raise ConfigError(
                f"--width-mult {self.width_mult} gives channel counts {scaled}: each must be a "
                "multiple of 8 (GroupNorm in 8 groups), e.g. 0.25, 0.5, 0.75 or 1"
            )
        if int(self.vox_res_mult * 8) < 1:
            raise ConfigError(f"--vox-res-mult {self.vox_res_mult}: the 8^3 grid would vanish")
        if self.num_points < 192:
            raise ConfigError(
                f"--num-points must be at least 192 (PVCNN2's last stage samples 1/192 of the "
                f"points as centres), got {self.num_points}"
            )
        checked_sampler(self.sampler)
        checked_sample_steps(self.sample_steps, self.sampler, self.timesteps)
        if not 0 < self.num_nn < self.num_points:
            raise ConfigError(f"--num-nn must be between 1 and --num-points - 1, got {self.num_nn}")
        # the environment's choice of kernels, refused here so that the dry run refuses it too
        require_usable_kernels(torch.cuda.is_available())


def network(settings: PointCloudSettings) -> PVCNN2:
    """pcdiff's PVCNN2 at these settings' sizes."""
    return PVCNN2(
        num_classes=3,
        num_points=settings.num_points,
        embed_dim=settings.embed_dim,
        use_att=settings.attention,
        dropout=settings.dropout,
        head_dropout=settings.head_dropout,
        width_multiplier=settings.width_mult,
        voxel_resolution_multiplier=settings.vox_res_mult,
        radius_multiplier=settings.radius_mult,
        num_neighbors=settings.num_neighbors,
    )
