"""From SkullBreak .nrrd volumes to the point-cloud recipe's layout, as the original's users do.

Small synthetic volumes stand in for SkullBreak (which cannot be downloaded here): a voxelised
spherical shell is the skull, and each defect type cuts out a different cap, which is the implant.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from accel_common.errors import DataError
from recipes.pointcloud.data import DEFECTS, SkullBreak
from tests.processes import POINTCLOUD, POINTCLOUD_TINY, run_recipe

# prepare needs the `volumes` extra; the checks of its output use scipy (the `vision` extra).
# Without them this module skips; test_pointcloud.py checks the error prepare gives then.
nrrd = pytest.importorskip("nrrd", reason="needs the volumes extra (pynrrd)")
pytest.importorskip("mcubes", reason="needs the volumes extra (PyMCubes)")
pytest.importorskip("trimesh", reason="needs the volumes extra (trimesh)")
pytest.importorskip("scipy", reason="needs scipy (the vision extra)")
from scipy.spatial import cKDTree  # noqa: E402

from recipes.pointcloud.prepare import prepare_skullbreak  # noqa: E402

SIZE, SPACING = 28, (0.4, 0.4, 0.5)  # anisotropic, so a swapped axis would show
CAP_DIRECTIONS = {
    "bilateral": (0, 0, 1),
    "frontoorbital": (0, 1, 0.3),
    "parietotemporal": (1, 0, 0.4),
    "random_1": (-1, 0.2, 0.5),
    "random_2": (0.3, -1, 0.6),
}


def skull_and_caps(radius_shift: float) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """A shell 3 voxels thick, and per defect the voxels within 35 degrees of its direction."""
    grid = np.stack(np.mgrid[:SIZE, :SIZE, :SIZE], axis=-1) - (SIZE - 1) / 2
    radius = np.linalg.norm(grid, axis=-1)
    shell = (radius >= 7 + radius_shift) & (radius <= 10 + radius_shift)
    caps = {}
    for defect, direction in CAP_DIRECTIONS.items():
        unit = np.asarray(direction, dtype=float) / np.linalg.norm(direction)
        cosine = (grid @ unit) / np.maximum(radius, 1e-9)
        caps[defect] = shell & (cosine > np.cos(np.radians(35)))
    return shell, caps


def write_volume(path: Path, volume: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"space directions": np.diag(SPACING), "space": "left-posterior-superior"}
    nrrd.write(str(path), volume.astype(np.uint8), header)


def write_raw_skullbreak(root: Path, cases: list[str]) -> None:
    """The downloaded layout, plus the CSVs the original's split script writes (absolute .nrrd)."""
    for i, case in enumerate(cases):
        shell, caps = skull_and_caps(radius_shift=i * 0.5)
        write_volume(root / "complete_skull" / f"{case}.nrrd", shell)
        for defect, cap in caps.items():
            write_volume(root / "defective_skull" / defect / f"{case}.nrrd", shell & ~cap)
            write_volume(root / "implant" / defect / f"{case}.nrrd", cap)
    for split, chosen in (("train", cases[:-1]), ("test", cases[-1:])):
        with (root / f"{split}.csv").open("w", newline="") as handle:
            rows = [[(root / "complete_skull" / f"{case}.nrrd").resolve()] for case in chosen]
            csv.writer(handle).writerows(rows)


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("skullbreak") / "SkullBreak"
    write_raw_skullbreak(root, ["000", "001", "002"])
    return root


@pytest.fixture(scope="module")
def prepared(raw, tmp_path_factory) -> tuple[Path, dict[str, int]]:
    out = tmp_path_factory.mktemp("prepared") / "points"
    return out, prepare_skullbreak(raw, out, points=600, workers=2, overwrite=False)


