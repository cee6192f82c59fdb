"""Batches balanced by cost across processes: the same global batches as the plain loader, each
process's cost as equal as the items allow, the same on every process, and exact on resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from accelerate.data_loader import BatchSamplerShard, SkipBatchSampler
from accelerate.state import AcceleratorState
from torch import nn
from torch.utils.data import BatchSampler, Dataset

from accel_common.batch_lr.balance import BalancedBatchSampler, balanced_slots, imbalance
from accel_common.batch_lr.batching import BatchPlan, BatchRequest
from accel_common.batch_lr.lr import Decay, LRSettings, make_lr_schedule
from accel_common.data.files import EpochShuffleSampler
from accel_common.data.loaders import make_train_loader
from accel_common.hardware.accelerator import make_accelerator
from accel_common.training.loop import TrainLoop
from accel_common.training.policy import LoopPolicy, SavePolicy
from accel_common.training.run import Run, RunConfig, StartRequest


def atom_counts(n: int, seed: int = 0) -> np.ndarray:
    """Skewed sizes like the crystal example's: mostly small structures, a few of up to 64."""
    return np.minimum(1 + np.random.default_rng(seed).geometric(0.08, n), 64).astype(float)


def plan_of(per_device: int, processes: int, accumulation: int) -> BatchPlan:
    return BatchPlan(per_device * processes * accumulation, per_device, processes, accumulation)


def dealt(batches: BatchSampler, plan: BatchPlan, epoch: int) -> list[list[list[int]]]:
    """Every process's micro-batches of `epoch`, as Accelerate deals them out."""
    batches.sampler.set_epoch(epoch)
    return [
        list(BatchSamplerShard(batches, plan.num_processes, rank))
        for rank in range(plan.num_processes)
    ]


def windows(per_rank_by_epoch: list[list[list[list[int]]]], accumulation: int) -> list[set]:
    """The items of each optimizer step over the run, windows counted from its start (they run
    across epoch ends), as sets."""
    micro_steps = [
        sorted(i for rank in per_rank for i in rank[m])
        for per_rank in per_rank_by_epoch
        for m in range(len(per_rank[0]))
    ]
    return [
        set().union(*micro_steps[at : at + accumulation])
        for at in range(0, len(micro_steps) - accumulation + 1, accumulation)
    ]


@pytest.mark.parametrize(("processes", "accumulation"), [(1, 1), (1, 3), (2, 1), (2, 3), (4, 2)])
def test_every_optimizer_step_holds_the_items_the_plain_loader_gives_it(processes, accumulation):
    """Over 3 epochs whose micro-steps (11) are not a multiple of the accumulation: the same
    global batch per optimizer step as without balancing, B items in every micro-batch, each
    item once; one process without accumulation gets exactly the plain batches."""
    per_device, n = 4, 4 * 11 * processes + 3
    plan = plan_of(per_device, processes, accumulation)
    costs = atom_counts(n)
    plain = BatchSampler(EpochShuffleSampler(n, seed=5), per_device, drop_last=True)
    balanced = BalancedBatchSampler(EpochShuffleSampler(n, seed=5), costs, plan)
    expected = [dealt(plain, plan, epoch) for epoch in range(3)]
    got = [dealt(balanced, plan, epoch) for epoch in range(3)]
    assert windows(got, accumulation) == windows(expected, accumulation)
    assert len(windows(got, accumulation)) == 3 * 11 // accumulation
    for per_rank in got:
        assert all(len(batch) == per_device for rank in per_rank for batch in rank)
        items = [i for rank in per_rank for batch in rank for i in batch]
        assert len(items) == len(set(items))
    if processes == accumulation == 1:
        assert got == expected


def test_balanced_slots_equal_counts_and_a_cost_spread_below_the_smallest_item():
    costs = atom_counts(96, seed=3)
    slots = balanced_slots(costs, 4)
    assert sorted(np.concatenate(slots).tolist()) == list(range(96))
    assert [len(s) for s in slots] == [24] * 4
    assert all((np.diff(s) > 0).all() for s in slots)  # positions keep their order
    sums = [costs[s].sum() for s in slots]
    assert max(sums) - min(sums) <= costs.max()  # LPT's bound for the last item placed
    with pytest.raises(ValueError, match="do not split into 4 equal groups"):
        balanced_slots(costs[:10], 4)


def test_the_imbalance_is_far_below_the_plain_loaders_on_skewed_costs():
    """Structures of 2 to 64 atoms, 32 per process: the plain loader's busiest process carries
    several percent more than the mean in a typical step; balanced, well under 1%."""
    n, plan = 64 * 50, plan_of(32, 2, 1)
    costs = atom_counts(n, seed=1)
    plain = BatchSampler(EpochShuffleSampler(n, seed=0), 32, drop_last=True)
    balanced = BalancedBatchSampler(EpochShuffleSampler(n, seed=0), costs, plan)

    def step_imbalances(sampler: BatchSampler) -> list[float]:
        per_rank = dealt(sampler, plan, epoch=0)
        return [
            imbalance(np.array([costs[rank[m]].sum() for rank in per_rank]))
            for m in range(len(per_rank[0]))
        ]

    before, after = step_imbalances(plain), step_imbalances(balanced)
    assert np.mean(before) > 1.03
    assert np.mean(after) < 1.01 and max(after) < 1.05
    assert all(a <= b for a, b in zip(after, before, strict=True))
    # the sampler's own record is what the processes got
    assert np.allclose([imbalance(row) for row in balanced.rank_costs], after)


