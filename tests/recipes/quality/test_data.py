"""The quality recipe's data: the original's layout (choices, subfolders, truth), the earlier flat
layout, and bad records or files stopped or dropped with one line naming them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from PIL import Image

from accel_common.data.images import list_images
from accel_common.errors import DataError, error_message
from recipes.quality import data as quality_data
from recipes.quality.example import ANNOTATORS
from tests.processes import QUALITY, run_recipe


@pytest.fixture
def broken(tmp_path, quality_data):
    folder = tmp_path / "q"
    shutil.copytree(quality_data, folder)
    return folder


def bad_choice(folder):
    path = folder / "casual" / "comparison_data.json"
    data = json.loads(path.read_text())
    data["comparisons"][7]["choice"] = "both"
    path.write_text(json.dumps(data))
    return "casual/comparison_data.json, record 7: choice is 'both', not left|right|draw|tie|equal"


def missing_image(folder):
    (folder / "images" / "img_005.png").unlink()
    return "records name images that are not there (1 distinct: img_005.png; first in"


def broken_json(folder):
    (folder / "spammer" / "comparison_data.json").write_text("[{")
    return "spammer/comparison_data.json: not valid JSON"


def no_annotations(folder):
    for annotator in ANNOTATORS:
        shutil.rmtree(folder / annotator)
    return "no comparisons: expected <annotator>/comparison_data.json folders"


def truth_without_reliability(folder):
    path = folder / "truth.json"
    path.write_text(json.dumps({"quality": json.loads(path.read_text())["quality"]}))
    return "truth.json: needs a 'reliability' object; fix it, or remove it"


@pytest.mark.slow
@pytest.mark.parametrize(
    "breaker", [bad_choice, missing_image, broken_json, no_annotations, truth_without_reliability]
)
def test_bad_data_gives_one_clear_error(breaker, broken, tmp_path):
    message = breaker(broken)
    result = run_recipe(
        ["--data", str(broken), "--output-dir", str(tmp_path / "run")],
        cwd=tmp_path,
        script=QUALITY,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert "optimizer steps" not in result.stdout  # refused before the run even starts


# --------------------------------------------------------------------------- the original's layout

# one annotator's votes, cycled over the pairs: the original's words in mixed case and padding
VOTES = ["left", "Right", "tie", "EQUAL", "draw", " left ", "right", "Left"]


def original_layout(root: Path, *, images: int = 8) -> Path:
    """A folder as the original project's users have it: <annotator>/comparison_data.json (one
    name with a space, as in its EDA report), {"comparisons": [...]} with the fields its app
    writes, images named by paths relative to the image folder, in subfolders."""
    names = [f"iter_{k % 2}/img_{k:05d}_patch_0.png" for k in range(images)]
    for k, name in enumerate(names):
        (root / "images" / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), (30 * k % 256, 90, 160)).save(root / "images" / name)
    for annotator in ("hitul", "rakshitha rp"):
        records = [
            {
                "img1": names[i],
                "img2": names[(i + 1 + j) % images],
                "choice": VOTES[(i + j) % len(VOTES)],
                "timestamp": f"2025-01-26T10:{i:02d}:{j:02d}",
                "time_taken": 2.5 + j,
                "batch_number": 1 + j,
                "pair_type": "regular_regular",
                "img1_category": "",
            }
            for i in range(images)
            for j in range(3)
        ]
        (root / annotator).mkdir()
        comparisons = {"comparisons": records}
        (root / annotator / "comparison_data.json").write_text(json.dumps(comparisons))
    return root


def add_records_naming_missing_images(root: Path) -> None:
    path = root / "hitul" / "comparison_data.json"
    data = json.loads(path.read_text())
    for gone in ("iter_0/gone_a.png", "iter_1/gone_b.png", "iter_0/gone_a.png"):
        data["comparisons"].append({"img1": data["comparisons"][0]["img1"], "img2": gone,
                                    "choice": "left"})  # fmt: skip
    path.write_text(json.dumps(data))


def test_the_original_layout_loads_with_its_choices_and_subfolder_names(tmp_path):
    root = original_layout(tmp_path)
    data = quality_data.read_comparisons(root, root / "images")
    assert data.layout == "<annotator>/comparison_data.json"
    assert data.annotators == ["hitul", "rakshitha rp"]  # the folders' names
    assert len(data.images) == 8 and data.images[0] == "iter_0/img_00000_patch_0.png"
    assert len(data.records) == 48 and data.dropped == 0
    choices = [r[2] for r in data.records]
    # per annotator and pair offset, each of the 8 votes once: 3 left, 2 right, 3 draws
    assert (choices.count(1), choices.count(-1), choices.count(0)) == (18, 12, 18)
    assert data.records[0] == ("iter_0/img_00000_patch_0.png", "iter_1/img_00001_patch_0.png",
                               1, "hitul", "regular_regular")  # fmt: skip
    assert data.categories == {}  # the empty img1_category is no category
    assert list_images(root / "images") == data.images  # what `score` rates


def test_the_earlier_flat_layout_still_loads(tmp_path):
    root = original_layout(tmp_path)
    (root / "annotations").mkdir()
    for annotator in ("hitul", "rakshitha rp"):
        folder = root / annotator
        records = json.loads((folder / "comparison_data.json").read_text())["comparisons"]
        (root / "annotations" / f"{annotator}.json").write_text(json.dumps(records))
        shutil.rmtree(folder)
    data = quality_data.read_comparisons(root, root / "images")
    assert data.layout == "annotations/<annotator>.json"
    assert data.annotators == ["hitul", "rakshitha rp"] and len(data.records) == 48
    (root / "hitul").mkdir()
    (root / "hitul" / "comparison_data.json").write_text('{"comparisons": []}')
    with pytest.raises(DataError, match=r"holds both <annotator>/comparison_data\.json folders"):
        quality_data.read_comparisons(root, root / "images")


def test_records_naming_missing_images_are_refused_or_dropped(tmp_path):
    root = original_layout(tmp_path)
    add_records_naming_missing_images(root)
    with pytest.raises(DataError) as error:
        quality_data.read_comparisons(root, root / "images")
    message = error_message(error.value)
    assert "3 of 51 comparison records name images that are not there" in message
    assert "(2 distinct: iter_0/gone_a.png, iter_1/gone_b.png; first in " in message
    assert "hitul/comparison_data.json, record 24)" in message
    assert "--skip-missing-images" in message and "\n" not in message
    data = quality_data.read_comparisons(root, root / "images", skip_missing_images=True)
    assert data.dropped == 3 and len(data.records) == 48
    assert not any("gone" in name for name in data.images)


# records the original skips silently (its data_loader.py and create_user_choice_training_data.py)
INVALID = {
    "choice is None, not left|right|draw|tie|equal (any case)": {"choice": None},
    "choice is '', not left|right|draw|tie|equal (any case)": {"choice": ""},
    "choice is 'both', not left|right|draw|tie|equal (any case)": {"choice": "both"},
    "has no choice": {},
    "img1 and img2 must be image names, got ('iter_0/img_00000_patch_0.png', None)": {
        "choice": "left", "img2": None
    },
}  # fmt: skip


def add_invalid_records(root: Path, fields: list[dict]) -> None:
    """Appended to hitul's file: from record 24 on in original_layout's."""
    path = root / "hitul" / "comparison_data.json"
    data = json.loads(path.read_text())
    pair = {"img1": "iter_0/img_00000_patch_0.png", "img2": "iter_1/img_00001_patch_0.png"}
    data["comparisons"] += [pair | extra for extra in fields]
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("detail", INVALID)
def test_an_invalid_record_is_named_with_what_to_do(tmp_path, detail):
    root = original_layout(tmp_path)
    add_invalid_records(root, [INVALID[detail]])
    with pytest.raises(DataError) as error:
        quality_data.read_comparisons(root, root / "images")
    message = error_message(error.value)
    where = f"{root / 'hitul' / 'comparison_data.json'}, record 24"
    assert message == (
        f"{where}: {detail}; fix or remove the record, or pass --skip-invalid-records to drop "
        "such records (the original skipped them silently)"
    )


def test_invalid_records_are_dropped_and_counted_by_reason(tmp_path):
    root = original_layout(tmp_path)
    add_invalid_records(root, [*INVALID.values(), {"choice": "  "}])
    data = quality_data.read_comparisons(root, root / "images", skip_invalid_records=True)
    assert len(data.records) == 48 and data.dropped == 0  # every valid record kept
    assert data.invalid == {
        "with no choice": 4,  # null, "", "  " and no choice key
        "with an unknown choice": 1,
        "without img1/img2": 1,
    }


def test_truth_problems_are_one_line_naming_file_and_key(tmp_path):
    root = original_layout(tmp_path)
    data = quality_data.read_comparisons(root, root / "images")
    path = root / "truth.json"
    assert quality_data.read_truth(path, data.images, data.annotators) is None  # optional
    quality = dict.fromkeys(data.images, 0.5)
    reliability = {"hitul": 0.9, "rakshitha rp": 0.8}
    cases = {
        "needs a 'reliability' object": {"quality": quality},
        "quality has no entry 'iter_1/img_00007_patch_0.png'": {
            "quality": {k: v for k, v in quality.items() if "00007" not in k},
            "reliability": reliability,
        },
        "reliability['hitul'] is 'high', not a finite number": {
            "quality": quality, "reliability": {**reliability, "hitul": "high"}
        },
    }  # fmt: skip
    for expected, truth in cases.items():
        path.write_text(json.dumps(truth))
        with pytest.raises(DataError) as error:
            quality_data.read_truth(path, data.images, data.annotators)
        message = error_message(error.value)
        assert message.startswith(f"{path}: {expected}; fix it, or remove it"), message
        assert "\n" not in message
    path.write_text(json.dumps({"quality": quality, "reliability": reliability}))
    truth = quality_data.read_truth(path, data.images, data.annotators)
    assert truth["quality"]["iter_1/img_00007_patch_0.png"] == 0.5  # subfolder names as keys


@pytest.mark.slow
def test_trains_on_the_original_layout_without_truth(tmp_path):
    """Annotations in one folder, images elsewhere (--image-dir), no truth.json; records the
    original skips (missing images, no or an unknown choice) dropped with a count."""
    root = original_layout(tmp_path / "logs")
    add_records_naming_missing_images(root)
    add_invalid_records(root, [{"choice": None}, {"choice": "both"}, {"choice": ""}])
    shutil.move(root / "images", tmp_path / "iter_images")
    args = ["--data", str(root), "--image-dir", str(tmp_path / "iter_images")]
    args += ["--output-dir", str(tmp_path / "run"), "--bs", "8", "--epochs", "1"]
    args += ["--image-size", "16", "--skip-missing-images", "--skip-invalid-records"]
    result = run_recipe(args, cwd=tmp_path, script=QUALITY)
    assert "read 48 comparisons (18 draws) by 2 annotators of 8 images" in result.stdout
    assert "--skip-missing-images: dropped 3 records" in result.stdout
    dropped = "dropped 3 invalid records (2 with no choice, 1 with an unknown choice)"
    assert f"--skip-invalid-records: {dropped}" in result.stdout
    assert "no truth.json" in result.stdout
    metrics = json.loads((tmp_path / "run" / "model" / "model.json").read_text())["metrics"]
    assert {"pair_acc", "baseline_pair_acc", "eta_hitul", "eta_rakshitha rp"} <= metrics.keys()
    assert "spearman" not in metrics and "eta_corr" not in metrics


def test_json_nested_too_deeply_is_one_line_naming_the_file(tmp_path):
    """Before: json's RecursionError, a traceback."""
    path = tmp_path / "comparison_data.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    for read in (quality_data.read_entries, lambda p: quality_data.read_truth(p, [], [])):
        with pytest.raises(DataError, match=f"^{path}: not valid JSON \\(maximum recursion depth"):
            read(path)
