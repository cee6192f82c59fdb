"""The point-cloud recipe's data: the SkullBreak layout, the original's CSV rows and normalisation,
voxel spacing, and bad data or sizes stopped with one clear line.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import recipes.train_pointcloud as recipe
from accel_common.errors import ConfigError, DataError
from recipes.pointcloud.data import DEFECTS, SPACING_FILE, SkullBreak, case_stem
from recipes.pointcloud.diffusion import Diffusion
from recipes.pointcloud.example import write_dataset
from recipes.pointcloud.model import PVCNN2
from recipes.pointcloud.prepare import merge_spacing
from tests.processes import POINTCLOUD, invoke_train, run_recipe
from tests.recipes.pointcloud.helpers import TINY


def test_generated_data_follows_the_skullbreak_layout(pointcloud_data):
    rows = (pointcloud_data / "train.csv").read_text().split()
    assert len(rows) == 24 and rows[0] == "complete_skull/000_surf.npy"
    complete = np.load(pointcloud_data / rows[0])
    for defect in DEFECTS:
        defective = np.load(pointcloud_data / "defective_skull" / defect / "000_surf.npy")
        implant = np.load(pointcloud_data / "implant" / defect / "000_surf.npy")
        assert defective.shape[1] == implant.shape[1] == 3
        assert len(implant) > 50 and len(defective) + len(implant) == len(complete)
        together = np.concatenate([defective, implant])
        assert np.allclose(np.sort(together, axis=0), np.sort(complete, axis=0))


@pytest.fixture
def broken_data(tmp_path, pointcloud_data):
    folder = tmp_path / "skulls"
    shutil.copytree(pointcloud_data, folder)
    return folder


def break_missing_implant(folder):
    (folder / "implant" / "random_2" / "003_surf.npy").unlink()
    return "implant/random_2/003_surf.npy: file not found (listed by", "train.csv, line 4"


def break_shape(folder):
    np.save(folder / "defective_skull" / "bilateral" / "000_surf.npy", np.zeros((10, 2)))
    return "bilateral/000_surf.npy: expected an M x 3 point cloud, got shape (10, 2)", ""


def break_empty_split(folder):
    (folder / "test.csv").write_text("path\n")
    return "test.csv: lists no .npy or .nrrd files", ""


def break_not_npy(folder):
    (folder / "train.csv").write_text("complete_skull/000_surf.npy\ncomplete_skull/001.txt\n")
    return "train.csv, line 2: 'complete_skull/001.txt' is not a .npy or .nrrd path", ""


def set_spacing(folder, value):
    """Give one implant a voxel spacing of `value` in the folder's voxel_spacing.json."""
    path = folder / SPACING_FILE
    document = json.loads(path.read_text())
    document["spacing"]["implant/random_1/002_surf.npy"] = value
    path.write_text(json.dumps(document))
    return f"{path}: entry 'implant/random_1/002_surf.npy' is {json.dumps(value)}; ", SPACING_HELP


SPACING_HELP = (
    "a voxel spacing is 3 positive numbers (mm per coordinate unit along x, y, z), or null "
    "where it is unknown: correct it, or write the file again with prepare"
)


def break_zero_spacing(folder):
    return set_spacing(folder, [1.0, 0.0, 1.0])


def break_text_spacing(folder):
    return set_spacing(folder, ["0.4 mm", 0.4, 0.5])


def test_a_case_in_both_splits_is_refused_before_training_naming_it_and_both_files(
    broken_data, tmp_path, monkeypatch
):
    """Training read train.csv and test.csv sharing a case, and reported test metrics on a
    training skull; `prepare` refused such splits. Training refuses them too, in one line
    naming the case and both files, before any point cloud is read."""
    train_rows = (broken_data / "train.csv").read_text().splitlines()
    shared = next(row for row in train_rows if row.endswith(".npy"))
    with (broken_data / "test.csv").open("a") as handle:
        handle.write(shared + "\n")
    case = case_stem(shared)
    expected = (
        f"{broken_data / 'train.csv'} and {broken_data / 'test.csv'} share 1 case(s) ({case}); "
        "remove them from one"
    )

    def no_reading(*_: object, **__: object) -> None:
        raise AssertionError("the splits were read before they were checked")

    monkeypatch.setattr(recipe, "skullbreak", no_reading)
    args = ["--data", str(broken_data), "--output-dir", str(tmp_path / "run"), "--cpu"]
    result = invoke_train(recipe.train, [*args, *TINY, "--max-steps", "1"])
    assert isinstance(result.exception, DataError), result.exception
    assert expected in str(result.exception) and "\n" not in str(result.exception)
    assert not (tmp_path / "run" / "model").exists()


