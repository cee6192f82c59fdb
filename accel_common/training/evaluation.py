"""What an evaluation needs from the run: random draws that depend only on the step it scores,
and metrics that a metrics log and an export (JSON) can record, under names the loop does not
own."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from accel_common.errors import ConfigError, NonFiniteError

# what the loop itself puts among a run's metrics: a recipe's evaluation may not return these
LOOP_METRICS = frozenset(
    {"train_loss", "train_loss_partial", "train_seconds", "skipped_steps", "nonfinite_skipped"}
    | {"best_epoch", "best_step"}
)


def evaluation_generator(seed: int, step: int, process_index: int = 0) -> torch.Generator:
    """A CPU generator seeded from (seed, step, process index), each mixed in fully (numpy's
    SeedSequence): neighbouring steps or processes get unrelated streams."""
    state = np.random.SeedSequence([seed, step, process_index]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def check_eval_metrics(
    metrics: dict[str, float], epoch: int, step: int, last_saved: Path | None
) -> None:
    """Refuse a metric named like one the loop owns (merged, it would replace the loop's own
    value in the log and the export), then a non-finite one."""
    owned = sorted(LOOP_METRICS & set(metrics))
    if owned:
        raise ConfigError(
            f"the recipe's evaluation returns {', '.join(map(repr, owned))}, a metric name the "
            f"training loop owns ({', '.join(sorted(LOOP_METRICS))}): rename it in the recipe's "
            "evaluate (e.g. 'eval_' + name)"
        )
    require_finite_metrics(metrics, epoch, step, last_saved)


def require_finite_metrics(
    metrics: dict[str, float], epoch: int, step: int, last_saved: Path | None
) -> None:
    """Stop on a NaN or infinite evaluation metric (the same on every process: the recipes
    compute them from gathered values): the metrics log and the export are JSON, which has
    no such numbers."""
    bad = [(k, v) for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return
    named = ", ".join(f"{key} is {value}" for key, value in bad)
    where = (
        f"the last good checkpoint is {last_saved}"
        if last_saved
        else "no checkpoint was saved before it"
    )
    raise NonFiniteError(
        f"the evaluation metric {named} at epoch {epoch} (optimizer step "
        f"{step}); a metrics log or export cannot record it, so the run stopped "
        f"without saving or exporting ({where}). Check the evaluation (a constant target "
        "or score, an empty split) and the weights"
    )
