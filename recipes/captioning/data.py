"""Image-caption pairs for the captioning recipe: three on-disk layouts, one reader, one cache.

A split folder (`<data>/train`, and `<data>/test` or, as Hugging Face `imagefolder` users often
name it, `<data>/validation`) holds images and their captions in one of:

    metadata.jsonl / metadata.csv    Hugging Face `imagefolder`: {"file_name": ..., "text": ...}
    captions.json                    a manifest: {"relative/image.png": "caption", ...}
    cat.png + cat.txt                the original's: each image with a same-named .txt caption

The held-out split is `test/`, else `validation/` (so a train/validation/test layout is evaluated
on its test images). Without any of these folders, `<data>` itself is read and every tenth image
(by a hash of its name, so the split is stable as files are added) is held out for testing.

The metadata files are read here rather than with `datasets.load_dataset("imagefolder")`,
because a user's error must name the line and key (a missing image, an empty caption, a column
that is not there) and the packaged loader reports neither; `prepare_split` then decodes,
resizes and tokenizes a split once and caches it as Arrow with `datasets`, and `collate` pads
each batch's captions. The example generator is in recipes/captioning/example.py.
"""

from __future__ import annotations

import csv
import io
import json
import time
import zlib
from pathlib import Path

import datasets
import torch
from tokenizers import Tokenizer
from torch import nn

from accel_common import DataError
from accel_common.data import (
    CSV_TEXT,
    cache_key,
    cache_root,
    code_digest,
    is_image,
    read_rgb,
    read_text,
    require_regular,
    to_signed_unit,
)
from recipes.captioning.tokenizer import PAD_ID

READER = code_digest(__file__)  # in the cache key: a fixed reader never reuses an old table
HELD_OUT = ("test", "validation")  # the first that exists is the held-out split
CAPTION_LISTS = ("metadata.jsonl", "metadata.csv", "captions.json")  # else .txt beside each image


def _checked(folder: Path, source: str, name: object, caption: object) -> tuple[str, str]:
    """One record, with its error naming where it came from (`source`: file, line or key)."""
    if name is not None and not isinstance(name, str):
        raise DataError(f"{source}: the file name is {_json_kind(name)}, not text")
    if not name:
        raise DataError(f"{source}: no image file name")
    if caption is not None and not isinstance(caption, str):
        raise DataError(
            f"{source}: the caption of {name} is {_json_kind(caption)}, not text; write it in "
            "quotes if it is meant as one"
        )
    if not caption or not caption.strip():
        raise DataError(f"{source}: empty caption for {name}")
    if not (folder / name).exists():
        raise DataError(f"{source}: image {folder / name} not found")
    require_regular(folder / name, f"{source}: image ")
    return name, " ".join(caption.split())


def _json_kind(value: object) -> str:
    """A JSON value's kind and the value: 'a number (42)', 'a list ([1, 2])'."""
    kinds = ((bool, "a boolean"), (int | float, "a number"), (list, "a list"), (dict, "an object"))
    kind = next((words for types, words in kinds if isinstance(value, types)), "a value")
    return f"{kind} ({json.dumps(value)[:40]})"


def _imagefolder_jsonl(folder: Path, path: Path) -> list[tuple[str, str]]:
    records = []
    for line, text in enumerate(read_text(path).splitlines(), start=1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}, line {line}: not JSON ({err.msg})") from None
        except RecursionError:
            raise DataError(f"{path}, line {line}: JSON nested too deeply to read") from None
        for key in ("file_name", "text"):
            if not isinstance(row, dict) or key not in row:
                raise DataError(f"{path}, line {line}: no '{key}' key (imagefolder needs it)")
        records.append(_checked(folder, f"{path}, line {line}", row["file_name"], row["text"]))
    return records


