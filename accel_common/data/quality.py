"""Pairwise image-quality data for the Crowd-BT recipe: the reader of the original's layout (and
of this project's earlier one) and a synthetic generator that writes the original's layout.

The original project (hituldesai03/crowd-bt, data_loader.py) keeps one folder per annotator,
synced from S3 (`quack_v2_data_user_logs/<annotator>/comparison_data.json`), and the images in a
separate folder (its --image-dir, e.g. data/iter_0) that the names in the records are relative
to:

    <root>/<annotator>/comparison_data.json   {"comparisons": [{img1, img2, choice, timestamp,
                                                time_taken, batch_number, ...}, ...]}
    <root>/images/...                         the default image folder (--image-dir)
    <root>/truth.json                         optional, synthetic data only: true quality per
                                              image, true reliability per annotator

The annotator is the folder's name. A choice is left, right or a draw written draw, tie or equal,
in any case. This project's earlier layout, `<root>/annotations/<annotator>.json` holding a bare
list of records (annotator: the record's "annotator" or the file's name), is read too.

The generator's images are degraded by a known amount (quality = 1 - degradation, mixing blur,
noise and JPEG compression). Annotators answer correctly with their reliability eta: experts near
1, a casual one at 0.75, a spammer at 0.5 (coin flips) and an adversarial one at 0.1
(systematically reversed). Near-equal pairs are often called a draw.
"""

from __future__ import annotations

import io
import json
import math
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter

from accel_common.errors import DataError

ORIGINAL_FILE = "comparison_data.json"
# the original's choice words (create_user_choice_training_data.py: lower-cased and stripped)
CHOICES = {"left": 1, "right": -1, "draw": 0, "tie": 0, "equal": 0}
SHOWN = 5  # missing images named in the error, before "..."

ANNOTATORS = {
    "expert_a": 0.95,
    "expert_b": 0.9,
    "expert_c": 0.85,
    "casual": 0.75,
    "spammer": 0.5,
    "adversarial": 0.1,
}
DRAW_GAP = 0.04  # pairs closer than this in quality are usually called a draw
BATCH_SIZE = 50  # comparisons per annotation batch (the records' batch_number)


# --------------------------------------------------------------------------- reading


@dataclass
class Comparisons:
    """Every vote as (img1, img2, choice in {1, -1, 0}, annotator), and what they name."""

    records: list[tuple[str, str, int, str]]
    annotators: list[str]
    images: list[str]  # relative to the image folder, sorted
    layout: str  # how the folder was read, for the run's log
    dropped: int  # records dropped by skip_missing_images
    invalid: dict[str, int]  # records dropped by skip_invalid_records, per reason


def annotation_files(root: Path) -> tuple[str, list[tuple[Path, str | None]]]:
    """The layout found in `root` and its files, each with its annotator (None: per record)."""
    folders = sorted(p for p in root.iterdir() if (p / ORIGINAL_FILE).is_file())
    flat = root / "annotations"
    flat_files = sorted(flat.glob("*.json")) if flat.is_dir() else []
    if folders and flat_files:
        raise DataError(
            f"{root}: holds both <annotator>/{ORIGINAL_FILE} folders and annotations/*.json; "
            "keep one layout (move the other out)"
        )
    if folders:
        return f"<annotator>/{ORIGINAL_FILE}", [(p / ORIGINAL_FILE, p.name) for p in folders]
    if flat_files:
        return "annotations/<annotator>.json", [(p, None) for p in flat_files]
    raise DataError(
        f"{root}: no comparisons: expected <annotator>/{ORIGINAL_FILE} folders (the original "
        "project's layout) or annotations/<annotator>.json files"
    )


def read_entries(path: Path) -> list:
    """A file's records: {"comparisons": [...]} as the original writes it, or a bare list."""
    try:
        data = json.loads(path.read_text())
    except ValueError as err:
        raise DataError(f"{path}: not valid JSON ({err})") from None
    if isinstance(data, dict) and isinstance(data.get("comparisons"), list):
        return data["comparisons"]
    if isinstance(data, list):
        return data
    raise DataError(f'{path}: expected {{"comparisons": [...]}} or a list of comparison records')


