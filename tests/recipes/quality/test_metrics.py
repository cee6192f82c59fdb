"""The quality recipe's metrics: rank correlations with ties, the win-rate baseline, pairwise
accuracy (the original's draw margin, by pair type, NDCG: test_original.py)."""

from __future__ import annotations

import pytest
import torch

from recipes.quality.data import Vote
from recipes.quality.metrics import pairwise_accuracy, rank_correlations, win_rates


def test_rank_correlations_handle_ties_whatever_the_row_order():
    """Win rates tie often; tied scores must share their average rank (Spearman) and count as
    ties (Kendall's tau-b), so the baseline is not understated by the order of the rows."""
    true = torch.arange(8.0)
    tied = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])  # two blocks, right order
    rho, tau = rank_correlations(tied, true)
    for perm in (torch.arange(7, -1, -1), torch.tensor([3, 6, 0, 5, 1, 7, 2, 4])):
        assert rank_correlations(tied[perm], true[perm]) == pytest.approx((rho, tau), abs=1e-12)
    # average ranks: corr([2.5]*4 + [6.5]*4, 1..8) = 0.8729; tau-b = 16 / sqrt(28 * 16)
    assert rho == pytest.approx(0.8729, abs=1e-4)
    assert tau == pytest.approx(16 / (28 * 16) ** 0.5)
    assert rank_correlations(true, true) == pytest.approx((1.0, 1.0))


def test_win_rates_count_a_draw_half_and_pair_accuracy_leaves_draws_out():
    records = [Vote("a", "b", 1, "k"), Vote("a", "c", 0, "k"), Vote("b", "c", -1, "k")]
    index = {name: k for k, name in enumerate("abcd")}
    # a: a win and a draw; b: a loss and a loss; c: a draw and a win; d: never seen
    assert win_rates(records, index).tolist() == [0.75, 0.0, 0.75, 0.0]
    scores = torch.tensor([2.0, 0.0, 1.0, 0.0])  # a over b right, c over b right
    assert pairwise_accuracy(scores, records, index) == 1.0
    assert pairwise_accuracy(-scores, records, index) == 0.0
