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
import random
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

from accel_common import ConfigError, DataError
from accel_common.data import (
    cache_key,
    cache_root,
    code_digest,
    files_digest,
    is_present,
    require_regular,
    save_whole,
)

READER = code_digest(__file__)  # in the cache key: a fixed reader never reuses an old table
STRUCTURES_FILE = "structures.extxyz"  # what a --data folder holds (make-data writes it)
TARGET_HELP = "info key, calculator result (energy, forces, stress, ...) or per-atom array"


def read_frames(path: Path, index: str) -> list:
    """The frames of an extended XYZ file selected by `index` as ASE takes it (":", ":1000",
    "::10", "5"). A truncated or malformed frame is a DataError naming the file, and the frame
    when a selected frame before it was read (before that, the error may come from ASE's scan
    of all the frame headers, which does not say which)."""
    import ase.io
    from ase.utils import string2index

    require_regular(path)
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
    if not is_present(data / STRUCTURES_FILE):
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
            "with --model eComformer to build plain neighbour graphs for molecules"
        )


# networks whose edges attend over their structure's three lattice vectors (lengths, and angles
# with the bond): the original's iComformer; eComformer reads only the bonds
LATTICE_MODELS = ("iComformer",)


def require_lattice(model: str, where: str) -> None:
    """A molecule (no lattice: its vectors are zeros here) for a network that needs one: the
    lattice lengths' RBF divides by zero, so the loss is NaN from the first step whatever --lr;
    refused naming the frame and the flags that work."""
    if model in LATTICE_MODELS:
        raise DataError(
            f"{where}: a molecule (pbc not all true: no lattice), but --model {model} attends over "
            "each structure's three lattice vectors, which would be zeros (NaN from the first "
            "step); use --model eComformer for --non-periodic data, or leave molecules out "
            "with --index"
        )


def require_lattices(rows: datasets.Dataset, model: str, path: Path) -> None:
    """`require_lattice` for every built graph (a molecule's lattice is all zeros)."""
    if model in LATTICE_MODELS:
        for index, lattice in zip(rows["index"], rows["lattice"], strict=True):
            if not np.any(lattice):
                require_lattice(model, f"{path}, frame {index}")


BOND_TOL = 0.15  # jarvis-tools' get_all_neighbors drops neighbours this close (angstrom)


class Lattice:
    """A cell as the original sees it: ASE -> pymatgen -> jarvis-tools Atoms (custom_train.py
    25-54, 173-190), so that every distance below is the same float the original compares:
    fractional coordinates as pymatgen computes them (pos @ inv(cell)); jarvis' Lattice rounds
    the cell to 5 decimals (`rounded`), from which it makes Cartesian coordinates, the vectors
    of the edges and their lengths (`abc`, rounded to 6 decimals), while its neighbour search
    steps through images with the cell as given, in the box of images jarvis'
    `get_all_neighbors` searches (atoms.py 791-819); that box can miss a neighbour near its
    edge, and then the original's graph misses it too."""

    def __init__(self, atoms: object) -> None:
        self.cell = np.asarray(atoms.cell.array, dtype=np.float64)
        self.rounded = np.around(self.cell, decimals=5)
        self.frac = np.asarray(atoms.positions, dtype=np.float64) @ np.linalg.inv(self.cell)
        self.cart = self.frac @ self.rounded
        self.abc = [round(x, 6) for x in np.sqrt(np.sum(self.rounded**2, axis=1)).tolist()]
        self.reciprocal = np.linalg.norm(2 * np.pi * np.linalg.inv(self.rounded).T, axis=1)

    def box(self, radius: float) -> tuple[np.ndarray, np.ndarray]:
        """The first and last image jarvis-tools searches along each axis within `radius`."""
        reach = np.ceil((radius + BOND_TOL) * self.reciprocal / (2 * np.pi))
        low = np.floor(np.min(self.frac, axis=0)) - reach
        high = np.ceil(np.max(self.frac, axis=0)) + reach
        return low, high - 1

    def distance(self, i: np.ndarray, j: np.ndarray, image: np.ndarray) -> np.ndarray:
        """|image cell + r_j - r_i| in jarvis-tools' operation order, bit for bit."""
        coords = image.astype(np.float64) @ self.cell + self.cart[j]
        return np.sum((coords - self.cart[i]) ** 2, axis=-1) ** 0.5


