"""The accelerate config against this machine and environment, and the shipped config (with its
launch line and batch plan) recommended for the devices seen."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import yaml

from accel_common.batch_lr.batching import BatchRequest
from accel_common.errors import RecipeError
from accel_common.hardware.launch_guard import (
    config_asks_for_gpus,
    sharding_refusal,
    unsharded_type,
)
from accel_common.tools.doctor.base import Problem

REPO_ROOT = Path(__file__).resolve().parents[3]


CONFIG_DIR = REPO_ROOT / "accelerate_configs"


DEFAULT_PER_DEVICE_BS = 32


GPU_CONFIGS = {1: "1gpu.yaml", 2: "2gpu.yaml", 4: "4gpu.yaml", 8: "8gpu.yaml"}


CPU_CONFIG = "cpu_2proc.yaml"


# the dynamo settings Accelerate's workers read as truth values (accelerate.utils.str_to_bool)
DYNAMO_FLAGS = (
    "dynamo_use_fullgraph",
    "dynamo_use_dynamic",
    "dynamo_use_regional_compilation",
)
TRUTH_VALUES = frozenset({"y", "yes", "t", "true", "on", "1", "n", "no", "f", "false", "off", "0"})


def yaml_error(err: yaml.YAMLError) -> str:
    """A YAML parse error on one line: where, what, and while doing what."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(err, "context", None)
    if isinstance(err, yaml.constructor.ConstructorError):  # `!!python/object/apply:...`
        return (
            f"a tag that builds an object{where} ({problem}): an accelerate config holds plain "
            "values only; remove the tag (nothing in the file was run)"
        )
    return f"not valid YAML{where}: {problem}" + (f" ({context})" if context else "")


class TaggedConfig(RecipeError):
    """A config with a tag that builds an object (`!!python/...`): Accelerate's own reading of it
    (yaml.safe_load) stops with a traceback before any of our code runs. `tag` says where."""

    def __init__(self, message: str, tag: str) -> None:
        super().__init__(message)
        self.tag = tag


def load_config(path: Path, flag: str = "--config-file") -> dict[str, Any]:
    """The accelerate config at `path`; a missing or malformed file is a user error (exit 2).
    `flag` is how the caller's user named it (`accelerate launch` spells it --config_file)."""
    shipped = ", ".join(sorted(p.name for p in CONFIG_DIR.glob("*.yaml")))
    if path.is_dir():
        inside = sorted(p.name for p in path.iterdir() if p.suffix in (".yaml", ".yml"))
        if inside:
            raise RecipeError(
                f"{flag} {path}: a folder, not a config file; give the YAML file inside it: "
                f"{', '.join(str(path / name) for name in inside)}"
            )
        raise RecipeError(
            f"{flag} {path}: a folder with no .yaml file in it; give an accelerate config file, "
            f"e.g. one of {CONFIG_DIR.name}/: {shipped}"
        )
    if not path.is_file():
        raise RecipeError(
            f"{flag} {path}: no such file; the configs in {CONFIG_DIR.name}/ are: {shipped}"
        )
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.constructor.ConstructorError as err:
        mark, tag = err.problem_mark, str(err.problem).split("tag ")[-1]
        where = f"{tag} at line {mark.line + 1}" if mark is not None else tag
        raise TaggedConfig(f"{flag} {path}: {yaml_error(err)}", where) from None
    except yaml.YAMLError as err:
        raise RecipeError(f"{flag} {path}: {yaml_error(err)}") from None
    except UnicodeDecodeError:
        raise RecipeError(f"{flag} {path}: not a text file, so not an accelerate config") from None
    if not isinstance(config, dict):
        raise RecipeError(f"{flag} {path}: not an accelerate config (no `key: value` lines)")
    if (problem := bad_value(config)) is not None:
        raise RecipeError(f"{flag} {path}: {problem}")
    return config


