"""The split of the usable matches into training, validation and test, by match: a seeded
permutation or, by date, the earliest matches for training.
"""

from __future__ import annotations

import numpy as np

from accel_common import DataError


def split_matches(
    files: list[str], dates: list[str], ratios: tuple[float, float], seed: int, by_date: bool
) -> dict[str, int]:
    """Match file -> 0 (train), 1 (val) or 2 (test): a permutation fixed by `seed`, or with
    `by_date` the earliest matches for training and the latest for testing."""
    if by_date:
        order = sorted(range(len(files)), key=lambda i: (dates[i], files[i]))
    else:
        order = np.random.default_rng(seed).permutation(len(files)).tolist()
    n_train, n_val = int(ratios[0] * len(files)), int(ratios[1] * len(files))
    if min(n_train, n_val, len(files) - n_train - n_val) < 1:
        raise DataError(
            f"{len(files)} usable matches are too few for the split ratios "
            f"{ratios[0]} / {ratios[1]}: give more match files"
        )
    return {files[i]: int(k >= n_train) + int(k >= n_train + n_val) for k, i in enumerate(order)}
