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

`write_dataset` builds varied crystals with ASE (fcc, bcc, hcp and simple-cubic lattices of Al,
Cu, Ag, Au, Ni, Pd, Pt, random alloying, strain and rattling, 1 to 64 atoms) and labels them
with ASE's EMT calculator: a real, learnable physical target with no download.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from accel_common.errors import ConfigError, DataError

ELEMENTS = ("Al", "Cu", "Ag", "Au", "Ni", "Pd", "Pt")
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


def check_periodic(atoms: object, where: str, allow_molecules: bool) -> None:
    """A crystal needs a lattice: pbc on all three axes and a non-singular cell. A frame that is
    periodic along some axis with a singular cell has no lattice to repeat, even as a molecule."""
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


# --------------------------------------------------------------------------- synthetic data


def random_crystal(rng: np.random.Generator) -> object:
    """A strained, rattled, possibly alloyed crystal of 1 to 64 atoms."""
    from ase.build import bulk

    lattice = str(rng.choice(["fcc", "bcc", "hcp", "sc"]))
    host = str(rng.choice(ELEMENTS))
    a = {"fcc": 4.0, "bcc": 3.2, "hcp": 2.8, "sc": 2.6}[lattice] * rng.uniform(0.92, 1.08)
    atoms = bulk(host, lattice, a=a, c=a * 1.63 if lattice == "hcp" else None)
    for _ in range(20):  # a random supercell of at most 64 atoms
        reps = rng.integers(1, 4, size=3)
        if len(atoms) * reps.prod() <= 64:
            atoms = atoms.repeat(tuple(int(r) for r in reps))
            break
    if rng.uniform() < 0.6:  # alloy: replace a random share of the atoms
        share = rng.uniform(0.1, 0.5)
        other = str(rng.choice(ELEMENTS))
        swap = rng.uniform(size=len(atoms)) < share
        atoms.symbols[swap] = other
    strain = np.eye(3) + rng.normal(scale=0.02, size=(3, 3))
    atoms.set_cell(atoms.cell.array @ strain, scale_atoms=True)
    atoms.positions += rng.normal(scale=0.05, size=atoms.positions.shape)
    return atoms


def write_dataset(out_dir: Path, *, structures: int = 1000, seed: int = 0) -> Path:
    """Write `structures.extxyz`: EMT-labelled crystals with energy, forces and stress as
    calculator results and `energy_per_atom` in each frame's info."""
    import ase.io
    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    frames = []
    for _ in range(structures):
        atoms = random_crystal(rng)
        atoms.calc = EMT()
        energy, forces, stress = (
            atoms.get_potential_energy(),
            atoms.get_forces(),
            atoms.get_stress(),
        )
        atoms.info["energy_per_atom"] = energy / len(atoms)
        atoms.calc = SinglePointCalculator(atoms, energy=energy, forces=forces, stress=stress)
        frames.append(atoms)
    ase.io.write(out_dir / "structures.extxyz", frames, format="extxyz")
    return out_dir
