"""Pairwise image-quality data for the Crowd-BT recipe: the reader of the original's layout (and
of this project's earlier one), the train/held-out split (the original's) and the dataset of
pairs.

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
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.data import Dataset

from accel_common import DataError
from accel_common.data import is_present, open_image, read_text

ORIGINAL_FILE = "comparison_data.json"
TRUTH_FILE = "truth.json"  # synthetic data's true values, beside the comparisons
# the original's choice words (create_user_choice_training_data.py: lower-cased and stripped)
CHOICES = {"left": 1, "right": -1, "draw": 0, "tie": 0, "equal": 0}
SHOWN = 5  # missing images named in the error, before "..."
# the original's quality hierarchy of gold images' categories, higher is better (config.py 68-78)
QUALITY_RANKS = {
    "goldensample": 100,
    "POS_5": 5,
    "POS_4": 4,
    "POS_3": 3,
    "POS_2": 2,
    "POS_1": 1,
    "POS_0": 0,
    "spraying_POS_0": 0,
    "sanding_POS_0": 0,
}
GOLD_PAIR = "gold_gold"  # the pair type of two gold images (data_loader.py 100)


class Vote(NamedTuple):
    """One comparison: choice 1 (img1 better), -1 (img2), 0 (draw); its pair type if the record
    names one (pair_type, e.g. gold_gold), else ""."""

    img1: str
    img2: str
    choice: int
    annotator: str
    pair_type: str = ""


# --------------------------------------------------------------------------- reading


@dataclass
class Comparisons:
    """Every vote as (img1, img2, choice in {1, -1, 0}, annotator), and what they name."""

    records: list[Vote]
    annotators: list[str]
    images: list[str]  # relative to the image folder, sorted
    layout: str  # how the folder was read, for the run's log
    dropped: int  # records dropped by skip_missing_images
    invalid: dict[str, int]  # records dropped by skip_invalid_records, per reason
    categories: dict[str, str]  # gold images' categories (img1_category / img2_category)
    files: list[Path]  # the annotation files read


def annotation_files(root: Path) -> tuple[str, list[tuple[Path, str | None]]]:
    """The layout found in `root` and its files, each with its annotator (None: per record)."""
    # in S3's listing order, as the original reads them (its keys compared as bytes, each name
    # with its "/": ann-2/ before ann/), for its split draws from the records in that order
    folders = sorted(
        (p for p in root.iterdir() if is_present(p / ORIGINAL_FILE)),
        key=lambda p: (p.name + "/").encode(errors="surrogateescape"),
    )
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
        data = json.loads(read_text(path))
    except (ValueError, RecursionError) as err:  # RecursionError: nested too deeply
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
    categories: dict[str, str] = {}
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
                    found[name] = (image_dir / name).exists()  # a FIFO is refused when read
            if not all(found[name] for name in pair):
                missing_at.append(where)
                continue
            who = annotator if annotator is not None else str(entry.get("annotator", path.stem))
            kind = entry.get("pair_type", entry.get("type")) or ""
            records.append(Vote(*pair, choice, who, str(kind)))
            for name, key in zip(pair, ("img1_category", "img2_category"), strict=True):
                if isinstance(entry.get(key), str) and entry[key]:
                    categories[name] = entry[key]
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
        categories=categories,
        files=[path for path, _ in files],
    )


def quality_rank(category: str) -> int:
    """The original's get_quality_rank (config.py 148-168): an exact name, else the first one
    the category contains (sanding_POS_5 -> 5); -1 when none."""
    if not category:
        return -1
    if category in QUALITY_RANKS:
        return QUALITY_RANKS[category]
    return next((rank for key, rank in QUALITY_RANKS.items() if key in category), -1)


def gold_reliabilities(records: list[Vote], categories: dict[str, str]) -> dict[str, float]:
    """Each annotator's accuracy on gold-gold pairs, as the original's compute_user_reliability
    (data_loader.py 95-133): the better category's image expected (equal ranks: a draw), half a
    point for a draw between adjacent ranks; 0.5 for an annotator without gold pairs."""
    correct: Counter[str] = Counter()
    total: Counter[str] = Counter()
    for vote in records:
        total[vote.annotator] += 0  # every annotator is listed
        if vote.pair_type != GOLD_PAIR:
            continue
        r1 = quality_rank(categories.get(vote.img1, ""))
        r2 = quality_rank(categories.get(vote.img2, ""))
        expected = (r1 > r2) - (r1 < r2)
        total[vote.annotator] += 1
        if vote.choice == expected:
            correct[vote.annotator] += 1
        elif vote.choice == 0 and abs(r1 - r2) <= 1 and 100 not in (r1, r2):
            correct[vote.annotator] += 0.5
    return {who: correct[who] / n if n else 0.5 for who, n in total.items()}


def read_truth(path: Path, images: list[str], annotators: list[str]) -> dict | None:
    """The optional truth.json ({"quality": {image: q}, "reliability": {annotator: eta}}) that
    synthetic data carries, checked up front: every image and annotator, finite numbers. Real
    data has none (the original has no such file)."""
    if not is_present(path):
        return None
    try:
        truth = json.loads(read_text(path))
    except (ValueError, RecursionError) as err:  # RecursionError: nested too deeply
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


# --------------------------------------------------------------------------- training pairs


def split_comparisons(
    records: list[Vote], held_out: float, seed: int, stratified: bool = True
) -> tuple[list[Vote], list[Vote]]:
    """Training and held-out comparisons, by the original's split_comparisons (dataset.py
    260-308) with Python's random seeded at `seed`, so the same records land on each side as in
    its runs for the same seed and share. Stratified (its train.py's): each pair type's records
    (types in the order first met, a record without one under "unknown") shuffled in turn, the
    first int(n x train share) of each for training, then both sides shuffled; else one shuffle
    of all. `records` must be in the original's order (annotation_files, read_comparisons)."""
    rng = random.Random(seed)
    share = round(1 - held_out, 12)  # the train share as written (1 - 0.9 is 0.0999...98)
    groups: dict[str, list[Vote]] = {}
    for vote in records:
        groups.setdefault((vote.pair_type or "unknown") if stratified else "", []).append(vote)
    train: list[Vote] = []
    held: list[Vote] = []
    for group in groups.values():
        rng.shuffle(group)
        cut = int(len(group) * share)
        train += group[:cut]
        held += group[cut:]
    if stratified:
        rng.shuffle(train)
        rng.shuffle(held)
    if not train or not held:
        side = "training" if not train else "held-out"
        plain = ", or pass --split plain (many small pair types)" if stratified else ""
        raise DataError(
            f"--held-out {held_out}: no {side} comparisons among {len(records)} "
            f"(--split {'stratified' if stratified else 'plain'}); change --held-out{plain}"
        )
    return train, held


class ImageReader:
    """One image as the original prepares it (dataset.py 17-48): decoded to RGB, resized to
    size x size (torchvision's Resize: PIL bilinear), in training optionally augmented (flips
    both ways, rotation up to 15 degrees, colour jitter 0.2 / 0.2 / 0.1), normalised with the
    backbone's own mean and std (timm's data config). Read from disk when asked, in the data
    loader's workers: no image set is ever held in memory."""

    def __init__(
        self,
        folder: Path,
        size: int,
        mean: tuple[float, ...],
        std: tuple[float, ...],
        augment: bool = False,
    ) -> None:
        from torchvision import transforms

        steps: list = [transforms.Resize((size, size))]
        if augment:
            steps += [
                transforms.RandomHorizontalFlip(p=0.5),
                transforms.RandomVerticalFlip(p=0.5),
                transforms.RandomRotation(degrees=15),
                transforms.ColorJitter(brightness=0.2, contrast=0.2, saturation=0.1),
            ]
        steps += [transforms.ToTensor(), transforms.Normalize(mean=mean, std=std)]
        self.folder, self.size = Path(folder), size
        self.transform = transforms.Compose(steps)

    def __call__(self, name: str) -> torch.Tensor:
        from PIL import UnidentifiedImageError

        path = self.folder / name
        try:
            with open_image(path) as image:
                rgb = image.convert("RGB")
        except (UnidentifiedImageError, OSError) as err:
            raise DataError(f"{path}: not a readable image ({err})") from None
        return self.transform(rgb)


def normalisation(backbone: nn.Module) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The backbone's own (mean, std) from timm's data config: ImageNet's for efficientnet_b4 as
    the original uses, (0.5, 0.5, 0.5) for timm's test models."""
    from timm.data import resolve_data_config

    config = resolve_data_config({}, model=backbone)
    return tuple(config["mean"]), tuple(config["std"])


class Images(Dataset):
    """The named images, one per item, for scoring."""

    def __init__(self, names: list[str], read: ImageReader) -> None:
        self.names, self.read = names, read

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, item: int) -> torch.Tensor:
        return self.read(self.names[item])