def _search(atoms: object, lattice: Lattice, radius: float) -> tuple[np.ndarray, ...]:
    """Every neighbour pair the original finds within `radius`: i, j, distance, vector from i to
    j's image, image. matscipy (C) finds the candidates; the original's box and float distance
    decide."""
    from matscipy.neighbours import neighbour_list

    i, j, vec, shift = neighbour_list("ijDS", atoms, radius + 1e-6)
    low, high = lattice.box(radius)
    d = lattice.distance(i, j, shift)
    keep = (d <= radius) & (d > 1e-8) & (d > BOND_TOL)
    keep &= np.all((shift >= low) & (shift <= high), axis=1)
    return i[keep], j[keep], d[keep], vec[keep], shift[keep]


def _angle(a: np.ndarray, b: np.ndarray) -> float:
    cosine = np.sum(a * b) / (np.sum(a**2) ** 0.5 * np.sum(b**2) ** 0.5)
    return float(np.arccos(cosine) / np.pi * 180.0)


def lattice_vectors(atoms: object, lattice: Lattice | None = None) -> np.ndarray:
    """The three lattice translations the original gives every edge (graphs.py 220-253), as
    integer images: among atom 0's own periodic images within the longest cell vector + 0.01,
    sorted by length (equal floats in jarvis-tools' enumeration order), the first, the next one
    not collinear with it and the next one not coplanar with both; the second and third flipped
    to make acute angles with the first, all three flipped to a right-handed set."""
    lattice = lattice or Lattice(atoms)
    radius = max(lattice.abc) + 1e-2
    low, high = lattice.box(radius)
    axes = [np.arange(a, b + 1) for a, b in zip(low, high, strict=True)]
    images = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)  # product order
    zero = np.zeros(len(images), dtype=np.int64)
    d = lattice.distance(zero, zero, images)
    keep = (d <= radius) & (d > 1e-8) & (d > BOND_TOL)
    images = images[keep][np.argsort(d[keep], kind="stable")]
    first = images[0]
    # the original's loops (graphs.py 230-241), vectorised: the next image not on first's line
    # (|cos| not within 1e-5 of 1), then from there the next one off their plane
    unit = images / np.sum(images**2, axis=1, keepdims=True) ** 0.5
    cosine = np.sum(unit[0] * unit, axis=1)
    off_line = np.nonzero((np.abs(cosine - 1.0) >= 1e-5) & (np.abs(cosine + 1.0) >= 1e-5))[0]
    start = off_line[0] if len(off_line) else 1
    second = images[start] if len(off_line) else images[-1]
    off_plane = np.nonzero(np.abs(images[start:] @ np.cross(first, second)) >= 1e-5)[0]
    third = images[start + off_plane[0]] if len(off_plane) else images[-1]
    matrix = lattice.rounded
    if _angle(first @ matrix, second @ matrix) > 90.0:
        second = -second
    if _angle(first @ matrix, third @ matrix) > 90.0:
        third = -third
    normal = np.cross(first @ matrix, second @ matrix)
    if not _angle(normal, third @ matrix) <= 90.0:
        first, second, third = -first, -second, -third
    return np.stack([first, second, third]).astype(np.int64)


def comformer_graph(atoms: object, cutoff: float, max_neighbors: int) -> dict[str, np.ndarray]:
    """The original's graph (comformer/graphs.py 205-300, with use_lattice=True and
    use_canonize=False as its API builds it), edge for edge: for every atom, all neighbours
    (periodic images included) up to the distance of its `max_neighbors`-th, every neighbour at
    exactly that distance kept; the search radius starts at `cutoff` and widens as the
    original's does until every atom has that many; each such pair is an edge both ways (a pair
    found from both of its atoms is there twice, as in the original), and every atom gets
    self-loops along the three lattice vectors (both ways) unless that image is already its
    neighbour. Returns source and target (messages flow source -> target), the vector from the
    source to the target's image, and the three lattice vectors (Cartesian)."""
    lattice = Lattice(atoms)
    n = len(atoms)
    radius = cutoff
    while True:
        i, j, d, vec, shift = _search(atoms, lattice, radius)
        if np.bincount(i, minlength=n).min() >= max_neighbors:
            break
        longest = max(lattice.abc)
        radius = longest if radius < longest else 2 * radius
    order = np.lexsort((d, i))  # by centre atom, nearest first
    i, j, d, vec, shift = i[order], j[order], d[order], vec[order], shift[order]
    kth = d[np.searchsorted(i, np.arange(n)) + max_neighbors - 1]
    keep = d <= kth[i]  # ties kept, as the original keeps them: equal floats
    i, j, shift = i[keep], j[keep], shift[keep]
    # the vector as the original computes it: frac_j + image - frac_i, in Cartesian
    vec = (lattice.frac[j] + shift - lattice.frac[i]) @ lattice.rounded
    images = lattice_vectors(atoms, lattice)
    own = i == j  # self-loops along the lattice vectors, unless that image is a neighbour
    present = np.zeros((n, 3), dtype=bool)
    same = np.all(shift[own][:, None, :] == images[None, :, :], axis=-1)
    np.logical_or.at(present, i[own], same)
    loop_atom, loop_vec = np.nonzero(~present)
    cart = images @ lattice.rounded
    src = np.concatenate([i, loop_atom])
    dst = np.concatenate([j, loop_atom])
    vec = np.concatenate([vec, cart[loop_vec]])
    return {
        "edge_index": np.stack([np.concatenate([src, dst]), np.concatenate([dst, src])]),
        "vector": np.concatenate([vec, -vec]).astype(np.float32),
        "lattice": cart.astype(np.float32),
    }


