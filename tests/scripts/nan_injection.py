"""The template recipe with a NaN loss injected on one process at one optimizer step.

tests/training/test_nonfinite.py runs it under `accelerate launch`: NAN_RANK and NAN_STEP say where
(the NAN_STEP-th training forward pass of rank NAN_RANK, i.e. that optimizer step without
accumulation). Every process writes what it did to NAN_REPORT/rank_R.json when it exits (training
forward passes, optimizer steps that had gradients, a checksum of its weights), so the test sees
each rank, not only rank 0's log. Nothing here is in the recipe: it wraps F.mse_loss and watches
the optimizer through torch's global optimizer hooks.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_pre_hook

TEMPLATE = str(Path(__file__).resolve().parents[2] / "recipes" / "train_template.py")
RANK = int(os.environ.get("RANK", "0"))
counts: dict[str, float] = {"forward": 0, "updates": 0}
optimizers: list[torch.optim.Optimizer] = []
mse_loss = F.mse_loss


def injected(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = mse_loss(prediction, target)
    if torch.is_grad_enabled():  # training, not evaluation
        counts["forward"] += 1
        chosen = (int(os.environ["NAN_RANK"]), int(os.environ["NAN_STEP"]))
        if (RANK, counts["forward"]) == chosen:
            loss = loss * float("nan")
    return loss


def count_update(optimizer: torch.optim.Optimizer, _args: object, _kwargs: object) -> None:
    optimizers[:] = [optimizer]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    counts["updates"] += any(p.grad is not None for p in params)


@atexit.register
def report() -> None:
    params = [p for o in optimizers for group in o.param_groups for p in group["params"]]
    counts["checksum"] = sum(p.detach().double().sum().item() for p in params)
    Path(os.environ["NAN_REPORT"], f"rank_{RANK}.json").write_text(json.dumps(counts))


F.mse_loss = injected
register_optimizer_step_pre_hook(count_update)
sys.argv = [TEMPLATE, *sys.argv[1:]]
runpy.run_path(TEMPLATE, run_name="__main__")
