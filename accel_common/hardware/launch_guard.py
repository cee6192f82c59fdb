"""Refusals before a launch does any work, and the watchdog that ends an orphaned worker.

Each check reads where a mistake was made (the launcher's command line and the config it names,
the environment Accelerate was given, the output folder) and stops the run in one line naming
it, before a process trains on the wrong devices or writes where it cannot:

- `require_requested_devices`: a GPU launch config on a machine without GPUs;
- `require_requested_sharding`: an FSDP/DeepSpeed config Accelerate dropped on the CPU;
- `require_writable_output_dir`, `require_writable_folder`, `require_new_file`: output paths
  checked before the work;
- `exit_when_launcher_dies`: a worker whose launcher was killed stops instead of writing on.

`accel_common.hardware.accelerator.make_accelerator` runs the launch checks; `accel-recipes doctor`
judges a config with the same `config_asks_for_gpus`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import yaml

from accel_common.errors import EXIT_LAUNCHER_GONE, ConfigError, DataError, say


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
        say(
            f"error (rank {os.environ.get('RANK', '?')}): the launcher (pid {launcher}) is gone; "
            "this worker stops without writing anything more"
        )
        os._exit(EXIT_LAUNCHER_GONE)

    threading.Thread(target=watch, name="launcher-watchdog", daemon=True).start()


def require_requested_devices(cpu: bool) -> None:
    """Refuse a launch that asks for GPUs on a machine without any, one process or several.

    `accelerate launch` with a GPU config (use_cpu: false) on a CPU-only machine starts one CPU
    process per GPU it was told about, silently (with 1gpu.yaml, one process in bf16). Its workers
    cannot tell: the multi-GPU launcher sets ACCELERATE_USE_CPU only on its single-process path,
    and the environments it gives the workers of 2gpu.yaml and cpu_2proc.yaml differ in nothing
    but ACCELERATE_MIXED_PRECISION. So the request is read where it was made, from the
    launcher's command line and the config it names (`launcher_gpu_request`). `accel-recipes
    doctor --config-file` calls the same configs a blocker (`config_asks_for_gpus`).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not cpu or torch.accelerator.is_available():
        return
    request = launcher_gpu_request()
    if request is not None:
        gpus = "1 GPU" if world == 1 else f"{world} GPUs"
        cpu_config = "1cpu.yaml" if world == 1 else "cpu_2proc.yaml"
        raise ConfigError(
            f"this launch asks for {gpus} ({request}): none is visible, so every process "
            f"would train on the CPU; use accelerate_configs/{cpu_config} (or "
            "ACCELERATE_USE_CPU=true accelerate launch ...) on a CPU, or launch on a machine "
            "with GPUs"
        )


# distributed types that `accelerate launch` runs one process per GPU for (unless use_cpu)
GPU_DISTRIBUTED_TYPES = frozenset({"MULTI_GPU", "FSDP", "DEEPSPEED"})


def config_asks_for_gpus(config: dict[str, Any]) -> bool:
    """Whether an accelerate config (its YAML as a dict) starts its processes on GPUs: a
    multi-GPU type, or one process with `use_cpu: false` written out (1gpu.yaml; `accelerate
    config` writes `use_cpu: true` on a machine without an accelerator)."""
    if bool(config.get("use_cpu", False)):
        return False
    kind = str(config.get("distributed_type", "NO"))
    return kind in GPU_DISTRIBUTED_TYPES or (kind == "NO" and config.get("use_cpu") is False)


def launcher_gpu_request() -> str | None:
    """What made the `accelerate launch` that started this worker ask for GPUs ("config
    2gpu.yaml", "--multi_gpu"), or None: no such launcher (plain python, torchrun), or one told
    to use the CPU (--cpu, use_cpu: true, ACCELERATE_USE_CPU=true in its environment).

    The launcher is this worker's parent process (torch elastic's agent runs inside it); its
    arguments are read with Accelerate's own parser, and the config it loads is the file given
    with --config_file (relative to its working folder) or Accelerate's default config.
    """
    # a multi-process launcher sets LOCAL_RANK; its one-process path, ACCELERATE_USE_CPU
    if "LOCAL_RANK" not in os.environ and "ACCELERATE_USE_CPU" not in os.environ:
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


# the launcher's variables that ask for sharding, and the distributed type each asks for
SHARDING_REQUESTS = (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DEEPSPEED"))


def requested_sharding() -> str | None:
    """FSDP or DEEPSPEED where the launcher asked for it (its config or flags), else None."""
    for variable, kind in SHARDING_REQUESTS:
        if os.environ.get(variable, "").lower() == "true":
            return kind
    return None


def sharding_refusal(asked: str, runs_as: str) -> tuple[str, str]:
    """Why a launch asking for `asked` sharding is refused when Accelerate would run it as
    `runs_as`, and what to do: the run, its dry run and `accel-recipes doctor` say the same."""
    return (
        f"the launch config asks for {asked}, but Accelerate enables it only on GPUs (or other "
        f"accelerators) and would run this launch as {runs_as} instead, with the whole model on "
        "every process",
        "launch on GPUs, or use accelerate_configs/cpu_2proc.yaml on the CPU",
    )


def unsharded_type(processes: int) -> str:
    """What Accelerate runs a launch as on the CPU, whatever sharding its config asks for."""
    return "MULTI_CPU" if processes > 1 else "NO"


def require_requested_sharding(runs_as: str) -> None:
    """Refuse a launch whose FSDP/DeepSpeed config Accelerate silently drops.

    Accelerate turns FSDP and DeepSpeed on only with a GPU (or another accelerator); on the CPU it
    trains plain data-parallel without a word, holding the whole model on every process.
    `runs_as` is the distributed type the launch runs as: the Accelerator's, or before there is
    one (the dry run) `unsharded_type` on the CPU.
    """
    asked = requested_sharding()
    if asked is not None and runs_as != asked:
        raise ConfigError("; ".join(sharding_refusal(asked, runs_as)))


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


def require_writable_folder(folder: Path, flag: str, named: Path | None = None) -> None:
    """`folder` (there or to be made) can take new files: its nearest existing folder is a folder
    this process may create files in. Checked before the work, creating nothing: an existing
    read-only folder otherwise fails only when the result is written, after the work. The
    message names `flag` and `named` (the path given, `folder` by default)."""
    named = folder if named is None else named
    existing = next(p for p in (folder, *folder.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise DataError(f"{flag} {named}: {existing} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise DataError(
            f"{flag} {named}: cannot write in {existing} ({err.strerror}); choose a writable "
            "place (nothing was written)"
        ) from None


def require_new_file(out: Path, flag: str = "--out") -> None:
    """A single-device command's --out (or another output `flag`), checked before the work: a
    result already there is never overwritten, and its folder is made now, so a path under a
    file or in an unwritable folder fails in one line instead of after the work."""
    if out.exists():
        raise DataError(f"{flag} {out} exists; choose another {flag} (nothing was overwritten)")
    require_writable_folder(out.parent, flag, out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(f"{flag} {out}: cannot create its folder ({err.strerror})") from None
