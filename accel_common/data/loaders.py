"""The training loader and the data folder every recipe needs in the same form.

`make_train_loader` builds the shuffled, drop-last loader whose order depends only on
(seed, epoch); `make_eval_loader` the in-order one whose items are the same at every pass;
`resolve_data` gives the user's --data folder or writes the workload's example once.
Each takes plain values, so a script with its own argparse can call them directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset

from accel_common.balance import BalancedBatchSampler
from accel_common.batching import BatchPlan
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
) -> DataLoader:
    """The training DataLoader every recipe needs, before `prepare`; `batch_size` is the plan's
    per-device batch.

    - drop_last, so every optimizer step sees exactly the global batch;
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
    kind = EpochDrawSampler if replacement else EpochShuffleSampler
    sampler = kind(len(dataset), seed)  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(seed)
    common = {"num_workers": workers, "collate_fn": collate_fn, "generator": generator}
    if costs is None:
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, **common)
    if plan is None or plan.per_device_batch_size != batch_size:
        raise ValueError("make_train_loader: costs need the plan whose per-device batch this is")
    batches = BalancedBatchSampler(sampler, costs, plan)
    return DataLoader(dataset, batch_sampler=batches, **common)


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
            tmp = target.with_name(target.name + ".tmp")
            make_example(tmp)
            tmp.rename(target)
    return target
