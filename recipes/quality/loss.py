"""The quality recipe's likelihood of the votes: Crowd-BT's (eta per annotator in [0, 1]), the
original's (eta in [0.5, 1]), and the reliabilities eta of each --reliability mode."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recipes.quality.model import QualityScorer


def reliabilities(
    model: QualityScorer, mode: str, fixed_eta: float, gold: torch.Tensor | None = None
) -> torch.Tensor:
    """eta per annotator: `full` learns each in [0, 1] (crowd_bt_loss); the original's forms
    keep it in [0.5, 1] (original_loss): `global` learns one shared value as the original does,
    0.5 + 0.5 sigmoid(logit) (loss.py 78), `fixed` uses --fixed-eta, `gold` each annotator's
    accuracy on gold pairs (its S3 runs)."""
    logits = model.annotator_logits
    if mode == "full":
        return torch.sigmoid(logits)
    if mode == "global":
        return (0.5 + 0.5 * torch.sigmoid(logits[:1])).expand_as(logits)
    if mode == "gold":
        return gold.to(logits) + 0 * logits
    return fixed_eta + 0 * logits  # still in the graph: DDP expects a gradient for every parameter


def crowd_bt_loss(
    diff: torch.Tensor, choice: torch.Tensor, eta: torch.Tensor, draw_weight: float
) -> torch.Tensor:
    """Mean negative log-likelihood of the votes; a draw costs draw_weight * |s_i - s_j|."""
    log_eta, log_not = torch.log(eta.clamp(1e-6, 1)), torch.log((1 - eta).clamp(1e-6, 1))
    log_left = torch.logaddexp(log_eta + F.logsigmoid(diff), log_not + F.logsigmoid(-diff))
    log_right = torch.logaddexp(log_eta + F.logsigmoid(-diff), log_not + F.logsigmoid(diff))
    nll = torch.where(choice > 0, -log_left, -log_right)
    return torch.where(choice == 0, draw_weight * diff.abs(), nll).mean()


def original_loss(
    diff: torch.Tensor, choice: torch.Tensor, eta: torch.Tensor, draw_weight: float
) -> torch.Tensor:
    """The original's likelihood, as it computes it (loss.py 114-168, every weight 1): a vote
    for the left image has P = eta sigmoid(d) + (1 - eta) / 2 with eta in [0.5, 1], cost
    -log(P + 1e-8); a draw costs draw_weight * |d| (the original's 0.5); the sum over the batch
    divided by its size + 1e-8."""
    eta = eta.clamp(0.5, 1.0)
    p = eta * torch.sigmoid(torch.where(choice < 0, -diff, diff)) + (1 - eta) * 0.5
    cost = torch.where(choice == 0, draw_weight * diff.abs(), -torch.log(p + 1e-8))
    return cost.sum() / (choice.numel() + 1e-8)


def likelihood(mode: str):
    """The loss of a --reliability mode: Crowd-BT for full, the original's for its own modes."""
    return crowd_bt_loss if mode == "full" else original_loss
