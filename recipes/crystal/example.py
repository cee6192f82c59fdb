"""Example data for the crystal recipe: `write_dataset` builds varied crystals with ASE (fcc, bcc,
hcp and simple-cubic lattices of Al, Cu, Ag, Au, Ni, Pd, Pt, random alloying, strain and
rattling, 1 to 64 atoms) and labels them with ASE's EMT calculator: a real, learnable physical
target with no download, written as extended XYZ, the format recipes/crystal/data.py reads.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

ELEMENTS = ("Al", "Cu", "Ag", "Au", "Ni", "Pd", "Pt")


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
