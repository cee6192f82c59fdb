"""`--dry-run`: the plan of a run, printed without starting it.

A user checks an 8-GPU or 2-node command on a laptop: the settings are resolved as the run
would resolve them (flags, `--config`, the recipe's defaults), the batch plan is made for the
launch's process count (or `--processes N`), the network is built on the `meta` device (no
memory), sized by the data where the run sizes it so (cricket's vocabulary, quality's
annotators: read as the run reads them, its preprocessing cache kept), and nothing is trained or
written to --output-dir.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from accel_common.batch_lr.batching import BatchRequest
from accel_common.batch_lr.lr import LRSettings
from accel_common.batch_lr.memory import MEMORY_DIR
from accel_common.errors import DataError
from accel_common.hardware.compilation import compile_line
from accel_common.hardware.launch_guard import (
    requested_sharding,
    require_requested_sharding,
    unsharded_type,
)
from accel_common.hardware.parameters import parameter_counts
from accel_common.hardware.speed import require_ddp, speed_lines

# fp32 weights and their gradients: what training holds per parameter before the optimizer's
# state and any activation (halve the gradients' share for bf16 gradients; sharding divides it)
WEIGHT_AND_GRADIENT_BYTES = 8
# Adam's two moments: what a recipe that declares no optimizer is assumed to keep per parameter
ASSUMED_STATE_BYTES = 8


def world_size(processes: int | None) -> int:
    """The process count to plan for: `--processes`, else the launcher's (WORLD_SIZE), else 1."""
    return processes or int(os.environ.get("WORLD_SIZE", "1"))


def mixed_precision(flag: str | None) -> str:
    """--mixed-precision, else what `accelerate launch` passes its workers, else 'no'."""
    return flag or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")


def optimizer_state(
    model: nn.Module, build_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None
) -> tuple[int, str]:
    """(bytes, words) of the state the recipe's optimizer keeps for `model` (on the `meta`
    device): built by the recipe's own `build_optimizer` and stepped once on empty gradients,
    so SGD with momentum counts one tensor per parameter, plain SGD none, Adam and AdamW two.
    Without `build_optimizer`, Adam's is assumed and the line says so."""
    parameters = sum(p.numel() for p in model.parameters())
    if build_optimizer is None:
        return parameters * ASSUMED_STATE_BYTES, "Adam state (assumed: no build_optimizer)"
    optimizer = build_optimizer(model)
    for group in optimizer.param_groups:  # torch's fused kernels refuse `meta` tensors (the
        group["fused"] = False  # --fused-optimizer), and the state is the same without them
    for parameter in model.parameters():
        parameter.grad = torch.empty_like(parameter)
    optimizer.step()  # creates the state (on `meta`: no memory, no arithmetic)
    tensors = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    state = sum(t.numel() * t.element_size() for t in tensors if t.dim() > 0)
    return state, f"{type(optimizer).__name__} state ({times_the_weights(state, parameters)})"


def ema_copy(model: nn.Module) -> tuple[int, str]:
    """(bytes, words) of the copy `--ema-decay` keeps: one tensor like each trainable parameter
    (accel_common.training.ema averages those, not the buffers)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    copy = sum(p.numel() * p.element_size() for p in trainable)
    parameters = sum(p.numel() for p in model.parameters())
    return copy, f"the EMA ({times_the_weights(copy, parameters)})"


def times_the_weights(count: int, parameters: int) -> str:
    """`count` bytes as a multiple of the fp32 weights' bytes: '2 x the weights'."""
    return f"{round(count / 4 / max(1, parameters), 2):g} x the weights"


def memory_line(
    recipe: str,
    parameters: int,
    per_device_batch_size: int,
    state: tuple[int, str],
    ema: tuple[int, str] | None = None,
) -> str:
    """Memory per device: the parameters' training state (weights, gradients, the optimizer's
    `state` from `optimizer_state` and, with --ema-decay, the `ema` copy from `ema_copy`), plus
    the activations where `plan --measure` has measured them (runs/memory/RECIPE.json)."""
    state_bytes, optimizer = state
    total = parameters * WEIGHT_AND_GRADIENT_BYTES + state_bytes
    kept = f"gradients and {optimizer}"
    if ema is not None:
        total += ema[0]
        kept = f"gradients, {optimizer} and {ema[1]}"
    line = f"{size(total)} for weights, {kept} (fp32, unsharded)"
    path = MEMORY_DIR / f"{recipe}.json"
    try:
        fit = json.loads(path.read_text())
    except (OSError, ValueError):
        return f"{line}; activations not measured (accel-recipes plan --measure {recipe})"
    peak = fit["fixed_bytes"] + fit["per_sample_bytes"] * per_device_batch_size
    return (
        f"{line}; {size(peak)} predicted peak at {per_device_batch_size} per device "
        f"on {fit['device_name']} ({path}, measured with {fit['flags']})"
    )


