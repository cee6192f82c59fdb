"""The warm-up's convention (`--warmup-style`): which point of the linear rise optimizer step k
(from 0) trains at, for a warm-up of W steps rising from the fraction s (--warmup-start) of the
peak:

    one-step-ahead (default)  s + (1 - s) x (k + 1) / W   step 0 already one step up, the
                                                          warm-up's last step (W - 1) at the peak
    hf                        s + (1 - s) x k / W         step 0 at s (0: trains at LR 0), the
                                                          peak at step W, the first after it

`hf` is the convention of transformers' and diffusers' `get_scheduler` (the HF Trainer's
`--warmup_steps`: `k / max(1, W)`, s = 0) and of torch's LinearLR(start_factor=s,
total_iters=W) stepped once per optimizer step from step 0; no --warmup-start reaches it under
the default. With --decay-per-epoch the LR changes only at epoch boundaries and epoch e already
trains at e epochs' rise (from s at epoch 0, as a torch scheduler stepped per epoch): both styles
are that. After the warm-up the schedule is the same in both styles.
"""

from __future__ import annotations

from enum import Enum

from accel_common.errors import ConfigError


class WarmupStyle(str, Enum):
    """--warmup-style: the point of the warm-up's rise that optimizer step k trains at (module
    docstring); LRSettings(warmup_style=...) for a script with its own flags."""

    one_step_ahead = "one-step-ahead"
    hf = "hf"


def warmup_multiplier(
    step: int, warmup: int, rise_from: float, every: int, style: WarmupStyle
) -> float:
    """The fraction of the peak for optimizer step `step` < `warmup` (module docstring);
    `every` > 1: the LR changes only every that many steps (one epoch's)."""
    if every > 1:  # a scheduler stepped per epoch: epoch e at e epochs' rise, in either style
        return rise_from + (1.0 - rise_from) * (step // every) * every / warmup
    if WarmupStyle(style) is WarmupStyle.hf:
        return rise_from + (1.0 - rise_from) * step / warmup
    return rise_from + (1.0 - rise_from) * (step + 1) / warmup


def refuse_without_warmup(style: WarmupStyle, warmup_steps: int, warmup_epochs: int) -> None:
    """--warmup-style hf shapes a warm-up: without one it would change nothing but the run's
    identity, so it is refused, as the other flags of a shape the schedule lacks."""
    if WarmupStyle(style) is not WarmupStyle.one_step_ahead and not (warmup_steps or warmup_epochs):
        raise ConfigError(
            f"--warmup-style {WarmupStyle(style).value} shapes the warm-up, and there is none: "
            "give --warmup-steps N or --warmup-epochs N, or drop --warmup-style"
        )
