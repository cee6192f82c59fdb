"""Crystal structures for the graph-transformer recipe: extended XYZ in, periodic k-NN graphs out.

Reading: ASE reads the frames of an .extxyz file (`index` as ASE takes it: ":", ":1000",
"::10"). A target is looked up where real files keep it: the frame's `info`, the calculator
results ASE fills from `energy`/`forces`/`stress`/`virial` (current ASE reads `energy` back that
way, not into `info`), then per-atom arrays. A per-atom array (from `arrays`, or a calculator
result that ASE declares per atom, such as forces) becomes one number per structure as the mean
over atoms of each atom's norm |x_i|; any other array (a Voigt stress, a virial) its norm.

Graphs: for every atom, its `max_neighbors` nearest neighbours within `cutoff` angstrom among
all periodic images. The neighbour search is matscipy's (C, the same "ijdD" interface as ASE's
`neighbor_list`, about 20x faster on 64-atom cells: 0.8 ms against 16 ms); the k-nearest
selection is one lexsort for the whole structure, no Python loop over atoms.

`load_graphs` builds every selected frame's graph once with `datasets`' `map` and caches the
result as Arrow, keyed by the file's bytes and the graph settings; `CrystalGraphs` turns the
cached rows into PyG graphs per item, and `split_indices` cuts the fixed train/val/test split.
The generator of the example structures is in recipes/crystal/example.py.
"""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from torch.utils.data import Dataset

with warnings.catch_warnings():  # PyG's import trips torch's own torch.jit deprecation warning
    warnings.simplefilter("ignore", FutureWarning)
    from torch_geometric.data import Data

from accel_common.data.cache import cache_key, cache_root, files_digest, save_whole
from accel_common.errors import ConfigError, DataError

STRUCTURES_FILE = "structures.extxyz"  # what a --data folder holds (make-data writes it)
TARGET_HELP = "info key, calculator result (energy, forces, stress, ...) or per-atom array"


def read_frames(path: Path, index: str) -> list:
    """The frames of an extended XYZ file selected by `index` as ASE takes it (":", ":1000",
    "::10", "5"). A truncated or malformed frame is a DataError naming the file, and the frame
    when a selected frame before it was read (before that, the error may come from ASE's scan
    of all the frame headers, which does not say which)."""
    import ase.io
    from ase.utils import string2index

    if not path.is_file():
        raise DataError(f"{path}: file not found")
    try:
        selection = string2index(index)  # "abc" comes back as a string, "1:2:3:4" raises
    except (TypeError, ValueError):
        selection = None
    if not isinstance(selection, int | slice):
        raise ConfigError(f"--index {index}: give a frame number or a slice (':', ':1000', '::10')")
    frames = []
    try:
        for atoms in ase.io.iread(path, index=selection, format="extxyz"):
            frames.append(atoms)
    except (OSError, ValueError, KeyError, IndexError) as err:  # ase's XYZError is an OSError
        where = f"{path}{_failed_frame(selection, len(frames))}"
        raise DataError(
            f"{where}: not a readable extended XYZ file ({err}); fix the file, or select the "
            "frames before the broken one with --index"
        ) from None
    if not frames:
        raise DataError(f"{path}: --index {index} selects no frames")
    return frames


def _failed_frame(selection: int | slice, frames_read: int) -> str:
    """Names the frame after the `frames_read` selected ones (", frame N") when that is known."""
    if isinstance(selection, int) or not frames_read:
        return ""
    start, step = selection.start or 0, selection.step or 1
    return f", frame {start + frames_read * step}" if start >= 0 and step > 0 else ""


def _reduce(value: object, rows_are_atoms: bool, where: str, name: str) -> float:
    """A scalar as it is; a per-atom array (one row per atom) as the mean over atoms of |x_i|,
    so opposite forces or charges do not cancel; any other array (a stress) as its norm."""
    try:
        array = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        raise DataError(f"{where}: target '{name}' is {value!r}, not a number") from None
    if array.ndim == 0:
        return float(array)
    if rows_are_atoms:
        return float(np.linalg.norm(array.reshape(len(array), -1), axis=1).mean())
    return float(np.linalg.norm(array))


