"""prepare splits SkullBreak's skulls as the original does: the cases of train.csv and test.csv
against pcdiff's own split_skullbreak.py run on the same case names (tests/fixtures/pointcloud/
split.json, make_split.py), for the recipe's example (30 skulls) and for SkullBreak's 114, whose
split is the one the original commits (pcdiff/datasets/SkullBreak/train.csv, test.csv)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipes.pointcloud.data import DEFECTS
from recipes.pointcloud.prepare import plan_splits, volume_relatives, write_split_csvs
from tests.processes import REPO

FIXTURE = json.loads((REPO / "tests" / "fixtures" / "pointcloud" / "split.json").read_text())


def raw_folder(root: Path, cases: list[str]) -> Path:
    """A downloaded SkullBreak layout of empty volumes (the split reads only their names),
    written in shuffled order, so the listing's order cannot stand in for the sorting."""
    folders = [f"{kind}/{d}" for kind in ("defective_skull", "implant") for d in DEFECTS]
    for case in sorted(cases, key=lambda c: c[::-1]):
        for folder in ("complete_skull", *folders):
            (root / folder).mkdir(parents=True, exist_ok=True)
            (root / folder / f"{case}.nrrd").touch()
    return root


@pytest.mark.parametrize("name", ["example", "skullbreak"])
def test_prepare_splits_the_skulls_as_the_originals_split_script(tmp_path, name):
    case = FIXTURE["cases"][name]
    assert (FIXTURE["seed"], FIXTURE["train_ratio"]) == (42, 0.8)  # its defaults, prepare's
    raw = raw_folder(tmp_path / "raw", case["complete_skulls"])
    out = tmp_path / "points"
    splits = plan_splits(raw, out, volume_relatives(raw))
    assert splits == {"train": case["train"], "test": case["test"]}  # members, in its order
    out.mkdir()
    write_split_csvs(out, splits)
    for split in ("train", "test"):  # as the original's committed CSVs are written
        rows = "".join(f"complete_skull/{stem}_surf.npy\n" for stem in case[split])
        assert (out / f"{split}.csv").read_text() == rows
