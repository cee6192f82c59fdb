"""The one-cycle schedule's shape, step for step torch's `OneCycleLR` (two phases).

With horizon T optimizer steps, p = --pct-start, the start a = 1 / --div-factor and the floor
z = a / --final-div-factor (fractions of the peak P), the LR of optimizer step k (from 0) is

    R = p T - 1
    k <= R:   P x anneal(a, 1, k / R)                              rising
    else:     P x anneal(1, z, min(1, (k - R) / (T - 1 - R)))      falling to the floor

where anneal(x, y, t) = y + (x - y) (1 + cos(pi t)) / 2 (--anneal cos) or x + (y - x) t
(--anneal linear): the floor is held from step T - 1 on. These are OneCycleLR's phases, its end
steps (p T - 1, a float, and T - 1) and its step counting: its LR at step k is the one after k
calls of `step()`, its constructor's included, so step 0 runs at P / --div-factor.
OneCycleLR's momentum cycling (cycle_momentum) is not part of it: the LR only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from accel_common.errors import ConfigError


class Anneal(str, Enum):
    cos = "cos"
    linear = "linear"


@dataclass(frozen=True)
class OneCycle:
    """OneCycleLR's shape: `pct_start` of the steps rising from peak / `div_factor`, then down to
    peak / `div_factor` / `final_div_factor`, along `anneal` (torch's defaults)."""

    pct_start: float = 0.3
    div_factor: float = 25.0
    final_div_factor: float = 1e4
    anneal: Anneal = Anneal.cos

    def __post_init__(self) -> None:
        if not 0.0 <= self.pct_start <= 1.0:
            raise ConfigError(f"--pct-start must be in [0, 1], got {self.pct_start:g}")
        for flag, value in (
            ("--div-factor", self.div_factor),
            ("--final-div-factor", self.final_div_factor),
        ):
            if not value > 0 or not math.isfinite(value):
                raise ConfigError(f"{flag} must be a positive number, got {value:g}")

    def changed(self) -> list[str]:
        """The flags set away from torch's defaults (they shape --schedule onecycle only)."""
        default = OneCycle()
        return [
            "--" + name.replace("_", "-")
            for name in ("pct_start", "div_factor", "final_div_factor", "anneal")
            if getattr(self, name) != getattr(default, name)
        ]

    @property
    def start(self) -> float:
        """The first step's fraction of the peak: OneCycleLR's initial_lr / max_lr."""
        return 1.0 / self.div_factor

    @property
    def floor(self) -> float:
        """The last step's fraction of the peak: OneCycleLR's min_lr / max_lr."""
        return self.start / self.final_div_factor

    def multiplier(self, step: int, horizon: int) -> float:
        """Fraction of the peak LR at optimizer step `step` of a cycle of `horizon` steps."""
        rise_end = float(self.pct_start * horizon) - 1  # OneCycleLR's phase end steps
        if step <= rise_end:
            return self.interpolate(self.start, 1.0, step / rise_end if rise_end else 1.0)
        span = horizon - 1 - rise_end
        progress = min(1.0, (step - rise_end) / span) if span > 0 else 1.0
        return self.interpolate(1.0, self.floor, progress)

    def interpolate(self, start: float, end: float, progress: float) -> float:
        """OneCycleLR's _annealing_cos / _annealing_linear, as it writes them."""
        if Anneal(self.anneal) is Anneal.cos:
            return end + (start - end) / 2.0 * (math.cos(math.pi * progress) + 1)
        return (end - start) * progress + start

    def describe(self, peak: float) -> str:
        """The banner's words for the cycle: 'from 4e-05 (peak / 25) up along a cosine over the
        first 30% of the steps, then down to 4e-09 (peak / 25 / 10000)'."""
        curve = "a cosine" if Anneal(self.anneal) is Anneal.cos else "a line"
        return (
            f"from {peak * self.start:.4g} (peak / {self.div_factor:g}) up along {curve} over "
            f"the first {self.pct_start * 100:g}% of the steps, then down to "
            f"{peak * self.floor:.4g} (peak / {self.div_factor:g} / {self.final_div_factor:g})"
        )
