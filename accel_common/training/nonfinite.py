"""What the training loop checks for NaN and infinity: the step's flags (one all-reduce that
also carries stop signals), the processes whose loss went non-finite, the weights at the end,
and the one-line error that stops the run (accel_common.training.loop uses them).
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import Accelerator

from accel_common.errors import NonFiniteError


def reduce_flags(
    accelerator: Accelerator,
    losses: list[torch.Tensor],
    stop_received: bool,
    grad_norm: torch.Tensor | None = None,
) -> tuple[int, int]:
    """(processes with a non-finite loss or gradient norm in this optimizer step, processes
    that received a stop signal): one all-reduce, the same answer on every process."""
    device = accelerator.device
    local = torch.zeros(2, device=device)
    values = [loss.float().reshape(-1) for loss in losses]
    if grad_norm is not None:
        values.append(grad_norm.float().reshape(-1).to(device))
    if values:
        local[0] = (~torch.isfinite(torch.cat(values))).any()
    local[1] = stop_received
    nonfinite, stop_signals = accelerator.reduce(local, reduction="sum").tolist()
    return int(nonfinite), int(stop_signals)


def nonfinite_losses(accelerator: Accelerator, losses: list[torch.Tensor]) -> str:
    """What went wrong, naming the processes whose loss was non-finite (collective)."""
    local = torch.cat([loss.float().reshape(-1) for loss in losses])
    bad = ~torch.isfinite(local)
    value = local[bad][0].item() if bad.any() else float("nan")
    flags = accelerator.gather(bad.any().reshape(1).float()).tolist()
    where = ", ".join(str(rank) for rank, flag in enumerate(flags) if flag) or "?"
    return f"the training loss went non-finite ({value}) on process {where}"


def diverged(what: str, step: int, last_saved: Path | None) -> NonFiniteError:
    """The error that stops a run at `step`, naming the last good checkpoint."""
    where = (
        f"The last good checkpoint is {last_saved}: resume from it with a lower --lr or a "
        "--clip-grad"
        if last_saved
        else "No checkpoint was saved before it: lower --lr or set --clip-grad"
    )
    return NonFiniteError(
        f"{what} at optimizer step {step}; stopped without saving or exporting. {where}, pass "
        "--on-nonfinite skip to skip such steps, or check the data for NaN and infinite values"
    )


@torch.no_grad()
def all_finite(accelerator: Accelerator, model: torch.nn.Module) -> bool:
    """Whether every weight of `model` is finite on every process (collective)."""
    bad = torch.zeros((), device=accelerator.device)
    for parameter in model.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter  # FSDP2
        bad += (~torch.isfinite(local)).sum()
    return accelerator.reduce(bad, reduction="sum").item() == 0
