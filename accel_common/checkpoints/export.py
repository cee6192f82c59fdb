"""The export: one safetensors file with clean keys and a JSON beside it, what a run leaves for
plain PyTorch. Recipes load it on any single device (`load_exported`, `load_for_inference`,
`read_recipe_export`); the loop and conversion write it (`write_export`). Its strict JSON and
write-failure messages serve resumable state too.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from accel_common.batch_lr.batching import BatchPlan
from accel_common.checkpoints.hf_layout import HFLayout, hf_layout
from accel_common.checkpoints.model_card import CARD_FILE, model_card
from accel_common.checkpoints.ties import missing_tie
from accel_common.errors import CheckpointError, ConfigError
from accel_common.hardware.launch_guard import require_writable_folder
from accel_common.hardware.parameters import parameter_counts
from accel_common.run_folder.outputs import disk_full, partial_path, place_file, write_failure
from accel_common.settings import CONFIG_FROM_SET, RecordedConfig

MODEL_FILE = "model.safetensors"
META_FILE = "model.json"
UNNAMED_RECIPE = "unknown"  # what `accel-recipes convert` records without --recipe
# Prefixes added by DDP / DataParallel (`module.`), torch.compile (`_orig_mod.`) and Lightning-style
# modules holding a DDP model (`model.module.`), in any nesting.
WRAPPER_PREFIXES = ("model.module.", "module.", "_orig_mod.")


# what to do after a write failed: on a full disk (or quota), or for another reason
WRITE_ADVICE = {
    True: "free space on that disk, or move --output-dir to another one",
    False: "check that the --output-dir disk is writable and healthy",
}


# a folder with less space left than this after a failed write was filled by it
FULL_BELOW = 64 * 2**20
# what torch.save's C++ writer says when it cannot open or write its file (it keeps no errno)
TORCH_WRITE_FAILURE = r"inline_container|PytorchStreamWriter|cannot be opened|Parent directory"


def as_write_error(err: Exception, folder: Path) -> OSError | None:
    """The OSError behind a failed write into `folder`, or None if `err` is no write failure.

    Only Python's own writes raise OSError: safetensors reports a full disk as a SafetensorError
    ending in '(os error 28)', and torch.save's C++ writer as a RuntimeError with no errno at all
    ('unexpected pos 576 vs 534'), so a full disk is told by the space left in `folder`."""
    if isinstance(err, OSError):
        return err
    text = str(err)
    if isinstance(err, SafetensorError) and (found := re.search(r"\(os error (\d+)\)", text)):
        code = int(found.group(1))
        return OSError(code, os.strerror(code))
    if isinstance(err, RuntimeError) and re.search(TORCH_WRITE_FAILURE, text):
        existing = next(p for p in (folder, *Path(folder).absolute().parents) if p.exists())
        if shutil.disk_usage(existing).free < FULL_BELOW:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return OSError(errno.EIO, text.splitlines()[0] if text else "torch.save failed")
    return None


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
    a file, and neither it nor its JSON over existing files unless `force`."""
    model_path, meta_path = export_paths(target)
    if model_path.parent.exists() and not model_path.parent.is_dir():
        raise CheckpointError(
            f"{model_path.parent} is a file; give a folder to write {MODEL_FILE} into, or a "
            "NAME.safetensors path"
        )
    require_writable_folder(model_path.parent, "OUTPUT", target)
    require_new_files([model_path, meta_path], force)
    return model_path


def require_new_files(paths: Iterable[Path], force: bool) -> None:
    """Never replace a file unless `force`: the one the user named, nor any a command writes
    beside it (the export's JSON, a vocabulary, an original's config.json), which may belong to
    another export in the same folder. Checked before anything is written."""
    if force:
        return
    for path in paths:
        if path.exists():
            raise CheckpointError(f"{path} exists; pass --force to overwrite it")


