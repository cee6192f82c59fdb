"""The recipes' models at the original codebases' sizes, each with a synthetic batch and its
recipe's loss: one definition for the memory estimate (on the `meta` device, no GPU needed) and
the GPU benchmark (on CUDA), so the two measure the same training step.

A workload's step is the recipe's forward pass and loss on random inputs of the original's
shapes; what the data loader does is left out (see `accel-recipes bench` for whole recipes).

`workloads(smoke=True)` gives each one at a small size (the recipe's CPU defaults, batch 2): the
GPU benchmark's `--smoke` runs them on the CPU in CI, so no workload breaks unseen between GPU runs.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from accel_common.recipe_cli.options import SharedSettings
from accel_common.settings import read_config_file
from recipes import load_recipe
from recipes.cricket.parsing import DEFAULT_MATCH_TYPES
from recipes.quality.loss import likelihood, reliabilities


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


SMOKE_BATCH = 2  # per-device batch of every workload under --smoke


def preset(name: str, smoke: bool = False, **small: Any) -> tuple[ModuleType, SharedSettings, Any]:
    """Recipe `name`, its shared arguments and its settings: at its original preset
    (recipes/NAME/configs/original.yaml), or with `smoke` at the recipe's defaults (sized for a
    CPU) changed by `small`. The recipe resolves them itself: the sizes live in one place."""
    recipe = load_recipe(name)
    if smoke:
        return recipe, *recipe.train.resolve(**small)
    config = Path(recipe.__file__).parent / name / "configs" / "original.yaml"
    names = [f.name for f in fields(SharedSettings)] + [
        f.name for f in fields(recipe.train.settings_class)
    ]
    return recipe, *recipe.train.resolve(**read_config_file(config, names))


def preset_model(name: str, smoke: bool = False, **small: Any) -> nn.Module:
    """Recipe `name`'s network as `preset` resolves it, built by the recipe itself."""
    recipe, args, settings = preset(name, smoke, **small)
    return recipe.build_model(args, settings)


def _pointcloud(smoke: bool) -> Workload:
    recipe, _, settings = preset("pointcloud", smoke)
    points, implant = settings.num_points, settings.num_nn  # original: 30720, 3072

    def batch(n: int, device: torch.device) -> tuple:
        skull = torch.randn(n, points - implant, 3, device=device)
        noise = torch.randn(n, implant, 3, device=device)
        t = torch.randint(0, settings.timesteps, (n,), device=device)
        return skull, noise, t

    def loss(model: nn.Module, inputs: tuple) -> torch.Tensor:
        skull, noise, t = inputs  # epsilon prediction on the implant points
        return F.mse_loss(recipe.predict_noise(model, skull, noise, t).float(), noise)

    size = "pcdiff's PVCNN2: 30720 points (3072 implant), embed 64, attention, 32/16/8 voxel grids"
    return Workload(
        "pointcloud",
        f"smoke: the CPU default, {points} points" if smoke else size,
        SMOKE_BATCH if smoke else 8,
        lambda: preset_model("pointcloud", smoke),
        batch,
        loss,
        # farthest-point sampling and ball query read point values, which the `meta` device
        # lacks, and a CPU pass at 30720 points is too large to estimate with: measured on a GPU
        activations_estimable=False,
    )