def bad_value(config: dict[str, Any]) -> str | None:
    """What in a config `accelerate launch` would accept and then fail on (a traceback from the
    launcher or every worker), as `key: value: what to give`; None when nothing is.

    Accelerate checks neither the process counts, the port nor the dynamo settings of a config
    file: a negative count starts a nonsense launch, a bad port, backend or flag kills it after
    it started."""
    from accelerate.utils import (  # imported here: accelerate is slow to import
        DistributedType,
        DynamoBackend,
    )

    kinds = [kind.value for kind in DistributedType]
    kind = config.get("distributed_type", "NO")
    if str(kind) not in kinds:
        return f"distributed_type: {kind!r}: give one of {', '.join(kinds)}"
    for key in ("num_processes", "num_machines"):
        value = config.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{key}: {value!r}: give a positive whole number"
    port = config.get("main_process_port")
    if port is not None and (not isinstance(port, int) or not 1 <= port <= 65535):
        return f"main_process_port: {port!r}: give a port from 1 to 65535 (above 1024 without root)"
    nested = config.get("dynamo_config") or {}
    if not isinstance(nested, dict):
        return f"dynamo_config: {nested!r}: give `key: value` lines under it"
    dynamo = {**nested, **config}  # the top-level spelling is the older one
    backends = [b.value.lower() for b in DynamoBackend]
    backend = dynamo.get("dynamo_backend")
    if backend is not None and str(backend).lower() not in backends:
        return f"dynamo_backend: {backend!r}: give one of {', '.join(backends)}"
    for key in DYNAMO_FLAGS:
        value = dynamo.get(key)
        if value is not None and str(value).lower() not in TRUTH_VALUES:
            return f"{key}: {value!r}: give true or false"
    return None


def missing_deepspeed(name: str) -> Problem | None:
    """A blocker when `name` (a config or a flag) asks for DeepSpeed and it is not installed."""
    if importlib.util.find_spec("deepspeed") is not None:
        return None
    return Problem(
        "blocker",
        f"{name} needs DeepSpeed, which is not installed",
        "`pip install deepspeed` on every GPU machine",
    )


def read_config(path: Path) -> tuple[dict[str, Any] | None, list[Problem]]:
    """The doctor's reading of --config-file: a tag that builds an object is a blocker in the
    report (a bare `accelerate launch` shows a traceback for it, our launcher one line); any other
    unreadable file stays one error line (load_config)."""
    try:
        return load_config(path), []
    except TaggedConfig as err:
        return None, [
            Problem(
                "blocker",
                f"{path.name} holds a tag that builds an object ({err.tag}): a bare "
                "`accelerate launch` stops on it with a traceback (yaml's ConstructorError; "
                "nothing in the file is run)",
                "remove the tag, an accelerate config holds plain values only; `accel-recipes "
                "launch -- accelerate launch ...` refuses such a file in one line",
            )
        ]