def size(count: float) -> str:
    """Bytes in the unit that reads best: '1.23 GiB', '45.6 MiB', '7.8 KiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count / 2**10:.3g} KiB"


def print_dry_run(
    recipe: str,
    batch: BatchRequest,
    lr: LRSettings,
    *,
    length: tuple[int, int],
    precision: str | None,
    build_model: Callable[[], nn.Module] | None,
    processes: int | None,
    build_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    compile: bool = False,
    absent: tuple[str, ...] = (),
    cpu: bool = False,
    speed: Mapping[str, Any] | None = None,
    ema: bool = False,
) -> None:
    """Print the plan the run would start with (on the launch's first process only): the batch
    plan and the LR line come from the same objects and functions as the run's (`batch.plan`,
    `lr.describe`, `compile_line`); `length` is (--epochs, --max-steps), `precision`
    --mixed-precision, `compile` --compile, `speed` the settings holding
    accel_common.hardware.speed's switches (the banner shows them from the same values); `absent`
    the input flags (`--init-from PATH`) whose files this machine lacks: the run would stop there,
    the plan says so; `ema` whether --ema-decay keeps a copy of the weights; `cpu` --cpu. A
    launch the run refuses before it starts (FSDP or DeepSpeed on the CPU, --ddp-static-graph
    without DDP) is refused here too, in the run's words."""
    world = world_size(processes)
    speed = speed or {}
    if cpu or not torch.accelerator.is_available():
        require_requested_sharding(unsharded_type(world))
    plan = batch.plan(world, warn_small=False)
    if speed.get("ddp_static_graph"):
        require_ddp(requested_sharding() or unsharded_type(world), plan.grad_accum_steps)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    epochs, max_steps = length
    rows = {
        "recipe": recipe,
        "world size": f"{world} process(es)",
        "batch": plan.describe(),
        # --max-steps cuts the warmup as in the run (the data's length, unread here, may too)
        "learning rate": lr.describe(
            plan.global_batch_size, lr.run_warmup(max_steps) if max_steps else None
        ),
        "epochs": (
            f"as many as {max_steps} steps take (--epochs 0)"
            if not epochs
            else f"{epochs}" + (f", at most {max_steps} steps" if max_steps else "")
        ),
        "mixed precision": mixed_precision(precision),
        "compile": compile_line(compile),
        **speed_lines(speed),
        **(
            {"inputs": f"not on this machine: {', '.join(absent)} (the run stops unless there)"}
            if absent
            else {}
        ),
    }
    lines = [f"  {k}: {v}" for k, v in rows.items()]
    if build_model is not None:
        lines += parameter_lines(
            recipe, build_model, plan.per_device_batch_size, build_optimizer, ema=ema
        )
    print("\n".join(["dry run: nothing is trained or written to --output-dir", *lines]), flush=True)


def parameter_lines(
    recipe: str,
    build_model: Callable[[], nn.Module],
    per_device_batch_size: int,
    build_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    *,
    ema: bool = False,
) -> list[str]:
    """The network's counts (on the `meta` device) and memory, with the state of the optimizer
    `build_optimizer` makes for it (the recipe's) and the EMA's copy if `ema`; where its sizes
    come from files this machine lacks (data, an export to start from: the hook raises
    `DataError`, as the run would stop), that instead of a guess."""
    try:
        with torch.device("meta"):
            model = build_model()
    except DataError as err:
        return [f"  parameters: not counted: the network's sizes are read from files ({err})"]
    counts = parameter_counts(model)
    total = counts["parameters"]
    lines = [f"  {label}: {count}" for label, count in counts.items()]
    for label in getattr(model, "COUNTED_APART", {}):
        lines[list(counts).index(label)] += " (not counted above)"
    state = optimizer_state(model, build_optimizer)
    copy = ema_copy(model) if ema else None
    memory = memory_line(recipe, total, per_device_batch_size, state, copy)
    lines.append(f"  memory per device: {memory}")
    return lines
