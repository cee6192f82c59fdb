"""Checkpoints in two parts: resumable training state, and an exported model for plain PyTorch.

Resumable state lives in `OUTPUT/checkpoints/step_N`: `accelerator.save_state` (model, optimizer,
scheduler, grad scaler, each rank's RNG) plus `progress.json` (epoch, samples seen in it, optimizer
step, batch plan). It is written to `step_N.tmp` and renamed only when complete, and
`progress.json` is written last, so a crash mid-save never produces a "latest" that cannot load.

The export is one safetensors file with clean keys (no `module.` / `_orig_mod.` prefixes) and a
JSON beside it, loadable on any single device with `load_exported`. `convert_checkpoint` produces
the same pair from foreign checkpoints (DDP / torch.compile / Accelerate folders, including FSDP's
sharded torch.distributed.checkpoint folders) without ever unpickling arbitrary objects.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from accel_common.batching import BatchPlan
from accel_common.errors import CheckpointError

CHECKPOINTS = "checkpoints"
PROGRESS_FILE = "progress.json"
MODEL_FILE = "model.safetensors"
META_FILE = "model.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")

# Wrappers that training scripts put around a state dict, outermost first.
STATE_DICT_WRAPPERS = ("model_state_dict", "model_state", "state_dict", "model")
# Prefixes added by DDP / DataParallel (`module.`), torch.compile (`_orig_mod.`) and Lightning-style
# modules holding a DDP model (`model.module.`), in any nesting.
WRAPPER_PREFIXES = ("model.module.", "module.", "_orig_mod.")

# What `accelerator.save_state` writes for a model under FSDP: FULL_STATE_DICT gives one torch.save
# file, SHARDED_STATE_DICT a torch.distributed.checkpoint (DCP) folder whose `.metadata` indexes
# the per-rank `__R_0.distcp` shards; Accelerate nests the weights under the key "model".
FSDP_FULL_FILE = "pytorch_model_fsdp{suffix}.bin"
FSDP_SHARDED_DIR = "pytorch_model_fsdp_{index}"
DCP_METADATA = ".metadata"
DCP_MODEL_KEY = "model"


@dataclass
class TrainProgress:
    """Where a run is: enough to resume at the exact sample, with any number of processes."""

    step: int = 0
    epoch: int = 0
    samples_in_epoch: int = 0
    skipped_steps: int = 0  # fp16: optimizer steps the loss scaler skipped after an overflow
    nonfinite_skipped: int = 0  # --on-nonfinite skip: steps skipped on every process
    # early stopping (TrainLoop's `monitor`): the best value so far, the metrics of the epoch
    # that reached it, epochs since, and whether the run stopped for want of improvement
    best: float | None = None
    best_metrics: dict[str, float] = field(default_factory=dict)
    bad_epochs: int = 0
    stopped: bool = False
    # seconds spent training (in loop.batches()) up to this point, over every launch of the run
    train_seconds: float = 0.0

    def batches_to_skip(self, plan: BatchPlan) -> int:
        """Per-process micro-batches of the current epoch that were already trained on."""
        per_round = plan.per_device_batch_size * plan.num_processes
        if self.samples_in_epoch % per_round:
            raise CheckpointError(
                f"the checkpoint stopped {self.samples_in_epoch} samples into epoch {self.epoch},"
                f" which is not a whole number of {per_round}-sample rounds with this launch's "
                f"batch plan ({plan.describe()}); resume with the original number of processes"
            )
        return self.samples_in_epoch // per_round


# --------------------------------------------------------------------------- resumable state


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS / f"step_{step}"


def checkpoint_step(path: Path) -> int:
    """The optimizer step of a `step_N` checkpoint folder."""
    return int(Path(path).name.removeprefix("step_"))


def list_checkpoints(output_dir: Path, run_id: str | None = None) -> list[Path]:
    """Complete checkpoints (renamed from .tmp, with progress.json), oldest first; with
    `run_id`, only that run's."""
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        complete = match and (path / PROGRESS_FILE).is_file()
        if complete and (run_id is None or checkpoint_run(path).get("id") == run_id):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def checkpoint_run(path: Path) -> dict[str, Any]:
    """The run a checkpoint belongs to: {"id", "identity"}; {} for one saved before runs had
    identities (or unreadable: loading it reports that)."""
    try:
        return json.loads((Path(path) / PROGRESS_FILE).read_text()).get("run") or {}
    except (OSError, ValueError, AttributeError):
        return {}