def target_value(atoms: object, name: str, where: str, per_atom: bool) -> float:
    """The target of one frame, looked up in info, calculator results, then per-atom arrays."""
    from ase.outputs import all_outputs

    results = getattr(atoms.calc, "results", {}) if atoms.calc is not None else {}
    declared_per_atom = name in all_outputs and all_outputs[name].shapespec[:1] == ("natoms",)
    for source, rows_are_atoms in (
        (atoms.info, False),
        (results, declared_per_atom),
        (atoms.arrays, True),
    ):
        if name in source:
            value = _reduce(source[name], rows_are_atoms, where, name)
            break
    else:
        keys = [f"info: {sorted(atoms.info)}", f"calculator: {sorted(results)}"]
        keys.append(
            f"arrays: {sorted(k for k in atoms.arrays if k not in ('numbers', 'positions'))}"
        )
        raise DataError(f"{where}: no target '{name}'; this frame has {'; '.join(keys)}")
    if not np.isfinite(value):
        raise DataError(f"{where}: target '{name}' is {value}, not a finite number")
    return value / len(atoms) if per_atom else value


def extxyz_file(data: Path) -> Path:
    """`--data` as training and predict read it: an extxyz file, or a folder holding
    structures.extxyz (the layout make-data writes)."""
    if not data.is_dir():
        return data
    if not (data / STRUCTURES_FILE).is_file():
        raise DataError(
            f"{data}: no {STRUCTURES_FILE} in this folder; give the extxyz file itself, or a "
            f"folder holding {STRUCTURES_FILE}"
        )
    return data / STRUCTURES_FILE


def check_periodic(atoms: object, where: str, allow_molecules: bool) -> None:
    """Positions and cell must be finite numbers. A crystal needs a lattice: pbc on all three
    axes and a non-singular cell. A frame that is periodic along some axis with a singular cell
    has no lattice to repeat, even as a molecule."""
    bad = ~np.isfinite(atoms.positions).all(axis=1)
    if bad.any():
        atom = int(np.flatnonzero(bad)[0])
        raise DataError(
            f"{where}: atom {atom} has position {atoms.positions[atom].tolist()}, not finite; "
            "fix the frame or leave it out with --index"
        )
    if not np.isfinite(atoms.cell.array).all():
        raise DataError(
            f"{where}: its cell has a value that is not finite ({atoms.cell.array.tolist()}); "
            "fix the frame or leave it out with --index"
        )
    volume = abs(np.linalg.det(atoms.cell.array))
    if atoms.pbc.any() and volume < 1e-8:
        raise DataError(
            f"{where}: periodic (pbc {atoms.pbc.tolist()}) but its cell is singular (volume "
            f"{volume:.3g}); give the frame three independent lattice vectors, or pbc F F F "
            "for a molecule"
        )
    if not allow_molecules and not atoms.pbc.all():
        raise DataError(
            f"{where}: not a periodic crystal (pbc {atoms.pbc.tolist()}); pass --non-periodic "
            "to build plain neighbour graphs for molecules"
        )


def knn_graph(atoms: object, cutoff: float, max_neighbors: int) -> dict[str, np.ndarray]:
    """Edges from every atom to its `max_neighbors` nearest neighbours (periodic images
    included) within `cutoff`: source, target, distance and displacement vector."""
    from matscipy.neighbours import neighbour_list

    if not atoms.pbc.any():  # a molecule: matscipy bins atoms in a cell, so give it a box
        atoms = atoms.copy()
        atoms.center(vacuum=cutoff)
    i, j, d, vec = neighbour_list("ijdD", atoms, cutoff)
    order = np.lexsort((d, i))  # by centre atom, nearest first
    i, j, d, vec = i[order], j[order], d[order], vec[order]
    first = np.searchsorted(i, i)  # index of each centre's first edge
    keep = (np.arange(len(i)) - first) < max_neighbors
    return {
        "edge_index": np.stack([j[keep], i[keep]]).astype(np.int64),  # message j -> i
        "distance": d[keep].astype(np.float32),
        "vector": vec[keep].astype(np.float32),
    }


def reduced_lattice(atoms: object) -> np.ndarray:
    """The shortest independent lattice translations (Minkowski-reduced cell), as the original
    uses for its edge update instead of the cell as written; zeros for a non-periodic frame."""
    from ase.geometry import minkowski_reduce

    if not atoms.pbc.all():
        return np.zeros((3, 3), dtype=np.float32)
    reduced, _ = minkowski_reduce(atoms.cell.array)
    return reduced.astype(np.float32)


# --------------------------------------------------------------------------- graph cache, dataset


