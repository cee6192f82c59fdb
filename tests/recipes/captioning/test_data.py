"""The captioning recipe's data: three readers (and `datasets`' imagefolder), the held-out split,
the preparation cache, the tokenizer, and bad metadata named by file and line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer

import recipes.train_captioning as recipe
from accel_common.checkpoints.export import write_export
from accel_common.errors import CheckpointError, DataError
from recipes.captioning import data as caption_data
from recipes.captioning.data import read_split
from recipes.captioning.example import write_dataset
from recipes.captioning.tokenizer import BOS, EOS, PAD_ID, train_tokenizer
from tests.processes import CAPTIONING, CAPTIONING_TINY, run_recipe


def test_the_three_layouts_read_the_same_records(tmp_path):
    imagefolder = write_dataset(tmp_path / "imagefolder", train_images=12, test_images=3)
    sidecars, manifest, csv_folder = (tmp_path / n for n in ("txt", "manifest", "csv"))
    expected = {split: read_split(imagefolder, split)[1] for split in ("train", "test")}
    for split, records in expected.items():
        for folder in (sidecars, manifest, csv_folder):
            shutil.copytree(
                imagefolder / split, folder / split, ignore=shutil.ignore_patterns("*.jsonl")
            )
        for name, text in records:
            (sidecars / split / name).with_suffix(".txt").write_text(text + "\n")
        (manifest / split / "captions.json").write_text(json.dumps(dict(records)))
        rows = "".join(f'{name},"{text}"\n' for name, text in records)
        (csv_folder / split / "metadata.csv").write_text("file_name,text\n" + rows)
    for folder in (sidecars, manifest, csv_folder):
        for split, records in expected.items():
            assert sorted(read_split(folder, split)[1]) == sorted(records), folder.name


def test_a_single_folder_holds_out_every_tenth_image(tmp_path):
    data = write_dataset(tmp_path / "d", train_images=60, test_images=0)
    train, test = (read_split(data / "train", split)[1] for split in ("train", "test"))
    assert len(test) > 0 and len(train) + len(test) == 60
    assert not {name for name, _ in train} & {name for name, _ in test}


def test_imagefolder_reads_as_datasets_does_with_validation_as_the_held_out_split(tmp_path):
    """Users' HF layout gives the records `datasets.load_dataset("imagefolder")` gives, and their
    validation/ folder is the held-out split when there is no test/."""
    data = write_dataset(tmp_path / "d", train_images=6, test_images=3)
    (data / "test").rename(data / "validation")
    loaded = datasets.load_dataset("imagefolder", data_dir=str(data), cache_dir=tmp_path / "hf")
    for split, ours in (("train", "train"), ("validation", "test")):
        rows = loaded[split].cast_column("image", datasets.Image(decode=False))
        theirs = [(Path(r["image"]["path"]).name, r["text"]) for r in rows]
        folder, records = read_split(data, ours)
        assert folder == data / split
        assert sorted(records) == sorted(theirs) and len(records) == len(rows)


def test_a_missing_held_out_folder_is_refused_with_what_to_add(tmp_path):
    data = write_dataset(tmp_path / "d", train_images=3, test_images=1)
    shutil.copytree(data / "test", data / "validation")
    assert read_split(data, "test")[0] == data / "test"  # test/ wins over validation/
    shutil.rmtree(data / "test")
    shutil.rmtree(data / "validation")
    expected = f"{data}: no test/ or validation/ folder beside train/; add one"
    with pytest.raises(DataError, match="^" + re.escape(expected)):
        read_split(data, "test")


BAD_METADATA = [
    ('{"file_name": "00001.png"}', "line 2: no 'text' key"),
    ('{"file_name": "gone.png", "text": "a red square"}', "line 2: image .*gone.png not found"),
    ('{"file_name": "00001.png", "text": "  "}', "line 2: empty caption for 00001.png"),
    ("{not json", "line 2: not JSON"),
    # before: "empty caption", which sent the user looking for a blank
    (
        '{"file_name": "00001.png", "text": 42}',
        r"line 2: the caption of 00001.png is a number \(42\), not text; write it in quotes",
    ),
    (
        '{"file_name": "00001.png", "text": ["a", "b"]}',
        r"line 2: the caption of 00001.png is a list \(\[\"a\", \"b\"\]\)",
    ),
    ('{"file_name": 7, "text": "a cat"}', r"line 2: the file name is a number \(7\), not text$"),
]


@pytest.mark.parametrize(("line", "expected"), BAD_METADATA)
def test_bad_metadata_names_the_file_and_line(tmp_path, line, expected):
    data = write_dataset(tmp_path / "d", train_images=3, test_images=1)
    metadata = data / "train" / "metadata.jsonl"
    rows = metadata.read_text().splitlines()
    metadata.write_text("\n".join([rows[0], line, rows[2]]) + "\n")
    with pytest.raises(DataError, match=f"metadata.jsonl, {expected}"):
        read_split(data, "train")


def test_a_missing_caption_column_and_a_missing_txt_are_named(tmp_path):
    data = write_dataset(tmp_path / "d", train_images=3, test_images=1)
    (data / "train" / "metadata.jsonl").unlink()
    (data / "train" / "metadata.csv").write_text("file_name,caption\n00000.png,a cat\n")
    with pytest.raises(DataError, match=r"metadata\.csv: no 'text' column"):
        read_split(data, "train")
    (data / "train" / "metadata.csv").unlink()
    with pytest.raises(DataError, match=r"00000.png: no caption file 00000.txt beside it"):
        read_split(data, "train")


def _without_metadata(tmp_path: Path) -> Path:
    """A train/ folder of 3 images whose captions a test writes in another layout."""
    data = write_dataset(tmp_path / "d", train_images=3, test_images=1)
    (data / "train" / "metadata.jsonl").unlink()
    return data / "train"


BAD_MANIFESTS = [
    ("{not json", "{file}: not JSON (Expecting property name enclosed in double quotes, line 1)"),
    ('["00000.png", "a red square"]', "{file}: expected an object mapping image path -> caption"),
    ('{"00000.png": "a cat", "gone.png": "a dog"}', "{file}, key 'gone.png': image {gone}"),
    ('{"00000.png": "a cat", "00001.png": " "}', "{file}, key '00001.png': empty caption"),
    ("[" * 100_000 + "]" * 100_000, "{file}: JSON nested too deeply to read"),  # not a traceback
]


@pytest.mark.parametrize(("text", "expected"), BAD_MANIFESTS)
def test_a_bad_manifest_names_the_file_and_key(tmp_path, text, expected):
    folder = _without_metadata(tmp_path)
    (folder / "captions.json").write_text(text)
    expected = expected.format(file=folder / "captions.json", gone=folder / "gone.png")
    with pytest.raises(DataError, match="^" + re.escape(expected)):
        read_split(folder.parent, "train")


BAD_CSV_ROWS = [
    ("gone.png,a red square", "line 3: image {folder}/gone.png not found"),
    ('00001.png,""', "line 3: empty caption for 00001.png"),
    ("00001.png", "line 3: empty caption for 00001.png"),  # the text cell is missing
]


@pytest.mark.parametrize(("row", "expected"), BAD_CSV_ROWS)
def test_a_bad_metadata_csv_row_names_the_file_and_line(tmp_path, row, expected):
    folder = _without_metadata(tmp_path)
    (folder / "metadata.csv").write_text(f"file_name,text\n00000.png,a cat\n{row}\n")
    expected = f"{folder / 'metadata.csv'}, {expected.format(folder=folder)}"
    with pytest.raises(DataError, match="^" + re.escape(expected)):
        read_split(folder.parent, "train")


@pytest.mark.parametrize(
    "others", [["metadata.csv"], ["captions.json"], ["metadata.csv", "captions.json"]]
)
def test_a_folder_with_two_caption_files_names_both_and_reads_neither(tmp_path, others):
    """metadata.jsonl beside metadata.csv (or captions.json): one would be read and the other
    silently ignored, so the folder is refused until one is kept."""
    data = write_dataset(tmp_path / "d", train_images=3, test_images=1)
    folder = data / "train"
    if "metadata.csv" in others:
        (folder / "metadata.csv").write_text("file_name,text\n00000.png,a cat\n")
    if "captions.json" in others:
        (folder / "captions.json").write_text(json.dumps({"00000.png": "a cat"}))
    named = {
        1: f"both metadata.jsonl and {others[0]}",
        2: "metadata.jsonl, metadata.csv and captions.json",
    }[len(others)]
    other = "other" if len(others) == 1 else "others"
    expected = (
        f"{folder}: holds {named}, and only one of them would be read; keep the one with the "
        f"captions to train on and move the {other} out of the folder"
    )
    with pytest.raises(DataError) as raised:
        read_split(data, "train")
    assert str(raised.value) == expected


def test_an_empty_txt_caption_names_the_txt_file(tmp_path):
    folder = _without_metadata(tmp_path)
    for name, text in (("00000", "a cat"), ("00001", "\n"), ("00002", "a dog")):
        (folder / f"{name}.txt").write_text(text)
    with pytest.raises(DataError, match=f"^{re.escape(str(folder / '00001.txt'))}: empty caption"):
        read_split(folder.parent, "train")


LATIN_1 = "caf\xe9".encode("latin-1")  # a caption saved in Latin-1: byte 0xe9 is no UTF-8
NOT_UTF8_CAPTIONS = {  # each layout's file with a Latin-1 caption on its second line
    "metadata.jsonl": b'{"file_name": "00000.png", "text": "a cat"}\n'
    b'{"file_name": "00001.png", "text": "a ' + LATIN_1 + b'"}\n',
    "metadata.csv": b"file_name,text\n00000.png,a " + LATIN_1 + b"\n",
    "captions.json": b'{"00000.png": "a cat",\n "00001.png": "a ' + LATIN_1 + b'"}',
    "00000.txt": b"a\n" + LATIN_1,
}


@pytest.mark.parametrize("name", list(NOT_UTF8_CAPTIONS))
def test_a_caption_file_that_is_not_utf8_is_one_line_naming_file_line_and_offset(tmp_path, name):
    """Before: a UnicodeDecodeError traceback."""
    folder = _without_metadata(tmp_path)
    for stem in ("00000", "00001", "00002"):
        (folder / f"{stem}.txt").write_text("a cat")
    path = folder / name
    path.write_bytes(NOT_UTF8_CAPTIONS[name])
    offset = NOT_UTF8_CAPTIONS[name].index(LATIN_1) + 3
    fix = (
        "save the file as UTF-8 comma-separated values"
        if name.endswith(".csv")
        else ("save it as UTF-8 text")
    )
    with pytest.raises(DataError) as raised:
        read_split(folder.parent, "train")
    expected = f"{path}, line 2: byte 0xe9 at offset {offset} is not UTF-8 text; {fix}"
    assert str(raised.value) == expected


def test_a_txt_caption_saved_with_a_byte_order_mark_is_read_without_it(tmp_path):
    """Notepad writes UTF-8 with a BOM; it was read into the caption as U+FEFF."""
    folder = _without_metadata(tmp_path)
    for stem in ("00000", "00001", "00002"):
        (folder / f"{stem}.txt").write_bytes(b"\xef\xbb\xbfa cat")
    assert [text for _, text in caption_data.read_folder(folder)] == ["a cat"] * 3


def test_a_caption_over_max_tokens_names_its_image(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    folder = _without_metadata(tmp_path)
    records = [("00000.png", "a cat"), ("00001.png", "a red square left of a blue circle")]
    tokenizer = train_tokenizer([text for _, text in records])
    expected = f"{folder / '00001.png'}: its caption has 10 tokens with [BOS]/[EOS], more than "
    expected += "--max-tokens 9; raise it"
    for _ in range(2):  # the failed preparation left no cache behind that would hide the error
        with pytest.raises(DataError, match="^" + re.escape(expected) + "$"):
            caption_data.prepare_split(folder, records, tokenizer, 8, max_tokens=9)


def test_preparation_is_cached_and_rebuilt_when_an_image_or_the_size_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    data = write_dataset(tmp_path / "d", train_images=4, test_images=1)
    folder, records = read_split(data, "train")
    tokenizer = train_tokenizer([text for _, text in records])
    decoded = []
    read_rgb = caption_data.read_rgb

    def counted(path: Path, size: int) -> np.ndarray:
        decoded.append(path.name)
        return read_rgb(path, size)

    monkeypatch.setattr(caption_data, "read_rgb", counted)

    def prepare(size: int = 16) -> tuple[datasets.Dataset, bool, int]:
        decoded.clear()
        prepared, _, cached = caption_data.prepare_split(
            folder, records, tokenizer, size, max_tokens=24
        )
        return prepared, cached, len(decoded)

    first, cached, decodes = prepare()
    assert (cached, decodes) == (False, 4)
    again, cached, decodes = prepare()
    assert (cached, decodes) == (True, 0)  # read from the Arrow file, no image decoded
    first, again = first[:], again[:]
    assert again["pixels"].equal(first["pixels"])
    assert [t.tolist() for t in again["tokens"]] == [t.tolist() for t in first["tokens"]]
    smaller, cached, decodes = prepare(size=8)
    assert (cached, decodes, tuple(smaller[:]["pixels"].shape)) == (False, 4, (4, 3, 8, 8))
    touched = folder / records[0][0]
    mtime = touched.stat().st_mtime_ns + 10**9
    os.utime(touched, ns=(mtime, mtime))
    _, cached, decodes = prepare()
    assert (cached, decodes) == (False, 4)


def test_the_saved_tokenizer_adds_bos_eos_pads_with_pad_and_maps_unseen_words_to_unk(tmp_path):
    path = tmp_path / "tokenizer.json"
    captions = ["a red square", "two small green triangles", "a Red circle"]
    train_tokenizer(captions).save(str(path))
    tokenizer = Tokenizer.from_file(str(path))  # as `caption` loads model/tokenizer.json
    vocab = tokenizer.get_vocab()
    assert [vocab[t] for t in ("[PAD]", "[UNK]", "[BOS]", "[EOS]")] == [PAD_ID, 1, 2, 3]
    short, long = tokenizer.encode_batch(["A red square", "two small green triangles"])
    assert short.tokens == ["[BOS]", "a", "red", "square", "[EOS]", "[PAD]"]
    assert short.ids[-1] == 0 and short.attention_mask[-1] == 0
    assert long.tokens == ["[BOS]", "two", "small", "green", "triangles", "[EOS]"]
    unseen = tokenizer.encode("a purple square")
    assert unseen.tokens == ["[BOS]", "a", "[UNK]", "square", "[EOS]"]
    assert tokenizer.decode(long.ids, skip_special_tokens=True) == "two small green triangles"


@pytest.mark.slow
def test_bad_data_stops_the_run_with_one_line_and_exit_code_2(tmp_path):
    data = write_dataset(tmp_path / "d", train_images=8, test_images=2)
    metadata = data / "test" / "metadata.jsonl"
    metadata.write_text(metadata.read_text() + '{"file_name": "lost.png", "text": "a cat"}\n')
    args = ["--data", str(data), "--output-dir", str(tmp_path / "run"), *CAPTIONING_TINY]
    result = run_recipe(args, cwd=tmp_path, script=CAPTIONING, check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {metadata}, line 3: image {data / 'test' / 'lost.png'} not found"
    ]
    assert not (tmp_path / "run" / "model").exists()


NOT_UTF8 = os.fsdecode(b"\xff")  # a file name whose bytes are not UTF-8, as Python holds it


def tiny_export(folder: Path, captions: list[str]) -> Path:
    """An untrained export with its tokenizer, as training writes them (no training: the
    `caption` command's reading and writing is what is tested)."""
    tokenizer = train_tokenizer(captions)
    settings = dict(image_size=8, patch=4, dim=8, depth=1, decoder_depth=1, heads=1, max_tokens=6)
    vocab = tokenizer.get_vocab_size()
    model = recipe.Captioner(vocab, **settings)
    config = settings | {"vocab_size": vocab, "bos": tokenizer.token_to_id(BOS)}
    config |= {"eos": tokenizer.token_to_id(EOS)}
    write_export(model.state_dict(), folder, {"recipe": "captioning", "config": config})
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_an_image_whose_name_is_not_utf8_is_prepared_and_captioned_under_its_name(
    tmp_path, monkeypatch
):
    """Before: Arrow refused the name in preparation, and the TSV could not be written."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    folder = tmp_path / "images"
    folder.mkdir()
    for name in (NOT_UTF8, "plain"):
        Image.new("RGB", (8, 8), "red").save(folder / f"{name}.png")
        (folder / f"{name}.txt").write_text("a red square")
    records = caption_data.read_folder(folder)
    tokenizer = train_tokenizer([text for _, text in records])
    prepared, _, _ = caption_data.prepare_split(folder, records, tokenizer, 8, max_tokens=6)
    assert len(prepared) == 2
    out = tmp_path / "captions.tsv"
    recipe.caption(tiny_export(tmp_path / "model", ["a red square"]), folder, out, None, 64)
    names = [line.split(b"\t")[0] for line in out.read_bytes().splitlines()]
    assert names == [b"plain.png", b"\xff.png"]  # the file's own bytes


def test_caption_with_an_export_lacking_its_tokenizer_names_the_folder_and_the_file(tmp_path):
    """Before: the tokenizers library's own exception, a traceback."""
    model = tiny_export(tmp_path / "model", ["a red square"])
    images, out = tmp_path / "images", tmp_path / "captions.tsv"
    images.mkdir()
    Image.new("RGB", (8, 8)).save(images / "a.png")
    (model / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=f"^{model / 'tokenizer.json'}: not a tokenizer file"):
        recipe.caption(model, images, out, None, 64)
    (model / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError) as error:
        recipe.caption(model, images, out, None, 64)
    assert str(error.value) == (
        f"--model {model}: no tokenizer.json beside the export ({model / 'tokenizer.json'}); "
        "training saves it there: copy it with the model"
    )
    assert not out.exists()