def remove_unfinished_saves(accelerator: Accelerator, output_dir: Path) -> None:
    """Delete `step_N.tmp` folders left by a crash during a save (main process; collective)."""
    root = Path(output_dir) / CHECKPOINTS
    if accelerator.is_main_process and root.is_dir():
        for leftover in root.glob("step_*.tmp"):
            shutil.rmtree(leftover, ignore_errors=True)
    accelerator.wait_for_everyone()


def save_checkpoint(
    accelerator: Accelerator,
    output_dir: Path,
    progress: TrainProgress,
    *,
    plan: BatchPlan,
    keep_last: int = 2,
    run: dict[str, Any] | None = None,
) -> Path:
    """Save resumable state for `progress.step`; every process must call this (collective).

    `run` ({"id", "identity"}, see accel_common.run) is recorded so that a resume can tell
    this run from another one in the same folder; pruning to `keep_last` touches only the
    checkpoints of the same run.
    """
    final = checkpoint_dir(output_dir, progress.step)
    tmp = final.with_name(final.name + ".tmp")
    # on every process, before anything is written: a value JSON cannot hold stops them all
    record = {"progress": asdict(progress), "batch_plan": plan.as_dict(), "run": run}
    text = strict_json(record, final / PROGRESS_FILE)
    remove_unfinished_saves(accelerator, output_dir)
    try:
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()  # every rank's RNG file is in place
        if accelerator.is_main_process:
            (tmp / PROGRESS_FILE).write_text(text)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
    except OSError as err:
        if accelerator.is_main_process:  # never complete; on a full disk, space again
            shutil.rmtree(tmp, ignore_errors=True)
        latest = list_checkpoints(output_dir)
        last = f"the last complete checkpoint is {latest[-1]}" if latest else "no checkpoint is"
        raise CheckpointError(
            f"{write_failure(err)} while saving {final.name}; {last} (nothing of {final.name} "
            f"was kept in {final.parent}): {WRITE_ADVICE[disk_full(err)]}, then continue with "
            "--resume latest"
        ) from None
    if accelerator.is_main_process:
        run_id = (run or {}).get("id")
        for old in list_checkpoints(output_dir, run_id)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


# what to do after a write failed: on a full disk (or quota), or for another reason
WRITE_ADVICE = {
    True: "free space on that disk, or move --output-dir to another one",
    False: "check that the --output-dir disk is writable and healthy",
}


def disk_full(err: OSError) -> bool:
    return err.errno in (errno.ENOSPC, errno.EDQUOT)


def write_failure(err: OSError) -> str:
    """'no space left on device' (or the quota, or the system's own words for another error)."""
    if err.errno == errno.ENOSPC:
        return "no space left on device"
    if err.errno == errno.EDQUOT:
        return "disk quota exceeded"
    return f"could not write ({err.strerror or err})"


def resolve_resume(resume: str | None, output_dir: Path) -> Path | None:
    """`latest` -> newest complete checkpoint (None if there is none yet), else a given path."""
    if resume is None:
        return None
    if resume == "latest":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"--resume {resume}: no such checkpoint folder")
    if not (path / PROGRESS_FILE).is_file():
        raise CheckpointError(
            f"--resume {resume}: {PROGRESS_FILE} is missing, so this save never completed "
            f"(or is not a checkpoint of this project); pick another folder under "
            f"{Path(output_dir) / CHECKPOINTS} or use --resume latest"
        )
    return path