def _quality(smoke: bool) -> Workload:
    recipe, args, settings = preset("quality", smoke)
    # as many annotators as the model has reliabilities: build_model's count without --data
    annotators = len(recipe.ANNOTATORS)
    size = settings.image_size  # original: 448
    loss_of = likelihood(settings.reliability)

    def batch(n: int, device: torch.device) -> tuple:
        images = torch.randn(2 * n, 3, size, size, device=device)  # a pair is two images
        choice = torch.randint(-1, 2, (n,), device=device)
        annotator = torch.randint(0, annotators, (n,), device=device)
        annotator[0] = annotators - 1  # the highest id in every batch: a wrong count fails at once
        return images, choice, annotator

    def loss(model: nn.Module, inputs: tuple) -> torch.Tensor:
        images, choice, annotator = inputs  # the recipe's step at the preset's reliability
        s_i, s_j = model(images).float().chunk(2)
        unwrapped = getattr(model, "module", model)
        eta = reliabilities(unwrapped, settings.reliability, settings.fixed_eta)
        return loss_of(s_i - s_j, choice, eta[annotator], settings.draw_weight)

    def build() -> nn.Module:
        model = recipe.build_model(args, settings)
        count = model.annotator_logits.numel()
        if count != annotators:  # the batch's annotator ids index the model's reliabilities
            raise ValueError(f"quality: the model has {count} annotators, the batch {annotators}")
        return model

    return Workload(
        "quality",
        f"smoke: {settings.backbone} at {size} px"
        if smoke
        else f"EfficientNet-B4 at {size} px; a sample is a pair (2 images)",
        SMOKE_BATCH if smoke else 32,
        build,
        batch,
        loss,
    )


CAPTION_VOCAB, CAPTION_TOKENS = 10_000, 32  # a word-level vocabulary of a COCO-sized corpus


def _captioning(smoke: bool) -> Workload:
    recipe = load_recipe("captioning")
    vocab, tokens_per_caption = (100, 8) if smoke else (CAPTION_VOCAB, CAPTION_TOKENS)
    sizes = {"image_size": 224, "patch": 16, "dim": 512, "depth": 6, "decoder_depth": 6}
    sizes |= {"heads": 8, "max_tokens": tokens_per_caption}
    if smoke:
        sizes |= {"image_size": 32, "patch": 8, "dim": 32, "depth": 1, "decoder_depth": 1}
        sizes |= {"heads": 2}
    pixels_size = sizes["image_size"]

    def batch(n: int, device: torch.device) -> tuple:
        pixels = torch.randn(n, 3, pixels_size, pixels_size, device=device)
        tokens = torch.randint(4, vocab, (n, tokens_per_caption), device=device)
        return pixels, tokens

    def loss(model: nn.Module, inputs: tuple) -> torch.Tensor:
        pixels, tokens = inputs
        summed, count = recipe.next_token_loss(model(pixels, tokens), tokens)
        return summed / count

    return Workload(
        "captioning",
        f"{pixels_size} px, patch {sizes['patch']}, width {sizes['dim']}, {sizes['depth']} + "
        f"{sizes['decoder_depth']} blocks, {sizes['heads']} heads, {vocab} words, "
        f"{tokens_per_caption} tokens",
        SMOKE_BATCH if smoke else 32,
        lambda: recipe.Captioner(vocab, **sizes),
        batch,
        loss,
    )


CRYSTAL_ATOMS, CRYSTAL_NEIGHBORS = 32, 25  # atoms per structure: typical of Materials Project


