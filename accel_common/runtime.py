"""Run set-up every recipe needs in the same form: Accelerator and batch plan, loader, data, CLI.

Each function takes plain values (the batch as one `BatchRequest`), so a script with its own
argparse or Hydra config can use them one at a time; `accel_common.options.TrainArgs` builds
them from the shared recipe flags.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import torch
import typer
import yaml
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import (
    DistributedType,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    KwargsHandler,
    set_seed,
)
from torch.utils.data import DataLoader, Dataset

from accel_common.balance import BalancedBatchSampler
from accel_common.batching import BatchPlan, BatchRequest
from accel_common.console import say
from accel_common.data.files import EpochShuffleSampler
from accel_common.determinism import make_deterministic
from accel_common.errors import EXIT_LAUNCHER_GONE, ConfigError, DataError, exit_on_error
from accel_common.sharding import guard_wrap_policy
from accel_common.tracking import trackers_for

EXAMPLE_DATA_ROOT = Path("data/example")
# 2 CPU processes over gloo: what train_in_python launches on a machine without GPUs
CPU_CONFIG = Path(__file__).resolve().parents[1] / "accelerate_configs" / "cpu_2proc.yaml"


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
) -> tuple[Accelerator, BatchPlan]:
    """Build the Accelerator and the batch plan for this launch's world size.

    `batch` gives the global or the per-device batch (see accel_common.batching).
    Two settings differ from Accelerate's defaults, both so that the math does not depend on the
    number of processes: the scheduler is stepped once per optimizer step (see accel_common.lr),
    and accumulation windows run across epoch ends instead of flushing a short window at the end
    of each epoch, so every optimizer step sees exactly the global batch.

    The process group is created here, by the first PartialState, so its settings (`dist_timeout`
    in seconds, a recipe's InitProcessGroupKwargs) go to it directly: Accelerate ignores them once
    the group exists, and InitProcessGroupKwargs.to_kwargs() drops a timeout equal to its own
    default (600 s). `seed` seeds every process alike, so initial weights are the same everywhere.
    `deterministic` makes every kernel after this call deterministic (accel_common.determinism).
    """
    if dist_timeout < 0:
        raise ConfigError(f"--dist-timeout {dist_timeout}: give seconds, or 0 for the default")
    cpu = cpu or not torch.accelerator.is_available()
    require_requested_devices(cpu)  # before the output folder is created
    require_writable_output_dir(Path(output_dir))
    kwargs_handlers = list(kwargs_handlers)
    init = next((h for h in kwargs_handlers if isinstance(h, InitProcessGroupKwargs)), None)
    group_kwargs = init.to_kwargs() if init else {}
    if dist_timeout:
        group_kwargs["timeout"] = timedelta(seconds=dist_timeout)
    group_kwargs |= restarted_group_store()
    world = PartialState(cpu=cpu, **group_kwargs).num_processes
    exit_when_launcher_dies()
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
    )
    require_requested_sharding(accelerator)
    if accelerator.distributed_type == DistributedType.FSDP:
        guard_wrap_policy()  # no ModuleList / ModuleDict as its own unit (accel_common.sharding)
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise ConfigError(
            "fp16 mixed precision (from --mixed-precision or the launch config) does not run on "
            "the CPU: Accelerate would train in fp32 while reporting fp16. Use --mixed-precision "
            "bf16 or no on the CPU, or launch on a GPU"
        )
    if deterministic:
        make_deterministic()
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


def exit_when_launcher_dies(poll_seconds: float = 0.2) -> None:
    """Under `accelerate launch` or `torchrun`, end this worker as soon as its launcher is gone.

    A SIGKILLed launcher (an OOM kill, `kill -9`, a scheduler cleaning up) cannot stop its
    workers, which would train on and write checkpoints and an export nobody asked for. A
    daemon thread watches the parent process; once this worker has been handed to another
    parent, it exits at once (os._exit: no cleanup that could write files), with code 4.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return  # `python recipe.py`: no launcher to outlive
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_seconds)
        print(
            f"error (rank {os.environ.get('RANK', '?')}): the launcher (pid {launcher}) is gone; "
            "this worker stops without writing anything more",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_LAUNCHER_GONE)

    threading.Thread(target=watch, name="launcher-watchdog", daemon=True).start()


def require_writable_output_dir(output_dir: Path) -> None:
    """The output folder must be a folder this process can write, before anything starts."""
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"--output-dir {output_dir} is a file; give a folder")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as err:
        raise ConfigError(
            f"--output-dir {output_dir} cannot be written ({err.strerror}); choose another folder"
        ) from None


