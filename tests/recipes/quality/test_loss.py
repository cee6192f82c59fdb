"""The Crowd-BT quality recipe's likelihood and the reliability forms."""

from __future__ import annotations

import pytest
import torch

import recipes.quality.loss as q


def test_crowd_bt_likelihood():
    diff = torch.tensor([2.0, 2.0, 2.0, 0.5])
    choice = torch.tensor([1.0, -1.0, 1.0, 0.0])
    reliable = torch.tensor([1.0, 1.0, 0.0, 1.0])
    expected = torch.stack(
        [
            -torch.nn.functional.logsigmoid(torch.tensor(2.0)),  # eta 1: plain Bradley-Terry
            -torch.nn.functional.logsigmoid(torch.tensor(-2.0)),
            -torch.nn.functional.logsigmoid(torch.tensor(-2.0)),  # eta 0: the vote is reversed
            torch.tensor(0.1 * 0.5),  # a draw costs draw_weight * |diff|
        ]
    ).mean()
    loss = q.crowd_bt_loss(diff, choice, reliable, 0.1)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)  # eta is clamped to 1e-6
    coin = q.crowd_bt_loss(diff[:2], choice[:2], torch.tensor([0.5, 0.5]), 0.1)
    assert coin.item() == pytest.approx(
        torch.log(torch.tensor(2.0)).item()
    )  # a spammer says nothing


def test_reduced_reliability_forms_stay_in_the_upper_half():
    model = torch.nn.Module()
    model.annotator_logits = torch.nn.Parameter(torch.tensor([-5.0, 0.0, 5.0]))
    full = q.reliabilities(model, "full", 0.9)
    assert full[0] < 0.01 and full[2] > 0.99
    shared = q.reliabilities(model, "global", 0.9)
    assert torch.all(shared == shared[0]) and 0.5 <= shared[0] <= 1
    assert torch.allclose(q.reliabilities(model, "fixed", 0.9), torch.full((3,), 0.9))