@pytest.mark.parametrize(
    "breaker",
    [
        break_missing_implant,
        break_shape,
        break_empty_split,
        break_not_npy,
        break_zero_spacing,
        break_text_spacing,
    ],
)
@pytest.mark.slow
def test_bad_data_gives_one_clear_error(breaker, broken_data, tmp_path):
    first, second = breaker(broken_data)
    args = ["--data", str(broken_data), "--output-dir", str(tmp_path / "run"), *TINY]
    result = run_recipe([*args, "--max-steps", "1"], cwd=tmp_path, script=POINTCLOUD, check=False)
    assert result.returncode == 2, result.stderr
    assert first in result.stderr and second in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "model").exists()


@pytest.mark.slow
def test_bad_sizes_are_refused(tmp_path, pointcloud_data):
    args = ["--data", str(pointcloud_data), "--num-points", "256", "--num-nn", "256"]
    result = run_recipe(args, cwd=tmp_path, script=POINTCLOUD, check=False)
    assert result.returncode == 2
    assert "--num-nn must be between 1 and --num-points - 1" in result.stderr
    args = ["--data", str(pointcloud_data), "--num-points", "64", "--num-nn", "8"]
    result = run_recipe(args, cwd=tmp_path, script=POINTCLOUD, check=False)
    assert result.returncode == 2
    assert "--num-points must be at least 192" in result.stderr
    result = run_recipe(
        ["--data", str(pointcloud_data), "--width-mult", "0.3"],
        cwd=tmp_path,
        script=POINTCLOUD,
        check=False,
    )
    assert result.returncode == 2 and "each must be a multiple of 8" in result.stderr


@pytest.mark.parametrize("module", ["nrrd", "mcubes", "trimesh"])
def test_prepare_without_the_volumes_extra_names_it(module, monkeypatch, tmp_path):
    """Here, not in test_prepare.py (which skips without the extra): the case a user meets."""
    prepare = recipe.prepare
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now fails as if absent
    with pytest.raises(ConfigError) as raised:
        prepare(raw=tmp_path, out=tmp_path / "out", points=10, workers=1, overwrite=False)
    message = str(raised.value)
    assert message.startswith("prepare needs the volumes extra") and "\n" not in message
    assert f"({module} is missing)" in message and 'pip install "accel-recipes[volumes]"' in message
    assert not (tmp_path / "out").exists()


def test_csv_rows_pointing_into_another_folder_resolve_as_the_originals(tmp_path):
    """The original reads each row from its own folder: the path before complete_skull/,
    relative to the CSV's folder unless absolute. A plain complete_skull/... row reads the
    CSV's folder; an absolute row whose folder lacks the case (a data set moved after the split
    script wrote it) falls back to the CSV's folder."""
    elsewhere = write_dataset(
        tmp_path / "elsewhere", train_skulls=2, test_skulls=0, points_per_skull=400
    )
    lists = tmp_path / "lists"
    lists.mkdir()
    (lists / "train.csv").write_text(
        f"{elsewhere / 'complete_skull' / '000_surf.npy'}\n../elsewhere/complete_skull/001.nrrd\n"
    )
    sizes = {"num_points": 64, "num_nn": 16, "timesteps": 10, "seed": 0}
    dataset = SkullBreak(lists, "train", **sizes)
    implants = [implant for _, implant in dataset.entries]
    assert implants[0] == elsewhere / "implant" / "bilateral" / "000_surf.npy"
    assert implants[5] == lists / "../elsewhere/implant/bilateral/001_surf.npy"
    assert len(dataset) == 10 and dataset.unit == "mm"  # the spacing file of the rows' folder
    (elsewhere / "train.csv").write_text(
        "complete_skull/000_surf.npy\n/moved/away/complete_skull/001_surf.npy\n"
    )
    beside = SkullBreak(elsewhere, "train", **sizes)
    assert [implant for _, implant in beside.entries][::5] == [
        elsewhere / "implant" / "bilateral" / "000_surf.npy",
        elsewhere / "implant" / "bilateral" / "001_surf.npy",
    ]


def test_distances_in_mm_follow_the_recorded_voxel_spacing(tmp_path):
    """The same points with a recorded spacing of 2 mm per voxel instead of 1: every distance
    `evaluate` reports (the model's and the baselines') doubles, with the same sampling noise."""
    root = write_dataset(tmp_path, train_skulls=2, test_skulls=1, points_per_skull=400)
    torch.manual_seed(0)
    model = PVCNN2(num_points=192, width_multiplier=0.25, voxel_resolution_multiplier=0.125)
    single_process = SimpleNamespace(process_index=0, gather_for_metrics=lambda x: x)
    sizes = {"num_points": 192, "num_nn": 16, "timesteps": 10}

    def metrics() -> dict[str, float]:
        train, test = (SkullBreak(root, name, **sizes, seed=0) for name in ("train", "test"))
        assert test.unit == "mm"
        loader = DataLoader(test, batch_size=5)
        diffusion = Diffusion(sizes["timesteps"])
        pool = recipe.implant_pool(train)
        noise = torch.Generator().manual_seed(0)
        return recipe.evaluate(single_process, model, loader, diffusion, 2, noise, pool, test.unit)

    at_1mm = metrics()
    recorded = json.loads((root / SPACING_FILE).read_text())["spacing"]
    merge_spacing(root, {key: [2.0, 2.0, 2.0] for key in recorded})
    at_2mm = metrics()
    in_mm = [name for name in at_1mm if name.endswith("_mm")]
    assert len(in_mm) == 4 and at_2mm.keys() == at_1mm.keys() and at_2mm["n"] == at_1mm["n"] == 5
    for name in in_mm:
        assert at_1mm[name] > 0 and at_2mm[name] == pytest.approx(2 * at_1mm[name], rel=1e-5)