def require_new_file(out: Path, flag: str = "--out") -> None:
    """A single-device command's --out (or another output `flag`), checked before the work: a
    result already there is never overwritten, and its folder is made now, so a path under a
    file or an unwritable one fails in one line instead of after the work."""
    if out.exists():
        raise DataError(f"{flag} {out} exists; choose another {flag} (nothing was overwritten)")
    existing = next(parent for parent in out.absolute().parents if parent.exists())
    if not existing.is_dir():
        raise DataError(f"{flag} {out}: {existing} is a file, not a folder")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(f"{flag} {out}: cannot create its folder ({err.strerror})") from None


def require_requested_devices(cpu: bool) -> None:
    """Refuse a multi-process launch that asks for GPUs on a machine without any.

    `accelerate launch` with a GPU config (use_cpu: false) on a CPU-only machine starts one CPU
    process per GPU it was told about, silently. Its workers cannot tell: the multi-GPU launcher
    sets ACCELERATE_USE_CPU only on its single-process path, and the environments it gives the
    workers of 2gpu.yaml and cpu_2proc.yaml differ in nothing but ACCELERATE_MIXED_PRECISION. So
    the request is read where it was made, from the launcher's command line and the config it
    names (`launcher_gpu_request`). `accel-recipes doctor --config-file` calls the same configs
    a blocker (`config_asks_for_gpus`).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2 or not cpu or torch.accelerator.is_available():
        return
    request = launcher_gpu_request()
    if request is not None:
        raise ConfigError(
            f"this launch asks for {world} GPUs ({request}): none is visible, so every process "
            "would train on the CPU; use accelerate_configs/cpu_2proc.yaml (or "
            "ACCELERATE_USE_CPU=true accelerate launch ...) on a CPU, or launch on a machine "
            "with GPUs"
        )


# distributed types that `accelerate launch` runs one process per GPU for (unless use_cpu)
GPU_DISTRIBUTED_TYPES = frozenset({"MULTI_GPU", "FSDP", "DEEPSPEED"})


def config_asks_for_gpus(config: dict[str, Any]) -> bool:
    """Whether an accelerate config (its YAML as a dict) starts its processes on GPUs."""
    kind = str(config.get("distributed_type", "NO"))
    return kind in GPU_DISTRIBUTED_TYPES and not bool(config.get("use_cpu", False))


def launcher_gpu_request() -> str | None:
    """What made the `accelerate launch` that started this worker ask for GPUs ("config
    2gpu.yaml", "--multi_gpu"), or None: no such launcher (plain python, torchrun), or one told
    to use the CPU (--cpu, use_cpu: true, ACCELERATE_USE_CPU=true in its environment).

    The launcher is this worker's parent process (torch elastic's agent runs inside it); its
    arguments are read with Accelerate's own parser, and the config it loads is the file given
    with --config_file (relative to its working folder) or Accelerate's default config.
    """
    if "LOCAL_RANK" not in os.environ:
        return None
    if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        return None
    try:
        launcher = psutil.Process(os.getppid())
        command, cwd = launcher.cmdline(), launcher.cwd()
    except (psutil.Error, OSError):
        return None
    args = accelerate_launch_args(command)
    if args is None or args.cpu:
        return None
    config_file = args.config_file
    if config_file is None and os.path.isfile(default_accelerate_config()):
        config_file = default_accelerate_config()
    config: dict[str, Any] = {}
    if config_file is not None:
        path = Path(cwd, config_file)
        try:
            config = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError):
            return None  # the launcher read it, or failed on it itself
        if not isinstance(config, dict):
            return None
        if config_asks_for_gpus(config):
            return f"config {path.name}"
    if bool(config.get("use_cpu", False)):
        return None
    flag = next((f for f in ("multi_gpu", "use_fsdp", "use_deepspeed") if getattr(args, f)), None)
    return f"--{flag}" if flag else None


def accelerate_launch_args(command: list[str]) -> argparse.Namespace | None:
    """`accelerate launch`'s own arguments parsed from its command line (`accelerate launch ...`,
    `accelerate-launch ...`, `python -m accelerate.commands.launch ...`); None for another one."""
    for i, word in enumerate(command):
        name = Path(word).name
        if word == "accelerate.commands.launch" or name == "accelerate-launch":
            rest = command[i + 1 :]
            break
        if name == "accelerate" and command[i + 1 : i + 2] == ["launch"]:
            rest = command[i + 2 :]
            break
    else:
        return None
    root = logging.getLogger()
    handlers = list(root.handlers)
    # imported here: on import it points the root logger at rich (logging.basicConfig), which
    # is undone at once; the recipes' own logging stays as it was
    from accelerate.commands.launch import launch_command_parser

    root.handlers[:] = handlers
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # argparse's usage text: not ours to show
            return launch_command_parser().parse_args(rest)
    except SystemExit:
        return None


def default_accelerate_config() -> str:
    """The config `accelerate launch` loads when given none (`accelerate config` writes it)."""
    from accelerate.commands.config import default_config_file

    return default_config_file


def require_requested_sharding(accelerator: Accelerator) -> None:
    """Refuse a launch whose FSDP/DeepSpeed config Accelerate silently dropped.

    Accelerate turns FSDP and DeepSpeed on only with a GPU (or another accelerator); on the CPU it
    trains plain data-parallel without a word, holding the whole model on every process.
    """
    for flag, kind in (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DEEPSPEED")):
        if os.environ.get(flag, "").lower() == "true" and accelerator.distributed_type != kind:
            raise ConfigError(
                f"the launch config asks for {kind}, but Accelerate enables it only on GPUs (or "
                f"other accelerators) and would run this launch as "
                f"{accelerator.distributed_type.value} instead, with the whole model on every "
                "process; launch on GPUs, or use accelerate_configs/cpu_2proc.yaml on the CPU"
            )


def make_train_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    seed: int = 0,
    workers: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    costs: Sequence[float] | None = None,
    plan: BatchPlan | None = None,
) -> DataLoader:
    """The training DataLoader every recipe needs, before `prepare`; `batch_size` is the plan's
    per-device batch.

    - drop_last, so every optimizer step sees exactly the global batch;
    - the shuffle order depends only on (seed, epoch): 1 or N processes see the same global
      batches, and a resumed run the same order;
    - its own generator: creating a loader iterator draws a seed, and drawing it from the global
      RNG would shift dropout masks after a resume (which restores that RNG);
    - with `costs` (one per item: atoms, edges, tokens) and the `plan`, the items of each
      optimizer step are spread over processes and accumulation steps so that the costs are
      balanced (balance.BalancedBatchSampler): the same global batches, less waiting.
    """
    sampler = EpochShuffleSampler(len(dataset), seed)  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(seed)
    common = {"num_workers": workers, "collate_fn": collate_fn, "generator": generator}
    if costs is None:
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, **common)
    if plan is None or plan.per_device_batch_size != batch_size:
        raise ValueError("make_train_loader: costs need the plan whose per-device batch this is")
    batches = BalancedBatchSampler(sampler, costs, plan)
    return DataLoader(dataset, batch_sampler=batches, **common)


def example_data_dir(workload: str) -> Path:
    """Where a workload's generated example lives when no --data is given."""
    return EXAMPLE_DATA_ROOT / workload


