"""The crystal recipe's data: extxyz targets where real files keep them, frame indices, the
split, and bad structures or files stopped with one line naming them.
"""

from __future__ import annotations

import csv
from pathlib import Path

import ase.io
import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk
from ase.calculators.singlepoint import SinglePointCalculator

import recipes.train_crystal as recipe
from accel_common.checkpoints.export import write_export
from accel_common.errors import ConfigError, DataError
from recipes import crystal_api as api
from recipes.crystal.data import load_graphs, read_frames, split_indices, target_value
from recipes.crystal.model import Comformer
from tests.processes import CRYSTAL, run_recipe
from tests.recipes.crystal.helpers import labelled_frames, write_volumes


def test_targets_are_found_in_info_calculator_results_and_arrays(tmp_path):
    path = tmp_path / "t.extxyz"
    ase.io.write(path, labelled_frames(), format="extxyz")
    frames = read_frames(path, ":")
    assert len(frames) == 2 and len(read_frames(path, "::2")) == 1
    first = frames[0]
    assert target_value(first, "formation_energy_per_atom", "f", False) == pytest.approx(-0.5)
    # current ASE reads energy back into the calculator, not info
    assert "energy" not in first.info
    assert target_value(first, "energy", "f", per_atom=True) == pytest.approx(-2.0)
    assert target_value(first, "forces", "f", False) == pytest.approx(5.0)  # mean per-atom norm
    with pytest.raises(DataError, match=r"frame 1: no target 'band_gap'; this frame has info: "):
        target_value(frames[1], "band_gap", "frame 1", False)


def test_a_per_atom_array_becomes_the_mean_of_per_atom_norms_and_a_stress_its_norm():
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True)  # 4 atoms
    atoms.arrays["local_e"] = np.array([1.0, -1.0, 1.0, -1.0])  # opposite signs do not cancel
    atoms.arrays["dipoles"] = np.array([[3.0, 4.0, 0.0], [0.0, 0.0, -5.0]] * 2)
    atoms.info["config_type"] = "bulk"
    assert target_value(atoms, "local_e", "f", False) == pytest.approx(1.0)
    assert target_value(atoms, "dipoles", "f", False) == pytest.approx(5.0)
    assert target_value(atoms, "local_e", "f", per_atom=True) == pytest.approx(0.25)
    # six atoms and a six-component (Voigt) stress: still one tensor, not six atoms
    six = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((1, 1, 2))[:6]
    stress = np.array([1.0, -2.0, 2.0, 0.0, 0.0, 0.0])
    six.calc = SinglePointCalculator(six, stress=stress, charges=[2.0, -2.0] * 3)
    assert target_value(six, "stress", "f", False) == pytest.approx(3.0)
    assert target_value(six, "charges", "f", False) == pytest.approx(2.0)  # per atom, declared
    with pytest.raises(DataError, match=r"^f: target 'config_type' is 'bulk', not a number$"):
        target_value(atoms, "config_type", "f", False)


def test_per_atom_arrays_are_read_back_from_an_extxyz_file(tmp_path):
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
    atoms.arrays["local_e"] = np.array([1.0, -1.0, 1.0, -1.0])
    path = tmp_path / "a.extxyz"
    ase.io.write(path, [atoms], format="extxyz")
    (frame,) = read_frames(path, ":")
    assert "local_e" in frame.arrays  # an arrays column, not a calculator result
    assert target_value(frame, "local_e", "f", False) == pytest.approx(1.0)


def test_index_takes_slices_and_frame_numbers_as_ase_writes_them(tmp_path):
    path = tmp_path / "v.extxyz"
    volumes = write_volumes(path, 5)

    def selected(index: str) -> list[float]:
        return [atoms.info["volume"] for atoms in read_frames(path, index)]

    assert selected(":") == pytest.approx(volumes)
    assert selected(":1000") == pytest.approx(volumes)  # past the end: what there is
    assert selected(":3") == pytest.approx(volumes[:3])
    assert selected("1::2") == pytest.approx(volumes[1::2])
    assert selected("2") == pytest.approx([volumes[2]])
    assert selected("-1") == pytest.approx([volumes[-1]])
    with pytest.raises(DataError, match=r"v.extxyz: --index 7 selects no frames"):
        read_frames(path, "7")
    with pytest.raises(ConfigError, match=r"--index first: give a frame number or a slice"):
        read_frames(path, "first")


