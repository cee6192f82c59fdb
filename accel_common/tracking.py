"""Experiment tracking on the main process only, never blocking on the network.

Accelerate creates trackers in `init_trackers` on the main process alone, so a job is one wandb
run, not one per rank. Every run also writes `OUTPUT/logs/metrics.jsonl` (one JSON object per log
call), which needs no service and is what the tests read. Without wandb credentials, wandb runs
offline (`wandb sync` uploads it later) instead of waiting on a login prompt or the network.
"""

from __future__ import annotations

import json
import netrc
import os
import time
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.tracking import GeneralTracker

METRICS_FILE = "metrics.jsonl"


class ReportTo(str, Enum):
    none = "none"
    wandb = "wandb"
    tensorboard = "tensorboard"
    all = "all"


class JSONLTracker(GeneralTracker):
    """Appends `{"step": ..., **values}` lines to `<logging_dir>/metrics.jsonl`."""

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, logging_dir: Path) -> None:
        super().__init__()
        self.path = Path(logging_dir) / METRICS_FILE
        self._file = None

    def start(self) -> None:  # called by init_trackers, on the main process only
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)

    @property
    def tracker(self) -> Any:
        return self._file

    def store_init_configuration(self, values: dict) -> None:
        self.log({"config": values}, step=None)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        record = {"step": step, "time": round(time.time(), 3), **values}
        self._file.write(json.dumps(record, default=str) + "\n")

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()


def has_wandb_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def trackers_for(report_to: ReportTo, output_dir: Path) -> list[Any]:
    """The `log_with` list for `Accelerator`: the JSONL log plus what `--report-to` asks for."""
    chosen: list[Any] = [JSONLTracker(Path(output_dir) / "logs")]
    report_to = ReportTo(report_to)
    if report_to in (ReportTo.wandb, ReportTo.all):
        chosen.append("wandb")
    if report_to in (ReportTo.tensorboard, ReportTo.all):
        chosen.append("tensorboard")
    return chosen


def start_tracking(
    accelerator: Accelerator,
    *,
    project: str,
    run_name: str | None,
    output_dir: Path,
    config: dict[str, Any],
) -> None:
    """Initialise trackers (main process only, inside Accelerate) with the run's config."""
    wandb_wanted = any(str(t) == "wandb" for t in accelerator.log_with)
    if wandb_wanted and accelerator.is_main_process:
        os.environ.setdefault("WANDB_DIR", str(output_dir))
        if "WANDB_MODE" not in os.environ and not has_wandb_credentials():
            os.environ["WANDB_MODE"] = "offline"
            accelerator.print(
                "wandb: no credentials found, logging offline; upload later with `wandb sync`"
            )
    flat = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in config.items()}
    accelerator.init_trackers(
        project_name=project,
        config=flat,
        init_kwargs={"wandb": {"name": run_name, "dir": str(output_dir)}},
    )


class RunningMean:
    """Sums a per-step scalar on the device; reading it costs one all-reduce and one host sync.

    Calling `.item()` every step would stall the GPU queue; the loop calls `add` each step and
    `compute` only at logging intervals, on every process (the reduction is collective).
    """

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.count = 0

    def add(self, value: torch.Tensor) -> None:
        value = value.detach().float()
        self.total = value if self.total is None else self.total + value
        self.count += 1

    def compute(self, accelerator: Accelerator, reset: bool = True) -> float:
        if self.total is None:
            return float("nan")
        mean = accelerator.reduce(self.total / self.count, reduction="mean").item()
        if reset:
            self.total, self.count = None, 0
        return mean


class Throughput:
    """Samples per second between two reads, from wall time and the global batch."""

    def __init__(self) -> None:
        self.last_time = time.perf_counter()
        self.samples = 0

    def add(self, samples: int) -> None:
        self.samples += samples

    def read(self) -> float:
        now = time.perf_counter()
        rate = self.samples / max(now - self.last_time, 1e-9)
        self.last_time, self.samples = now, 0
        return rate