def resolve_data(
    accelerator: Accelerator, workload: str, data: Path | None, make_example: Callable[[Path], Any]
) -> Path:
    """The user's --data folder, or a small example written once by the main process."""
    if data is not None:
        if not data.is_dir():
            raise DataError(f"--data {data}: no such folder")
        return data
    target = example_data_dir(workload)
    with accelerator.main_process_first():
        if accelerator.is_main_process and not target.exists():
            say(accelerator, f"no --data given: writing example {workload} data to {target}")
            tmp = target.with_name(target.name + ".tmp")
            make_example(tmp)
            tmp.rename(target)
    return target


def run_recipe(train: Callable[..., Any], **subcommands: Callable[..., Any]) -> None:
    """`python recipe.py [flags]` trains; `python recipe.py NAME [flags]` runs a subcommand.

    Training stays the default command, so `accelerate launch recipe.py --bs 64` works unchanged.
    """
    argv = sys.argv[1:]
    name = argv[0] if argv and argv[0] in subcommands else None
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    chosen = subcommands[name] if name else train
    if name is None and subcommands:
        doc = inspect.cleandoc(train.__doc__ or "")  # dedented: the appended line has no indent
        train.__doc__ = (
            doc
            + "\n\nOther commands: "
            + ", ".join(f"`{sys.argv[0]} {sub} --help`" for sub in subcommands)
        )
    app.command()(exit_on_error(chosen))
    prog = Path(sys.argv[0]).name + (f" {name}" if name else "")
    app(args=argv[1:] if name else argv, prog_name=prog)


def train_in_python(
    train: Callable[..., Any],
    argv: list[str],
    output_dir: Path,
    num_processes: int = 1,
    *,
    script: Path,
) -> tuple[dict[str, float], Path]:
    """Run a recipe's training command from Python (a notebook, a script): in this process, or on
    N processes through Accelerate's launcher (one per GPU when there are GPUs, else CPU processes
    over gloo). `argv` are its command-line flags. Returns the final metrics and the exported
    model's folder."""
    model_dir = output_dir / "model"
    if num_processes == 1:
        AcceleratorState._reset_state(reset_partial_state=True)  # a notebook may train twice
        app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
        app.command()(train)
        metrics = typer.main.get_command(app).main(
            args=argv, prog_name=script.name, standalone_mode=False
        )
        return metrics, model_dir
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes"]
    launch += [str(num_processes), "--main_process_ip", "127.0.0.1"]
    if torch.cuda.is_available():
        launch += ["--multi_gpu"]
    else:
        launch += ["--config_file", str(CPU_CONFIG)]
    subprocess.run([*launch, str(script), *argv], check=True)
    return json.loads((model_dir / "model.json").read_text())["metrics"], model_dir
