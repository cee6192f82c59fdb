"""The machine and its launch environment: versions, visible devices, hidden GPUs and launcher
variables left over in the shell."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import accelerate
import torch
import torch.distributed as dist

from accel_common.tools.doctor.base import Problem

ENV_SHOWN = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "CUDA_VISIBLE_DEVICES",
    "NCCL_SOCKET_IFNAME",
    "NCCL_DEBUG",
    "NCCL_IB_DISABLE",
    "NCCL_P2P_DISABLE",
    "GLOO_SOCKET_IFNAME",
    "OMP_NUM_THREADS",
)


ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "TORCH_DISTRIBUTED_", "ACCELERATE_")


def versions(gpus: int) -> dict[str, str]:
    """Versions that decide which launches can work; NCCL counts only with a GPU to run on."""
    if not dist.is_nccl_available():
        nccl = "not available (torch built without NCCL)"
    else:
        shipped = ".".join(map(str, torch.cuda.nccl.version()))
        nccl = shipped if gpus else f"not available: no GPU visible (torch ships NCCL {shipped})"
    backends = [
        name
        for name, ok in (
            ("gloo", dist.is_gloo_available()),
            ("nccl", dist.is_nccl_available()),
            ("mpi", dist.is_mpi_available()),
        )
        if ok
    ]
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "cuda": torch.version.cuda or "not built (CPU-only torch)",
        "nccl": nccl,
        "distributed backends": ", ".join(backends) or "none",
    }


def devices() -> dict[str, Any]:
    """Visible accelerators: CUDA GPUs with name and memory, MPS, and CPU cores."""
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append(
            {"index": index, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1)}
        )
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cuda": gpus,
        "mps": torch.backends.mps.is_available(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": usable,
    }


def physical_nvidia_gpus() -> int | None:
    """GPUs the NVIDIA driver knows whatever CUDA_VISIBLE_DEVICES says (Linux; None elsewhere)."""
    root = Path("/proc/driver/nvidia/gpus")
    return len(list(root.iterdir())) if root.is_dir() else None


def environment(env: dict[str, str]) -> dict[str, str | None]:
    """The launch-relevant variables (None = unset), plus any set NCCL_/GLOO_/ACCELERATE_ ones."""
    shown: dict[str, str | None] = {name: env.get(name) for name in ENV_SHOWN}
    shown.update({k: v for k, v in sorted(env.items()) if k.startswith(ENV_PREFIXES)})
    return shown


def check_environment(
    env: dict[str, str], gpus: int, physical: int | None, config_given: bool
) -> list[Problem]:
    """Hidden GPUs, and launcher variables left over in the shell."""
    problems = []
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and (visible.strip() in ("", "-1") or (physical or 0) > gpus):
        seen = f"shows {gpus} of this machine's {physical} GPUs" if physical else "hides every GPU"
        problems.append(
            Problem(
                "warning",
                f"CUDA_VISIBLE_DEVICES={visible!r} {seen}",
                "unset it to use them all: accelerate launch / torchrun give each process its "
                "own GPU, nothing needs to be hidden per process",
            )
        )
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"):
        value = env.get(name)
        if value is not None and not value.strip().isdigit():
            problems.append(
                Problem("blocker", f"{name}={value!r} is not a number", f"fix or unset {name}")
            )
    world = env.get("WORLD_SIZE", "")
    if not config_given and world.isdigit() and int(world) > 1:
        problems.append(
            Problem(
                "warning",
                f"WORLD_SIZE={world} is set in this shell",
                "launchers set it for each process they start; left over in a shell it makes a "
                f"plain `python recipe.py` wait for {int(world) - 1} peers that never come: "
                "`unset WORLD_SIZE RANK LOCAL_RANK` unless a launcher set it",
            )
        )
    return problems
