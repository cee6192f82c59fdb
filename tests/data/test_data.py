"""The data readers refuse what would make training silently wrong: NaN, inf, wrong files."""

from __future__ import annotations

import importlib
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from accel_common.data.cache import files_digest
from accel_common.data.files import read_numeric_csv, read_path_list
from accel_common.data.fingerprint import files_fingerprint, hash_cache_file, named_files
from accel_common.data.images import (
    MAX_PIXELS_VARIABLE,
    image_batches,
    list_images,
    read_images,
    read_rgb,
)
from accel_common.data.loaders import existing_data
from accel_common.errors import ConfigError, DataError, error_message
from recipes.crystal.data import STRUCTURES_FILE, extxyz_file
from recipes.pointcloud.data import SPACING_FILE, read_spacing
from recipes.quality.data import (
    ORIGINAL_FILE,
    ImageReader,
    annotation_files,
    read_entries,
    read_truth,
)
from tests.processes import POINTCLOUD, TEMPLATE


def load(path):
    return importlib.import_module(f"recipes.{path.stem}")


@pytest.mark.parametrize("bad", ["nan", "inf", "-Infinity"])
def test_csv_with_a_non_finite_number_names_file_line_and_column(bad, tmp_path):
    csv = tmp_path / "train.csv"
    csv.write_text(f"x0,x1,y\n1,2,3\n4,{bad},6\n")
    with pytest.raises(DataError, match=f"train.csv, line 3: column x1 is '{bad}', not finite"):
        read_numeric_csv(csv, required=["y"])


def test_a_csv_of_random_bytes_is_refused_naming_the_file_and_line(tmp_path):
    csv = tmp_path / "train.csv"
    csv.write_bytes(b"x0,x1,y\n1,2,3\n" + np.random.default_rng(0).bytes(4000))
    with pytest.raises(DataError) as error:
        read_numeric_csv(csv, required=["y"])
    message = str(error.value)
    assert message.startswith(f"{csv}, line 3: byte 0x")
    assert message.endswith("is not UTF-8 text; save the file as UTF-8 comma-separated values")
    assert "\n" not in message
    csv.write_bytes(b"x0,x1,y\n1,2,3\n" + b"7" * 200_000)  # UTF-8, but no line ends
    with pytest.raises(DataError) as error:
        read_numeric_csv(csv, required=["y"])
    limit = "field larger than field limit (131072)"
    assert str(error.value) == f"{csv}, line 3: not CSV text ({limit})"


def test_a_text_file_that_is_not_utf8_is_one_line_naming_file_line_and_offset(tmp_path):
    """Before: a UnicodeDecodeError traceback (a SkullBreak CSV), or the codec's own words
    ('utf-8' codec can't decode byte 0xe9 in position 6) in a JSON file's error."""
    path = tmp_path / SPACING_FILE
    path.write_bytes('[\n"café"]\n'.encode("latin-1"))  # é is byte 0xe9 in Latin-1
    as_csv, as_text = "save the file as UTF-8 comma-separated values", "save it as UTF-8 text"
    readers = [
        (lambda: read_path_list(path, (".npy",)), as_csv),  # pointcloud's train.csv
        (lambda: read_truth(path, [], []), as_text),  # quality's truth.json
        (lambda: read_entries(path), as_text),  # quality's comparison_data.json
        (lambda: read_spacing(tmp_path), as_text),  # pointcloud's voxel spacing
    ]
    for read, fix in readers:
        with pytest.raises(DataError) as error:
            read()
        assert str(error.value) == f"{path}, line 2: byte 0xe9 at offset 6 is not UTF-8 text; {fix}"


@pytest.mark.parametrize(("delimiter", "named"), [(";", "';'"), ("\t", "tab"), ("|", "'|'")])
def test_a_csv_with_another_delimiter_names_the_delimiter_found(tmp_path, delimiter, named):
    csv = tmp_path / "train.csv"
    csv.write_text(f"x0{delimiter}x1{delimiter}y\n1,5{delimiter}2{delimiter}3\n")
    header = f"x0{delimiter}x1{delimiter}y"
    expected = (
        f"{csv}: the header {header!r} looks {named}-separated; write comma-separated values "
        "(a header such as x0,x1,y)"
    )
    with pytest.raises(DataError) as error:
        read_numeric_csv(csv, required=["y"])
    assert str(error.value) == expected
    csv.write_text("x0,x1,target\n1,2,3\n")  # comma-separated, but without y: as before
    with pytest.raises(DataError, match=r"train\.csv: header lacks column\(s\) y$"):
        read_numeric_csv(csv, required=["y"])


