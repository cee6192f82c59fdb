"""The Crowd-BT recipe's synthetic example, written in the original project's layout (see
recipes/quality/data.py): images, one <annotator>/comparison_data.json per annotator, truth.json.

Like the original's data (patches of finished surfaces), each image is a surface patch: one
colour, gentle shading, a fine even grain. Its quality is 1 - degradation, the degradation drawn
as scratches, pits and coarse grain noise in proportion to a known amount. These survive the
original's training augmentation (flips, rotation up to 15 degrees, colour jitter) by design:
they do not depend on orientation, position, brightness or colour. Annotators answer correctly
with their reliability eta: experts near 1, a casual one at 0.75, a spammer at 0.5 (coin flips)
and an adversarial one at 0.1 (systematically reversed). Near-equal pairs are often called a
draw.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from recipes.quality.data import ORIGINAL_FILE

ANNOTATORS = {
    "expert_a": 0.95,
    "expert_b": 0.9,
    "expert_c": 0.85,
    "casual": 0.75,
    "spammer": 0.5,
    "adversarial": 0.1,
}
DRAW_GAP = 0.04  # pairs closer than this in quality are usually called a draw
BATCH_SIZE = 50  # comparisons per annotation batch (the records' batch_number)
GOLD_SHARE = 0.25  # the first quarter are gold: category POS_0..POS_5 by quality (gold_gold)


def surface(rng: np.random.Generator, size: int) -> np.ndarray:
    """A clean surface patch: one colour, gentle shading in a random direction, a fine even
    grain; values in [0, 1]."""
    y, x = np.mgrid[0:size, 0:size] / size
    angle = rng.uniform(0, 2 * np.pi)
    shading = 0.08 * (np.cos(angle) * (x - 0.5) + np.sin(angle) * (y - 0.5))
    grain = rng.normal(scale=0.02, size=(size, size, 1))
    return np.clip(rng.uniform(0.25, 0.75, size=3) + shading[..., None] + grain, 0, 1)


def degrade(image: np.ndarray, amount: float, rng: np.random.Generator) -> Image.Image:
    """Scratches (thin dark or light lines at any angle), pits (small dark spots) and coarse
    grain noise, each in proportion to `amount` in [0, 1]."""
    size = image.shape[0]
    scale = size / 32  # the defects keep their share of the patch at any --size
    pil = Image.fromarray((image * 255).astype(np.uint8))
    draw = ImageDraw.Draw(pil)
    for _ in range(round(6 * amount)):
        cx, cy = rng.uniform(0, size, size=2)
        angle, half = rng.uniform(0, np.pi), rng.uniform(0.1, 0.3) * size
        dx, dy = half * np.cos(angle), half * np.sin(angle)
        low, high = (0, 60) if rng.uniform() < 0.5 else (200, 255)
        colour = tuple(int(v) for v in rng.uniform(low, high, size=3))
        draw.line([(cx - dx, cy - dy), (cx + dx, cy + dy)], fill=colour, width=round(scale))
    for _ in range(round(8 * amount)):
        cx, cy = rng.uniform(0, size, size=2)
        radius = rng.uniform(0.5, 1.5) * scale
        colour = tuple(int(v) for v in rng.uniform(0, 80, size=3))
        draw.ellipse([cx - radius, cy - radius, cx + radius, cy + radius], fill=colour)
    noisy = np.asarray(pil) / 255 + rng.normal(scale=0.2 * amount, size=image.shape)
    return Image.fromarray((np.clip(noisy, 0, 1) * 255).astype(np.uint8))


def write_dataset(
    out_dir: Path,
    *,
    images: int = 320,
    comparisons_per_annotator: int = 300,
    size: int = 32,
    seed: int = 0,
) -> Path:
    """Images, one <annotator>/comparison_data.json per annotator as the original writes them
    (with its timestamp, time_taken and batch_number; draws as tie or equal), and truth.json."""
    out_dir = Path(out_dir)
    rng = np.random.default_rng(seed)
    clock_rng = np.random.default_rng([seed, 1])  # record metadata: the votes stay seed-stable
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    names, quality = [], {}
    gold_count = round(GOLD_SHARE * images)
    for index in range(images):
        name = f"img_{index:03d}.png"
        amount = float(rng.uniform(0, 1))
        degrade(surface(rng, size), amount, rng).save(out_dir / "images" / name)
        names.append(name)
        quality[name] = 1.0 - amount
    for annotator, eta in ANNOTATORS.items():
        clock = datetime(2024, 1, 8, 9, 0, tzinfo=timezone.utc)
        records = []
        for number in range(comparisons_per_annotator):
            i, j = rng.choice(len(names), size=2, replace=False)
            left_better = quality[names[i]] > quality[names[j]]
            if abs(quality[names[i]] - quality[names[j]]) < DRAW_GAP and rng.uniform() < 0.7:
                choice = str(clock_rng.choice(["tie", "equal"]))
            else:
                correct = rng.uniform() < eta
                choice = "left" if left_better == correct else "right"
            gold = [
                f"POS_{min(5, int(6 * quality[names[k]]))}" if k < gold_count else ""
                for k in (i, j)
            ]
            kind = {2: "gold_gold", 1: "gold_real", 0: "real_real"}[sum(map(bool, gold))]
            time_taken = round(float(clock_rng.gamma(2.0, 1.5)) + 0.5, 2)
            clock += timedelta(seconds=time_taken + 0.3)
            records.append(
                {
                    "img1": names[i],
                    "img2": names[j],
                    "choice": choice,
                    "timestamp": clock.isoformat(),
                    "time_taken": time_taken,
                    "batch_number": number // BATCH_SIZE + 1,
                    "pair_type": kind,
                    **{f"img{n}_category": c for n, c in zip((1, 2), gold, strict=True) if c},
                }
            )
        (out_dir / annotator).mkdir(exist_ok=True)
        comparisons = json.dumps({"comparisons": records}, indent=1)
        (out_dir / annotator / ORIGINAL_FILE).write_text(comparisons)
    truth = {"quality": quality, "reliability": ANNOTATORS}
    (out_dir / "truth.json").write_text(json.dumps(truth, indent=1))
    return out_dir
