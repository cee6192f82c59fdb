"""Training steps: one workload at one precision, eager or compiled (`torch.compile` through
Accelerate's dynamo setting), on the recipe's network or, for pointcloud, on the original's
(pcdiff's PVCNN2 on its own CUDA kernels) or on the recipe's plain-PyTorch point ops.

Each step trains through Accelerate as the recipes do (autocast, fp16's loss scaler, AdamW):
WARMUP untimed steps (a compiled model compiles in the first), then STEPS timed between CUDA
synchronisations. FLOPs come from torch's FLOP counter on one more step, run eagerly
(compilation changes the time, not the arithmetic), as the training loop counts them
(accel_common.monitoring.throughput)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from accel_common.monitoring.throughput import eager_flop_counter, synchronize
from benchmarks.original_sizes import Workload, preset

GIB = 2**30
PRECISIONS = ("no", "bf16", "fp16")
# the recipe's network on its default point ops (Triton on CUDA), on plain PyTorch, the original's
RECIPE, TORCH_OPS, ORIGINAL = "recipe", "recipe, PyTorch ops", "original"
COMPILED = ("pointcloud", "captioning", "crystal")  # the workloads measured compiled too
# under --smoke only captioning compiles (5 s per precision on 2 CPU cores with SMOKE_BACKEND;
# crystal's would add 50 s, and pointcloud's plain-PyTorch ops are not compiled at all)
SMOKE_COMPILED = "captioning"
# the compiler: Inductor (Triton on CUDA); under --smoke dynamo and AOT autograd without code
# generation, the same path through Accelerate and dynamo in seconds instead of minutes on a CPU
BACKEND, SMOKE_BACKEND = "inductor", "aot_eager"


def precision_name(precision: str) -> str:
    return "fp32" if precision == "no" else precision


class Skipped(Exception):
    """A step this run cannot measure, and why (no pcdiff, no CUDA, the time budget)."""


@dataclass(frozen=True)
class Step:
    """One measurement: which network, at which precision, compiled or not."""

    workload: str
    precision: str
    compiled: bool = False
    variant: str = RECIPE

    @property
    def label(self) -> str:
        mode = "compiled" if self.compiled else "eager"
        variant = "" if self.variant == RECIPE else f" ({self.variant})"
        return f"{self.workload}{variant} {precision_name(self.precision)} {mode}"


def plan(names: list[str], smoke: bool) -> tuple[list[Step], list[Step]]:
    """The steps to measure, in two lists: those the issue's targets read (run first, so that a
    time budget cuts the others), then the rest. Every workload eager at every precision; the
    workloads of COMPILED compiled in fp32 and bf16 (under `smoke`, SMOKE_COMPILED's only);
    pointcloud also on plain-PyTorch ops (fp32) and as the original (fp32, bf16, both modes)."""
    steps = [Step(name, p) for name in names for p in PRECISIONS]
    for name in names:
        for p in ("no", "bf16"):
            if name in COMPILED and (not smoke or name == SMOKE_COMPILED):
                steps.append(Step(name, p, compiled=True))
            if name == "pointcloud":
                steps += [Step(name, p, variant=ORIGINAL)]
                steps += [] if smoke else [Step(name, p, compiled=True, variant=ORIGINAL)]
        if name == "pointcloud":
            steps.append(Step(name, "no", variant=TORCH_OPS))
    first = {Step("pointcloud", p, variant=v) for p in ("no", "bf16") for v in (RECIPE, ORIGINAL)}
    first |= {Step("captioning", p, compiled=c) for p in ("no", "bf16") for c in (False, True)}
    return [s for s in steps if s in first], [s for s in steps if s not in first]


@contextmanager
def point_kernels(choice: str) -> Iterator[None]:
    """POINTCLOUD_KERNELS=choice while inside (recipes/pointcloud/backend.py reads it per call)."""
    before = os.environ.get("POINTCLOUD_KERNELS")
    os.environ["POINTCLOUD_KERNELS"] = choice
    try:
        yield
    finally:
        if before is None:
            del os.environ["POINTCLOUD_KERNELS"]
        else:
            os.environ["POINTCLOUD_KERNELS"] = before


def original_pointcloud(workload: Workload, smoke: bool) -> Workload:
    """The pointcloud workload on pcdiff's own PVCNN2 at the same sizes (tests/reference's
    builder; pcdiff's kernels must be loaded first: load_pcdiff)."""
    from tests.reference.pointcloud_kernels import original_pvcnn2

    _, _, s = preset("pointcloud", smoke)
    config = dict(num_points=s.num_points, num_nn=s.num_nn, width_multiplier=s.width_mult,
                  voxel_resolution_multiplier=s.vox_res_mult, radius_multiplier=s.radius_mult,
                  num_neighbors=s.num_neighbors, embed_dim=s.embed_dim, use_att=s.attention,
                  dropout=s.dropout)  # fmt: skip
    return replace(workload, build=lambda: original_pvcnn2(config))


def run(
    step: Step, workload: Workload, pcdiff: str, smoke: bool, steps: int, warmup: int
) -> dict[str, float | None]:
    """`step` measured: on pcdiff's network if it is the original's (`pcdiff`: why its
    kernels are not loaded, empty if they are), on the point ops its variant names. Raises
    Skipped where it cannot run here."""
    from recipes.pointcloud.backend import use_triton

    choice = os.environ.get("POINTCLOUD_KERNELS", "auto")
    if step.variant == ORIGINAL:
        if pcdiff:
            raise Skipped(pcdiff)
        workload = original_pointcloud(workload, smoke)
    elif step.variant == TORCH_OPS:
        choice = "torch"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with point_kernels(choice):
        plain = not use_triton(torch.empty(0, device=device))
        if step.compiled and step.workload == "pointcloud" and step.variant != ORIGINAL and plain:
            raise Skipped("plain-PyTorch point ops: dynamo would unroll farthest-point sampling")
        return measure(workload, step, steps, warmup, SMOKE_BACKEND if smoke else BACKEND)


def measure(
    workload: Workload, step: Step, steps: int, warmup: int, backend: str = BACKEND
) -> dict[str, Any]:
    """One step measurement: samples/s, ms/step, peak GiB (CUDA only), TFLOP/s, the seconds of
    the warm-up steps (a compiled model's compile among them), the last loss, fp16's skipped
    steps, the compiler (`backend`, "no" uncompiled). Raises if the loss or the rate is not
    finite."""
    AcceleratorState._reset_state(reset_partial_state=True)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()  # the previous measurement's tensors are gone; so is its cache
    if step.compiled:
        # a fresh cache: the same forward's guards from earlier models would count towards
        # dynamo's recompile limit, past which it runs eager without saying so
        torch._dynamo.reset()
        warmup = max(warmup, 1)
    backend = backend if step.compiled else "no"
    accelerator = Accelerator(mixed_precision=step.precision, dynamo_backend=backend)
    torch.manual_seed(0)
    with torch.device(accelerator.device):
        model = workload.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = workload.batch(workload.per_gpu_batch, accelerator.device)
    skipped = 0

    def train_step(network: torch.nn.Module) -> torch.Tensor:
        nonlocal skipped
        loss = workload.loss(network, batch)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        skipped += int(accelerator.optimizer_step_was_skipped)
        return loss.detach()

    start = time.perf_counter()
    for _ in range(warmup):
        train_step(model)
    synchronize()
    warmup_s = time.perf_counter() - start
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        loss = train_step(model)
    synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / GIB if cuda else None
    with ExitStack() as stack:
        counter = eager_flop_counter(stack)
        train_step(model)
    flops = counter.total
    result = {
        "samples_per_s": workload.per_gpu_batch * steps / seconds,
        "ms_per_step": 1e3 * seconds / steps,
        "warmup_s": warmup_s,
        "peak_gib": peak,
        "tflops": flops * steps / seconds / 1e12,
        "gflop_per_sample": flops / workload.per_gpu_batch / 1e9,
        "loss": loss.float().item(),
        "skipped_steps": skipped,
        "compiler": backend,
    }
    if not all(math.isfinite(result[key]) for key in ("samples_per_s", "loss")):
        raise FloatingPointError(f"not finite: {result}")
    return result
