"""Synthetic skulls in the SkullBreak layout, for the point-cloud completion recipe.

Layout (as the original data set):

    train.csv, test.csv                      one row per skull: complete_skull/070_surf.npy
    complete_skull/070_surf.npy              M x 3 surface points of the whole skull
    defective_skull/<defect>/070_surf.npy    the skull with a cap-shaped piece cut out
    implant/<defect>/070_surf.npy            the piece that was cut out (the target)
    voxel_spacing.json                       mm per coordinate unit of each file (1: already mm)

for the five defect types. Skulls are upper halves of bumpy ellipsoids of skull size (mm); each
defect removes the cap of surface points within an angle of a direction typical for its type, so
the implant is fully determined by the hole: a real, learnable ground truth.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from recipes.pointcloud.data import DEFECTS

# where each defect type sits on the skull (x: left-right, y: back-front, z: up)
DEFECT_DIRECTIONS = {
    "bilateral": (0.0, 0.0, 1.0),
    "frontoorbital": (0.0, 1.0, 0.35),
    "parietotemporal": (1.0, 0.0, 0.45),
}


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def skull_surface(rng: np.random.Generator, num_points: int) -> np.ndarray:
    """Points on the upper part of a bumpy ellipsoid of head size, in millimetres."""
    axes = np.array([72.0, 92.0, 70.0]) * rng.uniform(0.9, 1.1, size=3)
    bumps = rng.normal(size=(4, 3))
    phases = rng.uniform(0, 2 * np.pi, size=4)
    directions = np.empty((0, 3))
    while len(directions) < num_points:  # keep the cranium: directions above z = -0.3
        candidates = _unit(rng.normal(size=(2 * num_points, 3)))
        directions = np.concatenate([directions, candidates[candidates[:, 2] > -0.3]])
    directions = directions[:num_points]
    radius = 1.0 / np.sqrt(((directions / axes) ** 2).sum(axis=1))
    radius *= 1.0 + 0.04 * np.sin(directions @ bumps.T * 2.0 + phases).sum(axis=1)
    return (directions * radius[:, None]).astype(np.float32)


def cut_defect(
    skull: np.ndarray, direction: np.ndarray, angle_deg: float
) -> tuple[np.ndarray, np.ndarray]:
    """(defective skull, implant): the implant is the cap within `angle_deg` of `direction`."""
    cosine = _unit(skull) @ _unit(direction)
    in_cap = cosine > np.cos(np.radians(angle_deg))
    return skull[~in_cap], skull[in_cap]


def defect_direction(rng: np.random.Generator, defect: str) -> np.ndarray:
    if defect in DEFECT_DIRECTIONS:
        base = np.array(DEFECT_DIRECTIONS[defect])
        if rng.uniform() < 0.5 and defect != "bilateral":
            base[0] = -base[0]  # left or right side, front stays front
        return _unit(base + rng.normal(scale=0.1, size=3))
    direction = _unit(rng.normal(size=3))
    direction[2] = abs(direction[2]) + 0.2  # random defects on the upper skull
    return _unit(direction)


def write_dataset(
    out_dir: Path,
    *,
    train_skulls: int = 24,
    test_skulls: int = 6,
    points_per_skull: int = 4096,
    seed: int = 0,
) -> Path:
    """Write the SkullBreak layout with `train_skulls` + `test_skulls` skulls x 5 defects."""
    out_dir = Path(out_dir)
    rng = np.random.default_rng(seed)
    for sub in (
        "complete_skull",
        *(f"{kind}/{d}" for kind in ("defective_skull", "implant") for d in DEFECTS),
    ):
        (out_dir / sub).mkdir(parents=True, exist_ok=True)
    ids = [f"{i:03d}" for i in range(train_skulls + test_skulls)]
    spacing = {f"complete_skull/{skull_id}_surf.npy": [1.0, 1.0, 1.0] for skull_id in ids}
    for skull_id in ids:
        skull = skull_surface(rng, points_per_skull)
        np.save(out_dir / "complete_skull" / f"{skull_id}_surf.npy", skull)
        for defect in DEFECTS:
            angle = rng.uniform(22.0, 32.0)
            defective, implant = cut_defect(skull, defect_direction(rng, defect), angle)
            for kind, points in (("defective_skull", defective), ("implant", implant)):
                relative = f"{kind}/{defect}/{skull_id}_surf.npy"
                np.save(out_dir / relative, points)
                spacing[relative] = [1.0, 1.0, 1.0]
    for split, chosen in (("train", ids[:train_skulls]), ("test", ids[train_skulls:])):
        rows = "".join(f"complete_skull/{skull_id}_surf.npy\n" for skull_id in chosen)
        (out_dir / f"{split}.csv").write_text(rows)
    document = {"unit": "mm per point-coordinate unit, per axis", "spacing": spacing}
    (out_dir / "voxel_spacing.json").write_text(json.dumps(document, indent=1, sort_keys=True))
    return out_dir
