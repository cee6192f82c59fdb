"""The doctor's shared vocabulary: what it is asked to check, and the form of a finding."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from accel_common.batch_lr.batching import BatchRequest


class Backend(str, Enum):
    """`auto` is nccl when there are GPUs, else gloo (what Accelerate itself picks)."""

    auto = "auto"
    gloo = "gloo"
    nccl = "nccl"


@dataclass(frozen=True)
class Problem:
    """One finding: a `blocker` makes the launch fail (non-zero exit), a `warning` may."""

    severity: str
    message: str
    advice: str


@dataclass(frozen=True)
class DoctorOptions:
    """What to check; None means "derive it" (from the config, the environment, the devices)."""

    port: int | None = None
    addr: str | None = None
    config_file: Path | None = None
    # --bs / --per-device-bs (default: 32 per device)
    batch: BatchRequest = field(default_factory=BatchRequest)
    check_comm: bool = False
    backend: Backend = Backend.auto
    nproc: int | None = None
    sizes_mb: tuple[float, ...] = (1.0, 16.0, 64.0)
    iters: int = 10
    dist_timeout: float = 60.0
