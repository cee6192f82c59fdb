"""What SharedSettings builds a run's objects with (`RunObjects`, a base of SharedSettings): the
Accelerator and batch plan, the optimizer, the model's adaptation, the training loader, the LR
schedule and the TrainLoop, each from the shared flags and their groups (options.py), through the
library function that owns it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import KwargsHandler
from torch.utils.data import DataLoader, Dataset

import accel_common.hardware.accelerator
from accel_common.batch_lr.batching import BatchPlan
from accel_common.batch_lr.batchnorm import sync_batchnorm
from accel_common.batch_lr.lr import LRSchedule, make_lr_schedule
from accel_common.data import loaders
from accel_common.deprecation import warn_deprecated
from accel_common.hardware.compilation import requested_compilation
from accel_common.hardware.speed import make_optimizer
from accel_common.settings import Settings
from accel_common.training.ema import make_ema
from accel_common.training.loop import TrainLoop
from accel_common.training.policy import EarlyStopping, LoopPolicy
from accel_common.training.run import Run, RunConfig, Tracking


class RunObjects:
    """The methods of SharedSettings that build a run's objects; they read its flags (`self.seed`,
    `self.batch_request`, ...), so only SharedSettings takes this as a base."""

    def make_accelerator(
        self, kwargs_handlers: Iterable[KwargsHandler] = ()
    ) -> tuple[Accelerator, BatchPlan]:
        """The Accelerator and batch plan these flags ask for (accelerator.make_accelerator)."""
        return accel_common.hardware.accelerator.make_accelerator(
            output_dir=self.output_dir, batch=self.batch_request,
            mixed_precision=self.mixed_precision.value if self.mixed_precision else None,
            cpu=self.cpu, report_to=self.report_to, dist_timeout=self.dist_timeout,
            seed=self.seed, deterministic=self.deterministic, kwargs_handlers=kwargs_handlers,
            matmul_precision=self.matmul_precision.value if self.matmul_precision else None,
            ddp_static_graph=self.ddp_static_graph,
        )  # fmt: skip

    def make_optimizer(
        self, optimizer_class: type[torch.optim.Optimizer], params: Iterable[Any], **kwargs: Any
    ) -> torch.optim.Optimizer:
        """`optimizer_class(params, **kwargs)`, fused with --fused-optimizer (speed.make_optimizer:
        a fused kernel torch lacks is refused, naming the flag)."""
        return make_optimizer(optimizer_class, params, self.fused_optimizer, **kwargs)

    def adapt_model(self, model: torch.nn.Module) -> None:
        """What the launch asks of `model`, in place: --sync-batchnorm's BatchNorms over the
        global batch (accel_common.batch_lr.batchnorm), then --compile (or the launch config's
        dynamo backend: accel_common.hardware.compilation). Call it after any copy of the model is
        made (a deepcopy copies the compiled function too, which would run the original), before
        accelerator.prepare."""
        if self.sync_batchnorm:
            sync_batchnorm(model, PartialState().device)
        compilation = requested_compilation(self.compile)
        if compilation is not None:
            compilation.apply(model)

    def compile_model(self, model: torch.nn.Module) -> None:
        """adapt_model's name before 0.2.0, kept so that older recipes run (DeprecationWarning)."""
        warn_deprecated("SharedSettings.compile_model", "SharedSettings.adapt_model")
        self.adapt_model(model)

    def make_train_loader(
        self,
        dataset: Dataset,
        plan: BatchPlan,
        collate_fn: Callable | None = None,
        costs: Sequence[float] | None = None,
        replacement: bool = False,
        drop_last: bool = True,
    ) -> DataLoader:
        """The shuffled, drop-last training loader (data.loaders.make_train_loader); with `costs`
        (one per item), each step's items balanced over processes by cost; with `replacement`,
        each epoch's items drawn with replacement (iteration-sampled training); `drop_last=False`
        (one process, no accumulation only) keeps the epoch's last incomplete batch."""
        return loaders.make_train_loader(
            dataset, plan.per_device_batch_size, seed=self.seed, workers=self.workers,
            collate_fn=collate_fn, costs=costs, plan=plan, replacement=replacement,
            drop_last=drop_last,
        )  # fmt: skip

    def make_lr_schedule(
        self,
        accelerator: Accelerator,
        optimizer: torch.optim.Optimizer,
        plan: BatchPlan,
        steps_per_epoch: int,
    ) -> LRSchedule:
        """--lr scaled to the global batch, warmup and decay (lr.make_lr_schedule)."""
        return make_lr_schedule(
            accelerator,
            optimizer,
            plan,
            self.lr_settings,
            steps_per_epoch=steps_per_epoch,
            epochs=self.epochs,
            max_steps=self.max_steps,
        )

    def make_loop(
        self,
        accelerator: Accelerator,
        plan: BatchPlan,
        loader: DataLoader,
        schedule: LRSchedule,
        *,
        recipe: str,
        data_files: Mapping[str, Path],
        settings: Settings | None = None,
        derived: dict[str, Any] | None = None,
        config: dict[str, Any] | None = None,
        monitor: str | None = None,
        patience: int = 0,
        min_epochs: int = 0,
        min_delta: float = 0.0,
        model: torch.nn.Module | None = None,
    ) -> TrainLoop:
        """The run's TrainLoop (loop.TrainLoop). `data_files` are every file the run's data
        reader opens, by name (accel_common.data.named_files): their contents are the
        data's part of the run's identity. `settings` are the workload's own, `derived`
        what the run computed from its data that single-device commands need too (a target's
        mean, a vocabulary size); all of it, with every setting here, is stored in the trackers,
        the checkpoints and the export, and is the run's identity but for the adjustable
        settings. `monitor` and `patience` keep the best epoch's model and stop early, not before
        epoch `min_epochs` + 1; an epoch resets the patience only when better by more than
        `min_delta`. `model` (prepared): what --ema-decay averages (`loop.ema`)."""
        own = [settings] if settings is not None else []
        run_config = RunConfig(
            recipe,
            {**self.as_config(), **merged(own, "as_config"), **(derived or {}), **(config or {})},
            adjustable=frozenset(self.adjustable().union(*(s.adjustable() for s in own))),
            derived=frozenset(derived or {}),
            defaults={**self.default_config(), **merged(own, "default_config")},
        )
        stopping = EarlyStopping(monitor, patience, min_epochs, min_delta)
        policy = LoopPolicy(self.save_policy, self.clip_grad, self.on_nonfinite, stopping)
        policy.check(accelerator)  # before the run claims its folder
        # registered for checkpointing before the resume restores it
        ema = make_ema(accelerator, model, self.ema_settings, f"recipes/train_{recipe}.py")
        run = Run.open(
            accelerator,
            plan,
            schedule,
            run_config,
            output_dir=self.output_dir,
            data_dir=self.data or loaders.example_data_dir(recipe),
            data_files=data_files,
            start=self.start_request,
            monitored=bool(monitor),
            tracking=Tracking(self.wandb_project, self.wandb_name),
            ema=ema,
        )
        return TrainLoop(accelerator, plan, loader, schedule, run, policy)


def merged(settings: list[Settings], method: str) -> dict[str, Any]:
    """One dict of every Settings object's `method()` (as_config, default_config)."""
    return {k: v for s in settings for k, v in getattr(s, method)().items()}