def _imagefolder_csv(folder: Path, path: Path) -> list[tuple[str, str]]:
    with io.StringIO(read_text(path, CSV_TEXT), newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {"file_name", "text"} - set(reader.fieldnames or [])
        if missing:
            raise DataError(f"{path}: no '{sorted(missing)[0]}' column (imagefolder needs it)")
        return [
            _checked(folder, f"{path}, line {reader.line_num}", row["file_name"], row["text"])
            for row in reader
        ]


def _manifest(folder: Path, path: Path) -> list[tuple[str, str]]:
    try:
        mapping = json.loads(read_text(path))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not JSON ({err.msg}, line {err.lineno})") from None
    except RecursionError:
        raise DataError(f"{path}: JSON nested too deeply to read") from None
    if not isinstance(mapping, dict):
        raise DataError(f"{path}: expected an object mapping image path -> caption")
    return [_checked(folder, f"{path}, key '{k}'", k, v) for k, v in mapping.items()]


def _sidecars(folder: Path) -> list[tuple[str, str]]:
    records = []
    for image in sorted(p for p in folder.rglob("*") if is_image(p)):
        caption = image.with_suffix(".txt")
        if not caption.exists():
            raise DataError(f"{image}: no caption file {caption.name} beside it")
        name = image.relative_to(folder).as_posix()
        records.append(_checked(folder, str(caption), name, read_text(caption)))
    return records


def read_folder(folder: Path) -> list[tuple[str, str]]:
    """(image path relative to `folder`, caption) for every image, in whichever layout it uses.
    A folder with two caption lists is refused: one would be read and the other ignored."""
    readers = (_imagefolder_jsonl, _imagefolder_csv, _manifest)
    layouts = dict(zip(CAPTION_LISTS, readers, strict=True))
    found = [name for name in layouts if (folder / name).exists()]
    if len(found) > 1:
        named = f"{', '.join(found[:-1])} and {found[-1]}"
        both, others = ("both ", "other") if len(found) == 2 else ("", "others")
        raise DataError(
            f"{folder}: holds {both}{named}, and only one of them would be read; keep the one "
            f"with the captions to train on and move the {others} out of the folder"
        )
    records = layouts[found[0]](folder, folder / found[0]) if found else _sidecars(folder)
    if not records:
        raise DataError(
            f"{folder}: no captioned images (expected metadata.jsonl, metadata.csv, captions.json "
            "or images with same-named .txt captions)"
        )
    return records


def split_files(folder: Path, records: list[tuple[str, str]]) -> list[Path]:
    """Every file a split's records were read from (the run's data fingerprint): its caption
    list, or each image's .txt caption, and its images."""
    listed = [folder / name for name in CAPTION_LISTS if (folder / name).is_file()]
    captions = listed or [(folder / name).with_suffix(".txt") for name, _ in records]
    return [*captions, *(folder / name for name, _ in records)]


def read_split(data_dir: Path, split: str) -> tuple[Path, list[tuple[str, str]]]:
    """The images folder and records of `split`: "train", or "test" for the held-out images."""
    folders = ("train",) if split == "train" else HELD_OUT
    for name in folders:
        if (data_dir / name).is_dir():
            return data_dir / name, read_folder(data_dir / name)
    present = [name for name in ("train", *HELD_OUT) if (data_dir / name).is_dir()]
    if present:
        wanted = " or ".join(f"{name}/" for name in folders)
        raise DataError(
            f"{data_dir}: no {wanted} folder beside {present[0]}/; add one, or put all images "
            "in one folder to hold out every tenth"
        )
    records = read_folder(data_dir)
    held_out = [zlib.crc32(name.encode()) % 10 == 0 for name, _ in records]
    chosen = [r for r, test in zip(records, held_out, strict=True) if test == (split == "test")]
    if not chosen:
        raise DataError(f"{data_dir}: too few images to hold out a test split; add test/")
    return data_dir, chosen


# --------------------------------------------------------------------------- prepared splits


def prepare_split(
    folder: Path, records: list[tuple[str, str]], tokenizer: Tokenizer, size: int, max_tokens: int
) -> tuple[datasets.Dataset, float, bool]:
    """Decode, resize and tokenize once; cached as Arrow by `datasets`, keyed by the files (name,
    size, mtime), captions, tokenizer and sizes. Returns (dataset, seconds, was it cached)."""
    stats = [(name, text, *_stat(folder / name)) for name, text in records]
    key = cache_key(str(folder.resolve()), stats, tokenizer.to_str(), size, max_tokens, READER)
    cache = cache_root() / f"captioning-{key}.arrow"
    cached = cache.is_file()
    cache.parent.mkdir(parents=True, exist_ok=True)

    def encode(batch: dict[str, list]) -> dict[str, list]:
        ids = _unpadded([e.ids for e in tokenizer.encode_batch(batch["text"])])
        names = [records[i][0] for i in batch["record"]]
        for name, tokens in zip(names, ids, strict=True):
            if len(tokens) > max_tokens:
                raise DataError(
                    f"{folder / name}: its caption has {len(tokens)} tokens with [BOS]/[EOS], "
                    f"more than --max-tokens {max_tokens}; raise it"
                )
        pixels = [read_rgb(folder / name, size) for name in names]
        return {"pixels": pixels, "tokens": ids}

    features = datasets.Features(
        {
            "pixels": datasets.Array3D((3, size, size), "uint8"),
            "tokens": datasets.Sequence(datasets.Value("int32")),
        }
    )
    start = time.perf_counter()
    # records by their index: a file name need not be UTF-8 (b"\xff.png"), an Arrow string must
    table = datasets.Dataset.from_dict(
        {"record": list(range(len(records))), "text": [t for _, t in records]}
    )
    prepared = table.map(
        encode,
        batched=True,
        remove_columns=["record", "text"],
        features=features,
        cache_file_name=str(cache),
        new_fingerprint=key,
        desc=f"decode, resize, tokenize {folder.name}",
    )
    return prepared.with_format("torch"), time.perf_counter() - start, cached


def _stat(path: Path) -> tuple[int, int]:
    info = path.stat()
    return info.st_size, info.st_mtime_ns


def _unpadded(ids: list[list[int]]) -> list[list[int]]:
    """encode_batch pads to the longest caption; the collate function pads per batch instead."""
    return [[t for t in seq if t != PAD_ID] for seq in ids]


def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    pixels = to_signed_unit(torch.stack([r["pixels"] for r in rows]))
    tokens = nn.utils.rnn.pad_sequence(
        [r["tokens"].long() for r in rows], batch_first=True, padding_value=PAD_ID
    )
    return {"pixels": pixels, "tokens": tokens}
