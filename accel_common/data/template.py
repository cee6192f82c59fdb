"""Synthetic regression data for the template recipe: train.csv / test.csv of x0..xD-1, y.

The target is a fixed smooth nonlinear function of the features plus small noise, so a model can
learn it and the predict-the-mean baseline cannot.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

NOISE = 0.1


def target(x: np.ndarray, seed: int = 1234) -> np.ndarray:
    """The ground truth y = f(x) (without noise)."""
    w = np.random.default_rng(seed).normal(size=(x.shape[1], 3)) / np.sqrt(x.shape[1])
    z = x @ w
    return np.sin(2.0 * z[:, 0]) + 0.5 * z[:, 1] ** 2 + np.tanh(z[:, 2])


def write_dataset(
    out_dir: Path, *, train_size: int = 2048, test_size: int = 512, features: int = 8, seed: int = 0
) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for split, size in (("train", train_size), ("test", test_size)):
        x = rng.normal(size=(size, features))
        y = target(x) + NOISE * rng.normal(size=size)
        with (out_dir / f"{split}.csv").open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow([*(f"x{i}" for i in range(features)), "y"])
            writer.writerows(
                [*(f"{v:.6f}" for v in row), f"{t:.6f}"] for row, t in zip(x, y, strict=True)
            )
    return out_dir
