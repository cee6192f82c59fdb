"""What several of the cricket recipe's test files use: matches written to files, in-process
training.
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate.state import AcceleratorState

import recipes.train_cricket as recipe
from accel_common.entry import train_in_python
from recipes.cricket.parsing import DEFAULT_MATCH_TYPES
from tests.processes import CRICKET

T20 = DEFAULT_MATCH_TYPES


def train_here(argv: list[str], output_dir: Path) -> dict[str, float]:
    """The training command in this process, on one thread as run_recipe's processes: the
    recipe is imported already, so no second start-up (about 10 CPU-s: torch, PyG, datasets)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        metrics, _ = train_in_python(
            recipe.train, [*argv, "--output-dir", str(output_dir)], output_dir, script=CRICKET
        )
    finally:
        torch.set_num_threads(threads)
        AcceleratorState._reset_state(reset_partial_state=True)
    return metrics


def deliveries(inning: dict) -> list[dict]:
    return [d for over in inning["overs"] for d in over["deliveries"]]
