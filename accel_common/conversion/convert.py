"""Conversion of foreign checkpoints (DDP / torch.compile / Accelerate folders, FSDP's sharded
DCP folders, plain torch.save files) into the project's export, without ever unpickling arbitrary
objects: what `accel-recipes convert` and a recipe's `--weights` read.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from accel_common.checkpoints.checkpoint_files import (
    MANIFEST_FILE,
    PROGRESS_FILE,
    checkpoint_files,
    refused_global,
    require_manifest,
    torch_load_detail,
    verify_files,
)
from accel_common.checkpoints.dcp_reader import DCP_METADATA, FSDP_SHARDED_DIR, read_dcp_model
from accel_common.checkpoints.export import UNNAMED_RECIPE, require_export_target, write_export
from accel_common.checkpoints.ties import TIES_FILE, restore_ties, saved_ties
from accel_common.conversion.hf_layouts import read_hf_folder
from accel_common.data.paths import what_is
from accel_common.errors import CheckpointError, RecipeError
from accel_common.run_folder.outputs import exclusive_outputs
from accel_common.settings import CONFIG_FROM_SET

# Wrappers that training scripts put around a state dict, outermost first.
STATE_DICT_WRAPPERS = ("model_state_dict", "model_state", "state_dict", "model")

# What `accelerator.save_state` writes for a model under FSDP with FULL_STATE_DICT: one
# torch.save file (SHARDED_STATE_DICT: a DCP folder, see accel_common.checkpoints.dcp_reader).
FSDP_FULL_FILE = "pytorch_model_fsdp{suffix}.bin"


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
        "in this folder, nor a model's config.json with its weights (save_pretrained), a "
        "pipeline's model_index.json, or a subfolder a save hook wrote; is it an "
        "accelerator.save_state checkpoint?"
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
    """Read weights from a .safetensors/torch.save file, an Accelerate folder, a DCP folder or a
    Hugging Face save_pretrained / pipeline folder (`read_weights` says which)."""
    return read_weights(source, model_index)[0]


def read_weights(
    source: Path, model_index: int = 0, component: str | None = None
) -> tuple[dict[str, torch.Tensor], str]:
    """`read_state_dict`'s tensors, and a line saying what was read ('' for a file or an
    Accelerate / DCP folder): a Hugging Face layout (accel_common.conversion.hf_layouts) names
    its model class, file and tensor count. `component`: a pipeline's (or a hook-saved
    save_state folder's) model subfolder."""
    source = Path(source)
    if source.is_dir() and not (source / DCP_METADATA).is_file():
        found = read_hf_folder(source, _read_file, component, hooked=False)
        if found is None:
            try:
                _accelerate_folder_weights(source, model_index)
            except CheckpointError:  # a save hook put the model in a subfolder, or nothing
                found = read_hf_folder(source, _read_file, component)
                if found is None:
                    raise
        if found is not None:
            return found
    elif component is not None:
        raise CheckpointError(
            f"--component {component}: {source} is no diffusers pipeline or save_state folder"
        )
    return _read_file(source, model_index), ""