def knn_graph(atoms: object, cutoff: float, max_neighbors: int) -> dict[str, np.ndarray]:
    """The graph of one structure: the original's (`comformer_graph`) for a crystal; for a
    molecule (no lattice, --non-periodic), the same k-nearest rule without periodic images,
    self-loops or lattice vectors (zeros)."""
    if atoms.pbc.all():
        return comformer_graph(atoms, cutoff, max_neighbors)
    atoms = atoms.copy()
    atoms.center(vacuum=cutoff)  # matscipy bins atoms in a cell, so give it a box
    atoms.pbc = False
    from matscipy.neighbours import neighbour_list

    i, j, d, vec = neighbour_list("ijdD", atoms, cutoff)
    order = np.lexsort((d, i))
    i, j, d, vec = i[order], j[order], d[order], vec[order]
    first = np.searchsorted(i, i)
    rank = np.arange(len(i)) - first
    kth = np.full(len(atoms), np.inf)
    last = rank == np.minimum(np.bincount(i, minlength=len(atoms))[i], max_neighbors) - 1
    kth[i[last]] = d[last]
    keep = d <= kth[i]
    i, j, vec = i[keep], j[keep], vec[keep]
    return {
        "edge_index": np.stack([np.concatenate([i, j]), np.concatenate([j, i])]),
        "vector": np.concatenate([vec, -vec]).astype(np.float32),
        "lattice": np.zeros((3, 3), dtype=np.float32),
    }


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
    if graph["vector"].size == 0:
        raise DataError(
            f"structure {row['index']}: no neighbours within --cutoff {cutoff} angstrom"
        )
    # flat columns: Arrow hands flat lists to NumPy without copying, nested ones row by row
    return {
        "source": graph["edge_index"][0].astype(np.int32),
        "target": graph["edge_index"][1].astype(np.int32),
        "vector": graph["vector"].reshape(-1),
        "lattice": graph["lattice"].reshape(-1),
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
    settings = [index, target, per_atom, cutoff, max_neighbors, non_periodic, 4]  # 4: format
    key = cache_key(files_digest([path]) if path.is_file() else "", settings, READER)
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
            vector=torch.as_tensor(row["vector"], dtype=torch.float32).view(-1, 3),
            lattice=torch.as_tensor(row["lattice"], dtype=torch.float32).view(1, 3, 3),
            y=torch.tensor([float(row["y"]) if "y" in row else math.nan]),
            num_nodes=len(row["numbers"]),
        )


def split_indices(n: int, ratios: tuple[float, float, float], seed: int) -> list[np.ndarray]:
    """Train/val/test indices by ratio, as ComFormer's API splits (custom_train.py 599-618,
    `train_from_list`): the frame indices in file order shuffled by Python's `random` seeded
    with `seed` (`random.seed(split_seed); random.shuffle(indices)`: the same draws), the first
    int(ratio x n) for training, the next int(ratio x n) for validation, the rest for testing;
    so a run holds out the same structures as the original for the same seed and ratios."""
    indices = list(range(n))
    random.Random(seed).shuffle(indices)
    order = np.asarray(indices, dtype=np.int64)
    n_train, n_val = int(ratios[0] * n), int(ratios[1] * n)
    parts = [order[:n_train], order[n_train : n_train + n_val], order[n_train + n_val :]]
    if any(len(p) == 0 for p in parts):
        raise DataError(f"{n} structures are too few for the split ratios {ratios}")
    return parts
