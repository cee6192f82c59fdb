"""How long each process waits in the gradient all-reduce: the benchmark's view of imbalance.

A synchronised step ends with DDP's all-reduce of the gradients, which finishes only when every
process has sent its gradients. A process whose backward pass ends early waits there for the
slowest; the slowest waits only for the communication itself. `SyncWaitTimer` is a DDP
communication hook (the default all-reduce, timed): per step it measures, on this process, the
time from the launch of the step's last gradient bucket (the end of its backward pass, as far as
the all-reduce is concerned) to the completion of the step's all-reduces. Across processes, the
smallest of these is the communication, and the largest minus the smallest is the waiting for
the slowest process (imbalance, or a busy core).

The times are host clock times, exact for gloo on CPUs; on GPUs (nccl) a hook runs when the
all-reduce is queued, not when the GPU reaches it, so they are not measured there. Timing adds
no collective to a step; `TrainLoop` gathers the means over processes on logging steps only, and
only when the environment variable ACCEL_RECIPES_TIME_SYNC is 1 (set by `accel-recipes bench`).
"""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

ENV = "ACCEL_RECIPES_TIME_SYNC"


def timing_requested() -> bool:
    """Whether this run should time its all-reduce waits (the benchmark asks for it)."""
    return os.environ.get(ENV) == "1"


class SyncWaitTimer:
    """The DDP communication hook that times each step's gradient all-reduce (module
    docstring). Register with `attach(model)`; call `take_step()` after each step and read the
    mean with `take_mean_ms()`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # completions are recorded on the communication thread
        self._launched: list[float] = []
        self._finished: list[float] = []
        self.waits: list[float] = []  # seconds, one per synchronised step since the last read
        self.tried = self.attached = False

    def attach(self, model: torch.nn.Module) -> None:
        """Time `model`'s all-reduces if it is a DDP model on a CPU (gloo) process group (the
        same answer on every process); a second call does nothing."""
        if self.tried:
            return
        self.tried = True
        if isinstance(model, DistributedDataParallel) and dist.get_backend() == "gloo":
            model.register_comm_hook(self, _timed_allreduce)
            self.attached = True

    def launched(self) -> None:
        with self._lock:
            self._launched.append(time.perf_counter())

    def finished(self) -> None:
        with self._lock:
            self._finished.append(time.perf_counter())

    def take_step(self) -> None:
        """After a synchronised step: record its wait (nothing if no all-reduce ran)."""
        with self._lock:
            if self._launched and self._finished:
                self.waits.append(max(self._finished) - max(self._launched))
            self._launched.clear()
            self._finished.clear()

    def take_mean_ms(self) -> float:
        """The mean wait per step in milliseconds since the last call (0 if none), then reset."""
        waits, self.waits = self.waits, []
        return 1000 * sum(waits) / len(waits) if waits else 0.0


def _timed_allreduce(timer: SyncWaitTimer, bucket):
    """DDP's default all-reduce of one bucket (the mean over processes), timed. (No annotations
    on `bucket` and the result: DDP refuses a hook whose annotations are not its own classes,
    and here they would be strings.)"""
    timer.launched()
    future = default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    def done(reduced: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        timer.finished()
        return reduced.value()

    return future.then(done)
