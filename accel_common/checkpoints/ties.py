"""Tied parameters (one tensor under two names: nanoGPT's `lm_head.weight = wte.weight`) in the
files the project writes and reads.

safetensors cannot hold one tensor twice, so `accelerator.save_state` keeps the first name of
each tie and drops the others, with a warning on every save ("Removed shared tensor ...").
Resuming is unaffected (safetensors' `load_model` re-finds the tie in the model), but a file read
without the model (`accel-recipes convert`) lacks the dropped names. So a save drops them itself
(`recording_ties`: no warning, since the project restores them) and records each tie in the
checkpoint folder's tied.json, from which `convert` restores every name (`restore_ties`).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from accel_common.errors import CheckpointError
from accel_common.run_folder.outputs import write_output

TIES_FILE = "tied.json"
_MODEL_FILE = re.compile(r"^model(?:_(\d+))?\.safetensors$")


def tie_groups(state: Mapping[str, Any]) -> list[list[str]]:
    """The names of `state` that are one tensor (same memory, shape and strides), each group in
    the order of `state`; only groups of two or more."""
    groups: dict[tuple, list[str]] = {}
    for name, tensor in state.items():
        if torch.is_tensor(tensor) and tensor.device.type != "meta" and tensor.numel():
            view = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset())
            groups.setdefault((*view, tensor.dtype, tensor.shape, tensor.stride()), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _drop_and_record(accelerator: Accelerator, weights: list[dict[str, Any]], folder: str) -> None:
    """save_state's pre-hook: keep the first name of each tie in every model's state dict (what
    Accelerate would keep, without its warning) and record the ties in `folder`/tied.json."""
    record = {}
    for index, state in enumerate(weights):
        if groups := tie_groups(state):
            for group in groups:
                for name in group[1:]:
                    del state[name]
            record[str(index)] = groups
    if record and accelerator.is_main_process:
        write_output(Path(folder) / TIES_FILE, json.dumps({"models": record}, indent=1))


@contextlib.contextmanager
def recording_ties(accelerator: Accelerator) -> Iterator[None]:
    """Within it, `accelerator.save_state` records tied weights (see the module's docstring)."""
    handle = accelerator.register_save_state_pre_hook(
        lambda _models, weights, folder: _drop_and_record(accelerator, weights, folder)
    )
    try:
        yield
    finally:
        handle.remove()


def saved_ties(source: Path, model_index: int = 0) -> list[list[str]]:
    """The ties a save recorded for model `model_index` of the checkpoint folder `source` (or for
    `source`, its model.safetensors / model_N.safetensors); [] where none were recorded."""
    source = Path(source)
    if not source.is_dir():
        named = _MODEL_FILE.match(source.name)
        if named is None:
            return []
        source, model_index = source.parent, int(named.group(1) or 0)
    path = source / TIES_FILE
    if not path.is_file():
        return []
    try:
        groups = json.loads(path.read_text())["models"].get(str(model_index), [])
        if not all(isinstance(g, list) and all(isinstance(n, str) for n in g) for g in groups):
            raise ValueError("a tie is not a list of names")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise CheckpointError(
            f"{path} is unreadable ({type(err).__name__}: {str(err)[:200]}); it names the tied "
            f"weights of {source.name}: copy the folder again from where it was saved"
        ) from None
    return groups


def restore_ties(state: dict[str, torch.Tensor], groups: list[list[str]]) -> dict[str, Any]:
    """`state` with every name of each tie: a name the file lacks gets its tie's tensor."""
    for group in groups:
        present = next((name for name in group if name in state), None)
        for name in group if present is not None else []:
            state.setdefault(name, state[present])
    return state


def missing_tie(state: Mapping[str, Any], expected: Mapping[str, Any]) -> tuple[str, str] | None:
    """(absent name, present name) of a tie of the model's state dict `expected` of which `state`
    (a file's tensors) has one name but not another, else None."""
    for group in tie_groups(expected):
        present = [name for name in group if name in state]
        absent = [name for name in group if name not in state]
        if present and absent:
            return absent[0], present[0]
    return None