def _crystal(smoke: bool) -> Workload:
    from torch_geometric.data import Data

    atoms, neighbors = (4, 3) if smoke else (CRYSTAL_ATOMS, CRYSTAL_NEIGHBORS)

    def batch(n: int, device: torch.device) -> Data:
        nodes = n * atoms
        edges = nodes * neighbors
        target = torch.arange(nodes, device=device).repeat_interleave(neighbors)
        first = (target // atoms) * atoms  # neighbours within the structure
        source = first + torch.randint(0, atoms, (edges,), device=device)
        return Data(
            z=torch.randint(1, 95, (nodes,), device=device),
            edge_index=torch.stack([source, target]),
            distance=torch.empty(edges, device=device).uniform_(1.5, 6.0),
            vector=torch.randn(edges, 3, device=device),
            lattice=torch.randn(n, 3, 3, device=device),
            batch=torch.arange(n, device=device).repeat_interleave(atoms),
            y=torch.randn(n, device=device),
            num_nodes=nodes,
            num_graphs=n,  # as a PyG Batch has: the model pools by it
        )

    def loss(model: nn.Module, graph: Data) -> torch.Tensor:
        return F.mse_loss(model(graph).float(), graph.y)

    size = "the CPU default" if smoke else "iComformer width 256, 4 layers, 256 RBF"
    return Workload(
        "crystal",
        f"{size}, {neighbors} neighbours, {atoms} atoms per structure",
        SMOKE_BATCH if smoke else 64,
        lambda: preset_model("crystal", smoke),
        batch,
        loss,
        meta_ok=False,
    )


CRICKET_MATCHES = 5  # simulated matches the graphs are drawn from: ~1,100 deliveries


def cricket_graphs(recipe: ModuleType, history: int) -> tuple[Any, dict[str, int]]:
    """The recipe's graphs of simulated deliveries (`accel-recipes make-data cricket`), read,
    featurised and assembled by its own data path, with at most `history` earlier balls each
    (a cricket sample's shape is its innings so far, which random tensors cannot give), and the
    sizes of their vocabulary."""
    recipe.datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as tmp:
        rows, info = recipe.load_innings(
            recipe.write_dataset(Path(tmp) / "matches", matches=CRICKET_MATCHES),
            match_types=list(DEFAULT_MATCH_TYPES),
            strict=True,
            ratios=(0.6, 0.2),
            split_seed=0,
            split_by_date=False,
            min_matches=1,
            workers=0,
            cache_dir=Path(tmp) / "cache",
        )
        deliveries = recipe.Deliveries(rows)  # arrays in memory: the folder may go
    keep = np.ones(len(deliveries.y), dtype=bool)  # every split: only the shapes matter
    baseline = recipe.PhaseBaseline.fit(deliveries.over, deliveries.wickets, deliveries.y)
    graphs = recipe.CricketGraphs(deliveries, keep, history, baseline)
    return graphs, recipe.vocab_sizes(info["vocab"])


# the vocabulary of Cricsheet's t20s_male_json as the recipe reads it (docs/recipes/cricket.md)
T20_DOWNLOAD_VOCAB = {"players": 3563, "venues": 261, "teams": 104}


def _cricket(smoke: bool) -> Workload:
    small = {"hidden": 16, "layers": 1, "heads": 1, "history": 10} if smoke else {}
    recipe, _, settings = preset("cricket", smoke, **small)
    graphs: list[Any] = []  # built when first needed: the memory estimate may not need them

    def built() -> tuple[Any, dict[str, int]]:
        if not graphs:
            graphs.append(cricket_graphs(recipe, settings.history))
        return graphs[0]

    def network() -> nn.Module:
        """At full size, embeddings as large as the T20 download's vocabulary (not on this
        machine; the recipe's dry run reads it from --data); in smoke, the simulated data's."""
        return recipe.network(settings, built()[1] if smoke else T20_DOWNLOAD_VOCAB)

    def batch(n: int, device: torch.device) -> Any:
        """The first n of one fixed shuffle: a batch of n + 1 is this one and one more."""
        order = np.random.default_rng(0).permutation(len(built()[0]))
        return built()[0].collate(order[:n].tolist()).to(device)

    def loss(model: nn.Module, graph: Any) -> torch.Tensor:
        return F.smooth_l1_loss(model(graph).float(), graph.y, beta=settings.huber_delta)

    vocab = "the example's vocabulary" if smoke else "the T20 download's vocabulary"
    return Workload(
        "cricket",
        f"CricketHeteroGNN hidden {settings.hidden}, {settings.layers} layers, {settings.heads} "
        f"heads, up to {settings.history} earlier balls, {vocab}",
        SMOKE_BATCH if smoke else 64,
        network,
        batch,
        loss,
        meta_ok=False,  # PyG's pooling reads the batch vector
    )


def workloads(smoke: bool = False, only: str | None = None) -> list[Workload]:
    """Every recipe with an original (the template has none), or the one named `only`; with
    `smoke`, at a small size."""
    builders = {"pointcloud": _pointcloud, "quality": _quality, "captioning": _captioning,
                "crystal": _crystal, "cricket": _cricket}  # fmt: skip
    return [build(smoke) for name, build in builders.items() if only in (None, name)]
