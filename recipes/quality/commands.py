"""The quality recipe's single-device commands on an export (trained here or converted from the
original): `score` rates a folder, `compare` scores one image or compares two, `export-onnx`
writes the scorer as ONNX. recipes/train_quality.py runs them as its subcommands."""

from __future__ import annotations

import csv
from pathlib import Path

import torch
import typer
from torch.utils.data import DataLoader

from accel_common import (
    ConfigError,
    load_for_inference,
    model_option,
    new_file,
    print_names,
    read_recipe_export,
    require_new_file,
)
from accel_common.data import list_images
from recipes.quality.data import ImageReader, Images, normalisation
from recipes.quality.model import QualityScorer
from recipes.quality.onnx_export import ONNX_OPSETS, require_onnx, write_onnx
from recipes.quality.settings import RECIPE, QualitySettings


def load_scorer(model_dir: Path) -> tuple[QualityScorer, ImageReader, torch.device]:
    """An export (trained here or converted from the original) on one device, in eval mode,
    with the evaluation preprocessing its backbone takes."""
    config = read_recipe_export(model_dir, RECIPE)
    settings = QualitySettings.from_config(config)
    model = QualityScorer(settings.backbone, len(config["annotators"]), settings.dropout)
    device = load_for_inference(model_dir, model)
    mean, std = normalisation(model.backbone.backbone)
    return model, ImageReader(Path("."), settings.image_size, mean, std), device


def compare(
    model_dir: Path = model_option(RECIPE),
    images: list[Path] = typer.Argument(..., help="One image to score, or two to compare."),
    margin: float = typer.Option(
        0.1, min=0.0, help="Score difference under which two images are a draw (the original's)."
    ),
) -> None:
    """Score one image, or compare two: which is better, and the probability that it is
    (Bradley-Terry: sigmoid of the score difference), as the original's infer.py does."""
    if len(images) not in (1, 2):
        raise ConfigError(f"give one image to score or two to compare, not {len(images)}")
    model, read, device = load_scorer(model_dir)
    with torch.no_grad():
        scores = model(torch.stack([read(str(path)) for path in images]).to(device)).tolist()
    lines = [f"{image}: score {score:.6f}" for image, score in zip(images, scores, strict=True)]
    if len(images) == 2:
        diff = scores[0] - scores[1]
        p_first = torch.sigmoid(torch.tensor(diff)).item()
        better = images[0] if diff > 0 else images[1]
        lines.append(
            f"draw (|difference| {abs(diff):.4f} <= {margin})"
            if abs(diff) <= margin
            else f"{better} is better, probability {max(p_first, 1 - p_first):.4f}"
        )
    print_names("\n".join(lines))


def export_onnx(
    model_dir: Path = model_option(RECIPE),
    out: Path = typer.Option(..., help="ONNX file to write (scores images N x 3 x S x S)."),
    opset: int = typer.Option(
        17,
        min=ONNX_OPSETS[0],
        max=ONNX_OPSETS[1],
        help=f"ONNX opset version, {ONNX_OPSETS[0]} to {ONNX_OPSETS[1]}: what the exporter writes.",
    ),
) -> None:
    """Export the scorer to ONNX, as the original's export.py offers: input `image` (N x 3 x S x
    S, normalised as the backbone's data config says), output `score` (N x 1); dynamic batch."""
    require_new_file(out)
    model, read, _ = load_scorer(model_dir)  # a wrong --model first: installing onnx won't help
    require_onnx()
    write_onnx(model, read.size, out, opset)
    print(f"wrote {out}")


def score_folder(
    model_dir: Path = model_option(RECIPE),
    images: Path = typer.Option(..., help="Folder of images to rate (subfolders too)."),
    out: Path = typer.Option(..., help="CSV to write: image,score (higher is better)."),
    bs: int = typer.Option(64, min=1, help="Images per forward pass (memory grows with it)."),
) -> None:
    """Rate every image in a folder with an exported model, on one device, best first."""
    require_new_file(out)
    model, read, device = load_scorer(model_dir)
    read.folder = images
    names = list_images(images)
    loader = DataLoader(Images(names, read), batch_size=bs)
    with torch.no_grad():
        values = torch.cat([model(pixels.to(device)).cpu() for pixels in loader])
    scores = dict(zip(names, values.tolist(), strict=True))
    # a file name's own bytes (b"\xff.png" is no UTF-8): the CSV names the file as it is on disk
    with (
        new_file(out) as partial,
        partial.open("w", newline="", encoding="utf-8", errors="surrogateescape") as handle,
    ):
        writer = csv.writer(handle)
        writer.writerow(["image", "score"])
        ranked = sorted(scores.items(), key=lambda row: -row[1])
        writer.writerows((name, f"{value:.6f}") for name, value in ranked)
    print(f"wrote {out}: {len(scores)} images")
