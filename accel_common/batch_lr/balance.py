"""Per-device batches balanced by cost, for items whose size varies (atoms, edges, tokens).

Why: Accelerate deals out per-device batches in turn (batch j to process j % N), so each process
gets the next B items whatever their size. With graphs of 1 to 64 atoms one process often holds
far more work than the others, and every synchronised step waits for it.

`BalancedBatchSampler` keeps each optimizer step's global batch exactly as today (the same
shuffle, the same items in the same accumulation window) and changes only which micro-batch
slot (process x accumulation step) each item of the window lands in: greedy
longest-processing-time (largest cost first, into the open slot with the least cost so far),
with every slot holding exactly B items. Equal counts matter: the recipes' losses are means over
the items of a micro-batch and DDP averages over processes, which is the global mean only when
every micro-batch holds the same number of items. So the gradient is the one a single process
computes on the same global batch (up to float sum order), and a 1-process run with N x A
accumulation steps gets the same micro-batches as N processes with A.

Every process computes the same assignment from the same costs and shuffle; nothing is
communicated. The costs of each process in each step are known here, so the loop logs the
step's imbalance (max over processes of the cost / mean) without a collective.

Accumulation windows run across epoch ends (accelerator.make_accelerator), so windows are counted
from the start of the run: a window cut by an epoch's end is balanced within each part, and no
item ever moves to another window.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import pairwise
from typing import Any

import numpy as np
from torch.utils.data import BatchSampler, Sampler

from accel_common.batch_lr.batching import BatchPlan


def balanced_slots(costs: np.ndarray, slots: int) -> list[np.ndarray]:
    """Positions 0..len(costs)-1 split into `slots` groups of equal count whose cost sums are as
    equal as greedy longest-processing-time makes them: each item, largest first (ties: the
    earlier position), goes to the open group with the least cost (ties: the lower group).
    Within a group, positions stay in increasing order. Deterministic."""
    per_slot, rest = divmod(len(costs), slots)
    if rest:
        raise ValueError(f"{len(costs)} items do not split into {slots} equal groups")
    if slots == 1:
        return [np.arange(len(costs))]
    load = np.zeros(slots, dtype=np.float64)
    room = np.full(slots, per_slot)
    owner = np.empty(len(costs), dtype=np.int64)
    for position in np.argsort(-np.asarray(costs, dtype=np.float64), kind="stable"):
        open_load = np.where(room > 0, load, np.inf)
        slot = int(np.argmin(open_load))
        owner[position] = slot
        load[slot] += costs[position]
        room[slot] -= 1
    return [np.flatnonzero(owner == slot) for slot in range(slots)]


class BalancedBatchSampler(BatchSampler):
    """Per-device batches of `plan.per_device_batch_size` from `sampler`, in the order
    Accelerate's `BatchSamplerShard` deals them out (batch j to process j % N, accumulation
    step j // N of its window), each window's items balanced by `costs` over its slots (see the
    module docstring). Drops the last incomplete batch, as the recipes' loaders do.

    `rank_costs` holds, for the epoch being iterated, the cost of every process in every
    micro-step (micro-steps x processes), filled as the batches are drawn."""

    def __init__(self, sampler: Sampler[int], costs: Sequence[float], plan: BatchPlan) -> None:
        super().__init__(sampler, plan.per_device_batch_size, drop_last=True)
        self.costs = np.asarray(costs, dtype=np.float64)
        if self.costs.ndim != 1 or len(self.costs) != len(sampler):  # type: ignore[arg-type]
            raise ValueError(
                f"BalancedBatchSampler: {self.costs.shape} costs for {len(sampler)} items"  # type: ignore[arg-type]
            )
        if not np.isfinite(self.costs).all() or (self.costs < 0).any():
            raise ValueError("BalancedBatchSampler: costs must be finite and not negative")
        self.num_processes, self.accumulation = plan.num_processes, plan.grad_accum_steps
        self._epoch = 0
        self.rank_costs = np.zeros((0, self.num_processes))

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose batches come next, passed on to the sampler."""
        self._epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The sampler's epoch where it has one: on several processes the prepared loader's
        `set_epoch` reaches the sampler directly, past this wrapper. It places the windows."""
        return int(getattr(self.sampler, "epoch", self._epoch))

    def micro_steps_per_epoch(self) -> int:
        """Micro-batches per process in an epoch (what the prepared loader's length is)."""
        return len(self) // self.num_processes

    def window_starts(self) -> list[int]:
        """This epoch's micro-steps at which a group of micro-steps balanced together starts:
        where the run's accumulation windows start, and at the epoch's start and end."""
        steps = self.micro_steps_per_epoch()
        first = (-self.epoch * steps) % self.accumulation  # windows counted from the run's start
        return sorted({0, *range(first, steps, self.accumulation), steps})

    def __iter__(self) -> Iterator[list[int]]:
        order = np.fromiter(iter(self.sampler), dtype=np.int64)
        width = self.batch_size * self.num_processes  # the items of one micro-step
        starts = self.window_starts()
        self.rank_costs = np.zeros((starts[-1], self.num_processes))
        for begin, end in pairwise(starts):
            items = order[begin * width : end * width]
            slots = balanced_slots(self.costs[items], (end - begin) * self.num_processes)
            for k, positions in enumerate(slots):  # slot k: micro-step k // N, process k % N
                self.rank_costs[begin + k // self.num_processes, k % self.num_processes] = (
                    self.costs[items[positions]].sum()
                )
                yield items[positions].tolist()
        # the batches that do not fill a micro-step on every process: the shard drops them
        leftover = order[starts[-1] * width :]
        for at in range(0, len(leftover) - self.batch_size + 1, self.batch_size):
            yield leftover[at : at + self.batch_size].tolist()


def find_balanced_sampler(loader: Any) -> BalancedBatchSampler | None:
    """The `BalancedBatchSampler` inside a (prepared) DataLoader, or None: Accelerate wraps it
    in a `BatchSamplerShard` on several processes, and leaves it as it is on one."""
    found = getattr(loader, "batch_sampler", None)
    for _ in range(3):
        if isinstance(found, BalancedBatchSampler):
            return found
        found = getattr(found, "batch_sampler", None)
    return None


def imbalance(rank_costs: np.ndarray) -> float:
    """Max over processes of their cost / the mean cost (1.0: perfectly even; 1.0 too when
    there is no cost at all)."""
    mean = float(np.mean(rank_costs))
    return float(np.max(rank_costs)) / mean if mean > 0 else 1.0
