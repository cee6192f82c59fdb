"""How long each process waits in the gradient all-reduce: the benchmark's view of imbalance.

A synchronised step ends with DDP's all-reduce of the gradients, which finishes only when every
process has sent its gradients. A process whose backward pass ends early waits there for the
slowest; the slowest waits only for the communication itself. `SyncWaitTimer` measures, on this
process, the time from its last gradient being ready (DDP launches the last bucket's all-reduce
right then) to the end of `backward()`, which returns only once DDP has waited for every
bucket's all-reduce. Across processes, the smallest of these is the communication, and the
largest minus the smallest is the waiting for the slowest process (imbalance, or a busy core).

Only Python hooks on the parameters are used, which run in the thread that calls `backward()`:
DDP keeps its own C++ all-reduce, and no Python code runs on gloo's threads (as it would in a
timed communication hook, whose callbacks complete there).

The times are host clock times, exact for gloo on CPUs; on GPUs (nccl) `backward()` returns
when the all-reduce is queued, not when the GPU finishes it, so they are not measured there.
Timing adds no collective to a step; `TrainLoop` gathers the means over processes on logging
steps only, and only when the environment variable ACCEL_RECIPES_TIME_SYNC is 1 (set by
`accel-recipes bench`).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

ENV = "ACCEL_RECIPES_TIME_SYNC"


def timing_requested() -> bool:
    """Whether this run should time its all-reduce waits (the benchmark asks for it)."""
    return os.environ.get(ENV) == "1"


class SyncWaitTimer:
    """Times each step's wait in the gradient all-reduce (module docstring). `attach(model)`
    once, `backward_done()` right after each `backward()`, `take_step()` after each
    synchronised step; `take_mean_ms()` reads the mean."""

    def __init__(self) -> None:
        self._last_ready: float | None = None  # when this process's last gradient was ready
        self._backward_done: float | None = None
        self.waits: list[float] = []  # seconds, one per synchronised step since the last read
        self.tried = self.attached = False

    def attach(self, model: torch.nn.Module) -> None:
        """Time `model`'s all-reduces if it is a DDP model on a CPU (gloo) process group (the
        same answer on every process); a second call does nothing."""
        if self.tried:
            return
        self.tried = True
        if isinstance(model, DistributedDataParallel) and dist.get_backend() == "gloo":
            for parameter in model.parameters():
                if parameter.requires_grad:
                    parameter.register_post_accumulate_grad_hook(self._gradient_ready)
            self.attached = True

    def _gradient_ready(self, _parameter: torch.Tensor) -> None:
        self._last_ready = time.perf_counter()

    def backward_done(self) -> None:
        """Right after `backward()` returns (DDP has waited for its all-reduces by then)."""
        if self.attached:
            self._backward_done = time.perf_counter()

    def take_step(self) -> None:
        """After a synchronised step: record its wait (nothing if none was timed)."""
        if self._last_ready is not None and self._backward_done is not None:
            self.waits.append(max(0.0, self._backward_done - self._last_ready))
        self._last_ready = self._backward_done = None

    def take_mean_ms(self) -> float:
        """The mean wait per step in milliseconds since the last call (0 if none), then reset."""
        waits, self.waits = self.waits, []
        return 1000 * sum(waits) / len(waits) if waits else 0.0
