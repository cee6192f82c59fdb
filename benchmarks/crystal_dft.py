"""A small real-DFT set for the crystal recipe's learning check, from data ASE ships.

`ase.collections.dcdft` holds the 71 elemental crystals of the Delta test (Lejaeghere et al.,
Science 2016) with WIEN2k's all-electron PBE equation of state for each: the equilibrium volume
V0 per atom, the bulk modulus B0 and its pressure derivative B0'. This script scales each crystal
uniformly to `--per-element` volumes drawn in [0.90, 1.10] x V0 and labels each with WIEN2k's
third-order Birch-Murnaghan energy per atom relative to the minimum, E(V) - E(V0) in meV/atom
(`info["eos_energy"]`): DFT energies as the DFT fits give them, no calculator run here. A uniform
scaling keeps every structure on the path the fit describes (no rattling, no shear).

    python benchmarks/crystal_dft.py /tmp/dcdft.extxyz
    python recipes/train_crystal.py --data /tmp/dcdft.extxyz --target eos_energy --max-neighbors 25
"""

from __future__ import annotations

import argparse
from pathlib import Path

import ase.io
import numpy as np
from ase.collections import dcdft
from ase.units import GPa

VOLUME_RANGE = (0.90, 1.10)  # of the equilibrium volume


def birch_murnaghan(volume: float, v0: float, b0: float, b0_prime: float) -> float:
    """E(V) - E(V0) of the third-order Birch-Murnaghan equation of state (B0 in eV/angstrom^3)."""
    strain = (v0 / volume) ** (2 / 3) - 1
    return (
        9 * v0 * b0 / 16 * (strain**3 * b0_prime + strain**2 * (6 - 4 * (v0 / volume) ** (2 / 3)))
    )


def dcdft_frames(per_element: int, seed: int) -> list:
    """`per_element` scaled copies of each dcdft crystal, labelled with WIEN2k's EOS energy."""
    rng = np.random.default_rng(seed)
    frames = []
    for name in dcdft.names:
        data = dcdft.data[name]
        v0, b0, b0_prime = data["wien2k_volume"], data["wien2k_B"] * GPa, data["wien2k_Bp"]
        base = dcdft[name]
        for ratio in rng.uniform(*VOLUME_RANGE, per_element):
            atoms = base.copy()
            per_atom = v0 * ratio
            atoms.set_cell(atoms.cell * (per_atom * len(atoms) / atoms.get_volume()) ** (1 / 3),
                           scale_atoms=True)  # fmt: skip
            atoms.info = {"element": name, "volume_ratio": float(ratio)}
            atoms.info["eos_energy"] = 1000 * birch_murnaghan(per_atom, v0, b0, b0_prime)
            frames.append(atoms)
    return frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="extxyz file to write")
    parser.add_argument("--per-element", type=int, default=14, help="volumes per crystal (14)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the volumes (0)")
    args = parser.parse_args()
    frames = dcdft_frames(args.per_element, args.seed)
    ase.io.write(args.out, frames, format="extxyz")
    energies = np.array([f.info["eos_energy"] for f in frames])
    print(f"wrote {args.out}: {len(frames)} structures of {len(dcdft.names)} elements, "
          f"eos_energy {energies.min():.1f} to {energies.max():.1f} meV/atom "
          f"(mean {energies.mean():.1f})")  # fmt: skip


if __name__ == "__main__":
    main()
