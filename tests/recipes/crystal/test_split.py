"""The crystal presets hold out the structures ComFormer's own API holds out: the same frames in
train / val / test for the same ratios and seed (tests/fixtures/crystal/split.json, made by
the original's `train_from_extxyz`)."""

from __future__ import annotations

import json

import pytest
from accelerate.state import AcceleratorState

import recipes.train_crystal as recipe
from accel_common.checkpoints.checkpoint_files import (
    PROGRESS_FILE,
    read_manifest,
    write_manifest,
)
from accel_common.errors import CheckpointError
from accel_common.recipe_cli.entry import train_in_python
from recipes.crystal.data import load_graphs, split_indices
from recipes.crystal.example import write_dataset
from recipes.crystal.settings import CrystalSettings
from recipes.crystal_api import PRESETS, original_defaults
from tests.processes import CRYSTAL, CRYSTAL_TINY, REPO
from tests.recipes.crystal.helpers import write_volumes

FIXTURE = json.loads((REPO / "tests" / "fixtures" / "crystal" / "split.json").read_text())
STRUCTURES = 60  # the fixture's data: write_dataset(DIR, structures=60)


def frames(ids: list[str]) -> list[int]:
    """The original's ids (custom_<frame>) as frame indices."""
    return [int(name.removeprefix("custom_")) for name in ids]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_each_preset_splits_as_the_original_api(preset, tmp_path):
    """The preset's ratios and seed over the example's frames, in the file's order as the run
    reads them: the original's members, in its order."""
    write_dataset(tmp_path, structures=STRUCTURES)
    settings = CrystalSettings.from_config(original_defaults(preset))
    rows, _, _ = load_graphs(
        tmp_path / "structures.extxyz", index=settings.index, target=settings.target,
        per_atom=settings.per_atom, cutoff=4.0, max_neighbors=4, non_periodic=False,
        workers=1, cache=False,
    )  # fmt: skip
    assert rows["index"] == list(range(STRUCTURES))  # a row is its frame, in file order
    ratios = (settings.train_ratio, settings.val_ratio, settings.test_ratio)
    assert ratios == tuple(FIXTURE["ratios"].values())
    want = FIXTURE["splits"][str(settings.split_seed)]
    parts = split_indices(len(rows), ratios, settings.split_seed)
    assert [p.tolist() for p in parts] == [frames(want[k]) for k in ("train", "val", "test")]


def test_another_seed_splits_as_the_original_with_it():
    want = FIXTURE["splits"]["7"]
    parts = split_indices(STRUCTURES, (0.8, 0.1, 0.1), 7)
    assert [p.tolist() for p in parts] == [frames(want[k]) for k in ("train", "val", "test")]


def test_a_checkpoint_of_other_split_members_is_refused_naming_them(tmp_path):
    """A checkpoint that records no split members (saved before the split was ComFormer's, on
    numpy's permutation: other structures) or other ones is not resumed on this split."""
    path = tmp_path / "v.extxyz"
    write_volumes(path, 30)
    out = tmp_path / "run"
    argv = ["--data", str(path), "--target", "volume", "--no-cache-graphs", *CRYSTAL_TINY]
    argv += ["--bs", "8", "--output-dir", str(out)]
    try:
        train_in_python(recipe.train, [*argv, "--max-steps", "2"], out, script=CRYSTAL)
        (progress,) = out.glob(f"checkpoints/*/{PROGRESS_FILE}")
        record = json.loads(progress.read_text())
        del record["run"]["identity"]["split_members"]  # as a checkpoint from before
        progress.write_text(json.dumps(record))
        write_manifest(progress.parent, read_manifest(progress.parent)["progress"])  # as saved
        again = [*argv, "--max-steps", "3", "--resume", "latest"]
        with pytest.raises(CheckpointError, match=r"belongs to another run") as refused:
            train_in_python(recipe.train, again, out, script=CRYSTAL)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert "split_members (computed from the data): unset in the checkpoint" in str(refused.value)
