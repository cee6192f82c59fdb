"""The split of the usable matches into training, validation and test, by match: cricketmodel's
(src/data/dataset.py 137 and 158-170, `CricketDataset.process`), so that a run and the original
hold out the same matches for the same seed and ratios; or, by date, the earliest matches for
training.
"""

from __future__ import annotations

import random

from accel_common import DataError

PARTS = ("training", "validation", "test")


def original_parts(files: list[str], ratios: tuple[float, float], seed: int) -> dict[str, int]:
    """File -> 0 (train), 1 (val) or 2 (test) as cricketmodel splits: every .json file of the
    folder in name order (`sorted(Path(raw_dir).glob('*.json'))`, whether or not it is a usable
    match), shuffled by Python's `random` seeded with `seed` (`random.seed(seed);
    random.shuffle(...)`: the same draws), the first int(n x train ratio) for training, the next
    int(n x val ratio) for validation, the rest for testing."""
    order = list(files)
    random.Random(seed).shuffle(order)
    n_train, n_val = int(len(order) * ratios[0]), int(len(order) * ratios[1])
    return {f: int(k >= n_train) + int(k >= n_train + n_val) for k, f in enumerate(order)}


def split_matches(
    files: list[str],
    usable: list[str],
    dates: dict[str, str],
    ratios: tuple[float, float],
    seed: int,
    by_date: bool,
) -> dict[str, int]:
    """Usable match file -> 0 (train), 1 (val) or 2 (test): cricketmodel's split of every file
    (`files`, in name order; see `original_parts`), or with `by_date` the earliest usable
    matches for training and the latest for testing."""
    if by_date:
        order = sorted(usable, key=lambda f: (dates[f], f))
        n_train, n_val = int(ratios[0] * len(order)), int(ratios[1] * len(order))
        part = {f: int(k >= n_train) + int(k >= n_train + n_val) for k, f in enumerate(order)}
    else:
        part = original_parts(files, ratios, seed)
    split = {f: part[f] for f in usable}
    counts = [list(split.values()).count(k) for k in range(3)]
    if min(counts) < 1:
        empty = PARTS[counts.index(0)]
        raise DataError(
            f"{len(usable)} usable matches of {len(files)} files leave the {empty} split empty "
            f"at the split ratios {ratios[0]:g} / {ratios[1]:g}: give more match files"
        )
    return split
