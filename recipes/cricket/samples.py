"""The samples of the cached innings: every delivery's arrays flat in memory, and which
deliveries are samples with their labels (`--target`), over and wickets down.
"""

from __future__ import annotations

import datasets
import numpy as np

from accel_common import DataError
from accel_common.data import list_column
from recipes.cricket.features import CTX_DIM
from recipes.cricket.schema import BALL_FEATURE_DIM

TARGETS = ("original", "next-balls")


class Deliveries:
    """Every delivery's arrays, flat in memory (one copy out of Arrow, shared by the splits),
    and every sample as its row, position and flat index, with its label, over and wickets down.
    `target` "original": cricketmodel's samples (every delivery after the first, wides too) and
    target (runs to an over boundary); "next-balls": this recipe's (every legal delivery; runs
    in the next 5 overs of legal balls)."""

    def __init__(
        self, rows: datasets.Dataset, balls_per_over: int = 6, target: str = "original"
    ) -> None:
        if target not in TARGETS:
            raise DataError(f"--target {target}: one of {', '.join(TARGETS)}")
        original = target == "original"
        positions, sample_offsets = list_column(rows, "o_pos" if original else "sample_pos")
        self.y_all, offsets = list_column(rows, "o_y" if original else "y")
        self.row = np.repeat(np.arange(len(rows)), np.diff(sample_offsets))
        self.pos = positions.astype(np.int64)
        self.flat = offsets[self.row] + self.pos
        self.y = self.y_all[self.flat]
        self.over_all = list_column(rows, "over")[0].astype(np.int64)
        if original:
            self.over = self.over_all[self.flat]
        else:
            self.over = list_column(rows, "legal_before")[0][self.flat] // balls_per_over
        self.wickets = list_column(rows, "wickets")[0][self.flat].astype(np.int64)
        self.split = rows.data.column("split").to_numpy()[self.row]
        self.rank = np.arange(len(self.row)) - sample_offsets[self.row]  # sample number
        self.ctx = list_column(rows, "o_ctx")[0].reshape(-1, CTX_DIM)
        self.ball = list_column(rows, "o_ball")[0].reshape(-1, BALL_FEATURE_DIM)
        self.actor_ids = list_column(rows, "actor_ids")[0].reshape(-1, 3).astype(np.int64)
        self.context = np.stack(
            [rows.data.column(k).to_numpy() for k in ("venue_id", "batting_id", "bowling_id")], 1
        ).astype(np.int64)
        self.chase = rows.data.column("o_chase").to_numpy().astype(bool)
