"""The training loader and the data folder every recipe needs in the same form.

`make_train_loader` builds the shuffled, drop-last loader whose order depends only on
(seed, epoch); `make_eval_loader` the in-order one whose items are the same at every pass;
`resolve_data` gives the user's --data folder or writes the workload's example once.
Each takes plain values, so a script with its own argparse can call them directly.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset

from accel_common.batch_lr.balance import BalancedBatchSampler
from accel_common.batch_lr.batching import BatchPlan
from accel_common.console import say
from accel_common.data.files import EpochDrawSampler, EpochShuffleSampler
from accel_common.data.paths import require_folder
from accel_common.errors import DataError

EXAMPLE_DATA_ROOT = Path("data/example")


def make_train_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    seed: int = 0,
    workers: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    costs: Sequence[float] | None = None,
    plan: BatchPlan | None = None,
    replacement: bool = False,
    drop_last: bool = True,
) -> DataLoader:
    """The training DataLoader every recipe needs, before `prepare`; `batch_size` is the plan's
    per-device batch.

    - drop_last, so every optimizer step sees exactly the global batch; `drop_last=False` trains
      on the epoch's last incomplete batch too, as an original that keeps it (a smaller last
      step), for one process taking one batch per step only: on several, Accelerate would fill
      that batch up with items from the epoch's start (even_batches), so N processes would no
      longer take one process's steps; with accumulation its window would weigh it as a full
      micro-batch. `costs` then change nothing (one slot per step: nothing to balance);
    - the shuffle order depends only on (seed, epoch): 1 or N processes see the same global
      batches, and a resumed run the same order;
    - its own generator: creating a loader iterator draws a seed, and drawing it from the global
      RNG would shift dropout masks after a resume (which restores that RNG);
    - with `costs` (one per item: atoms, edges, tokens) and the `plan`, the items of each
      optimizer step are spread over processes and accumulation steps so that the costs are
      balanced (balance.BalancedBatchSampler): the same global batches, less waiting;
    - with `replacement`, each epoch draws len(dataset) items with replacement (EpochDrawSampler)
      instead of a permutation: iteration-sampled training, with --epochs 0 --max-steps N.
    """
    if not drop_last and plan is not None and plan.num_processes * plan.grad_accum_steps > 1:
        raise ValueError(
            "make_train_loader: drop_last=False is for one process taking one batch per step, "
            f"not {plan.describe()}"
        )
    kind = EpochDrawSampler if replacement else EpochShuffleSampler
    sampler = kind(len(dataset), seed)  # type: ignore[arg-type]
    dataset = FetchRngLog(dataset)  # a resume draws a transform's global-RNG values exactly
    generator = torch.Generator().manual_seed(seed)
    common = {"num_workers": workers, "collate_fn": collate_fn, "generator": generator}
    if costs is None or not drop_last:
        return DataLoader(
            dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **common
        )
    if plan is None or plan.per_device_batch_size != batch_size:
        raise ValueError("make_train_loader: costs need the plan whose per-device batch this is")
    batches = BalancedBatchSampler(sampler, costs, plan)
    return DataLoader(dataset, batch_sampler=batches, **common)


def global_rng_state() -> dict[str, Any]:
    """The global RNG states a transform draws from: torch's, numpy's and Python's."""
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def set_global_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


@contextlib.contextmanager
def per_sample_rng(seed: int, epoch: int, index: int) -> Iterator[None]:
    """Inside: the global CPU RNGs (torch's, numpy's, Python's) seeded by (seed, epoch, index)
    alone; outside, as they were. A transform that draws from them (torchvision's random crops
    and flips) then draws the same values for a sample whichever process reads it and whenever:
    N processes train as 1, and a resume is exact with any number of loader workers. Use it in
    a dataset's __getitem__: `with per_sample_rng(self.seed, self.epoch, index): x = aug(x)`."""
    state = global_rng_state()
    mixed = (seed * 1_000_003 + epoch) * 1_000_003 + index
    torch.default_generator.manual_seed(mixed)  # the CPU generator only: CUDA's is dropout's
    np.random.seed(mixed % 2**32)
    random.seed(mixed)
    try:
        yield
    finally:
        set_global_rng_state(state)


