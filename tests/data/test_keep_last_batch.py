"""make_train_loader(drop_last=False): an original's last incomplete batch, on one process only."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from accel_common.batch_lr.batching import BatchPlan
from accel_common.data.loaders import make_train_loader

DATA = TensorDataset(torch.arange(10))


def items(loader: torch.utils.data.DataLoader) -> list[list[int]]:
    return [batch[0].tolist() for batch in loader]


@pytest.mark.parametrize("costs", [None, [1.0] * 10])
def test_the_last_incomplete_batch_is_trained_on_where_kept(costs):
    plan = BatchPlan(4, 4, 1, 1)
    kept = items(make_train_loader(DATA, 4, seed=3, costs=costs, plan=plan, drop_last=False))
    dropped = items(make_train_loader(DATA, 4, seed=3, costs=costs, plan=plan))
    assert [len(b) for b in kept] == [4, 4, 2]
    assert sorted(i for b in kept for i in b) == list(range(10))  # each once, the same shuffle
    assert kept[:2] == dropped


@pytest.mark.parametrize("processes, accumulation", [(2, 1), (1, 2)])
def test_keeping_it_is_refused_where_a_step_has_several_batches(processes, accumulation):
    plan = BatchPlan(4 * processes * accumulation, 4, processes, accumulation)
    with pytest.raises(ValueError, match="one process taking one batch per step"):
        make_train_loader(DATA, 4, plan=plan, drop_last=False)
