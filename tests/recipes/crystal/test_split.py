"""The crystal presets hold out the structures ComFormer's own API holds out: the same frames in
train / val / test for the same ratios and seed (tests/fixtures/crystal/split.json, made by
the original's `train_from_extxyz`)."""

from __future__ import annotations

import json

import pytest

from recipes.crystal.data import load_graphs, split_indices
from recipes.crystal.example import write_dataset
from recipes.crystal.settings import CrystalSettings
from recipes.crystal_api import PRESETS, original_defaults
from tests.processes import REPO

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
