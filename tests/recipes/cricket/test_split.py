"""The cricket presets run cricketmodel's data whole: the same matches in train / val / test as
its own `CricketDataset.process` for the same seed (tests/fixtures/cricket/split.json, made by
the original's code), the split seed being --seed as there, and the last incomplete batch
trained on where cricketmodel trains on it (one process)."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest

import recipes.train_cricket as recipe
from accel_common import BatchPlan, SharedSettings, read_config_file
from accel_common.checkpoints.export import read_export_metadata
from recipes.cricket.example import write_dataset
from recipes.cricket.loading import load_innings
from recipes.cricket.samples import Deliveries
from recipes.cricket.settings import CricketSettings
from tests.processes import CRICKET_TINY, REPO
from tests.recipes.cricket.helpers import train_here

FIXTURE = json.loads((REPO / "tests" / "fixtures" / "cricket" / "split.json").read_text())
PRESETS = REPO / "recipes" / "cricket" / "configs"
PARTS = ("train", "val", "test")


def preset(name: str) -> CricketSettings:
    names = [f.name for f in fields(CricketSettings)] + [f.name for f in fields(SharedSettings)]
    return CricketSettings.from_config(read_config_file(PRESETS / f"{name}.yaml", names))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture's data: 30 simulated matches and a .json that is no match (the original
    shuffles every .json file; it gives no samples)."""
    out = tmp_path_factory.mktemp("split-data")
    write_dataset(out, matches=30)
    (out / "notes.json").write_text('{"note": "not a match"}')
    return out


@pytest.mark.parametrize("name", ["original", "tuned"])
@pytest.mark.parametrize("seed", sorted(FIXTURE["splits"]))
def test_each_preset_holds_out_cricketmodels_matches_for_its_seed(name, seed, folder, tmp_path):
    settings = preset(name)
    assert settings.split_seed is None  # --seed's, as cricketmodel splits with its --seed
    options = recipe.innings_options(SimpleNamespace(seed=int(seed), workers=1), settings)
    rows, _ = load_innings(folder, **{**options, "cache_dir": tmp_path})
    got = dict(zip(rows["file"], rows["split"], strict=True))
    want = {f: k for k, part in enumerate(PARTS) for f in FIXTURE["splits"][seed][part]}
    assert set(got) == set(want) - {"notes.json"}  # every match compared
    assert got == {f: want[f] for f in got}


def test_the_split_seed_is_the_one_given_else_seed():
    settings = preset("original")
    run = SimpleNamespace(seed=7, workers=1)
    assert recipe.innings_options(run, settings)["split_seed"] == 7
    settings.split_seed = 42
    assert recipe.innings_options(run, settings)["split_seed"] == 42


def test_the_last_batch_is_kept_on_one_process_taking_one_batch_per_step_only():
    settings = preset("original")
    assert settings.keep_last_batch
    assert recipe.keeps_last_batch(settings, BatchPlan(64, 64, 1, 1))
    assert not recipe.keeps_last_batch(settings, BatchPlan(64, 32, 2, 1))  # as under its DDP
    assert not recipe.keeps_last_batch(settings, BatchPlan(64, 32, 1, 2))
    assert not recipe.keeps_last_batch(CricketSettings(), BatchPlan(64, 64, 1, 1))


@pytest.mark.slow
def test_an_epoch_with_the_last_batch_kept_takes_one_step_more(folder, tmp_path):
    """One epoch over the training deliveries: ceil(n / batch) steps kept, floor dropped."""
    args = ["--data", str(folder), *CRICKET_TINY, "--bs", "24", "--sample-every", "16"]
    args += ["--epochs", "1", "--warmup-steps", "0", "--graph-cache-dir", str(tmp_path / "c")]
    rows, _ = load_innings(
        folder, **recipe.innings_options(SimpleNamespace(seed=0, workers=1), CricketSettings())
        | {"cache_dir": tmp_path / "c"}
    )  # fmt: skip
    deliveries = Deliveries(rows, target="original")
    n = int(((deliveries.rank % 16 == 0) & (deliveries.split == 0)).sum())
    assert n % 24, "the example's training split must leave an incomplete batch"
    steps = {}
    for keep in ("--keep-last-batch", "--no-keep-last-batch"):
        train_here([*args, keep], tmp_path / keep)
        steps[keep] = read_export_metadata(tmp_path / keep / "model")["step"]
    assert steps == {"--keep-last-batch": math.ceil(n / 24), "--no-keep-last-batch": n // 24}
