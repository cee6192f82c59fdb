"""The speed switches the originals' trainers turn on, one flag each, declared with the other
shared settings (accel_common.recipe_cli.options) and applied here: `--matmul-precision` (TF32 or
bf16 matrix products and convolutions), `--fused-optimizer` (torch's fused optimizer kernels) and
`--ddp-static-graph` (DistributedDataParallel's static_graph).

Only the first changes the numbers a run computes (TF32 keeps 10 bits of mantissa), so it is
part of the run's identity; a fused kernel and a static graph compute the same update as the
default ones, to the last bits (as --compile), and may change on a resume.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any

import torch
from accelerate.utils import DistributedDataParallelKwargs, KwargsHandler

from accel_common.errors import ConfigError
from accel_common.settings import single_line


class MatmulPrecision(str, Enum):
    highest = "highest"
    high = "high"
    medium = "medium"


MATMUL_PRECISION_HELP = (
    "Precision of float32 matrix products and convolutions (torch.set_float32_matmul_precision, "
    "with cuDNN's TF32 switch set alike): highest = full fp32 everywhere; high = TF32 on GPUs "
    "that have it (Ampere and later: several times faster, 10 bits of mantissa); medium = bf16 "
    "where supported. Default: torch's own (fp32 matrix products, TF32 cuDNN convolutions). "
    "Changes the numbers, so part of the run's identity."
)
FUSED_OPTIMIZER_HELP = (
    "torch's fused optimizer kernel (Adam, AdamW, SGD: fused=True, one kernel for all the "
    "weights, on GPUs and the CPU) instead of the per-tensor-list one: the same update, but "
    "for the last bits. An optimizer or device with no fused kernel is refused, naming it."
)
DDP_STATIC_GRAPH_HELP = (
    "DistributedDataParallel's static_graph: the model uses the same parameters every step, so "
    "DDP learns the gradient order once and overlaps the all-reduce better (and supports "
    "reentrant activation checkpointing). Multi-process data-parallel launches without "
    "gradient accumulation only: refused on one process, under FSDP or DeepSpeed (no DDP "
    "wrapper) and with accumulation (torch's static graph breaks in no_sync)."
)


def set_matmul_precision(precision: str | None) -> None:
    """torch's float32 matmul precision, and cuDNN's TF32 switch to match (None: leave torch's
    defaults). Only the legacy switches: torch 2.9+ refuses a mix of them with the newer
    per-backend `fp32_precision` ones, and the matmul precision sets cuBLAS's allow_tf32 itself."""
    if precision is None:
        return
    torch.set_float32_matmul_precision(precision)
    torch.backends.cudnn.allow_tf32 = precision != MatmulPrecision.highest


def precision_line(precision: str | None) -> str:
    """The banner's and --dry-run's words for --matmul-precision."""
    if precision is None:
        return "torch's default (fp32 matrix products, TF32 cuDNN convolutions)"
    words = {
        "highest": "fp32 matrix products and convolutions",
        "high": "TF32 matrix products and convolutions where the GPU has TF32",
        "medium": "bf16 matrix products where supported, TF32 convolutions",
    }
    return f"{precision} ({words[str(precision)]}, --matmul-precision)"


def make_optimizer(
    optimizer_class: type[torch.optim.Optimizer],
    params: Iterable[Any],
    fused: bool,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """`optimizer_class(params, **kwargs)`, with torch's fused kernel if `fused`. Without it no
    `fused` argument is passed, so the optimizer is exactly what the recipe built before.

    A fused kernel that torch lacks is refused, not replaced by the default one: who asks for it
    measures its speed, and a silent fallback would measure something else."""
    if not fused:
        return optimizer_class(params, **kwargs)
    name = optimizer_class.__name__
    if "fused" not in inspect.signature(optimizer_class.__init__).parameters:
        raise ConfigError(
            f"--fused-optimizer: torch {torch.__version__} has no fused {name}; drop "
            "--fused-optimizer"
        )
    try:
        return optimizer_class(params, fused=True, **kwargs)
    except (RuntimeError, ValueError) as err:
        if "fused" not in str(err):
            raise
        raise ConfigError(
            f"--fused-optimizer: torch {torch.__version__} refuses a fused {name} here "
            f"({single_line(err)}); drop --fused-optimizer"
        ) from None


def with_static_graph(handlers: list[KwargsHandler]) -> list[KwargsHandler]:
    """`handlers` with DDP's static_graph on: in the recipe's own DistributedDataParallelKwargs
    (its find_unused_parameters, broadcast_buffers kept), else in a new one (Accelerate takes
    one handler of each kind)."""
    ddp = next((h for h in handlers if isinstance(h, DistributedDataParallelKwargs)), None)
    rest = [h for h in handlers if h is not ddp]
    return [*rest, dataclasses.replace(ddp or DistributedDataParallelKwargs(), static_graph=True)]


def require_ddp(distributed_type: str, grad_accum_steps: int) -> None:
    """Refuse --ddp-static-graph where the launch (Accelerate's `distributed_type`) does not
    wrap the model in DistributedDataParallel, where the flag would do nothing, and with
    gradient accumulation: torch's static graph fails an internal assert on the first backward
    in no_sync (pytorch#143580, accelerate#3679; measured here with torch 2.14 on 2 gloo
    processes), and its fix (pytorch#187732, not merged) found that merely passing the assert
    leaves DDP skipping the all-reduce from the second step on."""
    if distributed_type == "NO":
        raise ConfigError(
            "--ddp-static-graph: one process has no DistributedDataParallel to configure; drop "
            "it, or launch 2 or more processes (accelerate launch --num_processes N)"
        )
    if not distributed_type.startswith("MULTI_"):
        raise ConfigError(
            f"--ddp-static-graph: this launch runs as {distributed_type}, which wraps the model "
            "its own way, with no DistributedDataParallel to configure; drop --ddp-static-graph"
        )
    if grad_accum_steps > 1:
        raise ConfigError(
            f"--ddp-static-graph with {grad_accum_steps} accumulation steps (--grad-accum, or "
            "--max-per-device-bs's split): torch's DDP static graph breaks under accumulation's "
            "no_sync (pytorch#143580); drop --ddp-static-graph or accumulate no more than 1"
        )


def speed_lines(values: Mapping[str, Any]) -> dict[str, str]:
    """The banner's and --dry-run's rows for the three switches, from a run's settings."""
    return {
        "matmul precision": precision_line(values.get("matmul_precision")),
        "fused optimizer": "yes (--fused-optimizer)" if values.get("fused_optimizer") else "no",
        "DDP static graph": "yes (--ddp-static-graph)" if values.get("ddp_static_graph") else "no",
    }
