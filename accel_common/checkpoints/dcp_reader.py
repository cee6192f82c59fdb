"""FSDP's sharded checkpoints (torch.distributed.checkpoint folders): their layout, and reading
them without unpickling arbitrary objects, what `accel-recipes convert` needs to merge them into
one safetensors file.

torch.distributed.checkpoint (and the DTensor and sympy machinery behind it) is imported only when
a folder is read: it adds ~1.3 s to every process start, and only conversion reads these folders;
Accelerate's own save_state/load_state import it when FSDP is on.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from accel_common.errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.checkpoint import FileSystemReader, Metadata

# What `accelerator.save_state` writes for a model under FSDP's SHARDED_STATE_DICT: a DCP folder
# whose `.metadata` indexes the per-rank `__R_0.distcp` shards; Accelerate nests the weights under
# the key "model".
FSDP_SHARDED_DIR = "pytorch_model_fsdp_{index}"
DCP_METADATA = ".metadata"
DCP_MODEL_KEY = "model"

# `.metadata` is a pickle. These are the only globals DCP's own metadata pickles reference (plus
# torch dtypes); anything else is refused, so reading it cannot run code. pathlib appears because
# DCP records the folder it saved to (`pathlib._local` on Python >= 3.13).
_PATHS = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}
DCP_METADATA_GLOBALS: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
    "pathlib": _PATHS,
    "pathlib._local": _PATHS,
}


class _DCPMetadataUnpickler(pickle.Unpickler):
    """Reads DCP's pickled `.metadata` index, refusing every global outside that format."""

    def find_class(self, module: str, name: str) -> Any:
        if name in DCP_METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"the DCP index refers to {module}.{name}, which is not part of torch.distributed."
            "checkpoint's metadata, so it was not loaded (unpickling it could run arbitrary code). "
            "If you trust this checkpoint, merge it with `accelerate merge-weights`, which "
            "unpickles it unchecked"
        )


def read_dcp_metadata(folder: Path) -> Metadata:
    """The index of a DCP folder (tensor shapes, dtypes, and which shard file holds each chunk)."""
    import torch.distributed.checkpoint as dcp

    path = Path(folder) / DCP_METADATA
    try:
        with path.open("rb") as stream:
            metadata = _DCPMetadataUnpickler(stream).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError) as err:
        raise CheckpointError(f"{path} is unreadable, corrupt or truncated: {err}") from err
    except CheckpointError as err:  # a global outside DCP's format
        raise CheckpointError(f"{path}: {err}") from None
    if not isinstance(metadata, dcp.Metadata):
        raise CheckpointError(f"{path} is not a torch.distributed.checkpoint index")
    return metadata


def _checked_reader(folder: Path, metadata: Metadata) -> FileSystemReader:
    """DCP's file reader, handed the index already read by `read_dcp_metadata`.

    FileSystemReader.read_metadata would `pickle.load` the index unchecked; the shards themselves
    are read with torch.load(weights_only=True) by DCP.
    """
    import torch.distributed.checkpoint as dcp

    class CheckedMetadataReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            return metadata

    return CheckedMetadataReader(folder)


def read_dcp_model(folder: Path) -> dict[str, torch.Tensor]:
    """Merge the model shards of a DCP folder (FSDP SHARDED_STATE_DICT) into full CPU tensors.

    Accelerate saves `{"model": state_dict}`, so entries are named `model.<parameter>`; the
    parameter names come from the index's own key paths, never from splitting on dots.
    Non-tensor entries are skipped: an export holds tensors only.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = Path(folder)
    metadata = read_dcp_metadata(folder)
    paths = metadata.planner_data or {}
    entries = {
        fqn: meta
        for fqn, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    tops = sorted({str(paths.get(fqn, (fqn,))[0]) for fqn in entries})
    if tops != [DCP_MODEL_KEY]:
        raise CheckpointError(
            f"{folder}: not a model checkpoint saved by Accelerate under FSDP (its top-level keys "
            f"are [{', '.join(tops)}], expected [{DCP_MODEL_KEY}]); an optimizer_N folder holds "
            f"optimizer state, the weights are in {FSDP_SHARDED_DIR.format(index='N')}"
        )
    state = {
        fqn: torch.empty(meta.size, dtype=meta.properties.dtype) for fqn, meta in entries.items()
    }
    try:
        with warnings.catch_warnings():  # single-process on purpose; DCP warns about that
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=_checked_reader(folder, metadata), no_dist=True)
    except (Exception, dcp.CheckpointException) as err:  # DCP wraps shard errors in the latter
        raise CheckpointError(
            f"{folder}: the shard files are missing, corrupt or truncated "
            f"({type(err).__name__}: {str(err).strip().splitlines()[-1]})"
        ) from err
    return {".".join(map(str, paths[fqn][1:])): tensor for fqn, tensor in state.items()}
