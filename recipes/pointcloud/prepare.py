"""SkullBreak NRRD volumes -> the surface point clouds the point-cloud recipe trains on.

The original project's preprocessing (pcdiff/utils/preproc_skullbreak.py) runs marching cubes at
level 0 on every binary volume (PyMCubes), samples points on the mesh, and writes
`<stem>_surf.npy` beside each `<stem>.nrrd`, in voxel units. This does the same with the same
marching cubes, so folders prepared by either tool are interchangeable, and adds what the original
lacks: the voxel spacing of every file (`voxel_spacing.json`, so distances can be reported in mm),
train/test CSVs, resumability that checks what it skips, and errors that name the volume.

Surface sampling differs: the original draws Poisson-disk samples with Open3D (minutes per mesh,
and a large dependency); this draws area-weighted uniform samples with trimesh, seeded per file.
The recipe subsamples each cloud at random on every step, so the spacing of the samples matters
little; the surface they lie on is the same.

Needs the `volumes` extra: pip install "accel-recipes[volumes]" (pynrrd, PyMCubes, trimesh).
"""

from __future__ import annotations

import json
import math
import os
import random
import zlib
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

from accel_common import ConfigError, DataError, require_writable_folder
from accel_common.data import read_path_list
from recipes.pointcloud.data import (
    DEFECTS,
    SPACING_FILE,
    case_stem,
    checked_spacing,
    read_spacing,
    require_disjoint,
)


def surface_name(volume: Path) -> str:
    """The original's output name: 070.nrrd -> 070_surf.npy."""
    return f"{volume.name.removesuffix('.nrrd')}_surf.npy"


def volume_relatives(raw: Path) -> list[Path]:
    """Every volume of a SkullBreak folder, relative to it, in the original's order and layout.

    Each complete skull needs its five defective skulls and five implants; a missing one is
    reported before any work starts.
    """
    complete = sorted((raw / "complete_skull").glob("*.nrrd"))
    if not complete:
        raise DataError(
            f"{raw / 'complete_skull'}: no .nrrd volumes (expected the SkullBreak layout: "
            "complete_skull/070.nrrd, defective_skull/<defect>/070.nrrd, implant/<defect>/070.nrrd)"
        )
    relatives = []
    for path in complete:
        relatives.append(path.relative_to(raw))
        for kind in ("defective_skull", "implant"):
            for defect in DEFECTS:
                relative = Path(kind, defect, path.name)
                if not (raw / relative).is_file():
                    raise DataError(f"{raw / relative}: file not found (needed for {path.name})")
                relatives.append(relative)
    return relatives


def voxel_spacing(header: dict, source: Path) -> list[float] | None:
    """Millimetres per voxel along each array axis, from an NRRD header (None: not given). A
    zero, negative or NaN spacing is refused, naming the volume `source`: recorded, it would
    give distances "in mm" that are not."""
    spacing = None
    if "space directions" in header:
        directions = np.array(
            [d for d in header["space directions"] if d is not None and not np.isnan(d).any()],
            dtype=float,
        )
        if directions.shape == (3, 3):
            spacing = np.linalg.norm(directions, axis=1).tolist()
    if spacing is None and "spacings" in header and len(header["spacings"]) == 3:
        spacing = [float(s) for s in header["spacings"]]
    if spacing is not None and not all(math.isfinite(s) and s > 0 for s in spacing):
        raise DataError(
            f"{source}: its header gives a voxel spacing of {spacing} mm; each must be a "
            "positive number: correct the header (space directions or spacings) and prepare again"
        )
    return spacing


def existing_cloud_is_valid(path: Path) -> bool:
    """A finished output: an N x 3 float array with points (a save never leaves half a file)."""
    try:
        points = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):
        return False
    return points.ndim == 2 and points.shape[1] == 3 and len(points) > 0


def surface_points(volume: np.ndarray, count: int, seed: int, path: Path) -> np.ndarray:
    """`count` points on the level-0 marching-cubes surface of a binary volume, voxel units."""
    import mcubes
    import trimesh

    if not np.any(volume):
        raise DataError(f"{path}: the volume is empty (no voxel is set), so it has no surface")
    vertices, faces = mcubes.marching_cubes(volume, 0)
    if len(faces) == 0:
        raise DataError(f"{path}: marching cubes found no surface")
    mesh = trimesh.Trimesh(vertices, faces, process=False)
    points, _ = trimesh.sample.sample_surface(mesh, count, seed=seed)
    return points.astype(np.float32)


def prepare_volume(job: tuple[Path, Path, int, bool]) -> tuple[str, list[float] | None, str]:
    """Write one volume's `_surf.npy` atomically: (its path, its spacing, what happened).

    Runs in a worker process, so a bad volume comes back as "error: <message naming it>" for
    the parent to report, instead of an exception from inside the pool.
    """
    import nrrd

    source, target, count, overwrite = job
    try:
        try:
            header = nrrd.read_header(str(source))
        except Exception as err:  # pynrrd raises several types for a damaged header
            raise DataError(f"{source}: not a readable NRRD volume ({err})") from None
        spacing = voxel_spacing(header, source)
        if not overwrite and existing_cloud_is_valid(target):
            return str(target), spacing, "skipped"
        try:
            volume, _ = nrrd.read(str(source))
        except Exception as err:
            raise DataError(f"{source}: not a readable NRRD volume ({err})") from None
        if volume.ndim != 3:
            raise DataError(f"{source}: expected a 3-D volume, got shape {volume.shape}")
        points = surface_points(volume, count, zlib.crc32(target.name.encode()), source)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        with partial.open("wb") as handle:
            np.save(handle, points)
        os.replace(partial, target)
        return str(target), spacing, "written"
    except DataError as err:
        return str(target), None, f"error: {err}"