def test_every_process_computes_the_same_assignment():
    """Each process builds its own sampler from the same costs and seed: the shards are
    disjoint and together the global batch, with no communication."""
    n, plan = 200, plan_of(8, 4, 1)
    costs = atom_counts(n, seed=2)
    shards = [
        list(BatchSamplerShard(BalancedBatchSampler(EpochShuffleSampler(n, 9), costs, plan), 4, r))
        for r in range(4)
    ]
    again = list(
        BatchSamplerShard(BalancedBatchSampler(EpochShuffleSampler(n, 9), costs, plan), 4, 2)
    )
    assert again == shards[2]
    for step in zip(*shards, strict=True):
        assert len({i for batch in step for i in batch}) == 4 * 8


def test_a_resume_skips_to_the_same_batches_on_every_process():
    """What TrainLoop does on resume (accelerator.skip_first_batches: a SkipBatchSampler over
    the shard) gives each process the rest of the uninterrupted epoch, windows included."""
    n, plan = 4 * 2 * 13, plan_of(4, 2, 3)
    costs = atom_counts(n, seed=4)
    for epoch in (0, 1, 2):  # 13 micro-steps: the windows sit differently in each epoch
        for rank in range(2):
            whole = BalancedBatchSampler(EpochShuffleSampler(n, 1), costs, plan)
            whole.set_epoch(epoch)
            uninterrupted = list(BatchSamplerShard(whole, 2, rank))
            fresh = BalancedBatchSampler(EpochShuffleSampler(n, 1), costs, plan)
            fresh.set_epoch(epoch)
            resumed = list(SkipBatchSampler(BatchSamplerShard(fresh, 2, rank), skip_batches=5))
            assert resumed == uninterrupted[5:]


def test_bad_costs_are_refused():
    plan = plan_of(2, 1, 1)
    with pytest.raises(ValueError, match=r"\(3,\) costs for 4 items"):
        BalancedBatchSampler(EpochShuffleSampler(4, 0), [1.0, 2.0, 3.0], plan)
    with pytest.raises(ValueError, match="finite and not negative"):
        BalancedBatchSampler(EpochShuffleSampler(2, 0), [1.0, -1.0], plan)


class Sized(Dataset):
    """Item i: x = i (to see which items came), cost = its 'size'."""

    def __init__(self, n: int) -> None:
        self.costs = atom_counts(n, seed=6)

    def __len__(self) -> int:
        return len(self.costs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([float(index)]), torch.ones(1)


@pytest.fixture
def balanced_run(tmp_path):
    """A 1-process TrainLoop over a balanced loader: 2 items per micro-batch, 3 micro-batches
    per step (balanced together), 10 micro-batches per epoch, so windows cross epoch ends."""

    def start(resume: str | None = None):
        AcceleratorState._reset_state(reset_partial_state=True)
        accelerator, plan = make_accelerator(
            output_dir=tmp_path,
            batch=BatchRequest(per_device_batch_size=2, grad_accum_steps=3),
            cpu=True,
        )
        data = Sized(20)
        model = nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        loader = make_train_loader(data, 2, costs=data.costs, plan=plan)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        schedule = make_lr_schedule(
            accelerator, optimizer, plan, LRSettings(1e-3, ref_bs=6, decay=Decay.constant),
            steps_per_epoch=len(loader), epochs=3, max_steps=9,
        )  # fmt: skip
        start = StartRequest(resume, overwrite_later=resume is not None)
        run = Run.open(
            accelerator, plan, schedule, RunConfig("toy", {}), output_dir=tmp_path, start=start
        )
        loop = TrainLoop(accelerator, plan, loader, schedule, run, LoopPolicy(SavePolicy(1, 4, 10)))
        seen = []
        for _epoch in loop.epochs():
            for x, y in loop.batches():
                with accelerator.accumulate(model):
                    loss = (model(x / 20) - y).pow(2).mean()
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                loop.record(loss)
                seen.append(sorted(int(v) for v in x[:, 0]))
            loop.end_epoch({})
        loop.finish(model)
        return seen

    yield start
    AcceleratorState._reset_state(reset_partial_state=True)


def test_a_run_resumed_mid_epoch_trains_on_the_same_micro_batches(balanced_run, tmp_path):
    uninterrupted = balanced_run()
    assert len(uninterrupted) == 27  # 9 steps x 3 micro-batches, across two epoch ends
    resumed = balanced_run(resume=str(tmp_path / "checkpoints" / "step_4"))
    assert resumed == uninterrupted[12:]  # step 4 ends 2 micro-batches into epoch 2
    # the windows hold the plain loader's items: consecutive slices of each epoch's shuffle
    shuffles = []
    for epoch in range(3):
        sampler = EpochShuffleSampler(20, 0)
        sampler.set_epoch(epoch)
        shuffles += list(sampler)
    windows_seen = [
        {i for batch in uninterrupted[k : k + 3] for i in batch} for k in range(0, 27, 3)
    ]
    assert windows_seen == [set(shuffles[k : k + 6]) for k in range(0, 54, 6)]
