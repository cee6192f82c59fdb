"""The original's Python API for the crystal recipe: `train_from_extxyz` and `train_from_list`,
called with the original's keywords, run `recipes/train_crystal.py`'s training command in this
process or, with `num_processes=N` (or `distributed=True`), on N processes through Accelerate's
launcher. It runs the script, so it lives beside it, not in recipes/crystal/ (the script's parts,
which never import it).

    from recipes.crystal_api import train_from_extxyz
    metrics, model_dir = train_from_extxyz("structures.extxyz", "energy_per_atom", n_epochs=50)
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

import recipes.train_crystal as recipe
from accel_common import ConfigError, SharedSettings, flag, read_config_file, train_in_python
from recipes.crystal.settings import CrystalSettings

# what an argument left out takes: the original's preset (its API's defaults: lr 1e-3, batch 64,
# 500 epochs, cutoff 6, 25 neighbours, width 256, ...), not the CPU-sized command-line defaults;
# its model_name picks the network's defaults as the original's config classes do
CONFIGS = Path(recipe.__file__).parent / "crystal" / "configs"
PRESETS = {
    "iComformer": CONFIGS / "original.yaml",
    "eComformer": CONFIGS / "original_ecomformer.yaml",
}


def original_defaults(model_name: str = "iComformer") -> dict[str, Any]:
    names = [f.name for f in fields(CrystalSettings)] + [f.name for f in fields(SharedSettings)]
    return read_config_file(preset(model_name), names)


def preset(model_name: str) -> Path:
    """The original's preset for its `model_name`; another name stops the call by name."""
    if model_name not in PRESETS:
        raise ConfigError(
            f"model_name={model_name!r}: not available here; give one of {', '.join(PRESETS)}"
        )
    return PRESETS[model_name]


# The original's arguments that have no counterpart here, with the one value each may take:
# this recipe is regression on the lattice-aware graph with the CGCNN atom features.
FIXED_IN_THIS_RECIPE: dict[str, Any] = {
    "atom_features": "cgcnn",
    "use_lattice": True,
    "use_angle": False,
    "classification": False,
    "classification_threshold": None,
}


def original_only_settings(options: dict[str, Any]) -> dict[str, Any]:
    """Settings from the original's remaining arguments (its `**kwargs` go into its training
    config); one this recipe cannot honour stops the call by name instead of being ignored."""
    settings = {}
    for name, value in options.items():
        if name == "weight_decay":
            settings[name] = value
        elif name not in FIXED_IN_THIS_RECIPE:
            raise ConfigError(
                f"{name}: not an argument this recipe knows; pass its command-line flags as "
                "extra_args=('--flag', 'value') (python recipes/train_crystal.py --help)"
            )
        elif value != FIXED_IN_THIS_RECIPE[name]:
            raise ConfigError(
                f"{name}={value!r}: not available here (this recipe trains ComFormer "
                f"regression on the lattice-aware graph); leave {name} out"
            )
    return settings


def as_flags(values: dict[str, Any]) -> list[str]:
    """Settings as command-line flags: `--name value`, and `--name` / `--no-name` for a bool."""
    argv = []
    for name, value in values.items():
        if isinstance(value, bool):
            argv.append(flag(name) if value else flag(f"no_{name}"))
        else:
            argv += [flag(name), str(value)]
    return argv


def processes_for(num_processes: int, distributed: bool) -> int:
    """The original's `distributed=True` means every GPU of this machine, here through
    Accelerate's launcher; an explicit `num_processes` wins."""
    if not distributed or num_processes > 1:
        return num_processes
    gpus = torch.cuda.device_count()
    if gpus < 2:
        raise ConfigError(
            f"distributed=True: this machine has {gpus} GPU(s); pass num_processes=N to train "
            "on N processes (CPU processes when there is no GPU)"
        )
    return gpus


