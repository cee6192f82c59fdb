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

With --cycle-momentum (OneCycleLR's cycle_momentum, off unless asked), the optimizer's momentum
(Adam's beta1, SGD's momentum) at step k follows the same phases the other way, between
b = --base-momentum and M = --max-momentum: anneal(M, b, k / R) rising, anneal(b, M, ...) falling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch

from accel_common.errors import ConfigError


class Anneal(str, Enum):
    cos = "cos"
    linear = "linear"


@dataclass(frozen=True)
class OneCycle:
    """OneCycleLR's shape: `pct_start` of the steps rising from peak / `div_factor`, then down to
    peak / `div_factor` / `final_div_factor`, along `anneal` (torch's defaults); with
    `cycle_momentum`, the momentum from `max_momentum` down to `base_momentum` and back."""

    pct_start: float = 0.3
    div_factor: float = 25.0
    final_div_factor: float = 1e4
    anneal: Anneal = Anneal.cos
    cycle_momentum: bool = False
    base_momentum: float = 0.85
    max_momentum: float = 0.95

    def __post_init__(self) -> None:
        if not 0.0 <= self.pct_start <= 1.0:
            raise ConfigError(f"--pct-start must be in [0, 1], got {self.pct_start:g}")
        for flag, value in (
            ("--div-factor", self.div_factor),
            ("--final-div-factor", self.final_div_factor),
        ):
            if not value > 0 or not math.isfinite(value):
                raise ConfigError(f"{flag} must be a positive number, got {value:g}")
        for flag, value, default in (
            ("--base-momentum", self.base_momentum, OneCycle.base_momentum),
            ("--max-momentum", self.max_momentum, OneCycle.max_momentum),
        ):
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"{flag} must be in [0, 1), got {value:g}")
            if value != default and not self.cycle_momentum:
                raise ConfigError(
                    f"{flag} {value:g} is a bound of the momentum that --cycle-momentum cycles: "
                    "add --cycle-momentum, or drop it"
                )

    def changed(self) -> list[str]:
        """The flags set away from torch's defaults (they shape --schedule onecycle only)."""
        default = OneCycle()
        return [
            "--" + name.replace("_", "-")
            for name in ("pct_start", "div_factor", "final_div_factor", "anneal", "cycle_momentum")
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

    def phase(self, step: int, horizon: int) -> tuple[bool, float]:
        """Whether optimizer step `step` of a cycle of `horizon` steps is in the rise, and how
        far along its phase it is (OneCycleLR's pct; 1 from the last step on)."""
        rise_end = float(self.pct_start * horizon) - 1  # OneCycleLR's phase end steps
        if step <= rise_end:
            return True, step / rise_end if rise_end else 1.0
        span = horizon - 1 - rise_end
        return False, min(1.0, (step - rise_end) / span) if span > 0 else 1.0

    def multiplier(self, step: int, horizon: int) -> float:
        """Fraction of the peak LR at optimizer step `step` of a cycle of `horizon` steps."""
        rising, progress = self.phase(step, horizon)
        if rising:
            return self.interpolate(self.start, 1.0, progress)
        return self.interpolate(1.0, self.floor, progress)

    def momentum(self, step: int, horizon: int) -> float:
        """The momentum at optimizer step `step`: down while the LR rises, up while it falls."""
        rising, progress = self.phase(step, horizon)
        if rising:
            return self.interpolate(self.max_momentum, self.base_momentum, progress)
        return self.interpolate(self.base_momentum, self.max_momentum, progress)

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

    def describe_momentum(self) -> str:
        """'; momentum (Adam's beta1) from 0.95 down to 0.85 at the peak LR and back', or ''."""
        if not self.cycle_momentum:
            return ""
        return (
            f"; momentum (Adam's beta1) from {self.max_momentum:g} down to "
            f"{self.base_momentum:g} at the peak LR and back"
        )


def set_momentum(optimizer: torch.optim.Optimizer, momentum: float) -> None:
    """Set every parameter group's momentum as OneCycleLR does: Adam's beta1 where the optimizer
    has betas, else SGD's momentum."""
    for group in optimizer.param_groups:
        if "betas" in optimizer.defaults:
            group["betas"] = (momentum, *group["betas"][1:])
        else:
            group["momentum"] = momentum


def require_momentum(optimizer: torch.optim.Optimizer) -> None:
    """Refuse --cycle-momentum for an optimizer with no momentum to cycle (OneCycleLR's check)."""
    if "betas" not in optimizer.defaults and "momentum" not in optimizer.defaults:
        name = type(getattr(optimizer, "optimizer", optimizer)).__name__
        raise ConfigError(
            f"--cycle-momentum cycles the optimizer's momentum (Adam's beta1, SGD's momentum), "
            f"and {name} has none: drop --cycle-momentum"
        )