def structures_table(frames: list, targets: list[float] | None) -> datasets.Dataset:
    """The frames as plain columns, so `map` workers get rows, not pickled ASE objects."""
    columns: dict[str, list] = {
        "numbers": [a.numbers.tolist() for a in frames],
        "positions": [a.positions.tolist() for a in frames],
        "cell": [a.cell.array.reshape(-1).tolist() for a in frames],
        "pbc": [a.pbc.tolist() for a in frames],
    }
    if targets is not None:
        columns["y"] = targets
    return datasets.Dataset.from_dict(columns)


def build_graph(row: dict[str, Any], cutoff: float, max_neighbors: int) -> dict[str, Any]:
    from ase import Atoms

    atoms = Atoms(
        numbers=row["numbers"],
        positions=row["positions"],
        cell=np.reshape(row["cell"], (3, 3)),
        pbc=row["pbc"],
    )
    graph = knn_graph(atoms, cutoff, max_neighbors)
    if graph["distance"].size == 0:
        raise DataError(
            f"structure {row['index']}: no neighbours within --cutoff {cutoff} angstrom"
        )
    # flat columns: Arrow hands flat lists to NumPy without copying, nested ones row by row
    return {
        "source": graph["edge_index"][0].astype(np.int32),
        "target": graph["edge_index"][1].astype(np.int32),
        "distance": graph["distance"],
        "vector": graph["vector"].reshape(-1),
        "lattice": reduced_lattice(atoms).reshape(-1),
    }


def load_graphs(
    path: Path,
    *,
    index: str,
    target: str | None,
    per_atom: bool,
    cutoff: float,
    max_neighbors: int,
    non_periodic: bool,
    workers: int,
    cache: bool = True,
    cache_dir: Path | None = None,
) -> tuple[datasets.Dataset, float, bool]:
    """Graphs of every selected frame, from the cache (under `cache_dir`, else the `datasets`
    cache) when the file's bytes and the settings are unchanged. Returns (graphs, seconds,
    whether they came from the cache)."""
    start = time.perf_counter()
    settings = [index, target, per_atom, cutoff, max_neighbors, non_periodic, 3]  # 3: format
    key = cache_key(files_digest([path]) if path.is_file() else "", settings)
    folder = cache_root(cache_dir) / f"crystal-{key}"
    if cache and folder.is_dir():
        return datasets.load_from_disk(str(folder)), time.perf_counter() - start, True
    frames = read_frames(path, index)
    targets = None
    if target is not None:
        targets = [
            target_value(a, target, f"{path}, frame {i}", per_atom) for i, a in enumerate(frames)
        ]
    for i, atoms in enumerate(frames):
        check_periodic(atoms, f"{path}, frame {i}", non_periodic)
    table = structures_table(frames, targets).add_column("index", list(range(len(frames))))
    graphs = table.map(
        build_graph,
        fn_kwargs={"cutoff": cutoff, "max_neighbors": max_neighbors},
        remove_columns=["positions", "pbc"],
        num_proc=workers if workers > 1 else None,
        new_fingerprint=key,
        desc=f"graphs of {path.name}",
    )
    if not cache:
        return graphs, time.perf_counter() - start, False
    save_whole(graphs, folder)
    return datasets.load_from_disk(str(folder)), time.perf_counter() - start, False


class CrystalGraphs(Dataset):
    """PyG graphs over the cached Arrow rows (memory-mapped; converted per item)."""

    def __init__(self, rows: datasets.Dataset) -> None:
        self.rows = rows.with_format("numpy")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Data:
        row = self.rows[int(index)]
        return Data(
            z=torch.as_tensor(row["numbers"], dtype=torch.long),
            edge_index=torch.as_tensor(np.stack([row["source"], row["target"]]), dtype=torch.long),
            distance=torch.as_tensor(row["distance"], dtype=torch.float32),
            vector=torch.as_tensor(row["vector"], dtype=torch.float32).view(-1, 3),
            lattice=torch.as_tensor(row["lattice"], dtype=torch.float32).view(1, 3, 3),
            y=torch.tensor([float(row["y"]) if "y" in row else math.nan]),
            num_nodes=len(row["numbers"]),
        )


def split_indices(n: int, ratios: tuple[float, float, float], seed: int) -> list[np.ndarray]:
    """Train/val/test indices by ratio, from a permutation fixed by `seed`."""
    order = np.random.default_rng(seed).permutation(n)
    n_train, n_val = int(ratios[0] * n), int(ratios[1] * n)
    parts = [order[:n_train], order[n_train : n_train + n_val], order[n_train + n_val :]]
    if any(len(p) == 0 for p in parts):
        raise DataError(f"{n} structures are too few for the split ratios {ratios}")
    return parts