def train_from_extxyz(
    extxyz_file: str | Path,
    target_property: str,
    index: int | str | slice | None = None,
    *,
    per_atom: bool | None = None,
    learning_rate: float | None = None,
    batch_size: int | None = None,
    n_epochs: int | None = None,
    train_ratio: float | None = None,
    val_ratio: float | None = None,
    test_ratio: float | None = None,
    split_seed: int | None = None,
    cutoff: float | None = None,
    max_neighbors: int | None = None,
    output_dir: str | Path | None = None,
    num_workers: int | None = None,
    random_seed: int | None = None,
    cache_graphs: bool | None = None,
    graph_cache_dir: str | Path | None = None,
    model_name: str = "iComformer",
    distributed: bool = False,
    num_processes: int = 1,
    extra_args: tuple[str, ...] = (),
    **original_options: Any,
) -> tuple[dict[str, float], Path]:
    """Train on an extxyz file, called as the original's `train_from_extxyz`; returns the final
    metrics and the exported model's folder.

    The original's arguments are the recipe's settings: `learning_rate` -> --lr, `batch_size`
    -> --bs, `n_epochs` -> --epochs, `num_workers` -> --workers (graph building and data
    loading), `random_seed` -> --seed, the others (and `weight_decay`) by their own names;
    `index` may be an int, a slice or ASE's string. `model_name` is "iComformer" or
    "eComformer"; its other model choices (`atom_features`, `use_lattice`, `use_angle`,
    `classification`) are accepted at the values this recipe is and refused otherwise. An
    argument left out (None) takes the original's default, from the model's preset,
    recipes/crystal/configs/original.yaml or original_ecomformer.yaml (the original's network
    at full size, lr 1e-3, batch 64, 500 epochs, 25 neighbours from 6 angstrom); every value is
    checked here, before anything is launched.

    With `num_processes=1` the recipe runs in this process; with N (or `distributed=True`: every
    GPU) it runs on N processes through `accelerate launch` (GPUs when there are, else CPU
    processes), so a notebook can train on every GPU of its machine. `extra_args` are further
    command-line flags (`--width`, `--layers`, ...)."""
    if isinstance(index, slice):
        index = ":".join("" if v is None else str(v) for v in (index.start, index.stop, index.step))
    values = {
        "data": extxyz_file,
        "target": target_property,
        "index": index,
        "per_atom": per_atom,
        "lr": learning_rate,
        "bs": batch_size,
        "epochs": n_epochs,
        "train_ratio": train_ratio,
        "val_ratio": val_ratio,
        "test_ratio": test_ratio,
        "split_seed": split_seed,
        "cutoff": cutoff,
        "max_neighbors": max_neighbors,
        "output_dir": output_dir,
        "workers": num_workers,
        "seed": random_seed,
        "cache_graphs": cache_graphs,
        "graph_cache_dir": graph_cache_dir,
        **original_only_settings(original_options),
    }
    values = {name: value for name, value in values.items() if value is not None}
    # the original's defaults under what is given; `extra_args` win over both
    defaults = original_defaults(model_name)
    args, _ = recipe.train.resolve(**(defaults | values))  # every check, now
    num_processes = processes_for(num_processes, distributed)
    argv = ["--config", str(preset(model_name)), *as_flags(values), *extra_args]
    script = Path(recipe.__file__)
    return train_in_python(recipe.train, argv, args.output_dir, num_processes, script=script)


def train_from_list(
    strucs: list, labels: list[float], **options: Any
) -> tuple[dict[str, float], Path]:
    """Train on ASE Atoms (or pymatgen Structures) and their labels, called as the original's
    `train_from_list(strucs=..., labels=..., ...)`: they are written to
    `<output_dir>.structures.extxyz` with the labels as `info["target"]`, then
    `train_from_extxyz` runs on that file with the same options (its arguments, above)."""
    import ase.io

    if len(strucs) != len(labels):
        raise ConfigError(f"{len(strucs)} structures but {len(labels)} labels: give one each")
    frames = []
    for structure, label in zip(strucs, labels, strict=True):
        if not hasattr(structure, "get_chemical_symbols"):  # a pymatgen Structure
            from pymatgen.io.ase import AseAtomsAdaptor

            structure = AseAtomsAdaptor.get_atoms(structure)
        atoms = structure.copy()
        atoms.calc = None
        atoms.info = {"target": float(label)}
        frames.append(atoms)
    output_dir = options.get("output_dir") or recipe.train.resolve()[0].output_dir
    output_dir = Path(output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    path = output_dir.with_name(output_dir.name + ".structures.extxyz")
    ase.io.write(path, frames, format="extxyz")
    return train_from_extxyz(path, "target", **options)