def check_config(
    config: dict[str, Any], path: Path, env: dict[str, str], gpus: int, ipv4: list[str]
) -> tuple[dict[str, Any], list[Problem]]:
    """Does this config fit this machine and this environment?"""
    kind = str(config.get("distributed_type", "NO"))
    total = int(config.get("num_processes", 1))
    machines = int(config.get("num_machines", 1))
    use_cpu = bool(config.get("use_cpu", False))
    per_machine = total // machines
    summary = {
        "path": str(path),
        "distributed_type": kind,
        "num_processes": total,
        "num_machines": machines,
        "processes_per_machine": per_machine,
        "use_cpu": use_cpu,
        "mixed_precision": config.get("mixed_precision", "no"),
    }
    problems = []
    if total % machines:
        problems.append(
            Problem(
                "blocker",
                f"{path.name}: num_processes={total} is not a multiple of num_machines={machines}",
                "num_processes is the TOTAL over all machines: machines x processes per machine",
            )
        )
    world = env.get("WORLD_SIZE", "")
    if world.isdigit() and int(world) != total:
        problems.append(
            Problem(
                "blocker",
                f"WORLD_SIZE={world} in the environment, but {path.name} starts num_processes="
                f"{total} in total ({machines} machine(s) x {per_machine})",
                "ranks then wait for peers that never join; unset WORLD_SIZE (launchers set it per "
                "process) or make every node's config and WORLD_SIZE agree: num_processes counts "
                "all machines together",
            )
        )
    wants_gpus = config_asks_for_gpus(config)  # what a recipe's workers refuse without GPUs
    hidden = env.get("CUDA_VISIBLE_DEVICES")
    hint = f" (CUDA_VISIBLE_DEVICES={hidden!r})" if hidden is not None else ""
    if wants_gpus and gpus == 0:
        problems.append(
            Problem(
                "blocker",
                f"{path.name} asks for {per_machine} GPU(s) per machine, but none is visible"
                + hint,
                f"on a CPU machine use accelerate_configs/{CPU_CONFIG}; otherwise check "
                "`nvidia-smi` and CUDA_VISIBLE_DEVICES",
            )
        )
    elif wants_gpus and per_machine > gpus:
        problems.append(
            Problem(
                "blocker",
                f"{path.name} starts {per_machine} processes per machine, but {gpus} GPU(s) are "
                "visible" + hint,
                f"pass --num_processes {gpus * machines} to accelerate launch, or use the "
                "recommended config below",
            )
        )
    if kind in ("FSDP", "DEEPSPEED") and (use_cpu or gpus == 0):  # what the run refuses
        problems.append(Problem("blocker", *sharding_refusal(kind, unsharded_type(per_machine))))
    if kind == "DEEPSPEED" and (missing := missing_deepspeed(path.name)) is not None:
        problems.append(
            replace(
                missing,
                message=f"{missing.message}: a bare `accelerate launch` stops with an ImportError "
                "traceback",
                advice=f"{missing.advice}; `accel-recipes launch -- accelerate launch ...` says "
                "so in one line before anything starts",
            )
        )
    torchrun = kind not in ("NO", "MULTI_CPU")  # the launcher path that starts N workers
    if use_cpu and torchrun and per_machine > 1 and not env_flag(env.get("ACCELERATE_USE_CPU")):
        problems.append(
            Problem(
                "warning",
                f"{path.name}: a bare `accelerate launch` starts {per_machine} workers without "
                "telling them use_cpu, so a script of your own whose Accelerator() lacks "
                f"cpu=True runs as {per_machine} separate one-process jobs (the recipes pass it "
                "themselves)",
                "launch your script with `accel-recipes launch -- accelerate launch "
                f"--config_file {path} ...` (it sets ACCELERATE_USE_CPU=true), or export "
                "ACCELERATE_USE_CPU=true",
            )
        )
    if config.get("mixed_precision") == "bf16" and gpus and not torch.cuda.is_bf16_supported():
        problems.append(
            Problem(
                "warning",
                f"{path.name} uses bf16, which these GPUs do not support",
                "add --mixed_precision fp16 to accelerate launch",
            )
        )
    head = str(config.get("main_process_ip", ""))
    if machines > 1 and head in ("", "127.0.0.1", "localhost"):
        problems.append(
            Problem(
                "warning",
                f"{path.name} is for {machines} machines but main_process_ip is "
                f"{head or 'unset'}, which other machines cannot reach",
                "pass --main_process_ip HEAD_NODE_IP on every node (this machine: "
                f"{', '.join(ipv4) or 'no IPv4 address'})",
            )
        )
    return summary, problems


def env_flag(value: str | None) -> bool:
    """An environment variable set to a truth value, as Accelerate reads it (str_to_bool)."""
    return str(value).lower() in ("y", "yes", "t", "true", "on", "1")


def recommend(gpus: int, mps: bool, batch: BatchRequest) -> dict[str, Any]:
    """The shipped config for the devices seen, the launch line, and the batch plan for it."""
    if gpus:
        nearest = min(GPU_CONFIGS, key=lambda n: (abs(n - gpus), n))
        name, processes = GPU_CONFIGS[nearest], gpus
        override = f"--num_processes {gpus} " if nearest != gpus else ""
        reason = f"{gpus} GPU(s) visible" + (
            f"; no config for {gpus}, so {name} with --num_processes {gpus}" if override else ""
        )
    elif mps:
        name, processes, override = GPU_CONFIGS[1], 1, ""
        reason = "one Apple GPU (MPS): one process; DDP over MPS brings no speed-up"
    else:
        name, processes, override = CPU_CONFIG, 2, ""
        reason = "no GPU: 2 CPU processes over gloo run the distributed code path"
    if batch.global_batch_size is None and batch.per_device_batch_size is None:
        batch = replace(batch, per_device_batch_size=DEFAULT_PER_DEVICE_BS)
    plan = batch.plan(processes, warn_small=False)
    config = f"{CONFIG_DIR.name}/{name}"
    return {
        "config": config,
        "num_processes": processes,
        "reason": reason,
        "command": f"accelerate launch --config_file {config} {override}"
        f"recipes/train_template.py --bs {plan.global_batch_size}",
        "batch": plan.as_dict(),
        "batch_text": plan.describe(),
    }