def record_problem(entry: object) -> tuple[str, str] | None:
    """Why a record cannot be used, as (reason for the dropped count, detail for the error), or
    None. The original skips these silently: no or an unknown choice, img1 or img2 missing."""
    if not isinstance(entry, dict):
        return "not an object", f"expected an object with img1, img2 and choice, got {entry!r:.80}"
    pair = entry.get("img1"), entry.get("img2")
    if not all(isinstance(name, str) and name for name in pair):
        return "without img1/img2", f"img1 and img2 must be image names, got {pair!r}"
    if "choice" not in entry:
        return "with no choice", "has no choice"
    value = entry["choice"]
    word = value.strip().lower() if isinstance(value, str) else None
    if word not in CHOICES:
        reason = "with no choice" if value is None or word == "" else "with an unknown choice"
        return reason, f"choice is {value!r}, not left|right|draw|tie|equal (any case)"
    return None


def read_comparisons(
    root: Path,
    image_dir: Path,
    *,
    skip_missing_images: bool = False,
    skip_invalid_records: bool = False,
) -> Comparisons:
    """Every record of `root`, checked before any training: fields, choices, and that the images
    it names exist under `image_dir` (names are relative paths, e.g. iter_0/x.png). An invalid
    record is refused by file and index, or dropped; records naming a missing image are refused
    with their count and the first names, or dropped."""
    if not image_dir.is_dir():
        raise DataError(f"{image_dir}: no such image folder; point --image-dir at the images")
    layout, files = annotation_files(root)
    records, missing_at = [], []
    invalid: Counter[str] = Counter()
    found: dict[str, bool] = {}
    for path, annotator in files:
        for index, entry in enumerate(read_entries(path)):
            where = f"{path}, record {index}"
            problem = record_problem(entry)
            if problem is not None:
                reason, detail = problem
                if not skip_invalid_records:
                    raise DataError(
                        f"{where}: {detail}; fix or remove the record, or pass "
                        "--skip-invalid-records to drop such records (the original skipped "
                        "them silently)"
                    )
                invalid[reason] += 1
                continue
            pair = entry["img1"], entry["img2"]
            choice = CHOICES[entry["choice"].strip().lower()]
            for name in pair:
                if name not in found:  # each name stats the disk once, not once per record
                    found[name] = (image_dir / name).is_file()
            if not all(found[name] for name in pair):
                missing_at.append(where)
                continue
            who = annotator if annotator is not None else str(entry.get("annotator", path.stem))
            records.append((*pair, choice, who))
    if missing_at and not skip_missing_images:
        names = [n for n, ok in found.items() if not ok]  # in the order first met
        shown = ", ".join(names[:SHOWN]) + (", ..." if len(names) > SHOWN else "")
        raise DataError(
            f"{image_dir}: {len(missing_at)} of {len(records) + len(missing_at)} comparison "
            f"records name images that are not there ({len(names)} distinct: {shown}; first in "
            f"{missing_at[0]}). Point --image-dir at the folder these names are relative to, "
            "or pass --skip-missing-images to drop those records (the original dropped them "
            "silently)"
        )
    if not records:
        raise DataError(f"{root}: no comparison records left to train on ({layout})")
    return Comparisons(
        records=records,
        annotators=sorted({r[3] for r in records}),
        images=sorted({name for r in records for name in r[:2]}),
        layout=layout,
        dropped=len(missing_at),
        invalid=dict(invalid),
    )


def read_truth(path: Path, images: list[str], annotators: list[str]) -> dict | None:
    """The optional truth.json ({"quality": {image: q}, "reliability": {annotator: eta}}) that
    synthetic data carries, checked up front: every image and annotator, finite numbers. Real
    data has none (the original has no such file)."""
    if not path.is_file():
        return None
    try:
        truth = json.loads(path.read_text())
    except ValueError as err:
        raise DataError(f"{path}: not valid JSON ({err})") from None
    fix = "fix it, or remove it to train without the metrics that need true values"
    for key, expected in (("quality", images), ("reliability", annotators)):
        table = truth.get(key) if isinstance(truth, dict) else None
        if not isinstance(table, dict):
            raise DataError(f"{path}: needs a {key!r} object; {fix}")
        for name in expected:
            if name not in table:
                raise DataError(f"{path}: {key} has no entry {name!r}; {fix}")
            value = table[name]
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise DataError(f"{path}: {key}[{name!r}] is {value!r}, not a finite number; {fix}")
    return truth


