"""accel_common's public API: what a recipe imports. Import from here (and data helpers from
`accel_common.data`), never from a module file: module files may move between versions, these
names keep their path, and a change to them is a deliberate one (CHANGELOG.md says what changed
and how to update; tests/api/public_api.txt holds every name's signature).

The names load on first use (PEP 562), so `import accel_common` costs nothing and a tool that
needs one helper does not import torch for the rest.

Constants: MODEL_FILE, the export's weights file ("model.safetensors"); MAX_BLOCKS, the most
blocks (layers) a network setting may ask for (`setting(..., max=MAX_BLOCKS)`).
"""

from __future__ import annotations

from typing import Any

from accel_common.deprecation import install_old_module_paths, public_face

# module -> the names it gives the public API, grouped as the layout is
_FACE = {
    # a recipe's settings and command line
    "accel_common.settings": ("Settings", "setting", "flag", "read_config_file", "MAX_BLOCKS"),
    "accel_common.recipe_cli.options": ("SharedSettings",),
    "accel_common.recipe_cli.command": ("train_command", "model_option"),
    "accel_common.recipe_cli.entry": ("run_recipe", "train_in_python"),
    # batch and LR math
    "accel_common.batch_lr.batching": (
        "total_optimizer_steps", "BatchRequest", "BatchPlan", "plan_batch",
    ),
    "accel_common.batch_lr.lr": ("Decay", "LRSettings", "make_lr_schedule"),
    "accel_common.batch_lr.warmup": ("WarmupStyle",),
    "accel_common.batch_lr.losses": ("GlobalItemMean",),
    "accel_common.batch_lr.batchnorm": ("GlobalBatchNorm", "sync_batchnorm"),
    # the export, and loading it
    "accel_common.checkpoints.export": (
        "MODEL_FILE", "export_paths", "inference_device", "load_exported", "load_for_inference",
        "read_export_weights", "read_recipe_export", "require_same_tensors",
        "require_start_export", "save_file_atomically", "strip_wrapper_prefixes",
    ),
    # checkpoint conversion: a recipe's `convert` of its original's checkpoints
    "accel_common.conversion.convert": (
        "load_original_checkpoint", "read_state_dict", "require_tensors", "settle_unrecorded",
        "tell",
    ),
    # files a recipe writes, refusals before a launch, FSDP
    "accel_common.run_folder.outputs": ("new_file",),
    "accel_common.hardware.launch_guard": ("require_new_file", "require_writable_folder"),
    "accel_common.hardware.sharding": ("forward_is_collective",),
    # what the main process prints
    "accel_common.console": ("say", "format_metrics", "print_names"),
    # errors a user can fix: one line and a non-zero exit
    "accel_common.errors": (
        "RecipeError", "ConfigError", "DataError", "CheckpointError", "NonFiniteError",
    ),
    # old paths of a recipe's own names (its `__getattr__`)
    "accel_common.deprecation": ("moved_attribute", "warn_deprecated"),
    # the building blocks for a script with its own argparse or Hydra config
    # (examples/plain_argparse.py): what `train_command` assembles for a recipe
    "accel_common.hardware.accelerator": ("make_accelerator",),
    "accel_common.training.loop": ("TrainLoop",),
    "accel_common.training.policy": ("LoopPolicy", "SavePolicy"),
    "accel_common.training.run": ("Run", "RunConfig"),
    "accel_common.training.ema": ("EmaSettings", "EmaWarmup", "WeightEMA", "make_ema"),
}  # fmt: skip

__all__ = [name for names in _FACE.values() for name in names]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use."""
    return public_face(__name__, _FACE, name, globals())


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


install_old_module_paths()
