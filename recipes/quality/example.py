"""The Crowd-BT recipe's synthetic example, written in the original project's layout (see
recipes/quality/data.py): images, one <annotator>/comparison_data.json per annotator, truth.json.

The images are degraded by a known amount (quality = 1 - degradation, mixing blur, noise and JPEG
compression). Annotators answer correctly with their reliability eta: experts near 1, a casual one
at 0.75, a spammer at 0.5 (coin flips) and an adversarial one at 0.1 (systematically reversed).
Near-equal pairs are often called a draw.
"""

from __future__ import annotations

import io
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter

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
GOLD = 40  # the first images are gold: category POS_0..POS_5 by quality (pair_type gold_gold)


def scene(rng: np.random.Generator, size: int) -> np.ndarray:
    """A colourful textured scene: gratings plus blobs, values in [0, 1]."""
    y, x = np.mgrid[0:size, 0:size] / size
    image = np.zeros((size, size, 3))
    for _ in range(3):
        angle, freq, phase = rng.uniform(0, np.pi), rng.uniform(2, 6), rng.uniform(0, 2 * np.pi)
        wave = np.sin(2 * np.pi * freq * (x * np.cos(angle) + y * np.sin(angle)) + phase)
        image += 0.25 * wave[..., None] * rng.uniform(0.2, 1.0, size=3)
    for _ in range(4):
        cx, cy, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.08, 0.25)
        blob = ((x - cx) ** 2 + (y - cy) ** 2) < r**2
        image[blob] = rng.uniform(0, 1, size=3)
    return np.clip(image + 0.5, 0, 1)


def degrade(image: np.ndarray, amount: float, rng: np.random.Generator) -> Image.Image:
    """Blur, add noise and JPEG-compress in proportion to `amount` in [0, 1]."""
    pil = Image.fromarray((image * 255).astype(np.uint8))
    pil = pil.filter(ImageFilter.GaussianBlur(radius=1.5 * amount))
    noisy = np.asarray(pil) / 255 + rng.normal(scale=0.15 * amount, size=image.shape)
    pil = Image.fromarray((np.clip(noisy, 0, 1) * 255).astype(np.uint8))
    buffer = io.BytesIO()
    pil.save(buffer, format="JPEG", quality=int(95 - 85 * amount))
    return Image.open(buffer).convert("RGB")


def write_dataset(
    out_dir: Path,
    *,
    images: int = 160,
    comparisons_per_annotator: int = 400,
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
    for index in range(images):
        name = f"img_{index:03d}.png"
        amount = float(rng.uniform(0, 1))
        degrade(scene(rng, size), amount, rng).save(out_dir / "images" / name)
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
            gold = [f"POS_{min(5, int(6 * quality[names[k]]))}" if k < GOLD else "" for k in (i, j)]
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