# --------------------------------------------------------------------------- generating


def scene(rng: np.random.Generator, size: int) -> np.ndarray:
    """A colourful textured scene: gratings plus blobs, values in [0, 1]."""
    y, x = np.mgrid[0:size, 0:size] / size
    image = np.zeros((size, size, 3))
    for _ in range(3):
        angle, freq, phase = rng.uniform(0, np.pi), rng.uniform(2, 6), rng.uniform(0, 2 * np.pi)
        wave = np.sin(2 * np.pi * freq * (x * np.cos(angle) + y * np.sin(angle)) + phase)
        image += 0.25 * wave[..., None] * rng.uniform(0.2, 1.0, size=3)
    for _ in range(4):
        cx, cy, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.08, 0.25)
        blob = ((x - cx) ** 2 + (y - cy) ** 2) < r**2
        image[blob] = rng.uniform(0, 1, size=3)
    return np.clip(image + 0.5, 0, 1)


def degrade(image: np.ndarray, amount: float, rng: np.random.Generator) -> Image.Image:
    """Blur, add noise and JPEG-compress in proportion to `amount` in [0, 1]."""
    pil = Image.fromarray((image * 255).astype(np.uint8))
    pil = pil.filter(ImageFilter.GaussianBlur(radius=1.5 * amount))
    noisy = np.asarray(pil) / 255 + rng.normal(scale=0.15 * amount, size=image.shape)
    pil = Image.fromarray((np.clip(noisy, 0, 1) * 255).astype(np.uint8))
    buffer = io.BytesIO()
    pil.save(buffer, format="JPEG", quality=int(95 - 85 * amount))
    return Image.open(buffer).convert("RGB")


def write_dataset(
    out_dir: Path,
    *,
    images: int = 160,
    comparisons_per_annotator: int = 400,
    size: int = 32,
    seed: int = 0,
) -> Path:
    """Images, one <annotator>/comparison_data.json per annotator as the original writes them
    (with its timestamp, time_taken and batch_number; draws as tie or equal), and truth.json."""
    out_dir = Path(out_dir)
    rng = np.random.default_rng(seed)
    clock_rng = np.random.default_rng([seed, 1])  # record metadata: the votes stay seed-stable
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    names, quality = [], {}
    for index in range(images):
        name = f"img_{index:03d}.png"
        amount = float(rng.uniform(0, 1))
        degrade(scene(rng, size), amount, rng).save(out_dir / "images" / name)
        names.append(name)
        quality[name] = 1.0 - amount
    for annotator, eta in ANNOTATORS.items():
        clock = datetime(2024, 1, 8, 9, 0, tzinfo=timezone.utc)
        records = []
        for number in range(comparisons_per_annotator):
            i, j = rng.choice(len(names), size=2, replace=False)
            left_better = quality[names[i]] > quality[names[j]]
            if abs(quality[names[i]] - quality[names[j]]) < DRAW_GAP and rng.uniform() < 0.7:
                choice = str(clock_rng.choice(["tie", "equal"]))
            else:
                correct = rng.uniform() < eta
                choice = "left" if left_better == correct else "right"
            time_taken = round(float(clock_rng.gamma(2.0, 1.5)) + 0.5, 2)
            clock += timedelta(seconds=time_taken + 0.3)
            records.append(
                {
                    "img1": names[i],
                    "img2": names[j],
                    "choice": choice,
                    "timestamp": clock.isoformat(),
                    "time_taken": time_taken,
                    "batch_number": number // BATCH_SIZE + 1,
                }
            )
        (out_dir / annotator).mkdir(exist_ok=True)
        comparisons = json.dumps({"comparisons": records}, indent=1)
        (out_dir / annotator / ORIGINAL_FILE).write_text(comparisons)
    truth = {"quality": quality, "reliability": ANNOTATORS}
    (out_dir / "truth.json").write_text(json.dumps(truth, indent=1))
    return out_dir