def test_a_truncated_or_malformed_file_is_a_data_error_naming_the_file_and_frame(tmp_path):
    path = tmp_path / "v.extxyz"
    write_volumes(path, 3)
    lines = path.read_text().splitlines(keepends=True)  # 6 lines per 4-atom frame
    path.write_text("".join(lines[:-2]))  # the last frame cut short
    with pytest.raises(DataError, match=r"v.extxyz, frame 2: not a readable extended XYZ file"):
        read_frames(path, ":")
    assert len(read_frames(path, ":2")) == 2  # the frames before it still read
    lines[8] = "Cu 0.0 x.y 0.0\n"  # frame 1, its third line
    path.write_text("".join(lines))
    with pytest.raises(DataError, match=r"v.extxyz, frame 1: not a readable extended XYZ file"):
        read_frames(path, "::1")
    lines[6] = "four\n"  # a broken header: ASE's scan fails before any frame is read
    path.write_text("".join(lines))
    with pytest.raises(DataError, match=r"v.extxyz: not a readable extended XYZ file"):
        read_frames(path, ":")


def test_a_singular_cell_is_refused_even_with_non_periodic(tmp_path):
    flat = Atoms("Cu2", positions=[[0, 0, 0], [1.8, 0, 0]], pbc=True)
    flat.cell = [[3.6, 0, 0], [0, 3.6, 0], [3.6, 3.6, 0]]  # three vectors in one plane
    flat.info["y"] = 1.0
    crystal = bulk("Cu", "fcc", a=3.6)
    crystal.info["y"] = 2.0
    path = tmp_path / "flat.extxyz"
    ase.io.write(path, [crystal, flat], format="extxyz")
    options = dict(index=":", target="y", per_atom=False, cutoff=4.0, max_neighbors=4, workers=1)
    for non_periodic in (False, True):
        with pytest.raises(
            DataError, match=r"flat.extxyz, frame 1: periodic \(pbc \[True, True, True\]\) but "
            r"its cell is singular \(volume 0\); give the frame three independent lattice"
        ):  # fmt: skip
            load_graphs(path, non_periodic=non_periodic, cache=False, **options)


def test_split_is_fixed_by_its_seed_disjoint_covering_and_80_10_10():
    parts = split_indices(50, (0.8, 0.1, 0.1), seed=123)
    assert [len(p) for p in parts] == [40, 5, 5]
    assert sorted(np.concatenate(parts).tolist()) == list(range(50))  # disjoint and covering
    again = split_indices(50, (0.8, 0.1, 0.1), seed=123)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = split_indices(50, (0.8, 0.1, 0.1), seed=124)
    assert not np.array_equal(parts[2], other[2])
    with pytest.raises(DataError, match=r"5 structures are too few for the split ratios"):
        split_indices(5, (0.8, 0.1, 0.1), seed=0)


@pytest.mark.slow
def test_a_missing_target_stops_with_one_line_naming_the_frame(crystal_data, tmp_path):
    args = ["--data", str(crystal_data), "--target", "band_gap", "--output-dir", str(tmp_path)]
    result = run_recipe(args, cwd=tmp_path, script=CRYSTAL, check=False)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "structures.extxyz, frame 0: no target 'band_gap'; this frame has info: " in line
    assert "calculator: ['energy', 'forces', 'stress']" in line


