"""The phase baseline the model is measured against: mean runs in the next 5 overs by over
number and wickets down, fitted on the training split.
"""

from __future__ import annotations

import numpy as np


class PhaseBaseline:
    """Mean runs in the next 5 overs by over number and wickets down, from the training split;
    a cell no training delivery reached falls back to its over's mean, then the overall mean."""

    def __init__(self, table: np.ndarray, mean: float) -> None:
        self.table, self.mean = np.asarray(table, dtype=np.float32), mean

    @classmethod
    def fit(cls, over: np.ndarray, wickets: np.ndarray, y: np.ndarray) -> PhaseBaseline:
        mean = float(y.mean())
        cells = np.clip(over, 0, 19) * 11 + np.clip(wickets, 0, 10)
        count = np.bincount(cells, minlength=220)
        total = np.bincount(cells, weights=y, minlength=220)
        over_count = count.reshape(20, 11).sum(1)
        over_mean = np.where(
            over_count > 0, total.reshape(20, 11).sum(1) / np.maximum(over_count, 1), mean
        )
        return cls(
            np.where(count > 0, total / np.maximum(count, 1), np.repeat(over_mean, 11)), mean
        )

    def __call__(self, over: np.ndarray, wickets: np.ndarray) -> np.ndarray:
        return self.table[np.clip(over, 0, 19) * 11 + np.clip(wickets, 0, 10)]