def write_export(
    state: Mapping[str, torch.Tensor],
    target: Path,
    metadata: dict[str, Any],
    layout: HFLayout | None = None,
    card: bool = False,
) -> Path:
    """Write the weights and their JSON (see `export_paths`), each via a private temporary name,
    moved into place by `outputs.place_file` (never over an existing file in a command that
    promises so: `outputs.exclusive_outputs`). A folder export also gets `layout`'s files (a
    diffusers or transformers model's config.json, its weights under the library's file name:
    `hf_layout`) and, with `card`, a README.md model card (`model_card`)."""
    model_path, meta_path = export_paths(target)
    text = strict_json(metadata, meta_path)  # before anything is written
    folder = model_path.parent
    extras: dict[Path, bytes] = {}
    aliases: list[Path] = []
    if model_path == Path(target) / MODEL_FILE:  # a folder, not NAME.safetensors
        if layout is not None:
            extras = {folder / name: data for name, data in layout.files.items()}
            aliases = [folder / layout.weights_name] if layout.weights_name != MODEL_FILE else []
        if card:
            extras[folder / CARD_FILE] = model_card(metadata, str(target), layout).encode()
    targets = [model_path, *aliases, *extras, meta_path]
    partials = {path: partial_path(path) for path in targets}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp_model = partials[model_path]
        save_file(_clean_tensors(strip_wrapper_prefixes(state)), str(tmp_model), {"format": "pt"})
        # safetensors writes through a private temporary file (mode 0600): give the export the
        # permissions any file the user creates gets, so colleagues and serving jobs can read it
        os.chmod(tmp_model, 0o666 & ~current_umask())
        for alias in aliases:  # the same bytes under the library's name: a link, else a copy
            try:
                os.link(tmp_model, partials[alias])
            except OSError:
                shutil.copyfile(tmp_model, partials[alias])
        for path, data in extras.items():
            partials[path].write_bytes(data)
        partials[meta_path].write_text(text)
    except (OSError, SafetensorError) as raw:
        if (err := as_write_error(raw, folder)) is None:
            raise
        with contextlib.suppress(OSError):
            for partial in partials.values():
                partial.unlink(missing_ok=True)
        raise CheckpointError(
            f"{write_failure(err)} while writing the export {model_path}; an export already "
            f"there is unchanged: {WRITE_ADVICE[disk_full(err)]}, then export again (a training "
            "run: --resume latest)"
        ) from None
    try:
        for path in targets:
            place_file(partials[path], path, "OUTPUT")
    finally:
        for partial in partials.values():
            partial.unlink(missing_ok=True)
    return model_path


def save_file_atomically(target: Path, write: Callable[[Path], object], what: str) -> Path:
    """`write(temporary)` then move it to `target` (`outputs.place_file`: never over an existing
    file within `outputs.exclusive_outputs`): a failed write (a full disk, a folder that cannot
    be written) leaves a file already at `target` unchanged and no partial one, and is one line
    naming `target` and `what` to do (e.g. 'convert again')."""
    target = Path(target)
    partial = partial_path(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write(partial)
        place_file(partial, target, "OUTPUT")
    except (OSError, RuntimeError, SafetensorError) as raw:
        if (err := as_write_error(raw, target.parent)) is None:
            raise
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        raise CheckpointError(
            f"{write_failure(err)} while writing {target}; a file already there is unchanged: "
            f"{WRITE_ADVICE[disk_full(err)].replace('--output-dir', 'the output')}, then {what}"
        ) from None
    return target


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
    schedule: dict[str, Any],
    step: int,
    metrics: dict[str, float],
    derived: Iterable[str] = (),
    ema: dict[str, Any] | None = None,
) -> Path:
    """Export the trained model; every process calls this (gathering shards is collective).
    Its metadata records what `--dry-run` promises of the run (parameter counts as it counts
    them, the batch plan, `schedule`: the LR line and optimizer steps), so each can be held to
    the other. `derived`: the config's values computed from the data (not flags: the model
    card's command leaves them out). `ema`: the weights are an EMA of the trained ones, so
    recorded (training.ema). A diffusers or transformers model's export is also that
    library's `from_pretrained` folder (`hf_layout`); every export gets a README.md."""
    state = accelerator.get_state_dict(model)
    path = Path(out_dir) / MODEL_FILE
    if accelerator.is_main_process:
        metadata = {
            "recipe": recipe,
            "config": config,
            "parameters": parameter_counts(accelerator.unwrap_model(model)),
            "batch_plan": plan.as_dict(),
            "schedule": schedule,
            "step": step,
            "metrics": metrics,
        } | ({"derived": sorted(derived)} if derived else {})
        if ema:
            metadata["ema"] = ema
        layout = hf_layout(accelerator.unwrap_model(model))
        path = write_export(state, out_dir, metadata, layout, card=True)
    accelerator.wait_for_everyone()
    return path


