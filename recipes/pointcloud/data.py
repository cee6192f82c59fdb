"""The SkullBreak layout as the original's preprocessing leaves it, and its reader.

    train.csv, test.csv                      one row per skull: complete_skull/070_surf.npy
    complete_skull/070_surf.npy              M x 3 surface points of the whole skull
    defective_skull/<defect>/070_surf.npy    the skull with the defect
    implant/<defect>/070_surf.npy            the missing piece (the target)
    voxel_spacing.json                       mm per coordinate unit of each file (optional)

for the five defect types. Each CSV row expands to the five defective skull + implant pairs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from accel_common import DataError
from accel_common.data import is_present, read_path_list, read_text, require_finite, require_regular

DEFECTS = ("bilateral", "frontoorbital", "parietotemporal", "random_1", "random_2")
SPACING_FILE = "voxel_spacing.json"
SKULL_AND_IMPLANT = ("defective_skull", "implant")


def case_stem(listed: str) -> str:
    """A CSV row's case: .../complete_skull/070.nrrd, 070_surf.npy or 070.npy -> 070."""
    return Path(listed).name.removesuffix(".nrrd").removesuffix(".npy").removesuffix("_surf")


def require_disjoint(train: tuple[Path, list[str]], test: tuple[Path, list[str]]) -> None:
    """Refuse a case listed by both splits (each a CSV and its case stems): the held-out skulls
    are never trained on. `prepare` and training check alike."""
    (train_csv, train_cases), (test_csv, test_cases) = train, test
    shared = sorted(set(train_cases) & set(test_cases))
    if shared:
        raise DataError(
            f"{train_csv} and {test_csv} share {len(shared)} case(s) ({', '.join(shared[:5])}"
            f"{', ...' if len(shared) > 5 else ''}); remove them from one, so that no "
            "held-out skull is trained on"
        )


def require_disjoint_splits(root: Path) -> None:
    """The SkullBreak folder's train.csv and test.csv list no case in common (before any
    point cloud is read: a test metric on a training skull is silently wrong)."""
    train, test = (
        (csv, [case_stem(row) for _, row in read_path_list(csv, suffixes=(".npy", ".nrrd"))])
        for csv in (root / "train.csv", root / "test.csv")
    )
    require_disjoint(train, test)


def load_points(path: Path, header_only: bool = False) -> np.ndarray:
    """An M x 3 float point cloud from a .npy file (never unpickled).

    `header_only` maps the file instead of reading it: a cheap check of every file up front, so
    bad data fails before training starts, with the file's name, not inside a loader worker.
    """
    require_regular(path)
    with path.open("rb") as handle:
        if handle.read(6) != b"\x93NUMPY":  # else np.load calls any other file "pickled data"
            raise DataError(f"{path}: not a .npy file (it lacks NumPy's header)")
    try:
        points = np.load(path, allow_pickle=False, mmap_mode="r" if header_only else None)
    except (ValueError, OSError) as err:
        raise DataError(f"{path}: not a readable .npy array ({err})") from None
    if points.ndim != 2 or points.shape[1] != 3 or len(points) == 0:
        raise DataError(f"{path}: expected an M x 3 point cloud, got shape {points.shape}")
    if header_only:
        return points
    require_finite(points, str(path))  # index [point, coordinate]
    return points.astype(np.float32)


def rotation_xyz(angles: np.ndarray) -> np.ndarray:
    """Open3D's get_rotation_matrix_from_xyz((a, b, c)): Rx(a) @ Ry(b) @ Rz(c)."""
    (ca, cb, cc), (sa, sb, sc) = np.cos(angles), np.sin(angles)
    rx = np.array([[1, 0, 0], [0, ca, -sa], [0, sa, ca]])
    ry = np.array([[cb, 0, sb], [0, 1, 0], [-sb, 0, cb]])
    rz = np.array([[cc, -sc, 0], [sc, cc, 0], [0, 0, 1]])
    return rx @ ry @ rz


def normalisation(defective: np.ndarray) -> tuple[np.ndarray, float]:
    """The original's normalisation: centre of the bounding box, scale (max extent / 2) / 3."""
    low, high = defective.min(axis=0), defective.max(axis=0)
    return (low + high) / 2, float((high - low).max() / 2 / 3)


def point_file(root: Path, kind: str, defect: str, stem: str) -> Path:
    """The original's `<kind>/<defect>/070_surf.npy`, or `070.npy` as this project once wrote."""
    original = root / kind / defect / f"{stem}_surf.npy"
    plain = original.with_name(f"{stem}.npy")
    return plain if plain.is_file() and not original.is_file() else original


def case_folder(root: Path, listed: str, stem: str) -> Path:
    """The folder a CSV row's case lives in, as the original resolves it: the row's path up to
    complete_skull/, relative to the CSV's folder `root` unless absolute (a row without that
    folder: `root`). If that folder lacks the case and `root` has it, `root`: a data set moved
    after the original's split script wrote absolute paths still loads."""
    parts = Path(listed).parts
    if "complete_skull" not in parts[:-1]:
        return root
    folder = root.joinpath(*parts[: parts.index("complete_skull")])
    probe = SKULL_AND_IMPLANT[0], DEFECTS[0], stem
    if not point_file(folder, *probe).is_file() and point_file(root, *probe).is_file():
        return root
    return folder