class Pairs(Dataset):
    """Comparisons as (image i, image j, choice, annotator index), the images read from disk.

    The augmentation's draws for an item depend only on (seed, epoch, item), as every random
    sample in this project: the same on 1 or N processes, with any number of loader workers and
    after a resume. torchvision's transforms draw from the global CPU generator, so it is seeded
    per item and restored after (dropout on the CPU draws from it too). Only the CPU's: the
    `torch.manual_seed` of every device would reseed a GPU's generator, which dropout there draws
    from, on every item read in the main process (fork_rng(devices=[]) restores only the CPU's),
    so with 0 and N loader workers a GPU would draw other dropout masks."""

    def __init__(self, records: list, read: ImageReader, annotators: list[str], seed: int = 0):
        self.read = read
        who = {name: k for k, name in enumerate(annotators)}
        self.rows = [(v.img1, v.img2, v.choice, who[v.annotator]) for v in records]
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:  # called by the training loop before each epoch
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, item: int):
        a, b, choice, annotator = self.rows[item]
        with torch.random.fork_rng(devices=[]):
            seed = (self.seed * 1_000_003 + self.epoch) * 1_000_003 + item
            torch.random.default_generator.manual_seed(seed)
            image_a, image_b = self.read(a), self.read(b)
        return image_a, image_b, torch.tensor(float(choice)), torch.tensor(annotator)