def _read_file(source: Path, model_index: int = 0) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint file, or of an Accelerate / DCP folder."""
    if not source.exists():
        raise CheckpointError(f"{source}: no such file or folder")
    if not source.is_dir() and not source.is_file():
        raise CheckpointError(
            f"{source} is {what_is(source, source.stat().st_mode)}, not a checkpoint file or "
            "folder; nothing was read from it"
        )
    if source.is_dir() and not (source / DCP_METADATA).is_file():
        source = _accelerate_folder_weights(source, model_index)
    if source.is_dir():
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
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note on a pickle protocol it did not write
            obj = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as err:
        refused = refused_global(err, source, [])
        if refused:
            raise CheckpointError(
                f"{source} holds a pickled {refused} beyond tensors, and loading it could run "
                "arbitrary code, so it was not loaded. If you trust it, re-save only the weights: "
                "torch.save(model.state_dict(), 'weights.pt')"
            ) from None
        raise CheckpointError(
            f"{source} is corrupt, truncated or not a PyTorch file ({torch_load_detail(err)})"
        ) from None
    return unwrap_state_dict(obj, str(source))


def load_original_checkpoint(source: Path, original: str, state_key: str) -> Any:
    """`torch.load(source, weights_only=True)` of a checkpoint saved by `original`'s trainer (a
    dict holding the state dict under `state_key`), every way that fails as one line naming the
    file: missing, a folder, empty, a safetensors or text file, truncated, or holding pickled
    objects (never unpickled here: that can run code)."""
    source = Path(source)
    expected = f"the file {original}'s trainer saves ({{'{state_key}': state_dict, ...}})"
    if not source.exists():
        raise CheckpointError(f"{source}: no such file; give {expected}")
    if source.is_dir():
        raise CheckpointError(f"{source} is a folder; give {expected}")
    if source.stat().st_size == 0:
        raise CheckpointError(f"{source} is empty (0 bytes: an interrupted copy?); give {expected}")
    kind = file_kind(source)
    if kind == "safetensors":
        raise CheckpointError(
            f"{source} is a safetensors file (as this project's exports are), not {expected}; "
            "an export needs no --from: use it as it is"
        )
    if kind is None:
        raise CheckpointError(
            f"{source}: not a torch checkpoint, or a damaged one (torch.save writes a zip archive "
            f"or a pickle; this file starts with neither); give {expected}"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note on a pickle protocol it did not write
            return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises whatever its unpickler or zip reader met
        refused = refused_global(err, source, [])
        if refused:
            raise CheckpointError(
                f"{source}: holds a pickled {refused} object, which is not unpickled "
                "here (weights_only: unpickling can run code). If you trust the file, save the "
                f"weights alone and convert that: torch.save({{'{state_key}': torch.load("
                f"'{source}', weights_only=False)['{state_key}']}}, 'weights.pth')"
            ) from None
        detail = str(err).split("WeightsUnpickler error:")[-1].strip().split(". ")[0]
        first = detail.splitlines()[0] if detail else ""
        raise CheckpointError(
            f"{source}: not a torch checkpoint, or a damaged one: truncated? "
            f"({type(err).__name__}{': ' + first if first else ''}); copy it again from where "
            "it was saved"
        ) from None


def require_tensors(state: Any, source: Path, where: str) -> dict[str, torch.Tensor]:
    """`state` if it is a non-empty dict of tensors, else one line naming `source` and `where`
    in it the state dict was looked for (a checkpoint with lists or numbers in its place)."""
    if isinstance(state, Mapping) and state and all(torch.is_tensor(v) for v in state.values()):
        return dict(state)
    got = type(state).__name__ if not isinstance(state, Mapping) else "a dict of other values"
    if isinstance(state, Mapping) and not state:
        got = "an empty dict"
    raise CheckpointError(f"{source}: {where} is {got}, not a state dict of tensors")


def convert_checkpoint(
    source: Path,
    target: Path,
    *,
    recipe: str = UNNAMED_RECIPE,
    model_index: int = 0,
    force: bool = False,
    allow_unverified: bool = False,
    component: str | None = None,
    config: dict[str, Any] | None = None,
) -> Path:
    """Turn a foreign checkpoint into the project's clean export (safetensors + JSON): `target`
    is a folder (model.safetensors + model.json) or a NAME.safetensors file (+ NAME.json).
    Without `force`, never over a file, even one another process wrote after the check. A
    checkpoint folder this project saved is read only as its manifest vouches for it
    (`require_vouched`). A Hugging Face layout is said in one line on stdout (`read_weights`);
    `config` (the recipe's settings `--set` gave) is recorded for its commands."""
    require_export_target(target, force)
    source, folder = Path(source), checkpoint_folder(Path(source))
    within = source if source.is_dir() else folder
    if within is not None and Path(target).resolve().is_relative_to(within.resolve()):
        raise CheckpointError(
            f"{target} is inside the checkpoint {within}, which would then hold a file its save "
            "did not write: convert to a path outside it"
        )
    if folder is not None:
        require_vouched(folder, allow_unverified)
    # the tied names a save_state file lacks (safetensors keeps one of them), restored
    weights, read = read_weights(source, model_index, component)
    state = restore_ties(weights, saved_ties(source, model_index))
    metadata = {"recipe": recipe, "converted_from": str(source), "num_tensors": len(state)}
    if read:
        print(read)
        metadata["read"] = read.removeprefix("read ")
    if config is not None:  # for a recipe of this checkout's: what --set gave its commands
        metadata |= {"config": config, "config_from": CONFIG_FROM_SET}
    with exclusive_outputs(not force):
        return write_export(state, target, metadata)


def checkpoint_folder(source: Path) -> Path | None:
    """The checkpoint folder of this project's (one holding progress.json, manifest.json or
    tied.json) that `source` is or lies in, or None: another tool's file or folder."""
    folder = source if source.is_dir() else source.parent
    if (folder / DCP_METADATA).is_file():  # FSDP's sharded model folder inside a checkpoint
        folder = folder.parent
    ours = (MANIFEST_FILE, PROGRESS_FILE, TIES_FILE)
    return folder if any(os.path.lexists(folder / name) for name in ours) else None


def require_vouched(folder: Path, allow_unverified: bool) -> None:
    """A checkpoint folder of this project's is converted only if its manifest lists every file
    it holds as saved: a tied.json added afterwards would export tensors the model does not
    have. One without a manifest is refused unless `allow_unverified`. Other tools' folders
    carry no manifest, and nothing of ours is read from them."""
    checkpoint_files(folder)  # regular files only: a FIFO or /dev/zero would never end
    try:
        record = json.loads((folder / PROGRESS_FILE).read_text())
    except (OSError, ValueError, RecursionError):
        record = None  # no record: the manifest decides
    manifest = require_manifest(folder, record, allow_unverified=allow_unverified, use="convert")
    if manifest is not None:
        verify_files(folder, manifest)


def parse_given(pairs: list[str]) -> dict[str, str]:
    """`convert --set NAME=VALUE ...` as {NAME: VALUE}; anything else is one line."""
    given = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise RecipeError(f"--set {pair}: give NAME=VALUE, e.g. --set dropout=0.15")
        given[name.strip().replace("-", "_")] = value.strip()
    return given


def _as_type_of(value: str, assumed: Any, name: str) -> Any:
    """The text `value` as the type of the value the import assumed for `name`."""
    kind = type(assumed)
    try:
        if kind is bool:
            if value.lower() not in ("true", "false"):
                raise ValueError
            return value.lower() == "true"
        parsed = kind(value)
    except ValueError:
        raise RecipeError(
            f"--set {name}={value}: not a {kind.__name__} (as the assumed {assumed!r})"
        ) from None
    if isinstance(parsed, float) and not math.isfinite(parsed):
        raise RecipeError(f"--set {name}={value}: not a finite number")
    return parsed


def settle_unrecorded(
    source: Path,
    assumed: dict[str, Any],
    given: Mapping[str, str],
    supplied: dict[str, tuple[Any, str]] | None = None,
) -> tuple[dict[str, Any], str]:
    """The values of the settings an original's checkpoint does not record: `assumed` (the
    original's defaults) unless a file beside it `supplied` one ({name: (value, file name)}) or
    `--set` gave one (which wins); and ONE line saying which it lacks and what is used ("" when
    it lacks none), for `tell` once the import has succeeded, so that a model trained at another
    value is not converted silently. A --set of a setting the checkpoint records (or this
    import does not read) is one line naming those it takes."""
    supplied = supplied or {}
    unknown = sorted(set(given) - set(assumed))
    if unknown:
        takes = ", ".join(assumed) if assumed else "nothing: it records all this import reads"
        raise RecipeError(
            f"--set {unknown[0]}: {source} records it, or the import does not read it; "
            f"--set takes {takes}"
        )
    values, origins = {}, []
    for name, default in assumed.items():
        if name in given:
            values[name] = _as_type_of(given[name], default, name)
            origins.append(f"{name} {values[name]!r} (--set)")
        elif name in supplied:
            values[name], where = supplied[name]
            origins.append(f"{name} {values[name]!r} ({where})")
        else:
            values[name] = default
            origins.append(f"{name} {default!r} (the original's default)")
    note = (
        f"note: {source} does not record {', '.join(assumed)}; used {', '.join(origins)}; "
        "for a model trained with other values, convert again with --set NAME=VALUE"
    )
    return values, note if assumed else ""


def tell(note: str) -> None:
    """`settle_unrecorded`'s line on stderr, if there is one."""
    if note:
        print(note, file=sys.stderr)
