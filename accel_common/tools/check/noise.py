"""Tensors whose true gradient is zero, found by the check itself, and how far each tensor may be.

Some tensors cannot change a model's output: attention's key bias (`to_k.bias`: softmax ignores
a shift shared by every key), a bias that a normalisation removes again (one-channel-per-group
GroupNorm, a BatchNorm right after it) and any bias that only adds a constant they remove. Their
gradient is zero up to rounding, and Adam divides it by its own size, so it steps them by about
the LR in a direction rounding picks: any other sum order (2 processes instead of 1, FSDP's
reduce-scatter instead of DDP's all-reduce) moves them ~1e-3 while every other tensor agrees to
~1e-6 (issue 57: 14 such tensors in diffusers' UNet).

How they are found: by their own sum-order spread, the distance between the 1-process run and
the same run accumulating two halves (the runs `sum_order_floor` makes anyway). That is the same
computation in another sum order, so it moves exactly these tensors by the same order of
magnitude as the comparisons do (measured on tests/fixtures/check_recipes/train_attention.py:
FSDP-vs-DDP over own spread 0.4 to 1.4 for its four such tensors). A tensor is noise when its
spread is NOISE_RATIO times the median tensor's (the lower median: a model of two tensors, one
of them noise, still counts) and over NOISE_LEAST (a tenth of FLOOR: FLOOR already allows ten
times such a spread). Each noise tensor is held to NOISE_FACTOR times its own spread
(two draws of the same noise, with room for their scatter: FSDP against DDP measured 0.4 to 1.4
times it on the attention test recipe, up to 25 times on cricket's GNN, where one draw is a poor
estimate of the noise's scale), and never to less than twice the largest noise spread, what
every tensor was held to before noise was told apart. A real fault moves the other tensors too.

Why not a float64 reference step (a gradient at rounding level relative to its tensor): the
check runs a recipe as its own processes and has neither its model nor its loss in hand, and a
float64 step would need every op and data path of the recipe in float64; a small gradient is
not yet noise either (Adam steps a small true gradient deterministically). The spread measures
the very thing compared: rounding amplified by the recipe's own optimizer over the same steps.

Why this cannot hide a real fault: the noise is measured on 1-process runs only, which no
distributed fault (a gradient not averaged, one process's batch skipped) touches; such a fault
moves every tensor at 1e-2 and fails on the others, which keep their bound. A computation that
is no sum order (a BatchNorm's statistics over each half) moves every tensor alike, so none is
an outlier and none is taken for noise (such a recipe declares CHECK_NOISE itself). The
per-step losses are never relaxed: a tensor without gradient cannot move the loss.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

NOISE_RATIO = 100.0  # a sum-order spread this many times the median tensor's is noise
NOISE_LEAST = 0.1  # x FLOOR: a spread below it is no outlier worth naming
NOISE_FACTOR = 100.0  # what a noise tensor is held to, times its own spread (measured: 0.4-25)
SHOWN = 3  # tensors a row names


@dataclass(frozen=True)
class Bounds:
    """What each tensor's relative difference is held to: `default`, or for a tensor found to be
    rounding noise NOISE_FACTOR times its own sum-order spread (never less than `default`)."""

    default: float
    noise: dict[str, float] = field(default_factory=dict)
    # nor less, for a noise tensor, than every tensor was held to before noise was told apart
    # (twice the largest spread): one draw of noise is not its bound (cricket's GNN under FSDP
    # moved a noise tensor 25x its own spread, within the largest)
    noise_least: float = 0.0

    def of(self, name: str) -> float:
        if name not in self.noise:
            return self.default
        return max(self.default, NOISE_FACTOR * self.noise[name], self.noise_least)


def rounding_noise(spread: dict[str, float], floor: float) -> dict[str, float]:
    """The tensors whose sum-order `spread` (tensor -> relative distance, 1 process on the whole
    batch against the same run on accumulated halves) marks them rounding noise, with it."""
    if not spread:
        return {}
    least = max(NOISE_RATIO * statistics.median_low(spread.values()), NOISE_LEAST * floor)
    return {name: s for name, s in spread.items() if s > least}


def over(differences: dict[str, float], bounds: Bounds) -> list[tuple[str, float, float]]:
    """The tensors over their bound as (name, difference, bound), the furthest over first."""
    found = [(k, d, bounds.of(k)) for k, d in differences.items() if d > bounds.of(k)]
    return sorted(found, key=lambda item: item[1] / item[2], reverse=True)


def largest(differences: dict[str, float], bounds: Bounds) -> float:
    """The largest difference of the tensors held to the default bound (0 if none)."""
    return max((d for k, d in differences.items() if k not in bounds.noise), default=0.0)


def named(tensors: list[tuple[str, float, float]], shown: int = SHOWN) -> str:
    """`name 1.2e-02 (bound 1.0e-05), ...` for the first `shown`, then how many more."""
    text = ", ".join(f"{k} {d:.1e} (bound {b:.1e})" for k, d, b in tensors[:shown])
    return text + (f" and {len(tensors) - shown} more" if len(tensors) > shown else "")


def noise_line(differences: dict[str, float], bounds: Bounds, shown: int = 6) -> str:
    """The row's line naming the tensors taken for rounding noise and where each ended."""
    if not bounds.noise:
        return ""
    names = sorted(bounds.noise, key=lambda k: differences.get(k, 0.0), reverse=True)
    tensors = [(k, differences.get(k, 0.0), bounds.of(k)) for k in names]
    return (
        f"rounding noise (zero true gradient; each held to {NOISE_FACTOR:g}x its own sum-order "
        f"spread): {named(tensors, shown)}"
    )
