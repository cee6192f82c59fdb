"""Readers every recipe with files of that kind uses: numeric CSV and path lists (files), image
folders (images), and Arrow caches built once on the main process (cache); the loaders every
recipe trains and evaluates with (loaders); a run's data fingerprint (fingerprint).

A workload's own format (Cricsheet JSON, extxyz, SkullBreak point clouds, ...) is read by its
recipe's folder, `recipes/X/data.py`; its example generator is `recipes/X/example.py`.

This is the data helpers' public API: import them from `accel_common.data`, never from a module
file (names load on first use). Constant: CSV_TEXT, the advice a CSV error ends with.
"""

from __future__ import annotations

from typing import Any

from accel_common.deprecation import public_face

_FACE = {
    "accel_common.data.files": (
        "read_numeric_csv", "read_path_list", "read_text", "require_finite", "CSV_TEXT",
    ),
    "accel_common.data.paths": ("is_present", "require_regular"),
    "accel_common.data.images": (
        "list_images", "is_image", "open_image", "read_rgb", "image_batches", "to_signed_unit",
    ),
    "accel_common.data.cache": (
        "cached", "cache_key", "cache_root", "code_digest", "files_digest", "list_column",
        "list_lengths", "save_whole",
    ),
    "accel_common.data.loaders": (
        "resolve_data", "existing_data", "make_train_loader", "make_eval_loader", "per_sample_rng",
    ),
    "accel_common.data.fingerprint": ("named_files",),
}  # fmt: skip

__all__ = [name for names in _FACE.values() for name in names]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use."""
    return public_face(__name__, _FACE, name, globals())


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
