"""The quality recipe holds out the comparisons the original holds out: its preset's split of
the example data against crowd-bt's own split_comparisons run on it (tests/fixtures/quality/
split.json, make_split.py), the annotators read in its S3 order, and a resume on another split
refused."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest

import recipes.train_quality as recipe
from accel_common import DataError
from accel_common.checkpoints.checkpoint_files import PROGRESS_FILE, read_manifest, write_manifest
from recipes.quality.data import Vote, annotation_files, read_comparisons, split_comparisons
from recipes.quality.example import write_dataset
from tests.original_step import preset
from tests.processes import QUALITY, REPO, run_recipe

FIXTURE = REPO / "tests" / "fixtures" / "quality" / "split.json"
ORIGINAL = REPO / "recipes" / "quality" / "configs" / "original.yaml"


def ids(records: list[Vote], read: list[Vote]) -> list[str]:
    """Each record as '<annotator>/<index in its file>', from the order the run read them in
    (every record of the example is read, so the k-th of an annotator is its file's k-th)."""
    name: dict[int, str] = {}
    seen: Counter[str] = Counter()
    for vote in read:
        name[id(vote)] = f"{vote.annotator}/{seen[vote.annotator]}"
        seen[vote.annotator] += 1
    return [name[id(vote)] for vote in records]


def test_the_presets_split_holds_out_the_originals_comparisons(quality_data):
    fixture = json.loads(FIXTURE.read_text())
    args, settings = preset(recipe.train, ORIGINAL)  # as --config resolves it
    seed, stratified = args.seed, settings.split == "stratified"  # as the run passes them
    assert (settings.split, seed, 1 - settings.held_out) == ("stratified", 42, 0.8)
    assert fixture["seed"] == seed and fixture["train_ratio"] == 0.8
    data = read_comparisons(quality_data, quality_data / "images")
    assert len(data.records) == len(fixture["train"]) + len(fixture["val"]) == 1800
    train, held = split_comparisons(list(data.records), settings.held_out, seed, stratified)
    # the same records on each side, in the original's order (its last shuffles included)
    assert ids(train, data.records) == fixture["train"]
    assert ids(held, data.records) == fixture["val"]


def test_another_seed_or_a_plain_split_holds_out_other_comparisons(quality_data):
    records = read_comparisons(quality_data, quality_data / "images").records
    stratified = set(ids(split_comparisons(list(records), 0.2, 42)[1], records))
    assert stratified == set(json.loads(FIXTURE.read_text())["val"])
    assert set(ids(split_comparisons(list(records), 0.2, 43)[1], records)) != stratified
    plain = split_comparisons(list(records), 0.2, 42, stratified=False)[1]
    assert set(ids(plain, records)) != stratified and len(plain) == 360  # 1800 - int(1440.0)


def test_annotators_are_read_in_the_order_s3_lists_them(tmp_path):
    """S3 compares keys as bytes, each annotator's with its "/": "ann-2/" ('-' is 0x2d) comes
    before "ann/" ('/' 0x2f), though sorted names put "ann" first. The original's split draws
    from its records in that order."""
    for name in ("ann", "ann-2", "Zed", "ann_3"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "comparison_data.json").write_text('{"comparisons": []}')
    _, files = annotation_files(tmp_path)
    assert [annotator for _, annotator in files] == ["Zed", "ann-2", "ann", "ann_3"]


def test_a_split_that_leaves_a_side_empty_names_the_flag():
    votes = [Vote("a.png", "b.png", 1, "x", f"type_{k}") for k in range(3)]
    with pytest.raises(DataError, match=r"--held-out 0.2: no training comparisons among 3"):
        split_comparisons(votes, 0.2, 0)  # three types of one record: int(0.8) = 0 each
    train, held = split_comparisons(votes, 0.2, 0, stratified=False)
    assert (len(train), len(held)) == (2, 1)


@pytest.mark.slow
def test_resuming_on_another_split_or_other_members_is_refused(tmp_path: Path):
    data = write_dataset(tmp_path / "data", images=12, comparisons_per_annotator=16, size=16)
    args = ["--data", str(data), "--output-dir", str(tmp_path / "run"), "--image-size", "16"]
    args += ["--bs", "8"]
    first = run_recipe([*args, "--max-steps", "2"], cwd=tmp_path, script=QUALITY)
    split = "split: 79 comparisons to train on, 17 held out (stratified split, seed 0)"
    assert split in first.stdout
    again = [*args, "--max-steps", "4", "--resume", "latest"]
    refused = refusal(
        run_recipe([*again, "--split", "plain"], cwd=tmp_path, script=QUALITY, check=False)
    )
    assert "--split stratified in the checkpoint, plain now" in refused
    # a checkpoint that records no members (saved before the split was the original's, on
    # torch's permutation: other comparisons held out) is not resumed on this split
    (progress,) = (tmp_path / "run").glob(f"checkpoints/*/{PROGRESS_FILE}")
    record = json.loads(progress.read_text())
    del record["run"]["identity"]["split_members"]
    progress.write_text(json.dumps(record))
    write_manifest(progress.parent, read_manifest(progress.parent)["progress"])  # as saved
    refused = refusal(run_recipe(again, cwd=tmp_path, script=QUALITY, check=False))
    assert "split_members (computed from the data): unset in the checkpoint" in refused


def refusal(result: subprocess.CompletedProcess) -> str:
    """The one error line of a run refused with exit code 2."""
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "belongs to another run" in errors[0], result.stderr
    return errors[0]
