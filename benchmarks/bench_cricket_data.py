"""How fast the cricket recipe preprocesses a Cricsheet download cold, and how fast it starts
cached, at the size of `t20s_male_json.zip` (about 3,000 matches, 700,000 deliveries).

The matches are the recipe's own simulated ones (`accel-recipes make-data cricket`), written once
into a temporary folder. `load_innings` then runs as the recipe calls it at its defaults: cold
into a fresh cache folder (hashing the files, parsing the JSON, splitting, building the training
vocabulary, computing every delivery's features, writing Arrow), then cached (hashing the files
and reading the cache back), and finally the flat delivery arrays the data loader reads are built
from the cache. Prints a Markdown table for docs/recipes/cricket.md.

    OMP_NUM_THREADS=1 python benchmarks/bench_cricket_data.py --matches 3000 --workers 2
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from recipes import load_recipe
from recipes.cricket.example import write_dataset
from recipes.cricket.parsing import DEFAULT_MATCH_TYPES

RECIPE = load_recipe("cricket")
SETTINGS = dict(ratios=(0.8, 0.1), split_seed=42, split_by_date=False, min_matches=2)
COLD_TARGET_S, CACHED_TARGET_S = 300.0, 10.0  # issue 13, at ~3,000 matches on 2 cores


def measure(folder: Path, cache: Path, workers: int) -> dict[str, float]:
    """Seconds cold, cached and for the loader's arrays, with the sizes read."""
    options = dict(match_types=list(DEFAULT_MATCH_TYPES), strict=False, workers=workers)
    start = time.perf_counter()
    rows, info = RECIPE.load_innings(folder, cache_dir=cache, **options, **SETTINGS)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    rows, info = RECIPE.load_innings(folder, cache_dir=cache, **options, **SETTINGS)
    cached = time.perf_counter() - start
    assert info["cached"]
    start = time.perf_counter()
    deliveries = RECIPE.Deliveries(rows)
    arrays = time.perf_counter() - start
    return {
        "matches": info["summary"]["matches"],
        "deliveries": len(deliveries.y_all),
        "samples": len(deliveries.y),
        "cold": cold,
        "cached": cached,
        "arrays": arrays,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matches", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        folder = write_dataset(Path(tmp) / "matches", matches=args.matches)
        written = time.perf_counter() - start
        size = sum(p.stat().st_size for p in folder.glob("*.json")) / 2**20
        print(f"wrote {args.matches} matches ({size:.0f} MiB) in {written:.0f}s")
        result = measure(folder, Path(tmp) / "cache", args.workers)
    print("\n| matches | deliveries | samples (legal) | workers | cold | cached | loader arrays |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {result['matches']:,} | {result['deliveries']:,} | {result['samples']:,} | "
        f"{args.workers} | {result['cold']:.0f} s (target < {COLD_TARGET_S:.0f} s) | "
        f"{result['cached']:.1f} s (target < {CACHED_TARGET_S:.0f} s) | {result['arrays']:.1f} s |"
    )


if __name__ == "__main__":
    main()