class FetchRngLog(Dataset):
    """The training set, noting the global RNG state before each batch is fetched.

    Accelerate's loader fetches one batch ahead (to know an epoch's last batch), so a transform
    that draws from the global RNG in the main process (`--workers 0`) has drawn batch k+1's
    values before step k ends and is saved: a resumed run that only restored the RNG state of the
    save would draw them again, one batch late, and end elsewhere. The loop saves the state noted
    before that fetch (`pending_fetch`) and, on resume, has the first fetch start from it and the
    next from the restored state (`resume_at`), as in the uninterrupted run. (In worker processes
    the RNG is each worker's own; a transform there is exact only with per-sample seeds.)"""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset, self.epoch, self.fetched = dataset, 0, 0
        self.noted: tuple[int, dict[str, Any]] | None = None  # (fetch index, state before it)
        self.starts: dict[int, dict[str, Any]] = {}  # fetch index -> state to start it from

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """One batch (the DataLoader's fetch with a batch sampler): its items, one after another."""
        if self.fetched in self.starts:
            set_global_rng_state(self.starts.pop(self.fetched))
        self.noted = (self.fetched, global_rng_state())
        self.fetched += 1
        return [self.dataset[index] for index in indices]

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.fetched, self.noted, self.starts = epoch, 0, None, {}
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def pending_fetch(self, consumed: int) -> dict[str, Any] | None:
        """For a save after `consumed` batches of this epoch: the state before the fetch of the
        next batch, if it was fetched ahead."""
        if self.noted is None or self.noted[0] != consumed:
            return None
        return {"epoch": self.epoch, "fetch": consumed, "state": self.noted[1]}

    def resume_at(self, consumed: int, saved: dict[str, Any] | None) -> None:
        """A resumed epoch fetches from batch `consumed` on: from the state `saved` noted before
        it, and the batch after from the state restored now (the one saved after the step)."""
        self.fetched = consumed
        if saved and saved["epoch"] == self.epoch and saved["fetch"] == consumed:
            self.starts = {consumed: saved["state"], consumed + 1: global_rng_state()}


def fetched_ahead(loader: DataLoader, consumed: int) -> dict[str, Any] | None:
    """What a save after `consumed` batches of the epoch keeps of a FetchRngLog training set."""
    dataset = getattr(loader, "dataset", None)
    return dataset.pending_fetch(consumed) if isinstance(dataset, FetchRngLog) else None


class FixedWindow(Dataset):
    """`dataset` as it is now, without its `set_epoch`: a prepared DataLoader calls
    `dataset.set_epoch(n)` at its n-th pass, so an evaluation set whose samples depend on the
    epoch (a subsample, a noise draw) would be drawn anew at every evaluation, and the in-run
    metric would differ from `evaluate` on the export."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]


def make_eval_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    workers: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> DataLoader:
    """The evaluation DataLoader: in order, every item once (Accelerate pads the last round and
    `gather_for_metrics` drops the padding), and the same items at every pass (`FixedWindow`)."""
    if hasattr(dataset, "set_epoch"):
        dataset = FixedWindow(dataset)
    return DataLoader(dataset, batch_size=batch_size, num_workers=workers, collate_fn=collate_fn)


def example_data_dir(workload: str) -> Path:
    """Where a workload's generated example lives when no --data is given."""
    return EXAMPLE_DATA_ROOT / workload


def existing_data(workload: str, data: Path | None) -> Path:
    """The folder `resolve_data` would give, for `--dry-run`'s network sizes, read as the run
    reads them: --data, or the example once a run has written it; else a DataError saying why
    (the dry run then says the count is unknown instead of guessing)."""
    if data is not None:
        require_folder(data, "--data ")
        return data
    target = example_data_dir(workload)
    if not target.is_dir():
        raise DataError(f"no --data, and the example is not written yet: a run writes {target}")
    return target


def resolve_data(
    accelerator: Accelerator, workload: str, data: Path | None, make_example: Callable[[Path], Any]
) -> Path:
    """The user's --data folder, or a small example written once by the main process."""
    if data is not None:
        require_folder(data, "--data ")
        return data
    target = example_data_dir(workload)
    with accelerator.main_process_first():
        if accelerator.is_main_process and not target.exists():
            say(accelerator, f"no --data given: writing example {workload} data to {target}")
            # a folder of this process's own: two runs started at once never write into one
            partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
            shutil.rmtree(partial, ignore_errors=True)  # a killed run's with this pid
            make_example(partial)
            try:
                partial.rename(target)  # fails if another run put its example there meanwhile
            except OSError:
                if not target.is_dir():
                    raise
                shutil.rmtree(partial)  # the same example (same seed): theirs is used
    return target
