"""The recipes' models at the original codebases' sizes, each with a synthetic batch and its
recipe's loss: one definition for the memory estimate (on the `meta` device, no GPU needed) and
the GPU benchmark (on CUDA), so the two measure the same training step.

A workload's step is the recipe's forward pass and loss on random inputs of the original's
shapes; what the data loader does is left out (see `accel-recipes bench` for whole recipes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from accel_common.options import TrainArgs
from accel_common.settings import read_config_file
from accel_common.tools.bench import load_recipe


@dataclass(frozen=True)
class Workload:
    name: str
    size: str  # the original's size, in words, for the tables
    per_gpu_batch: int  # the original's per-GPU batch (one sample: what the batch counts)
    build: Callable[[], nn.Module]  # called under `with torch.device(...)`
    batch: Callable[[int, torch.device], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    # False where the forward pass reads tensor values (PyG's pooling sizes its output from the
    # batch vector), which the shapes-only `meta` device cannot give: estimated on the CPU
    meta_ok: bool = True
    # False where no pass can be run cheaply without a GPU: the estimate gives the parameters'
    # share only, and `make bench-gpu` measures the rest
    activations_estimable: bool = True


def preset_model(name: str) -> nn.Module:
    """Recipe `name`'s network at its original preset (recipes/NAME/configs/original.yaml), built
    by the recipe itself: the sizes live in one place."""
    recipe = load_recipe(name)
    preset = Path(recipe.__file__).parent / name / "configs" / "original.yaml"
    names = [f.name for f in fields(TrainArgs)] + [
        f.name for f in fields(recipe.train.settings_class)
    ]
    args, settings = recipe.train.resolve(**read_config_file(preset, names))
    return recipe.build_model(args, settings)


def _pointcloud() -> Workload:
    recipe = load_recipe("pointcloud")
    points, implant = 30720, 3072

    def batch(n: int, device: torch.device) -> tuple:
        skull = torch.randn(n, points - implant, 3, device=device)
        noise = torch.randn(n, implant, 3, device=device)
        t = torch.randint(0, 1000, (n,), device=device)
        return skull, noise, t

    def loss(model: nn.Module, inputs: tuple) -> torch.Tensor:
        skull, noise, t = inputs  # epsilon prediction on the implant points
        return F.mse_loss(recipe.predict_noise(model, skull, noise, t).float(), noise)

    return Workload(
        "pointcloud",
        "pcdiff's PVCNN2: 30720 points (3072 implant), embed 64, attention, 32/16/8 voxel grids",
        8,
        lambda: preset_model("pointcloud"),
        batch,
        loss,
        # farthest-point sampling and ball query read point values, which the `meta` device
        # lacks, and a CPU pass at 30720 points is too large to estimate with: measured on a GPU
        activations_estimable=False,
    )


def _quality() -> Workload:
    recipe = load_recipe("quality")

    def batch(n: int, device: torch.device) -> tuple:
        images = torch.randn(2 * n, 3, 448, 448, device=device)  # a pair is two images
        choice = torch.randint(-1, 2, (n,), device=device)
        annotator = torch.randint(0, 8, (n,), device=device)
        return images, choice, annotator

    def loss(model: nn.Module, inputs: tuple) -> torch.Tensor:
        images, choice, annotator = inputs
        scores = model(images).float().view(2, -1)
        eta = torch.sigmoid(model.annotator_logits)[annotator]
        return recipe.crowd_bt_loss(scores[0] - scores[1], choice, eta, draw_weight=0.1)

    return Workload(
        "quality",
        "EfficientNet-B4 at 448 px; a sample is a pair (2 images)",
        32,
        lambda: preset_model("quality"),
        batch,
        loss,
    )


CAPTION_VOCAB, CAPTION_TOKENS = 10_000, 32  # a word-level vocabulary of a COCO-sized corpus


def _captioning() -> Workload:
    recipe = load_recipe("captioning")

    def batch(n: int, device: torch.device) -> tuple:
        pixels = torch.randn(n, 3, 224, 224, device=device)
        tokens = torch.randint(4, CAPTION_VOCAB, (n, CAPTION_TOKENS), device=device)
        return pixels, tokens

    def loss(model: nn.Module, inputs: tuple) -> torch.Tensor:
        pixels, tokens = inputs
        summed, count = recipe.next_token_loss(model(pixels, tokens), tokens)
        return summed / count

    sizes = {"image_size": 224, "patch": 16, "dim": 512, "depth": 6, "decoder_depth": 6}
    sizes |= {"heads": 8, "max_tokens": CAPTION_TOKENS}
    return Workload(
        "captioning",
        f"224 px, patch 16, width 512, 6 + 6 blocks, 8 heads, {CAPTION_VOCAB} words, "
        f"{CAPTION_TOKENS} tokens",
        32,
        lambda: recipe.Captioner(CAPTION_VOCAB, **sizes),
        batch,
        loss,
    )


CRYSTAL_ATOMS, CRYSTAL_NEIGHBORS = 32, 25  # atoms per structure: typical of Materials Project


def _crystal() -> Workload:
    from torch_geometric.data import Data

    def batch(n: int, device: torch.device) -> Data:
        nodes = n * CRYSTAL_ATOMS
        edges = nodes * CRYSTAL_NEIGHBORS
        target = torch.arange(nodes, device=device).repeat_interleave(CRYSTAL_NEIGHBORS)
        first = (target // CRYSTAL_ATOMS) * CRYSTAL_ATOMS  # neighbours within the structure
        source = first + torch.randint(0, CRYSTAL_ATOMS, (edges,), device=device)
        return Data(
            z=torch.randint(1, 95, (nodes,), device=device),
            edge_index=torch.stack([source, target]),
            distance=torch.empty(edges, device=device).uniform_(1.5, 6.0),
            vector=torch.randn(edges, 3, device=device),
            lattice=torch.randn(n, 3, 3, device=device),
            batch=torch.arange(n, device=device).repeat_interleave(CRYSTAL_ATOMS),
            y=torch.randn(n, device=device),
            num_nodes=nodes,
        )

    def loss(model: nn.Module, graph: Data) -> torch.Tensor:
        return F.mse_loss(model(graph).float(), graph.y)

    return Workload(
        "crystal",
        f"iComformer width 256, 4 layers, 256 RBF, {CRYSTAL_NEIGHBORS} neighbours, "
        f"{CRYSTAL_ATOMS} atoms per structure",
        64,
        lambda: preset_model("crystal"),
        batch,
        loss,
        meta_ok=False,
    )


def workloads() -> list[Workload]:
    """Every recipe with an original (the template has none)."""
    return [_pointcloud(), _quality(), _captioning(), _crystal()]
