"""Which implementation of the point ops runs: Triton kernels on CUDA tensors, plain PyTorch
elsewhere. The plain-PyTorch ops launch many small kernels per call on a GPU (farthest-point
sampling: several per centre), which is where the recipe lost to pcdiff's CUDA kernels.

`POINTCLOUD_KERNELS` overrides the choice: `torch` forces plain PyTorch (to compare on a GPU),
`triton` forces the Triton kernels on any device; with `TRITON_INTERPRET=1` they then run on the
CPU, which is how the CPU suite tests them against the brute-force references."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from accel_common import ConfigError

CHOICES = ("auto", "torch", "triton")


# looked up once at import (a cached function in the ops' path would be a Dynamo warning)
TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def kernels_choice() -> str:
    """The `POINTCLOUD_KERNELS` setting; an unknown value stops with one line."""
    choice = os.environ.get("POINTCLOUD_KERNELS", "auto")
    if choice not in CHOICES:
        raise ConfigError(f"POINTCLOUD_KERNELS={choice!r}: use one of {', '.join(CHOICES)}")
    if choice == "triton" and not TRITON_AVAILABLE:
        raise ConfigError(
            "POINTCLOUD_KERNELS=triton, but triton is not installed: `pip install triton`, or "
            f"use one of {', '.join(c for c in CHOICES if c != 'triton')}"
        )
    return choice


def require_usable_kernels(cuda: bool) -> None:
    """Refuse, before any work (in a dry run too), a `POINTCLOUD_KERNELS` the ops would fail on
    later: an unknown value, or `triton` where the tensors are not on a CUDA GPU (`cuda`) and
    Triton's interpreter is off, which Triton reports deep in the first op as "0 active
    drivers"."""
    if kernels_choice() != "triton" or cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return
    raise ConfigError(
        "POINTCLOUD_KERNELS=triton runs the Triton kernels, which need a CUDA GPU, and none is "
        "used here: unset it (auto picks them on a GPU) or set it to torch; TRITON_INTERPRET=1 "
        "runs them (slowly) in Triton's interpreter on the CPU"
    )


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether an op on `tensor` runs the Triton kernels."""
    choice = kernels_choice()
    if choice == "auto":
        return tensor.is_cuda and TRITON_AVAILABLE
    return choice == "triton"


def launchable(kernel: Any) -> Any:
    """`torch.library.wrap_triton(kernel)`, so that torch.compile traces the launch; under
    Triton's interpreter (`TRITON_INTERPRET=1`, the CPU tests) torch 2.11 refuses interpreted
    kernels there, and the kernel itself runs (eagerly: the interpreter compiles nothing)."""
    try:
        return torch.library.wrap_triton(kernel)
    except RuntimeError:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise
        return kernel