def read_spacing(root: Path, checked: bool = True) -> dict[str, list[float] | None]:
    """mm per coordinate unit per axis for each point file (None: unknown), as `prepare`
    records it; every entry is checked (`checked`=False: as written, for prepare to merge)."""
    path = root / SPACING_FILE
    if not is_present(path):
        return {}
    try:
        recorded = dict(json.loads(read_text(path))["spacing"])
    except (ValueError, KeyError, TypeError) as err:
        raise DataError(f"{path}: not a voxel-spacing file written by prepare ({err})") from None
    if not checked:
        return recorded
    return {key: checked_spacing(path, key, value) for key, value in recorded.items()}


def checked_spacing(path: Path, key: str, value: object) -> list[float] | None:
    """One entry of a voxel-spacing file: three positive numbers, or None (unknown). A zero or
    negative spacing would still report distances "in mm"."""
    if value is None:
        return None
    if (
        isinstance(value, list)
        and len(value) == 3
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        and all(math.isfinite(v) and v > 0 for v in value)
    ):
        return [float(v) for v in value]
    raise DataError(
        f"{path}: entry '{key}' is {json.dumps(value)}; a voxel spacing is 3 positive numbers "
        "(mm per coordinate unit along x, y, z), or null where it is unknown: correct it, or "
        "write the file again with prepare"
    )


class SkullBreak(Dataset):
    """Defective skull + implant pairs of one split, five defect types per listed skull.

    Point subsampling, the diffusion timestep and the noise of sample i in epoch e come from a
    generator seeded by (seed, e, i), so they are the same whichever process loads the sample:
    1 and N processes train on identical inputs, and a resumed run on the same ones.
    """

    def __init__(
        self,
        root: Path,
        split: str,
        num_points: int,
        num_nn: int,
        timesteps: int,
        seed: int,
        train: bool = False,
        augment: bool = False,
    ):
        # train: normalise as the original trains (bounding box of the sampled skull + implant
        # points, skullbreak_data.py lines 76-88), else by the sampled skull as it evaluates;
        # augment: its random rotation of both by up to 10 degrees about each axis (lines 63-70)
        self.train, self.augment = train, augment
        csv = root / f"{split}.csv"
        self.files = [csv]  # every file the split reads (the run's data fingerprint)
        recorded: dict[Path, dict[str, list[float] | None]] = {}  # per case folder: its spacings
        self.entries, spacings = [], []
        for line, listed in read_path_list(csv, suffixes=(".npy", ".nrrd")):
            stem = case_stem(listed)
            folder = case_folder(root, listed, stem)
            if folder not in recorded:
                recorded[folder] = read_spacing(folder)
                if (folder / SPACING_FILE).is_file():
                    self.files.append(folder / SPACING_FILE)
            for defect in DEFECTS:
                pair = tuple(point_file(folder, kind, defect, stem) for kind in SKULL_AND_IMPLANT)
                for path in pair:
                    if not path.exists():  # a FIFO or device is refused by load_points
                        raise DataError(
                            f"{path}: file not found (listed by {csv}, line {line}; "
                            f"{stem}.npy is read too). From .nrrd volumes, make the point clouds "
                            "with: python recipes/train_pointcloud.py prepare --raw DIR --out DIR"
                        )
                    load_points(path, header_only=True)
                self.entries.append(pair)
                self.files += pair
                spacings.append(recorded[folder].get(pair[1].relative_to(folder).as_posix()))
        # distances in mm need every implant's voxel spacing; else they stay in the files' units
        self.unit = "mm" if all(spacings) else "units"
        self.mm_per_unit = [np.asarray(s or (1.0, 1.0, 1.0), dtype=np.float32) for s in spacings]
        self.num_skull_points, self.num_nn = num_points - num_nn, num_nn
        self.timesteps, self.seed, self.epoch = timesteps, seed, 0

    def set_epoch(self, epoch: int) -> None:  # called by the prepared DataLoader's set_epoch
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        defective_path, implant_path = self.entries[index]
        defective, implant = load_points(defective_path), load_points(implant_path)
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) * 1_000_003 + index)
        skull_idx = torch.randint(len(defective), (self.num_skull_points,), generator=g)
        implant_idx = torch.randint(len(implant), (self.num_nn,), generator=g)
        skull, implant = defective[skull_idx.numpy()], implant[implant_idx.numpy()]
        if self.train and self.augment:  # about the centre of both, as Open3D's rotate
            angles = (
                (torch.rand(3, generator=g, dtype=torch.float64).numpy() * 20 - 10) * np.pi / 180
            )
            both = np.concatenate([skull, implant]).astype(np.float64)
            rotated = (both - both.mean(axis=0)) @ rotation_xyz(angles).T + both.mean(axis=0)
            skull, implant = np.split(rotated.astype(np.float32), [len(skull)])
        center, scale = normalisation(np.concatenate([skull, implant]) if self.train else skull)
        return {
            "skull": torch.from_numpy((skull - center) / scale).float(),
            "implant": torch.from_numpy((implant - center) / scale).float(),
            "t": torch.randint(self.timesteps, (), generator=g),
            "noise": torch.randn(self.num_nn, 3, generator=g),
            "center": torch.from_numpy(center),
            "scale": torch.tensor(scale),
            "mm_per_unit": torch.from_numpy(self.mm_per_unit[index]),
        }