def load_checkpoint(
    accelerator: Accelerator,
    path: Path,
    plan: BatchPlan,
    *,
    accept: Callable[[Path, TrainProgress, int, dict[str, Any]], None] | None = None,
) -> tuple[TrainProgress, dict[str, Any]]:
    """Restore model, optimizer, scheduler, scaler and RNG from `path`; return its progress and
    its run record ({"id", "identity"}).

    `accept(path, progress, saved global batch, run record)` refuses a checkpoint of another
    run before anything is restored (accel_common.run.RunCheck). Refused here: a missing or
    truncated file, a position this launch's plan cannot reach, tensors whose shapes do not fit
    the model.
    """
    try:
        record = json.loads((path / PROGRESS_FILE).read_text())
        progress = TrainProgress(**record["progress"])
        saved_plan = record["batch_plan"]
        saved_global = int(saved_plan["global_batch_size"])
        saved_processes = int(saved_plan["num_processes"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path / PROGRESS_FILE} is unreadable: {err}") from err
    run = record.get("run") or {}
    if accept is not None:
        accept(path, progress, saved_global, run)
    progress.batches_to_skip(plan)  # fails early if the position cannot be mapped
    check_rng_file(path, accelerator.process_index, saved_processes)
    try:
        accelerator.load_state(str(path))
    except Exception as err:  # torch/safetensors raise many types for truncated or corrupt files
        mismatch = shape_mismatch(str(err))
        if mismatch:
            raise CheckpointError(f"{path}: {mismatch}; were the model flags the same?") from err
        raise CheckpointError(
            f"checkpoint {path} is corrupt or truncated and cannot be loaded "
            f"({type(err).__name__}: {err}); resume from an earlier step_N folder instead"
        ) from err
    return progress, run


def check_rng_file(path: Path, process_index: int, saved_processes: int) -> None:
    """This process's RNG state must load: Accelerate skips a missing or broken one silently,
    and the resumed run would then draw other dropout masks and noise than the original."""
    if process_index >= saved_processes:
        return  # more processes than at the save: Accelerate seeds the new ones itself
    rng_file = Path(path) / f"random_states_{process_index}.pkl"
    try:
        # our own file, written by Accelerate's save_state: numpy's RNG state needs pickle
        torch.load(rng_file, weights_only=False)
    except Exception as err:  # missing, truncated or not a pickle: many exception types
        raise CheckpointError(
            f"{rng_file} is missing or truncated ({type(err).__name__}); resume from an earlier "
            "step_N folder instead"
        ) from err


_SIZE_MISMATCH = re.compile(
    r"size mismatch for ([\w.]+): copying a param with shape torch\.Size\((\[[^\]]*\])\) from "
    r"checkpoint, the shape in current model is torch\.Size\((\[[^\]]*\])\)"
)


def shape_mismatch(message: str) -> str | None:
    """'shape mismatch: weight X is [A] in the checkpoint, [B] in the model' from torch's error."""
    found = _SIZE_MISMATCH.findall(message)
    if not found:
        return None
    first = "; ".join(
        f"weight {n} is {a} in the checkpoint, {b} in the model" for n, a, b in found[:3]
    )
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    return f"shape mismatch: {first}{more}"


# --------------------------------------------------------------------------- export


def _clean_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # clone() unties shared storage, which safetensors refuses to write.
    return {key: tensor.detach().cpu().contiguous().clone() for key, tensor in state.items()}


def export_paths(target: Path) -> tuple[Path, Path]:
    """(weights file, metadata JSON) of an export: a folder holds model.safetensors and
    model.json; a target ending in .safetensors is the weights file, with NAME.json beside it
    (model.safetensors -> model.json). An existing folder stays a folder whatever its name, so
    one that an earlier version wrote as OUT.safetensors/ is still read and replaced as such."""
    target = Path(target)
    if target.suffix == ".safetensors" and not target.is_dir():
        return target, target.with_suffix(".json")
    return target / MODEL_FILE, target / META_FILE


def require_export_target(target: Path, force: bool) -> Path:
    """The weights file an export to `target` writes, checked before anything is read: not under
    a file, and not over an export unless `force`."""
    model_path, _ = export_paths(target)
    if model_path.parent.exists() and not model_path.parent.is_dir():
        raise CheckpointError(
            f"{model_path.parent} is a file; give a folder to write {MODEL_FILE} into, or a "
            "NAME.safetensors path"
        )
    if model_path.exists() and not force:
        raise CheckpointError(f"{model_path} exists; pass --force to overwrite it")
    return model_path


def write_export(state: Mapping[str, torch.Tensor], target: Path, metadata: dict[str, Any]) -> Path:
    """Write the weights and their JSON (see `export_paths`), each via a temporary name."""
    model_path, meta_path = export_paths(target)
    text = strict_json(metadata, meta_path)  # before anything is written
    tmp_model = model_path.with_name(model_path.name + ".tmp")
    tmp_meta = meta_path.with_name(meta_path.name + ".tmp")
    try:
        model_path.parent.mkdir(parents=True, exist_ok=True)
        save_file(_clean_tensors(strip_wrapper_prefixes(state)), str(tmp_model), {"format": "pt"})
        tmp_meta.write_text(text)
        # safetensors writes through a private temporary file (mode 0600): give the export the
        # permissions any file the user creates gets, so colleagues and serving jobs can read it
        os.chmod(tmp_model, 0o666 & ~current_umask())
    except OSError as err:
        tmp_model.unlink(missing_ok=True)
        tmp_meta.unlink(missing_ok=True)
        raise CheckpointError(
            f"{write_failure(err)} while writing the export {model_path}; an export already "
            f"there is unchanged: {WRITE_ADVICE[disk_full(err)]}, then export again (a training "
            "run: --resume latest)"
        ) from None
    os.replace(tmp_model, model_path)
    os.replace(tmp_meta, meta_path)
    return model_path


def strict_json(data: Any, path: Path) -> str:
    """`data` as the JSON text of `path`. NaN and infinity are refused, naming the entry: JSON has
    no such numbers (Python would write `NaN`, which strict readers reject)."""
    try:
        return json.dumps(data, indent=2, default=str, allow_nan=False)
    except ValueError:
        bad = "; ".join(f"{key} is {value}" for key, value in non_finite_entries(data))
        raise CheckpointError(
            f"{path}: {bad or 'a value is not finite'}; JSON cannot hold it, so nothing was written"
        ) from None


def non_finite_entries(data: Any, prefix: str = "") -> list[tuple[str, float]]:
    """('metrics.train_loss', nan) for every NaN or infinite float in nested dicts and lists."""
    if isinstance(data, float):
        return [] if math.isfinite(data) else [(prefix or "the value", data)]
    if isinstance(data, Mapping):
        items = ((f"{prefix}.{key}" if prefix else str(key), v) for key, v in data.items())
    elif isinstance(data, (list, tuple)):
        items = ((f"{prefix}[{i}]", v) for i, v in enumerate(data))
    else:
        return []
    return [found for key, value in items for found in non_finite_entries(value, key)]


def current_umask() -> int:
    """The process's umask (reading it means setting it: set it straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def export_model(
    accelerator: Accelerator,
    model: torch.nn.Module,
    out_dir: Path,
    *,
    recipe: str,
    config: dict[str, Any],
    plan: BatchPlan,
    step: int,
    metrics: dict[str, float],
) -> Path:
    """Export the trained model; every process calls this (gathering shards is collective)."""
    state = accelerator.get_state_dict(model)
    path = Path(out_dir) / MODEL_FILE
    if accelerator.is_main_process:
        metadata = {
            "recipe": recipe,
            "config": config,
            "batch_plan": plan.as_dict(),
            "step": step,
            "metrics": metrics,
        }
        path = write_export(state, out_dir, metadata)
    accelerator.wait_for_everyone()
    return path


def read_export_metadata(path: Path) -> dict[str, Any]:
    """The JSON written beside an export (recipe, config, batch plan, step, metrics)."""
    path = Path(path)
    meta_path = path / META_FILE if path.is_dir() else path.with_suffix(".json")
    try:
        return json.loads(meta_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{meta_path}: cannot read the export's metadata ({err})") from err


def read_recipe_export(model_dir: Path, recipe: str, flag: str = "--model") -> dict[str, Any]:
    """The training config of an export made by `recipe`: what its commands need to rebuild the
    model. An export of another recipe, a converted checkpoint (no config) or a missing folder
    is a clear error naming `flag` (the argument that named the folder) instead of a KeyError."""
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise CheckpointError(f"{flag} {model_dir}: no such folder (training writes OUTPUT/model)")
    meta = read_export_metadata(model_dir)
    if meta.get("recipe") == recipe and isinstance(meta.get("config"), dict):
        return meta["config"]
    if "converted_from" in meta:
        origin = f"converted by `accel-recipes convert` from {meta['converted_from']}"
    else:
        settings = ", ".join(f"{k}={v}" for k, v in list((meta.get("config") or {}).items())[-6:])
        origin = f"exported by the {meta.get('recipe')!r} recipe ({settings})"
    raise CheckpointError(
        f"{model_dir} was {origin}; it records no {recipe} settings to rebuild this recipe's "
        f"model from. Point {flag} at the model folder a {recipe} training run exported"
    )


def load_exported(
    path: Path, model: torch.nn.Module, device: str | torch.device = "cpu"
) -> dict[str, Any]:
    """Load an export (its folder or its .safetensors) strictly into `model`; return its JSON."""
    path = Path(path)
    model_path = path / MODEL_FILE if path.is_dir() else path
    if not model_path.is_file():
        raise CheckpointError(f"no exported model at {model_path}")
    try:
        state = load_file(str(model_path), device=str(device))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{model_path} is not a readable safetensors file: {err}") from err
    misfit = (
        f"{model_path} does not fit this model (were the width/depth flags the same as in "
        f"training? see {META_FILE} beside it)"
    )
    require_same_tensors(state, model.state_dict(), misfit)  # one line, not torch's list
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"{misfit}: {err}") from err
    return read_export_metadata(model_path) if model_path.with_suffix(".json").is_file() else {}


def inference_device() -> torch.device:
    """This machine's accelerator (CUDA, MPS, XPU, ...), or the CPU without one."""
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator()
    return torch.device("cpu")


def load_for_inference(model_dir: Path, model: torch.nn.Module) -> torch.device:
    """Load an export into `model` and put it in eval mode on `inference_device()`: how every
    recipe's single-device command (predict, score, caption, ...) starts. Returns the device."""
    load_exported(model_dir, model)
    device = inference_device()
    model.to(device).eval()
    return device


# --------------------------------------------------------------------------- conversion


def require_same_tensors(
    state: Mapping[str, torch.Tensor], expected: Mapping[str, Any], where: str
) -> None:
    """A strict import's check, before loading: `state` has every tensor `expected` names (a
    state dict, or shapes), no other, each of the same shape; else one line naming the first
    mismatch and both shapes (another architecture, or other sizes)."""
    shapes = {k: tuple(getattr(v, "shape", v)) for k, v in expected.items()}
    for key, shape in shapes.items():
        if key not in state:
            raise CheckpointError(f"{where}: missing tensor {key} {shape}")
        if tuple(state[key].shape) != shape:
            raise CheckpointError(
                f"{where}: {key} has shape {tuple(state[key].shape)} in the checkpoint, {shape} "
                "in this recipe's network"
            )
    unexpected = [k for k in state if k not in shapes]
    if unexpected:
        name = unexpected[0]
        raise CheckpointError(
            f"{where}: unexpected tensor {name} {tuple(state[name].shape)} (another network?)"
        )


def strip_wrapper_prefixes(state: Mapping[str, Any]) -> dict[str, Any]:
    """Remove DDP/compile wrapper prefixes in any nesting, and compiled-submodule `_orig_mod.`."""
    cleaned: dict[str, Any] = {}
    for key, value in state.items():
        new = key
        while prefix := next((p for p in WRAPPER_PREFIXES if new.startswith(p)), None):
            new = new[len(prefix) :]
        new = new.replace("._orig_mod.", ".")
        if new in cleaned:
            raise CheckpointError(
                f"removing wrapper prefixes maps two keys onto '{new}' (one of them is '{key}')"
            )
        cleaned[new] = value
    return cleaned


def unwrap_state_dict(obj: Any, source: str) -> dict[str, torch.Tensor]:
    """Descend through `model_state` / `state_dict` / `model` wrappers to the tensors."""
    while isinstance(obj, Mapping) and not all(torch.is_tensor(v) for v in obj.values()):
        key = next((k for k in STATE_DICT_WRAPPERS if isinstance(obj.get(k), Mapping)), None)
        if key is None:
            keys = ", ".join(sorted(map(str, obj))[:12])
            raise CheckpointError(
                f"{source}: found no model weights; top-level keys are [{keys}] and none of "
                f"{', '.join(STATE_DICT_WRAPPERS)} holds a state dict"
            )
        obj = obj[key]
    if not isinstance(obj, Mapping) or not obj:
        raise CheckpointError(f"{source}: contains no tensors")
    return dict(obj)


def _accelerate_folder_weights(folder: Path, model_index: int) -> Path:
    """The model's weights in a save_state folder: a file, or FSDP's sharded DCP folder."""
    suffix = "" if model_index == 0 else f"_{model_index}"
    for name in (
        f"model{suffix}.safetensors",
        f"pytorch_model{suffix}.bin",
        FSDP_FULL_FILE.format(suffix=suffix),
        FSDP_SHARDED_DIR.format(index=model_index),
    ):
        if (folder / name).is_file() or (folder / name / DCP_METADATA).is_file():
            return folder / name
    if (folder / "zero_to_fp32.py").is_file() or (folder / f"pytorch_model{suffix}").is_dir():
        raise CheckpointError(
            f"{folder} is a DeepSpeed ZeRO checkpoint; merge it with DeepSpeed's own script first "
            f"(needs `pip install deepspeed`): python {folder}/zero_to_fp32.py {folder} MERGED "
            f"--tag pytorch_model{suffix} --safe_serialization, then convert "
            "MERGED/model.safetensors"
        )
    raise CheckpointError(
        f"{folder}: no model{suffix}.safetensors, pytorch_model{suffix}.bin, "
        f"{FSDP_FULL_FILE.format(suffix=suffix)} or {FSDP_SHARDED_DIR.format(index=model_index)}/ "
        "in this folder; is it an accelerator.save_state checkpoint?"
    )


def file_kind(path: Path) -> str | None:
    """'safetensors', 'torch' (a torch.save zip archive or legacy pickle) or None, by content."""
    with Path(path).open("rb") as handle:
        head = handle.read(9)
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
        return "torch"
    if len(head) == 9 and head[8:9] == b"{":  # an 8-byte header length, then the JSON header
        return "safetensors"
    return None


def read_state_dict(source: Path, model_index: int = 0) -> dict[str, torch.Tensor]:
    """Read weights from a .safetensors/torch.save file, an Accelerate folder or a DCP folder."""
    source = Path(source)
    if not source.exists():
        raise CheckpointError(f"{source}: no such file or folder")
    if source.is_dir() and not (source / DCP_METADATA).is_file():
        source = _accelerate_folder_weights(source, model_index)
    if source.is_dir():
        # imported here: torch.distributed.checkpoint costs a recipe ~1.3 s of start-up
        from accel_common.dcp_reader import read_dcp_model

        return read_dcp_model(source)
    kind = file_kind(source)
    if kind is None and source.suffix == ".safetensors":
        kind = "safetensors"  # too short even for a header: reported as truncated below
    if kind is None:
        raise CheckpointError(
            f"{source} is neither a safetensors file nor a PyTorch checkpoint (torch.save writes "
            "a zip archive or a pickle; this file starts with neither), so nothing was loaded"
        )
    if kind == "safetensors":
        try:
            return load_file(str(source))
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{source} is corrupt or truncated: {err}") from err
    try:
        obj = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as err:
        if "weights_only" in str(err) or "Unsupported global" in str(err):
            raise CheckpointError(
                f"{source} holds pickled Python objects beyond tensors, and loading it would run "
                "arbitrary code, so it was not loaded. If you trust it, re-save only the weights: "
                "torch.save(model.state_dict(), 'weights.pt')"
            ) from err
        raise CheckpointError(
            f"{source} is corrupt, truncated or not a PyTorch file: {err}"
        ) from err
    return unwrap_state_dict(obj, str(source))


def convert_checkpoint(
    source: Path,
    target: Path,
    *,
    recipe: str = "unknown",
    model_index: int = 0,
    force: bool = False,
) -> Path:
    """Turn a foreign checkpoint into the project's clean export (safetensors + JSON): `target`
    is a folder (model.safetensors + model.json) or a NAME.safetensors file (+ NAME.json)."""
    require_export_target(target, force)
    state = read_state_dict(source, model_index)
    metadata = {"recipe": recipe, "converted_from": str(source), "num_tensors": len(state)}
    return write_export(state, target, metadata)