def test_prepare_writes_the_originals_names_in_voxel_units_with_the_spacing(raw, prepared):
    out, counts = prepared
    assert counts == {"written": 33, "skipped": 0}  # 3 complete + 3 x 5 defective + 3 x 5 implants
    assert (out / "train.csv").read_text().split() == [
        "complete_skull/000_surf.npy",
        "complete_skull/001_surf.npy",
    ]
    assert (out / "test.csv").read_text().split() == ["complete_skull/002_surf.npy"]
    spacing = json.loads((out / "voxel_spacing.json").read_text())["spacing"]
    assert len(spacing) == 33
    assert spacing["implant/random_2/001_surf.npy"] == pytest.approx(SPACING)
    for defect in DEFECTS:
        _, caps = skull_and_caps(radius_shift=0.0)
        implant = np.load(out / "implant" / defect / "000_surf.npy")
        assert implant.shape == (600, 3) and implant.dtype == np.float32
        # level-0 marching cubes puts the surface on the voxels around the cap: within one
        # voxel's diagonal of it, in voxel units (not mm), and nowhere near the other caps
        distance, _ = cKDTree(np.argwhere(caps[defect])).query(implant)
        assert distance.max() <= np.sqrt(3)
        other = next(d for d in DEFECTS if d != defect)
        assert cKDTree(np.argwhere(caps[other])).query(implant)[0].mean() > 3


def test_prepare_skips_what_is_done_and_redoes_a_damaged_file(raw, tmp_path):
    out = tmp_path / "points"
    prepare_skullbreak(raw, out, points=50, workers=1, overwrite=False)
    damaged = out / "implant" / "bilateral" / "001_surf.npy"
    damaged.write_bytes(damaged.read_bytes()[:60])  # a copy cut short
    kept = out / "complete_skull" / "000_surf.npy"
    before = kept.stat().st_mtime_ns
    counts = prepare_skullbreak(raw, out, points=50, workers=1, overwrite=False)
    assert counts == {"written": 1, "skipped": 32}
    assert np.load(damaged).shape == (50, 3) and kept.stat().st_mtime_ns == before
    counts = prepare_skullbreak(raw, out, points=50, workers=1, overwrite=True)
    assert counts == {"written": 33, "skipped": 0}


@pytest.mark.parametrize("damage", ["empty", "garbage"])
def test_a_bad_volume_is_named_and_nothing_is_half_written(raw, tmp_path, damage):
    broken = tmp_path / "SkullBreak"
    shutil.copytree(raw, broken)
    volume = broken / "implant" / "frontoorbital" / "001.nrrd"
    if damage == "empty":
        write_volume(volume, np.zeros((SIZE, SIZE, SIZE)))
        expected = "the volume is empty"
    else:
        volume.write_bytes(b"not a volume\n" + bytes(100))  # e.g. a failed download
        expected = "not a readable NRRD volume"
    with pytest.raises(DataError, match=expected) as raised:
        prepare_skullbreak(broken, tmp_path / "out", points=50, workers=2, overwrite=False)
    assert str(volume) in str(raised.value)
    target = tmp_path / "out" / "implant" / "frontoorbital"
    assert not (target / "001_surf.npy").exists()
    assert not list(target.glob("*.partial"))


@pytest.mark.parametrize(
    ("header", "spacing"),
    [
        ({"space directions": np.diag((0.4, 0.0, 0.5))}, "[0.4, 0.0, 0.5]"),
        ({"spacings": [0.4, -0.4, 0.5]}, "[0.4, -0.4, 0.5]"),
        ({"spacings": [0.4, float("nan"), 0.5]}, "[0.4, nan, 0.5]"),
    ],
)
def test_a_volume_whose_header_gives_no_positive_spacing_is_named(raw, tmp_path, header, spacing):
    """A zero, negative or NaN spacing would be recorded and give distances "in mm" that are
    not: the volume is named, with the spacing its header gives, and nothing is written for it."""
    broken = tmp_path / "SkullBreak"
    shutil.copytree(raw, broken)
    volume = broken / "implant" / "parietotemporal" / "001.nrrd"
    data, _ = nrrd.read(str(volume))
    nrrd.write(str(volume), data, header)
    out = tmp_path / "out"
    with pytest.raises(DataError) as raised:
        prepare_skullbreak(broken, out, points=50, workers=1, overwrite=False)
    assert str(raised.value) == (
        f"{volume}: its header gives a voxel spacing of {spacing} mm; each must be a positive "
        "number: correct the header (space directions or spacings) and prepare again "
        "(nothing was written for it)"
    )
    assert not (out / "implant" / "parietotemporal" / "001_surf.npy").exists()
    recorded = json.loads((out / "voxel_spacing.json").read_text())["spacing"]
    assert "implant/parietotemporal/001_surf.npy" not in recorded
    assert all(value == pytest.approx(SPACING) for value in recorded.values())


