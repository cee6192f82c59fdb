"""How well a run uses its device: the FLOPs of a training step, the TFLOP/s it achieves, and
MFU, the fraction of the device's peak (as litgpt, torchtitan and Lightning's ThroughputMonitor
report it).

The FLOPs come from torch's FLOP formulas (torch.utils.flop_counter) on the run's first optimizer
step (every micro-batch of its accumulation window up to `loop.clip_gradients`, or to its end:
forward, backward, whatever else the recipe computes; matrix products, convolutions and attention,
the ops that dominate, not elementwise ones or the optimizer's), counted by `FlopCount`, which runs
every op as it is: the counted step is bit for bit the uncounted one. Checkpoints keep the count: a
resumed run does not count again. The step runs eagerly while it is counted
(`torch.compiler.set_stance("force_eager")`): a compiled module's kernels would hide their
arithmetic from the counter, which compilation does not change. Each process counts its own micro-
batches; one all-reduce sums them, so a step's FLOPs are the whole job's. Activation
checkpointing's recomputation is counted too (hardware FLOPs, slightly above the model FLOPs of the
papers' MFU).

The achieved rate per device is the step's FLOPs / processes x optimizer steps per second over
each logging window (the window of `train/samples_per_s`); MFU divides it by the device's dense
peak at the run's precision: a known device's from PEAK_TFLOPS, an unknown GPU's from a matrix
product measured at that precision once (`matmul_peak`). The CPU has no peak to divide by: its
runs log the FLOPs and TFLOP/s, not MFU.
"""

from __future__ import annotations

import re
import time
from contextlib import ExitStack

import torch
from accelerate import Accelerator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

# dense (no sparsity) tensor-core peaks in TFLOP/s from NVIDIA's data sheets, by the run's
# matrix-product precision; the first pattern matching torch.cuda.get_device_name() wins
PEAK_TFLOPS: tuple[tuple[str, str, dict[str, float]], ...] = (
    (r"h100.*nvl", "H100 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"h100.*pcie", "H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    (r"h100", "H100 SXM", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"h200.*nvl", "H200 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"h200", "H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"a100", "A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"l40s", "L40S", {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    (r"\bl4\b", "L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\ba10\b", "A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"\bt4\b", "T4", {"fp16": 65.0, "fp32": 8.1}),
    (r"v100.*pcie", "V100 PCIe", {"fp16": 112.0, "fp32": 14.0}),
    (r"v100", "V100 SXM", {"fp16": 125.0, "fp32": 15.7}),
)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32}
DTYPES["fp32"] = torch.float32


def matmul_precision(mixed_precision: str) -> str:
    """The precision a run's matrix products use: its autocast dtype, else TF32 where torch
    allows it for fp32 products (`torch.set_float32_matmul_precision`), else fp32."""
    if mixed_precision in ("bf16", "fp16", "fp8"):
        return mixed_precision
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def known_peak(device_name: str, precision: str) -> tuple[str, float | None] | None:
    """(the table's name for the device, its dense peak TFLOP/s at `precision`, None if it has
    none there), or None for a device not in PEAK_TFLOPS."""
    for pattern, name, peaks in PEAK_TFLOPS:
        if re.search(pattern, device_name.lower()):
            return name, peaks.get(precision)
    return None


def mfu(tflops_per_device: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: the achieved share of the device's peak (0 to 1)."""
    return tflops_per_device / peak_tflops


def synchronize() -> None:
    """Wait for the GPU's queued work, so that a clock read after it counts it (no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def matmul_peak(size: int = 8192, repeats: int = 20, dtype: torch.dtype = torch.bfloat16) -> float:
    """TFLOP/s of a size^3 matrix product in `dtype`: what this device's matrix units reach in
    practice (benchmarks/bench_gpu.py's yardstick, and MFU's peak on a GPU not in the table)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize()
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12


class FlopCount(TorchDispatchMode):
    """The FLOPs of the ops that run inside it (`total`), by torch's own formulas, each op run as
    it is. torch's FlopCounterMode runs an op it has no formula for as its decomposition (SiLU's
    backward, as elementwise ops), which rounds otherwise: a step it counted was not the step the
    run would have taken, and a resumed run that counted again was no longer bit-equal."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out


def eager_flop_counter(stack: ExitStack) -> FlopCount:
    """Enter, on `stack`, a FLOP counter and eager execution of compiled modules (a compiled
    module's kernels would hide their arithmetic from the counter); returns the counter."""
    counter = stack.enter_context(FlopCount())
    stack.enter_context(torch.compiler.set_stance("force_eager"))
    return counter


def device_peak(accelerator: Accelerator) -> tuple[float | None, str]:
    """The peak TFLOP/s MFU divides by on this process's device, and the line that says where
    it comes from, or why there is none."""
    if accelerator.device.type != "cuda":
        where = "the CPU" if accelerator.device.type == "cpu" else accelerator.device.type
        return None, (
            f"MFU is not logged on {where}: it has no known peak FLOP/s to "
            "divide by (the step's FLOPs and train/tflops_per_device are logged)"
        )
    name = torch.cuda.get_device_name(accelerator.device)
    precision = matmul_precision(accelerator.mixed_precision)
    known = known_peak(name, precision)
    if known is not None and known[1] is not None:
        return known[1], f"MFU against the {known[0]}'s dense {precision} peak, {known[1]} TFLOP/s"
    if known is not None or precision not in DTYPES:
        return None, f"MFU is not logged: no {precision} peak is known for {name}"
    peak = matmul_peak(4096, 10, DTYPES[precision])
    return peak, (
        f"MFU against a {precision} matrix product measured on this {name} ({peak:.0f} TFLOP/s): "
        "the device is not in accel_common/monitoring/throughput.py's PEAK_TFLOPS"
    )


class StepFlops:
    """The FLOPs of one optimizer step over every process, counted on the run's first:
    `begin` before each of its micro-batches, `pause` after the backward (the optimizer's
    arithmetic is not the model's, and its many small ops would only slow the count down) or
    after the micro-batch, `step_done` after the optimizer step. Later steps cost two attribute
    reads."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self.per_step: float | None = None  # all processes', once counted
        self._count = True  # False once counted, or restored from a checkpoint
        self._counted: int | None = None  # this process's, while counting
        self._counting: tuple[ExitStack, FlopCount] | None = None

    def begin(self) -> None:
        """Count what runs from here to `pause` (the recipe's body for one micro-batch)."""
        if self._count and self._counting is None:
            stack = ExitStack()
            self._counting = stack, eager_flop_counter(stack)

    def pause(self) -> None:
        """Stop counting until the next `begin`, keeping the count."""
        if self._counting is not None:
            stack, counter = self._counting
            stack.close()
            self._counted = (self._counted or 0) + counter.total
            self._counting = None

    def step_done(self) -> None:
        """After the counted optimizer step: sum every process's count (collective: every
        process's first step ends at the same step)."""
        self.pause()
        if self._count and self._counted is not None:
            mine = torch.tensor([float(self._counted)], device=self.accelerator.device)
            self.per_step = self.accelerator.reduce(mine, reduction="sum").item()
            self._count = False

    def restore(self, per_step: float | None) -> None:
        """A resumed run's count, from its checkpoint (the same count, without counting again).
        None: a checkpoint from before counts were kept; this launch logs no TFLOP/s."""
        self.per_step, self._count = per_step, False
