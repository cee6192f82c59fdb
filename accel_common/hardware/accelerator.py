"""The Accelerator and the batch plan a launch trains with (`make_accelerator`).

A module named for the one object it builds, so that a reader looking for where the Accelerator
is made finds it by name; the checks it runs before and after (devices, sharding, output folder,
the launcher watchdog) are accel_common.hardware.launch_guard's. It takes plain values, so a script
with its own argparse or Hydra config can call it directly; `accel_common.SharedSettings`
maps the shared recipe flags onto it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import (
    DistributedType,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    KwargsHandler,
    parse_flag_from_env,
    set_seed,
)

from accel_common.batch_lr.batching import BatchPlan, BatchRequest
from accel_common.errors import ConfigError
from accel_common.hardware.determinism import make_deterministic
from accel_common.hardware.group_release import release_at_exit
from accel_common.hardware.launch_guard import (
    exit_when_launcher_dies,
    require_requested_devices,
    require_requested_sharding,
    require_writable_output_dir,
)
from accel_common.hardware.sharding import guard_wrap_policy
from accel_common.hardware.speed import require_ddp, set_matmul_precision, with_static_graph
from accel_common.monitoring.tracking import trackers_for


def make_accelerator(
    *,
    output_dir: Path,
    batch: BatchRequest,
    mixed_precision: str | None = None,
    cpu: bool = False,
    report_to: str = "none",
    dist_timeout: int = 0,
    seed: int = 0,
    deterministic: bool = False,
    kwargs_handlers: Iterable[KwargsHandler] = (),
    matmul_precision: str | None = None,
    ddp_static_graph: bool = False,
) -> tuple[Accelerator, BatchPlan]:
    """Build the Accelerator and the batch plan for this launch's world size.

    `batch` gives the global or the per-device batch (see accel_common.batch_lr.batching).
    Two settings differ from Accelerate's defaults, both so that the math does not depend on the
    number of processes: the scheduler is stepped once per optimizer step (see
    accel_common.batch_lr.lr), and accumulation windows run across epoch ends instead of flushing a
    short window at the end of each epoch, so every optimizer step sees exactly the global batch.

    The process group is created here, by the first PartialState, so its settings (`dist_timeout`
    in seconds, a recipe's InitProcessGroupKwargs) go to it directly: Accelerate ignores them once
    the group exists, and InitProcessGroupKwargs.to_kwargs() drops a timeout equal to its own
    default (600 s). `seed` seeds every process alike, so initial weights are the same everywhere.
    `deterministic` makes every kernel after this call deterministic
    (accel_common.hardware.determinism). `matmul_precision` and `ddp_static_graph` are
    accel_common.hardware.speed's switches; the static graph goes into the recipe's own
    DistributedDataParallelKwargs where it passes one.
    """
    if dist_timeout < 0:
        raise ConfigError(f"--dist-timeout {dist_timeout}: give seconds, or 0 for the default")
    # ACCELERATE_USE_CPU=true (1cpu.yaml's launcher, `accel-recipes launch` with a CPU config):
    # the Accelerator would read it after this PartialState chose the GPU, and refuse
    cpu = cpu or parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.accelerator.is_available()
    require_requested_devices(cpu)  # before the output folder is created
    require_writable_output_dir(Path(output_dir))
    kwargs_handlers = list(kwargs_handlers)
    if ddp_static_graph:
        kwargs_handlers = with_static_graph(kwargs_handlers)
    init = next((h for h in kwargs_handlers if isinstance(h, InitProcessGroupKwargs)), None)
    group_kwargs = init.to_kwargs() if init else {}
    if dist_timeout:
        group_kwargs["timeout"] = timedelta(seconds=dist_timeout)
    group_kwargs |= restarted_group_store()
    world = PartialState(cpu=cpu, **group_kwargs).num_processes
    exit_when_launcher_dies()
    # end_training destroys the group, but torch keeps it (and gloo's threads) alive until
    # Python finalises, where gloo could abort a finished worker: freed at exit instead
    release_at_exit()
    plan = batch.plan(world, warn_small=False)  # the banner warns, once, on the main process
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision=mixed_precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=plan.grad_accum_steps, sync_with_dataloader=False
        ),
        step_scheduler_with_optimizer=False,
        log_with=trackers_for(report_to, output_dir),
        project_dir=str(output_dir),
        kwargs_handlers=kwargs_handlers,
        # never Accelerate's own compile (a wrapper whose `_orig_mod.` keys would reach the
        # checkpoints): --compile and a config's dynamo_backend compile in place, once
        # (accel_common.hardware.compilation, SharedSettings.adapt_model)
        dynamo_backend="no",
    )
    require_requested_sharding(accelerator.distributed_type.value)
    if ddp_static_graph:
        require_ddp(accelerator.distributed_type.value, plan.grad_accum_steps)
    if accelerator.distributed_type == DistributedType.FSDP:
        guard_wrap_policy()  # no ModuleList / ModuleDict as its own unit (hardware.sharding)
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise ConfigError(
            "fp16 mixed precision (from --mixed-precision or the launch config) does not run on "
            "the CPU: Accelerate would train in fp32 while reporting fp16. Use --mixed-precision "
            "bf16 or no on the CPU, or launch on a GPU"
        )
    if deterministic:
        make_deterministic()
    set_matmul_precision(matmul_precision)
    set_seed(seed)
    return accelerator, plan


def restarted_group_store() -> dict[str, Any]:
    """For a worker group that torch elastic restarted: a namespace of its own in the launcher's
    store, as `init_process_group` arguments ({} on a first start).

    The restarted workers get the same store (MASTER_ADDR:MASTER_PORT, served by the agent) with
    the keys of the group they replace still in it: without a namespace of their own they read
    the dead processes' addresses and fail (gloo: "connectFullMesh failed ... Connection
    refused"). DeepSpeed creates its process group itself and takes no store.
    """
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    if count in ("", "0") or not agent_store or deepspeed:
        return {}
    store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
    )
    return {
        "store": torch.distributed.PrefixStore(f"accel-recipes/restart_{count}", store),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }


ONE_STREAM = "one_rng_stream"  # the setting that keeps one RNG stream for every process


def split_rng_streams(accelerator: Accelerator, seed: int, one_stream: bool | None) -> None:
    """A fresh run's global RNG (dropout masks, any augmentation drawn from it) becomes a stream
    per process: process k > 0 reseeds with `seed + k`, process 0 goes on as it is, so one
    process trains as before and the weights, initialised before this from `--seed` on every
    process, stay alike. Seeded alike, every process would draw the same masks for its share of
    the batch, and dropout would weaken as processes are added. A resume restores each process's
    own saved stream instead; `one_stream` keeps them alike, for an original that did so."""
    if not one_stream and accelerator.process_index > 0:
        set_seed(int(seed) + accelerator.process_index)


def launcher_restart() -> str | None:
    """How this process was restarted, or None for a first start: torch elastic (torchrun,
    `accelerate launch --max_restarts N`) counts its restarts of the worker group in
    TORCHELASTIC_RESTART_COUNT; SLURM counts requeues of the job in SLURM_RESTART_COUNT."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if count not in ("", "0"):
        limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
        return f"restart {count} of {limit} by the launcher"
    count = os.environ.get("SLURM_RESTART_COUNT", "0")
    if count not in ("", "0"):
        return f"SLURM requeue {count}"
    return None