def test_a_missing_volume_is_named_before_any_work(raw, tmp_path):
    broken = tmp_path / "SkullBreak"
    shutil.copytree(raw, broken)
    (broken / "defective_skull" / "random_1" / "002.nrrd").unlink()
    with pytest.raises(DataError, match=r"random_1/002.nrrd: file not found"):
        prepare_skullbreak(broken, tmp_path / "out", points=50, workers=1, overwrite=False)
    assert not (tmp_path / "out").exists()


def test_a_train_csv_alone_gets_the_other_cases_as_test(raw, tmp_path):
    """Not the original's 80/20 split, which could hold out a case train.csv trains on."""
    given = tmp_path / "SkullBreak"
    shutil.copytree(raw, given)
    (given / "test.csv").unlink()
    (given / "train.csv").write_text(f"{given / 'complete_skull' / '001.nrrd'}\n")
    out = tmp_path / "out"
    prepare_skullbreak(given, out, points=50, workers=1, overwrite=False)
    assert (out / "train.csv").read_text().split() == ["complete_skull/001_surf.npy"]
    assert (out / "test.csv").read_text().split() == [
        "complete_skull/000_surf.npy",
        "complete_skull/002_surf.npy",
    ]


def test_splits_that_would_overlap_are_refused_before_any_work(raw, tmp_path):
    given = tmp_path / "SkullBreak"
    shutil.copytree(raw, given)
    (given / "test.csv").write_text("complete_skull/001.nrrd\ncomplete_skull/002.nrrd\n")
    with pytest.raises(DataError, match=r"train.csv and .*test.csv share 1 case\(s\) \(001\)"):
        prepare_skullbreak(given, tmp_path / "out", points=50, workers=1, overwrite=False)
    (given / "test.csv").unlink()
    (given / "train.csv").write_text("000.nrrd\n001.nrrd\n002.nrrd\n")
    with pytest.raises(DataError, match=r"train.csv: lists every case, so none is left for test"):
        prepare_skullbreak(given, tmp_path / "out", points=50, workers=1, overwrite=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_recipe_prepares_in_place_as_the_original_and_trains_on_it(raw, tmp_path):
    """`prepare` with no --out writes beside the volumes, exactly as the original's preprocessing;
    the original's split CSVs (absolute .nrrd paths) stay as they are and the recipe reads them;
    distances come out in mm from the recorded spacing."""
    root = tmp_path / "SkullBreak"
    shutil.copytree(raw, root)
    csvs = {name: (root / name).read_text() for name in ("train.csv", "test.csv")}
    args = ["prepare", "--raw", str(root), "--points", "400", "--workers", "2"]
    result = run_recipe(args, cwd=tmp_path, script=POINTCLOUD)
    assert "33 point clouds written, 0 already there" in result.stdout
    assert (root / "implant" / "parietotemporal" / "002_surf.npy").is_file()
    assert {name: (root / name).read_text() for name in csvs} == csvs
    args = ["--path", str(root / "train.csv"), "--output-dir", str(tmp_path / "run")]
    args += [*POINTCLOUD_TINY, "--max-steps", "3", "--eval-every", "100"]
    run_recipe(args, cwd=tmp_path, script=POINTCLOUD)
    metrics = json.loads((tmp_path / "run" / "model" / "model.json").read_text())["metrics"]
    assert metrics["n"] == 5 and metrics["chamfer_mm"] > 0


def test_a_folder_the_original_preprocessed_loads_without_the_spacing(prepared, tmp_path):
    """No voxel_spacing.json (the original does not write one): the files load, distances stay in
    the files' units; this project's older names (070.npy) are still read."""
    out, _ = prepared
    folder = tmp_path / "original"
    shutil.copytree(out, folder)
    (folder / "voxel_spacing.json").unlink()
    dataset = SkullBreak(folder, "train", num_points=64, num_nn=16, timesteps=10, seed=0)
    assert len(dataset) == 10 and dataset.unit == "units"
    assert dataset.entries[0][1] == folder / "implant" / "bilateral" / "000_surf.npy"
    renamed = folder / "implant" / "bilateral" / "000.npy"
    os.replace(dataset.entries[0][1], renamed)
    again = SkullBreak(folder, "train", num_points=64, num_nn=16, timesteps=10, seed=0)
    assert again.entries[0][1] == renamed
    with_spacing = SkullBreak(out, "train", num_points=64, num_nn=16, timesteps=10, seed=0)
    assert with_spacing.unit == "mm"
    assert with_spacing[0]["mm_per_unit"].tolist() == pytest.approx(SPACING)