def original_split(relatives: list[Path], seed: int = 42, train_ratio: float = 0.8) -> dict:
    """The original's split_skullbreak.py: shuffle the sorted complete skulls, first 80% train."""
    cases = [r for r in relatives if r.parts[0] == "complete_skull"]
    random.Random(seed).shuffle(cases)
    cut = int(len(cases) * train_ratio)
    return {"train": cases[:cut], "test": cases[cut:]}


def plan_splits(raw: Path, out: Path, relatives: list[Path]) -> dict[str, list[str]]:
    """The cases of each CSV that `out` lacks, checked before any volume is prepared.

    A CSV already in `out` is the user's and is left alone (the recipe reads .nrrd and absolute
    rows too); one in `raw` is kept (the original's split script writes absolute .nrrd paths).
    A split given for one side only makes the other of the remaining cases, and two given
    splits must not share a case: the held-out skulls are never trained on. Without either, the
    original's split.
    """
    given: dict[str, tuple[Path, list[str]]] = {}
    for name in ("train", "test"):
        source = next((f for f in (out / f"{name}.csv", raw / f"{name}.csv") if f.is_file()), None)
        if source is not None:
            rows = read_path_list(source, suffixes=(".nrrd", ".npy"))
            given[name] = (source, [case_stem(row) for _, row in rows])
    if len(given) == 2:
        require_disjoint(given["train"], given["test"])
        splits = {"train": given["train"][1], "test": given["test"][1]}
    elif len(given) == 1:
        [(name, (source, listed))] = given.items()
        other, taken = "test" if name == "train" else "train", set(listed)
        cases = [case_stem(r.name) for r in relatives if r.parts[0] == "complete_skull"]
        rest = [stem for stem in cases if stem not in taken]
        if not rest:
            raise DataError(
                f"{source}: lists every case, so none is left for {other}.csv; write "
                f"{other}.csv beside it, or list fewer cases"
            )
        splits = {name: listed, other: rest}
    else:
        split = original_split(relatives)
        splits = {name: [case_stem(r.name) for r in cases] for name, cases in split.items()}
    return {name: stems for name, stems in splits.items() if not (out / f"{name}.csv").is_file()}


def write_split_csvs(out: Path, splits: dict[str, list[str]]) -> None:
    """train.csv / test.csv of `complete_skull/<stem>_surf.npy` rows, the point clouds' names."""
    for name, stems in splits.items():
        rows = "".join(f"complete_skull/{stem}_surf.npy\n" for stem in stems)
        (out / f"{name}.csv").write_text(rows)


def merge_spacing(out: Path, spacings: dict[str, list[float] | None]) -> None:
    """Add to `voxel_spacing.json`: mm per voxel along each axis, per point-cloud file (null
    where the volume's header gives none; the recipe then reports distances in voxels)."""
    path = out / SPACING_FILE
    recorded = read_spacing(out, checked=False) | spacings
    for key, value in recorded.items():  # nothing but spacings is written (nor NaN, not JSON)
        checked_spacing(path, key, value)
    document = {"unit": "mm per point-coordinate unit, per axis", "spacing": recorded}
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(document, indent=1, sort_keys=True))
    os.replace(partial, path)


def prepare_skullbreak(
    raw: Path, out: Path, *, points: int, workers: int, overwrite: bool
) -> dict[str, int]:
    """Turn a SkullBreak folder of .nrrd volumes into the recipe's point-cloud layout."""
    try:
        import mcubes  # noqa: F401
        import nrrd  # noqa: F401
        import trimesh  # noqa: F401
    except ImportError as err:
        raise ConfigError(
            f"prepare needs the volumes extra, pynrrd, PyMCubes and trimesh ({err.name} is "
            'missing): pip install "accel-recipes[volumes]"'
        ) from None
    if not raw.is_dir():
        raise DataError(f"--raw {raw}: not a folder")
    require_writable_folder(out, "--out")  # before any volume is meshed, not at its first write
    relatives = volume_relatives(raw)
    splits = plan_splits(raw, out, relatives)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(raw / r, out / r.parent / surface_name(r), points, overwrite) for r in relatives]
    counts = {"written": 0, "skipped": 0}
    spacings: dict[str, list[float] | None] = {}
    try:
        for target, spacing, status in tqdm(
            _run(jobs, workers), total=len(jobs), desc="volumes", unit="vol"
        ):
            if status.startswith("error: "):
                raise DataError(status.removeprefix("error: ") + " (nothing was written for it)")
            spacings[Path(target).relative_to(out).as_posix()] = spacing
            counts[status] += 1
    finally:  # record what finished, so a resumed run has the spacing of the skipped files
        if spacings:
            merge_spacing(out, spacings)
    write_split_csvs(out, splits)
    return counts


def _run(jobs: list, workers: int) -> Iterator[tuple[str, list[float] | None, str]]:
    """Results in job order; the first error stops the pool without running the rest."""
    if workers <= 1:
        yield from map(prepare_volume, jobs)
        return
    pool = ProcessPoolExecutor(workers)
    try:
        yield from pool.map(prepare_volume, jobs, chunksize=1)
    finally:
        pool.shutdown(cancel_futures=True)