def test_point_cloud_with_nan_or_not_npy_at_all_is_refused(tmp_path):
    load_points = load(POINTCLOUD).load_points
    points = np.zeros((10, 3), dtype=np.float32)
    points[7, 2] = np.nan
    np.save(tmp_path / "skull.npy", points)
    load_points(tmp_path / "skull.npy", header_only=True)  # the up-front check reads no data
    with pytest.raises(DataError, match=r"skull.npy: value nan at index \[7, 2\] is not finite"):
        load_points(tmp_path / "skull.npy")
    (tmp_path / "garbage.npy").write_bytes(b"this is not an array" * 10)
    with pytest.raises(DataError, match=r"garbage\.npy: not a \.npy file") as error:
        load_points(tmp_path / "garbage.npy", header_only=True)
    assert "pickled" not in str(error.value)


def test_quality_truth_with_a_missing_or_nan_entry_is_refused(tmp_path):
    path = tmp_path / "truth.json"
    path.write_text(json.dumps({"quality": {"a.png": 1.0, "b.png": math.nan}, "reliability": {}}))
    with pytest.raises(DataError, match=r"quality\['b.png'\] is nan, not a finite number"):
        read_truth(path, ["a.png", "b.png"], ["x"])
    path.write_text(json.dumps({"quality": {"a.png": 1.0}}))
    with pytest.raises(DataError, match="needs a 'reliability' object"):
        read_truth(path, ["a.png"], ["x"])
    path.write_text(json.dumps({"quality": {"a.png": 1.0}, "reliability": {"x": 0.9}}))
    assert read_truth(path, ["a.png"], ["x"])["reliability"] == {"x": 0.9}


class Broken(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        raise DataError(f"skull_{index}.npy: value nan at index [0, 0] is not finite")


def test_an_error_raised_in_a_loader_worker_is_reported_as_one_line():
    with pytest.raises(DataError) as error:
        next(iter(DataLoader(Broken(), num_workers=1)))
    assert "Traceback" in str(error.value)  # torch folds the worker's traceback into it
    assert error_message(error.value) == "skull_0.npy: value nan at index [0, 0] is not finite"


def test_a_test_split_with_other_columns_is_refused_at_load(tmp_path):
    load_split = load(TEMPLATE).load_split
    (tmp_path / "train.csv").write_text("x0,x1,y\n1,2,3\n")
    (tmp_path / "test.csv").write_text("x0,x2,y\n1,2,3\n")
    train = load_split(tmp_path, "train")
    with pytest.raises(DataError, match="columns x0, x2, y differ from the training split's x0,"):
        load_split(tmp_path, "test", columns=train.columns)


def test_an_image_folder_is_listed_with_subfolders_and_read_in_chunks(tmp_path):
    """What captioning's `caption` and quality's `score` predict from: every image, in a fixed
    order, in chunks that together equal one batch of all of them."""
    rng = np.random.default_rng(0)
    for name in ("b.png", "a.JPG", "sub/c.webp", "sub/deeper/d.bmp"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (12, 9, 3), dtype=np.uint8)).save(tmp_path / name)
    (tmp_path / "notes.txt").write_text("not an image")
    names = list_images(tmp_path)
    assert names == ["a.JPG", "b.png", "sub/c.webp", "sub/deeper/d.bmp"]
    whole = read_images(tmp_path, names, 8)
    assert whole.shape == (4, 3, 8, 8) and -1 <= whole.min() < whole.max() <= 1
    chunks = list(image_batches(tmp_path, names, 8, bs=3))
    assert [chunk for chunk, _ in chunks] == [names[:3], names[3:]]
    assert torch.cat([pixels for _, pixels in chunks]).equal(whole)


def test_a_missing_empty_or_unreadable_image_folder_is_named(tmp_path):
    with pytest.raises(DataError, match=r"--images .*nowhere: no such folder"):
        list_images(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"--images .*empty: no images \(\.png, \.jpg"):
        list_images(tmp_path / "empty")
    (tmp_path / "broken.png").write_bytes(b"not a png")
    with pytest.raises(DataError, match=r"broken\.png: not a readable image"):
        read_rgb(tmp_path / "broken.png", 32)


def special_files(folder, suffix):
    """A FIFO and a link to /dev/zero named as data files, and what each is called."""
    fifo, zero = folder / f"pipe{suffix}", folder / f"zero{suffix}"
    os.mkfifo(fifo)
    zero.symlink_to("/dev/zero")
    return {
        fifo: "is a FIFO (named pipe), not a regular file",
        zero: "is a character device (a link to /dev/zero), not a regular file",
    }