@pytest.mark.slow
def test_a_truncated_file_stops_the_run_with_one_line_and_exit_code_2(tmp_path):
    path = tmp_path / "v.extxyz"
    write_volumes(path, 3)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-2]))  # as a copy cut off in the middle of the last frame
    args = ["--data", str(path), "--target", "volume", "--output-dir", str(tmp_path / "run")]
    result = run_recipe(args, cwd=tmp_path, script=CRYSTAL, check=False)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {path}, frame 2: not a readable extended XYZ file (")


def test_a_training_split_smaller_than_the_global_batch_says_so_and_what_to_pass(
    tmp_path, monkeypatch
):
    """22 training structures and batch_size=64: no optimizer step can be taken. The error names
    the split's size, the global batch and the way out, not an empty schedule."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "v.extxyz"
    write_volumes(path, 28)  # 22 / 2 / 4 at 0.8 / 0.1 / 0.1
    with pytest.raises(
        ConfigError, match=r"^the training split \(22 structures\) is smaller than the global "
        r"batch \(64\).* a smaller --bs \(batch_size= from Python\), at most 22, or more data"
    ):  # fmt: skip
        api.train_from_extxyz(
            path, "volume", batch_size=64, n_epochs=1, cache_graphs=False,
            extra_args=("--width", "16", "--layers", "1", "--rbf-bins", "16"),
        )  # fmt: skip


def write_with_nan(path: Path, what: str) -> None:
    """Three labelled copper crystals; frame 1 has one NaN position or cell entry."""
    frames = []
    for i in range(3):
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
        atoms.info["y"] = float(i)
        frames.append(atoms)
    if what == "position":
        frames[1].positions[2, 0] = np.nan
    else:
        cell = frames[1].cell.array.copy()
        cell[1, 1] = np.inf
        frames[1].set_cell(cell)
    ase.io.write(path, frames, format="extxyz")


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("position", r"nan.extxyz, frame 1: atom 2 has position \[nan, 0\.0, 1\.8\], not finite"),
        ("cell", r"nan.extxyz, frame 1: its cell has a value that is not finite"),
    ],
)
def test_a_non_finite_position_or_cell_is_refused_in_training_and_predict(tmp_path, what, message):
    path = tmp_path / "nan.extxyz"
    write_with_nan(path, what)
    options = dict(index=":", target="y", per_atom=False, cutoff=4.0, max_neighbors=4, workers=1)
    with pytest.raises(DataError, match=message):
        load_graphs(path, non_periodic=False, cache=False, **options)
    model = Comformer(width=8, layers=1, heads=1, rbf_bins=8)
    config = dict(width=8, layers=1, heads=1, rbf_bins=8, angle_bins=8, fc_features=8)
    config |= dict(cutoff=4.0, max_neighbors=6)
    config |= dict(target="y", per_atom=False, mean=0.0, std=1.0, non_periodic=False)
    write_export(model.state_dict(), tmp_path / "model", {"recipe": "crystal", "config": config})
    out = tmp_path / "p.csv"
    with pytest.raises(DataError, match=message):
        recipe.predict(model_dir=tmp_path / "model", data=path, out=out, index=":")
    assert not out.exists()


def test_predict_reads_a_data_folder_as_training_does(tmp_path):
    """`--data FOLDER` means FOLDER/structures.extxyz in training; predict reads it the same way."""
    folder = tmp_path / "data"
    folder.mkdir()
    write_volumes(folder / "structures.extxyz", 3)
    model = Comformer(width=8, layers=1, heads=1, rbf_bins=8)
    config = dict(width=8, layers=1, heads=1, rbf_bins=8, angle_bins=8, fc_features=8)
    config |= dict(cutoff=4.0, max_neighbors=6)
    config |= dict(target="volume", per_atom=False, mean=0.0, std=1.0, non_periodic=False)
    write_export(model.state_dict(), tmp_path / "model", {"recipe": "crystal", "config": config})
    out = tmp_path / "p.csv"
    recipe.predict(model_dir=tmp_path / "model", data=folder, out=out, index=":")
    assert len(list(csv.DictReader(out.open()))) == 3
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: no structures.extxyz in this folder"):
        recipe.predict(
            model_dir=tmp_path / "model",
            data=tmp_path / "empty",
            out=out.with_name("q.csv"),
            index=":",
        )