@pytest.mark.parametrize(
    "value", [[0, 1, 1], [-0.4, 0.4, 0.5], [1, "a", 1], [1, 1], "1 mm", [1, True, 1], [1, 1e400, 1]]
)
def test_a_voxel_spacing_that_is_not_three_positive_numbers_is_refused(tmp_path, value):
    """Zero or negative spacings would still report distances "in mm" (0 mm, or negative),
    others a traceback: each is refused naming the file and the entry, read or merged."""
    root = write_dataset(tmp_path, train_skulls=2, test_skulls=1, points_per_skull=400)
    before = (root / SPACING_FILE).read_text()
    message = "^" + re.escape(f"{root / SPACING_FILE}: entry 'implant/bilateral/000_surf.npy' is ")
    with pytest.raises(DataError, match=message + ".*" + re.escape(SPACING_HELP) + "$"):
        merge_spacing(root, {"implant/bilateral/000_surf.npy": value})
    assert (root / SPACING_FILE).read_text() == before  # nothing written
    document = json.loads(before)
    document["spacing"]["implant/bilateral/000_surf.npy"] = None  # unknown: distances in units
    (root / SPACING_FILE).write_text(json.dumps(document))
    assert SkullBreak(root, "train", num_points=64, num_nn=16, timesteps=10, seed=0).unit == "units"
    document["spacing"]["implant/bilateral/000_surf.npy"] = value
    (root / SPACING_FILE).write_text(json.dumps(document))
    with pytest.raises(DataError, match=message + ".*" + re.escape(SPACING_HELP) + "$"):
        SkullBreak(root, "train", num_points=64, num_nn=16, timesteps=10, seed=0)


def test_training_samples_are_normalised_as_the_original_trains_and_may_be_rotated(tmp_path):
    """Training: by the bounding box of the sampled skull + implant points (the largest extent
    becomes 6, centred); evaluation: by the sampled skull alone. --augment rotates both about
    their centre by up to 10 degrees: distances between the points are kept."""
    root = write_dataset(tmp_path, train_skulls=1, test_skulls=1, points_per_skull=400)
    sizes = {"num_points": 192, "num_nn": 32, "timesteps": 10, "seed": 0}
    train = SkullBreak(root, "train", **sizes, train=True)[0]
    both = torch.cat([train["skull"], train["implant"]])
    extent = both.max(dim=0).values - both.min(dim=0).values
    assert extent.max().item() == pytest.approx(6.0, rel=1e-5)
    middle = (both.max(dim=0).values + both.min(dim=0).values) / 2
    assert middle.abs().max().item() < 1e-5
    test = SkullBreak(root, "test", **sizes)[0]
    skull_extent = test["skull"].max(dim=0).values - test["skull"].min(dim=0).values
    assert skull_extent.max().item() == pytest.approx(6.0, rel=1e-5)
    rotated = SkullBreak(root, "train", **sizes, train=True, augment=True)[0]
    together = torch.cat([rotated["skull"], rotated["implant"]]) * rotated["scale"]
    plain = both * train["scale"]
    assert not torch.allclose(together, plain)
    exact = "donot_use_mm_for_euclid_dist"
    distances = [torch.cdist(p.double(), p.double(), compute_mode=exact) for p in (together, plain)]
    torch.testing.assert_close(distances[0], distances[1], atol=1e-3, rtol=1e-5)


def test_complete_normalises_the_skull_as_the_originals_test_loader():
    """The original's test-time loader draws the skull points first and normalises by their
    bounding box (skullbreak_data.py, eval=True): the drawn points span exactly -3..3 along their
    longest axis, centred, and generated points map back by x * scale + centre."""
    rng = np.random.default_rng(0)
    points = rng.normal(size=(5000, 3)) * [30.0, 40.0, 20.0] + [5.0, -7.0, 60.0]
    points = points.astype(np.float32)
    condition, center, scale = recipe.skull_condition(points, 200, torch.Generator().manual_seed(0))
    low, high = condition[0].amin(dim=0), condition[0].amax(dim=0)
    assert condition.shape == (1, 200, 3)
    assert (high - low).max().item() == pytest.approx(6.0, abs=1e-5)
    torch.testing.assert_close((high + low) / 2, torch.zeros(3), atol=1e-5, rtol=0)
    back = condition[0].numpy() * scale + center
    nearest = torch.cdist(torch.from_numpy(back).double(), torch.from_numpy(points).double())
    assert nearest.min(dim=1).values.max().item() < 1e-3  # each is one of the skull's points