@pytest.mark.timeout(30)  # before: "not found", or a read of the FIFO that waited forever
def test_a_fifo_or_a_device_given_as_a_data_file_is_refused_as_such_before_reading(tmp_path):
    for path, kind in special_files(tmp_path, ".csv").items():
        for read in (lambda p: read_numeric_csv(p, ["y"]), lambda p: read_path_list(p, (".npy",))):
            with pytest.raises(DataError) as error:
                read(path)
            assert str(error.value) == f"{path}: {kind}"
        with pytest.raises(DataError) as error:
            files_digest([path])  # the cache key of cricket's and crystal's tables
        assert str(error.value) == f"{path}: {kind}"
        with pytest.raises(DataError) as error:
            files_fingerprint({"train.csv": path})  # every recipe's declared files
        assert str(error.value) == f"{path}: {kind}; remove it from the data"
        with pytest.raises(DataError) as error:
            existing_data("template", path)
        assert str(error.value) == f"--data {path}: {kind.replace('a regular file', 'a folder')}"
    for path, kind in special_files(tmp_path, ".png").items():
        assert list_images(tmp_path) == [path.name for path in sorted(tmp_path.glob("*.png"))]
        with pytest.raises(DataError) as error:
            read_rgb(path, 8)
        assert str(error.value) == f"{path}: {kind}"


@pytest.mark.timeout(30)
def test_a_fifo_where_an_optional_file_belongs_is_refused_not_taken_for_no_file(tmp_path):
    """Before: a FIFO named truth.json, voxel_spacing.json or an annotator's
    comparison_data.json was taken for no file, and the run went on without it (structures.extxyz:
    'no structures.extxyz in this folder')."""
    (tmp_path / "hitul").mkdir()
    readers = {
        tmp_path / "truth.json": lambda: read_truth(tmp_path / "truth.json", [], []),
        tmp_path / SPACING_FILE: lambda: read_spacing(tmp_path),
        tmp_path / "hitul" / ORIGINAL_FILE: lambda: annotation_files(tmp_path),
        tmp_path / STRUCTURES_FILE: lambda: extxyz_file(tmp_path),
    }
    for path, read in readers.items():
        os.mkfifo(path)
        with pytest.raises(DataError) as error:
            read()
        assert str(error.value) == f"{path}: is a FIFO (named pipe), not a regular file"
        path.unlink()
    assert read_truth(tmp_path / "truth.json", [], []) is None  # absent: still optional
    assert read_spacing(tmp_path) == {}


def test_a_number_too_large_for_float32_is_refused_at_read_time_naming_row_and_column(tmp_path):
    """Before: read as inf, and the run stopped later as if training had diverged."""
    csv = tmp_path / "train.csv"
    csv.write_text("x0,x1,y\n1,2,3\n4,-1e39,6\n")
    with pytest.raises(DataError) as error:
        read_numeric_csv(csv, required=["y"])
    assert str(error.value) == (
        f"{csv}, line 3: column x1 is '-1e39', which does not fit float32 (largest 3.403e+38): "
        "it would be read as infinite; rescale the column"
    )
    csv.write_text("x0,x1,y\n1,3e38,3\n")  # the largest float32 is about 3.4e38: it fits
    assert read_numeric_csv(csv, required=["y"])[1][0, 1] == pytest.approx(3e38)
    load_points = load(POINTCLOUD).load_points
    points = np.zeros((10, 3))  # float64, as numpy saves by default
    points[4, 1] = 1e39
    np.save(tmp_path / "skull.npy", points)
    with pytest.raises(DataError, match=r"skull\.npy: value 1e\+39 at index \[4, 1\] does not fit"):
        load_points(tmp_path / "skull.npy")


def test_a_header_with_spaces_after_the_commas_is_read_and_a_repeated_name_refused(tmp_path):
    csv = tmp_path / "train.csv"
    csv.write_text("x1, x2, y\n1, 2, 3\n")
    columns, values = read_numeric_csv(csv, required=["y"])
    assert columns == ["x1", "x2", "y"] and values.tolist() == [[1, 2, 3]]
    csv.write_text("y, x2 ,y\n1,2,3\n")  # which y is the target?
    with pytest.raises(DataError) as error:
        read_numeric_csv(csv, required=["y"])
    assert str(error.value) == f"{csv}: the header names column 'y' twice; rename one of them"


