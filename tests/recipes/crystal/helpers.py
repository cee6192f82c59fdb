"""What several of the crystal recipe's test files use: the original's fixtures and small
structures.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path

import ase.io
import numpy as np
import torch
from ase import Atoms
from ase.build import bulk
from ase.calculators.singlepoint import SinglePointCalculator

from recipes.crystal.data import read_frames
from tests.processes import REPO

with warnings.catch_warnings():  # PyG's import trips torch's own torch.jit deprecation warning
    warnings.simplefilter("ignore", FutureWarning)
    from torch_geometric.data import Data
    from torch_geometric.loader.dataloader import Collater


def labelled_frames() -> list[Atoms]:
    """Two frames the way real files carry targets: info keys, and calculator results."""
    frames = []
    for scale in (1.0, 1.05):
        atoms = bulk("Cu", "fcc", a=3.6 * scale, cubic=True)  # 4 atoms
        atoms.info["formation_energy_per_atom"] = -0.5 * scale
        forces = np.tile([[3.0, 4.0, 0.0]], (4, 1))  # norm 5 on every atom
        atoms.calc = SinglePointCalculator(atoms, energy=-8.0 * scale, forces=forces)
        frames.append(atoms)
    return frames


def write_volumes(path: Path, count: int) -> list[float]:
    """`count` Cu cells of growing size with their volume in info["volume"]."""
    frames = [bulk("Cu", "fcc", a=3.5 + 0.01 * i, cubic=True) for i in range(count)]
    for atoms in frames:
        atoms.info["volume"] = atoms.get_volume()
    ase.io.write(path, frames, format="extxyz")
    return [atoms.get_volume() for atoms in frames]


# --------------------------------------------------------------------------- the original's code

FIXTURES = REPO / "tests" / "fixtures" / "crystal"  # made by jwchen25/comformer: see README.md


def original_outputs(name: str = "icomformer") -> dict:
    return json.loads((FIXTURES / "outputs.json").read_text())[name]


def original_graphs(max_neighbors: int | None = None) -> list[dict]:
    graphs = json.loads((FIXTURES / "graphs.json").read_text())["graphs"]
    return [g for g in graphs if max_neighbors in (None, g["max_neighbors"])]


def fixture_frames() -> dict[str, Atoms]:
    return {a.info["name"]: a for a in read_frames(FIXTURES / "structures.extxyz", ":")}


def as_batch(graphs: list[dict]):
    frames = fixture_frames()
    data = [
        Data(
            z=torch.as_tensor(frames[g["name"]].numbers),
            edge_index=torch.tensor(g["edge_index"]),
            vector=torch.tensor(g["edge_attr"]),
            lattice=torch.tensor(g["lattice"]).view(1, 3, 3),
            num_nodes=len(frames[g["name"]]),
        )
        for g in graphs
    ]
    return Collater(data)(data)


def relative(a: torch.Tensor, b: list[float]) -> float:
    b = torch.tensor(b)
    return ((a - b).abs() / b.abs().clamp(min=1e-6)).max().item()


def edge_multiset(edge_index, vectors) -> Counter:
    vectors = np.round(np.asarray(vectors, dtype=np.float64), 4) + 0.0  # -0.0 as 0.0
    return Counter(
        (int(s), int(t), *v) for s, t, v in zip(*edge_index, vectors.tolist(), strict=True)
    )