def intact_weights(path: Path) -> bool:
    """Whether `path` is weights as an export writes them: a regular file (no link) whose
    safetensors header reads."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with safe_open(path, framework="pt"):
            return True
    except (SafetensorError, OSError):
        return False


def read_export_metadata(path: Path) -> dict[str, Any]:
    """The JSON written beside an export (recipe, config, batch plan, step, metrics)."""
    path = Path(path)
    meta_path = path / META_FILE if path.is_dir() else path.with_suffix(".json")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{meta_path}: cannot read the export's metadata ({err})") from err
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_path}: not an export's metadata (a JSON object)")
    return meta


def read_recipe_export(model_dir: Path, recipe: str, flag: str = "--model") -> dict[str, Any]:
    """The training config of an export made by `recipe`: what its commands need to rebuild the
    model. An export of another recipe, a converted checkpoint (no config) or a missing folder
    is a clear error naming `flag` (the argument that named the folder) instead of a KeyError."""
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise CheckpointError(f"{flag} {model_dir}: no such folder (training writes OUTPUT/model)")
    if model_dir.is_file() and model_dir.suffix != ".safetensors":
        raise CheckpointError(
            f"{flag} {model_dir} is not an export: give the model folder training writes "
            "(OUTPUT/model: model.safetensors + model.json), or a NAME.safetensors export"
        )
    meta = read_export_metadata(model_dir)
    converted = "converted_from" in meta
    if meta.get("recipe") == recipe and isinstance(meta.get("config"), dict):
        if meta.get("config_from") == CONFIG_FROM_SET:  # a foreign checkpoint's: what --set gave
            where = f"{model_dir} (converted from {meta.get('converted_from')})"
            return RecordedConfig(meta["config"], where, recipe)
        return meta["config"]
    if converted:
        origin = (
            f"converted by `accel-recipes convert` from {meta['converted_from']}, for the "
            f"{meta.get('recipe')!r} recipe"
        )
    else:
        settings = ", ".join(f"{k}={v}" for k, v in list((meta.get("config") or {}).items())[-6:])
        origin = f"exported by the {meta.get('recipe')!r} recipe ({settings})"
    raise CheckpointError(
        f"{model_dir} was {origin}; it records no {recipe} settings to rebuild this recipe's "
        f"model from. Point {flag} at the model folder a {recipe} training run exported"
        + (
            f", or convert it again with --recipe {recipe} --set NAME=VALUE for each setting "
            "its model was trained with"
            if converted and "num_tensors" in meta
            else ""
        )
    )


def read_export_weights(path: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of an export (its folder or its .safetensors), or one line naming the file."""
    path = Path(path)
    model_path = path / MODEL_FILE if path.is_dir() else path
    if not model_path.is_file():
        raise CheckpointError(f"no exported model at {model_path}")
    try:
        return load_file(str(model_path), device=str(device))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{model_path} is not a readable safetensors file: {err}") from err


def require_start_export(
    source: Path, recipe: str, original: str | None, flag: str = "--init-from"
) -> Path:
    """The weights file of an export of `recipe` to start training from, checked before the
    work: an original's checkpoint (a torch.save file, or a folder of them) is one line naming the
    convert command that makes it an export; another recipe's export is one naming that recipe
    (not a misfit of widths); no export there, one saying what to give."""
    source = Path(source)
    convert = (
        f"convert it first: accel-recipes convert --from {original} {source} OUT"
        if original
        else f"convert it first: accel-recipes convert {source} OUT --recipe {recipe}"
    ) + f", then {flag} OUT"
    if source.is_file() and source.suffix != ".safetensors":
        kind = f"{original}'s checkpoint or another torch.save file" if original else "a file"
        raise ConfigError(f"{flag} {source}: not an export but {kind}; {convert}")
    weights, meta_path = export_paths(source)
    if not weights.is_file():
        saved = sorted(p.name for p in source.glob("*.pt*")) if source.is_dir() else []
        if saved:
            raise ConfigError(
                f"{flag} {source}: no export there but checkpoint files ({', '.join(saved[:3])});"
                f" {convert.replace(str(source), str(source / saved[0]))}"
            )
        raise ConfigError(
            f"{flag} {source}: no export there (no {weights}); give the model folder a {recipe} "
            "training run wrote (OUTPUT/model), or its NAME.safetensors"
        )
    other = read_export_metadata(weights).get("recipe") if meta_path.is_file() else None
    if other not in (None, recipe, UNNAMED_RECIPE):  # unnamed: convert without --recipe
        made = f" (or convert --from {original})" if original else ""
        raise ConfigError(
            f"{flag} {source} is the {other} recipe's export, not the {recipe} recipe's; give "
            f"the model folder a {recipe} training run{made} wrote"
        )
    return weights


def load_exported(
    path: Path, model: torch.nn.Module, device: str | torch.device = "cpu"
) -> dict[str, Any]:
    """Load an export (its folder or its .safetensors) strictly into `model`; return its JSON."""
    path = Path(path)
    model_path = path / MODEL_FILE if path.is_dir() else path
    state = read_export_weights(model_path, device)
    misfit = (
        f"{model_path} does not fit this model (were the width/depth flags the same as in "
        f"training? see {META_FILE} beside it)"
    )
    expected = model.state_dict()
    if tie := missing_tie(state, expected):
        raise CheckpointError(
            f"{model_path}: {tie[0]} is tied to {tie[1]} in this model and is absent from the "
            "file (safetensors keeps one name of tied weights); convert the checkpoint again "
            "with `accel-recipes convert`, which writes every name of a tie"
        )
    require_same_tensors(state, expected, misfit)  # one line, not torch's list
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
