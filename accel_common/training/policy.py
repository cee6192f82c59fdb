"""What the training loop does between steps besides counting them (accel_common.training.loop):
when it logs, saves and evaluates, gradient clipping, non-finite steps, early stopping. Flags become
these groups once (accel_common.recipe_cli.options); a script with its own flags builds them
itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from accelerate import Accelerator
from accelerate.utils import DistributedType

from accel_common.checkpoints.checkpoint import TrainProgress
from accel_common.errors import ConfigError


class OnNonFinite(str, Enum):
    stop = "stop"
    skip = "skip"


@dataclass(frozen=True)
class SavePolicy:
    """When the loop logs, saves and evaluates (--log-every, --save-every, --keep-last,
    --eval-every)."""

    log_every: int = 50
    save_every: int = 0  # 0: only the final save
    keep_last: int = 2
    eval_every: int = 0  # optimizer steps; 0: only where the recipe calls end_epoch


@dataclass(frozen=True)
class EarlyStopping:
    """A recipe's early stopping: keep the best evaluated model by `monitor` (lower is better);
    with `patience` N, stop after N evaluations (epoch ends, and --eval-every's steps where the
    recipe passes the model to `log_eval`) without an improvement by more than `min_delta`, not
    before epoch `min_epochs` + 1."""

    monitor: str | None = None
    patience: int = 0
    min_epochs: int = 0
    min_delta: float = 0.0

    def __post_init__(self) -> None:
        if self.patience and not self.monitor:
            raise ConfigError("TrainLoop: patience needs a metric to monitor")

    def judge(
        self,
        progress: TrainProgress,
        value: float,
        metrics: dict[str, float],
        epoch: int,
        step: int,
    ) -> tuple[bool, bool]:
        """Record the monitored `value` of an evaluation in epoch `epoch` at optimizer step
        `step` in `progress`: (whether it is the best so far, whether the run stops now). Any
        lower value is the best model; only one lower by more than `min_delta` resets the
        patience count (as the cricket original's trainer: a tiny gain does not keep it going)."""
        significant = progress.best is None or value < progress.best - self.min_delta
        best = progress.best is None or value < progress.best
        if best:
            progress.best = value
            progress.best_metrics = {**metrics, "best_epoch": epoch, "best_step": step}
        if significant:
            progress.bad_epochs = 0
            return best, False
        progress.bad_epochs += 1
        patient = progress.bad_epochs < self.patience or epoch <= self.min_epochs
        if self.patience and not patient:
            progress.stopped = True
            return best, True
        return best, False

    def stopped(self, progress: TrainProgress, saves: SavePolicy) -> str:
        """The line that says why the run stopped early, and which model it exports."""
        unit = "evaluations" if saves.eval_every else "epochs"
        at = progress.best_metrics  # a checkpoint from before best_step was kept has none
        step = f", step {at['best_step']}" if "best_step" in at else ""
        return (
            f"early stopping: {self.monitor} has not improved for {self.patience} {unit} (best "
            f"{progress.best:.4g} at epoch {at['best_epoch']}{step}); the export is that model"
        )


@dataclass(frozen=True)
class LoopPolicy:
    """What the loop does between steps besides counting them: saves, clipping (--clip-grad),
    non-finite steps (--on-nonfinite), early stopping."""

    saves: SavePolicy = SavePolicy()
    clip_grad: float = 0.0
    on_nonfinite: OnNonFinite = OnNonFinite.stop
    early_stopping: EarlyStopping = field(default_factory=EarlyStopping)

    def __post_init__(self) -> None:
        object.__setattr__(self, "on_nonfinite", OnNonFinite(self.on_nonfinite))

    def check(self, accelerator: Accelerator) -> None:
        """Refuse what this launch cannot do, before the run starts."""
        if self.on_nonfinite is OnNonFinite.skip and (
            accelerator.distributed_type == DistributedType.DEEPSPEED
        ):
            raise ConfigError(
                "--on-nonfinite skip does not work under DeepSpeed, whose engine takes the "
                "optimizer step itself; use --on-nonfinite stop (fp16 runs: DeepSpeed's loss "
                "scaler already skips overflowing steps)"
            )