def test_an_image_over_the_pixel_limit_is_named_with_its_size_and_how_to_raise_it(
    tmp_path, monkeypatch
):
    """A decompression bomb: before, PIL's DecompressionBombError came out as a traceback.
    The limit is lowered here, so that a 40 x 30 image is over it."""
    path = tmp_path / "big.png"
    Image.new("RGB", (40, 30)).save(path)
    quality = ImageReader(tmp_path, 8, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    monkeypatch.setenv(MAX_PIXELS_VARIABLE, "1000")
    for read in (lambda: read_rgb(path, 8), lambda: quality("big.png")):  # captioning, quality
        with pytest.raises(DataError) as error:
            read()
        assert str(error.value) == (
            f"{path}: 40 x 30 = 1,200 pixels, over the limit of 1,000 that guards against "
            f"decompression bombs; if you trust the file, raise the limit with "
            f"{MAX_PIXELS_VARIABLE}=1200 (0: no limit)"
        )
    for trusted in ("1200", "0"):
        monkeypatch.setenv(MAX_PIXELS_VARIABLE, trusted)
        assert read_rgb(path, 8).shape == (3, 8, 8) and quality("big.png").shape == (3, 8, 8)
    monkeypatch.setenv(MAX_PIXELS_VARIABLE, "1e6")
    with pytest.raises(ConfigError, match=f"^{MAX_PIXELS_VARIABLE}=1e6: give a whole number"):
        read_rgb(path, 8)


def test_a_data_file_whose_name_is_not_utf8_is_fingerprinted_and_its_digest_cached(tmp_path):
    """Before: UnicodeEncodeError from the fingerprint, its cache and the tables' cache key."""
    folder = tmp_path / os.fsdecode(b"data\xff")
    folder.mkdir()
    path = folder / os.fsdecode(b"\xff.npy")
    path.write_bytes(b"points")
    files = named_files([path], folder)
    cache = hash_cache_file(folder, tmp_path / "cache")
    fingerprint, digests = files_fingerprint(files, cache)
    assert list(digests) == [os.fsdecode(b"\xff.npy")] and cache.is_file()
    assert files_fingerprint(files, cache) == (fingerprint, digests)  # from the cache
    path.write_bytes(b"other points")
    assert files_fingerprint(files, cache)[0] != fingerprint
    assert len(files_digest([path])) == 64


class EpochDrawn(torch.utils.data.Dataset):
    """Items that depend on the epoch, as pointcloud's subsampled test skulls do."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index * 100 + self.epoch])


def test_an_evaluation_loader_is_never_rewindowed_by_set_epoch(accelerator):
    """A prepared loader calls dataset.set_epoch(n) at its n-th pass: a plain DataLoader over
    an epoch-dependent evaluation set gives other items at every evaluation, the eval loader
    the same ones, as `evaluate` on the export sees them."""
    from torch.utils.data import DataLoader

    from accel_common.data.loaders import make_eval_loader

    def passes(loader) -> list[list[int]]:
        return [[int(x) for batch in loader for x in batch.flatten()] for _ in range(3)]

    plain = passes(accelerator.prepare(DataLoader(EpochDrawn(), batch_size=2)))
    assert plain[0] != plain[1]  # the failure mode this loader exists for
    fixed = passes(accelerator.prepare(make_eval_loader(EpochDrawn(), 2)))
    assert fixed == [[0, 100, 200, 300]] * 3


def test_per_sample_rng_draws_depend_on_the_sample_alone_and_leave_the_stream_alone():
    """What a transform draws inside per_sample_rng depends only on (seed, epoch, index): not on
    the global state before (another process, a resume), and the global stream goes on after it
    as if nothing had been drawn."""
    import random

    import numpy as np

    from accel_common.data.loaders import per_sample_rng

    def draw() -> tuple[float, float, float]:
        return torch.rand(()).item(), float(np.random.rand()), random.random()

    torch.manual_seed(1)
    with per_sample_rng(7, 2, 5):
        first = draw()
    after = draw()
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    with per_sample_rng(7, 2, 5):
        assert draw() == first
    with per_sample_rng(7, 3, 5):
        assert draw() != first  # another epoch
    torch.manual_seed(1)
    np.random.seed(99), random.seed(99)
    assert draw()[0] == after[0]  # torch's stream as if per_sample_rng never ran


def test_an_example_written_meanwhile_by_another_run_is_used_not_mixed(
    tmp_path, monkeypatch, accelerator
):
    """Two runs without --data started at once both wrote data/example/NAME.tmp: one folder,
    two writers. Each now writes a folder of its own; the second to finish uses the first's."""
    from accel_common.data.loaders import resolve_data

    monkeypatch.chdir(tmp_path)
    target = tmp_path / "data" / "example" / "toy"
    written = []

    def make_example(folder: Path) -> None:
        written.append(folder)
        folder.mkdir(parents=True)
        (folder / "mine.csv").write_text("x\n")
        target.mkdir(parents=True)  # meanwhile, the other run's example arrived
        (target / "theirs.csv").write_text("x\n")

    assert resolve_data(accelerator, "toy", None, make_example).resolve() == target
    assert [p.name for p in target.iterdir()] == ["theirs.csv"]
    assert written[0] != target.with_name("toy.tmp") and not written[0].exists()
