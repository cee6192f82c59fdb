"""The point-cloud diffusion recipe: data layout, exact scaling, single-device use, bad input."""

from __future__ import annotations

import functools
import json
import re
import shutil
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import typer
from torch.utils.data import DataLoader
from typer.testing import CliRunner

import recipes.train_pointcloud as recipe
from accel_common.checkpoint import write_export
from accel_common.errors import CheckpointError, ConfigError, DataError, exit_on_error
from recipes.pointcloud.data import DEFECTS, SPACING_FILE, SkullBreak
from recipes.pointcloud.diffusion import Diffusion
from recipes.pointcloud.example import write_dataset
from recipes.pointcloud.model import PVCNN2
from recipes.pointcloud.prepare import merge_spacing
from tests.conftest import (
    POINTCLOUD,
    POINTCLOUD_TINY,
    REPO,
    dry_run_plan,
    exported_params,
    global_relative_difference,
    max_relative_difference,
    metrics_log,
    run_recipe,
)

TINY = POINTCLOUD_TINY


# `make train`'s defaults (675 steps), scored once at the end, on 2 processes (1 thread each)
LEARNING_RUN = ["--eval-every", "100"]
# measured for that run on seed 0 (the test's): chamfer / baseline 0.73 (50 / 68 mm), own / other
# skull 0.58; seeds 1 and 2 (one process): chamfer / baseline 0.89 and 0.82, own / other 0.74 and
# 0.78, so the chamfer bound has its margin on seed 0 only. Another processor's float order
# (simulated with ATen and oneDNN held to AVX2 kernels) moved seed 0 to 0.72. Runs of 300 or 450
# steps (cheaper, for the 90 s the issue asks) scored 0.94 to 1.40 x the baseline with every lever
# tried (docs/recipes/pointcloud.md, Quality)
CHAMFER_BOUND, OWN_OTHER_BOUND = 0.85, 0.85


def chamfer_with_own_and_other_skull(model_dir, data) -> tuple[float, float]:
    """Mean Chamfer distance of the exported model's implants for the test split, sampled with
    each case's own defective skull, and with the same noise but the skull of another defect of
    the same head (its hole elsewhere), both against the true implant. A model that ignores the
    skull gives the two exactly equal."""
    model, settings = recipe.load_model(model_dir, torch.device("cpu"))
    test = recipe.skullbreak(data, "test", settings, seed=0)
    batch = next(iter(DataLoader(test, batch_size=len(test))))
    # the rows are head by head, five defects each: take the next defect's skull, same head
    other = torch.arange(len(test)).view(-1, len(DEFECTS)).roll(1, dims=1).flatten()
    diffusion = Diffusion(settings.timesteps)
    to_mm = batch["scale"][:, None, None] * batch["mm_per_unit"][:, None, :]
    scores = []
    for skulls in (batch["skull"], batch["skull"][other]):
        generator = torch.Generator().manual_seed(0)
        steps = settings.sample_steps
        implants = diffusion.sample(model, skulls, settings.num_nn, steps, generator)
        scores.append(recipe.chamfer(implants * to_mm, batch["implant"] * to_mm).mean().item())
    return scores[0], scores[1]


@pytest.mark.slow
@pytest.mark.dist
def test_learns_to_place_the_implant_in_the_defect(pointcloud_data, tmp_path):
    """`make train`'s run (PVCNN2 at width 0.25, voxel grids 16^3 / 8^3 / 4^3, 675 steps) on the
    example skulls, on 2 processes of one thread (the same run as 1 process, to the sum order).
    Measured in docs/recipes/pointcloud.md (Quality), with why it needs this many steps: ~75% of
    the test's time is the training, and shorter runs did not beat the baseline.

    - The implants sampled for the held-out skulls beat the trivial baseline that ignores the
      skull (points drawn from all training implants). Not proof that the skull is used alone:
      one fixed point set, the same for every skull, scored 0.76 x the baseline before.
    - The model places the implant by the skull: sampled with the same noise, its implants are
      nearer the true one with the case's own skull than with the skull of another defect of
      the same head (equal for a model that ignores the skull)."""
    out = tmp_path / "run"
    args = ["--data", str(pointcloud_data), "--output-dir", str(out), *LEARNING_RUN]
    run_recipe(args, cwd=tmp_path, nproc=2, script=POINTCLOUD)
    metrics = json.loads((out / "model" / "model.json").read_text())["metrics"]
    assert metrics["n"] == 30
    assert metrics["chamfer_mm"] < CHAMFER_BOUND * metrics["baseline_skull_agnostic_mm"], metrics
    own, other = chamfer_with_own_and_other_skull(out / "model", pointcloud_data)
    assert own < OWN_OTHER_BOUND * other, (own, other, metrics)


def test_generated_data_follows_the_skullbreak_layout(pointcloud_data):
    rows = (pointcloud_data / "train.csv").read_text().split()
    assert len(rows) == 24 and rows[0] == "complete_skull/000_surf.npy"
    complete = np.load(pointcloud_data / rows[0])
    for defect in DEFECTS:
        defective = np.load(pointcloud_data / "defective_skull" / defect / "000_surf.npy")
        implant = np.load(pointcloud_data / "implant" / defect / "000_surf.npy")
        assert defective.shape[1] == implant.shape[1] == 3
        assert len(implant) > 50 and len(defective) + len(implant) == len(complete)
        together = np.concatenate([defective, implant])
        assert np.allclose(np.sort(together, axis=0), np.sort(complete, axis=0))


def small_run(data, out) -> list[str]:
    args = ["--data", str(data), "--output-dir", str(out), *TINY, "--max-steps", "20"]
    args += ["--log-every", "1", "--eval-every", "100"]
    return [*args, "--ema-decay", "0.9"]  # the export is the EMA of the weights


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, pointcloud_data):
    tmp = tmp_path_factory.mktemp("pc1")
    args = small_run(pointcloud_data, tmp / "run")
    args[:2] = ["--path", str(pointcloud_data / "train.csv")]  # the original's flag, its CSV
    run_recipe(args, cwd=tmp, script=POINTCLOUD)
    return tmp / "run"


@pytest.mark.dist
def test_two_processes_see_the_same_noise_and_end_with_the_same_parameters(
    one_process, pointcloud_data, tmp_path
):
    """Timesteps, noise and point subsets are drawn per sample from (seed, epoch, index), so the
    runs differ only in the order of floating-point sums. Two references, as in test_quality:
    - 1 process accumulating 2 micro-batches of 4 sums the same per-sample gradients in the same
      halves as 2 processes of 4 do. Bound 1e-6 (measured: bit-equal on the 2-core CI VM).
    - 1 process at batch 8 in one micro-batch differs from both by summation order alone
      (measured with the former flat network: 1.0e-6 per tensor; with PVCNN2 1.2e-4 over all
      parameters together). So the 2-process run may be no further from it than the
      accumulating run is (x2, + 1e-6), per tensor and over all parameters together."""
    accumulated = tmp_path / "accum"
    run_recipe(
        [*small_run(pointcloud_data, accumulated), "--grad-accum", "2"],
        cwd=tmp_path,
        script=POINTCLOUD,
    )
    run_recipe(
        small_run(pointcloud_data, tmp_path / "run"), cwd=tmp_path, nproc=2, script=POINTCLOUD
    )
    assert metrics_log(tmp_path / "run")[0]["config"]["num_processes"] == 2
    single, double = exported_params(one_process), exported_params(tmp_path / "run")
    same_halves = exported_params(accumulated)
    assert max_relative_difference(same_halves, double) <= 1e-6
    # PVCNN2 (GroupNorm over few values, unscaled attention, Adam on near-zero gradients)
    # turns the sum-order noise into more than the flat network did: the bound is the measured
    # floor, the accumulating run's distance from the single batch, for both measures
    global_floor = global_relative_difference(single, same_halves)
    measured = global_relative_difference(single, double)
    assert measured <= 2 * global_floor + 1e-6, (measured, global_floor)
    sum_order_floor = max_relative_difference(single, same_halves)
    assert max_relative_difference(single, double) <= 2 * sum_order_floor + 1e-6
    single, double, halves = (
        [r["train/loss"] for r in metrics_log(run) if "train/loss" in r]
        for run in (one_process, tmp_path / "run", accumulated)
    )
    assert double == pytest.approx(halves, rel=1e-5)
    # the single batch's losses drift from them by the sum order alone (measured up to 2.9e-4)
    assert single == pytest.approx(double, rel=1e-3)


@pytest.mark.slow
def test_complete_writes_an_implant_and_a_picture(one_process, pointcloud_data, tmp_path):
    skull = pointcloud_data / "defective_skull" / "bilateral" / "025_surf.npy"
    out, png = tmp_path / "implant.npy", tmp_path / "view.png"
    args = ["complete", "--model", str(one_process / "model"), "--skull", str(skull)]
    args += ["--out", str(out), "--png", str(png), "--sample-steps", "5"]
    run_recipe(args, cwd=tmp_path, script=POINTCLOUD)
    implant = np.load(out)
    assert implant.shape == (32, 3) and np.isfinite(implant).all()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    before = out.read_bytes()
    again = run_recipe(args, cwd=tmp_path, script=POINTCLOUD, check=False)
    assert again.returncode == 2 and "exists" in again.stderr
    assert out.read_bytes() == before


@pytest.mark.slow
def test_evaluate_command_scores_the_export(one_process, pointcloud_data, tmp_path):
    args = ["evaluate", "--model", str(one_process / "model"), "--data", str(pointcloud_data)]
    result = run_recipe([*args, "--sample-steps", "3"], cwd=tmp_path, script=POINTCLOUD)
    assert "chamfer_mm" in result.stdout and "baseline_skull_agnostic_mm" in result.stdout
    assert "n 30" in result.stdout


@pytest.fixture
def broken_data(tmp_path, pointcloud_data):
    folder = tmp_path / "skulls"
    shutil.copytree(pointcloud_data, folder)
    return folder


def break_missing_implant(folder):
    (folder / "implant" / "random_2" / "003_surf.npy").unlink()
    return "implant/random_2/003_surf.npy: file not found (listed by", "train.csv, line 4"


def break_shape(folder):
    np.save(folder / "defective_skull" / "bilateral" / "000_surf.npy", np.zeros((10, 2)))
    return "bilateral/000_surf.npy: expected an M x 3 point cloud, got shape (10, 2)", ""


def break_empty_split(folder):
    (folder / "test.csv").write_text("path\n")
    return "test.csv: lists no .npy or .nrrd files", ""


def break_not_npy(folder):
    (folder / "train.csv").write_text("complete_skull/000_surf.npy\ncomplete_skull/001.txt\n")
    return "train.csv, line 2: 'complete_skull/001.txt' is not a .npy or .nrrd path", ""


def set_spacing(folder, value):
    """Give one implant a voxel spacing of `value` in the folder's voxel_spacing.json."""
    path = folder / SPACING_FILE
    document = json.loads(path.read_text())
    document["spacing"]["implant/random_1/002_surf.npy"] = value
    path.write_text(json.dumps(document))
    return f"{path}: entry 'implant/random_1/002_surf.npy' is {json.dumps(value)}; ", SPACING_HELP


SPACING_HELP = (
    "a voxel spacing is 3 positive numbers (mm per coordinate unit along x, y, z), or null "
    "where it is unknown: correct it, or write the file again with prepare"
)


def break_zero_spacing(folder):
    return set_spacing(folder, [1.0, 0.0, 1.0])


def break_text_spacing(folder):
    return set_spacing(folder, ["0.4 mm", 0.4, 0.5])


@pytest.mark.parametrize(
    "breaker",
    [
        break_missing_implant,
        break_shape,
        break_empty_split,
        break_not_npy,
        break_zero_spacing,
        break_text_spacing,
    ],
)
@pytest.mark.slow
def test_bad_data_gives_one_clear_error(breaker, broken_data, tmp_path):
    first, second = breaker(broken_data)
    args = ["--data", str(broken_data), "--output-dir", str(tmp_path / "run"), *TINY]
    result = run_recipe([*args, "--max-steps", "1"], cwd=tmp_path, script=POINTCLOUD, check=False)
    assert result.returncode == 2, result.stderr
    assert first in result.stderr and second in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "model").exists()


@pytest.mark.slow
def test_bad_sizes_are_refused(tmp_path, pointcloud_data):
    args = ["--data", str(pointcloud_data), "--num-points", "256", "--num-nn", "256"]
    result = run_recipe(args, cwd=tmp_path, script=POINTCLOUD, check=False)
    assert result.returncode == 2
    assert "--num-nn must be between 1 and --num-points - 1" in result.stderr
    args = ["--data", str(pointcloud_data), "--num-points", "64", "--num-nn", "8"]
    result = run_recipe(args, cwd=tmp_path, script=POINTCLOUD, check=False)
    assert result.returncode == 2
    assert "--num-points must be at least 192" in result.stderr
    result = run_recipe(
        ["--data", str(pointcloud_data), "--width-mult", "0.3"],
        cwd=tmp_path,
        script=POINTCLOUD,
        check=False,
    )
    assert result.returncode == 2 and "each must be a multiple of 8" in result.stderr


@pytest.mark.parametrize("module", ["nrrd", "mcubes", "trimesh"])
def test_prepare_without_the_volumes_extra_names_it(module, monkeypatch, tmp_path):
    """Here, not in test_prepare.py (which skips without the extra): the case a user meets."""
    prepare = recipe.prepare
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now fails as if absent
    with pytest.raises(ConfigError) as raised:
        prepare(raw=tmp_path, out=tmp_path / "out", points=10, workers=1, overwrite=False)
    message = str(raised.value)
    assert message.startswith("prepare needs the volumes extra") and "\n" not in message
    assert f"({module} is missing)" in message and 'pip install "accel-recipes[volumes]"' in message
    assert not (tmp_path / "out").exists()


def test_csv_rows_pointing_into_another_folder_resolve_as_the_originals(tmp_path):
    """The original reads each row from its own folder: the path before complete_skull/,
    relative to the CSV's folder unless absolute. A plain complete_skull/... row reads the
    CSV's folder; an absolute row whose folder lacks the case (a data set moved after the split
    script wrote it) falls back to the CSV's folder."""
    elsewhere = write_dataset(
        tmp_path / "elsewhere", train_skulls=2, test_skulls=0, points_per_skull=400
    )
    lists = tmp_path / "lists"
    lists.mkdir()
    (lists / "train.csv").write_text(
        f"{elsewhere / 'complete_skull' / '000_surf.npy'}\n../elsewhere/complete_skull/001.nrrd\n"
    )
    sizes = {"num_points": 64, "num_nn": 16, "timesteps": 10, "seed": 0}
    dataset = SkullBreak(lists, "train", **sizes)
    implants = [implant for _, implant in dataset.entries]
    assert implants[0] == elsewhere / "implant" / "bilateral" / "000_surf.npy"
    assert implants[5] == lists / "../elsewhere/implant/bilateral/001_surf.npy"
    assert len(dataset) == 10 and dataset.unit == "mm"  # the spacing file of the rows' folder
    (elsewhere / "train.csv").write_text(
        "complete_skull/000_surf.npy\n/moved/away/complete_skull/001_surf.npy\n"
    )
    beside = SkullBreak(elsewhere, "train", **sizes)
    assert [implant for _, implant in beside.entries][::5] == [
        elsewhere / "implant" / "bilateral" / "000_surf.npy",
        elsewhere / "implant" / "bilateral" / "001_surf.npy",
    ]


def test_distances_in_mm_follow_the_recorded_voxel_spacing(tmp_path):
    """The same points with a recorded spacing of 2 mm per voxel instead of 1: every distance
    `evaluate` reports (the model's and the baselines') doubles, with the same sampling noise."""
    root = write_dataset(tmp_path, train_skulls=2, test_skulls=1, points_per_skull=400)
    torch.manual_seed(0)
    model = PVCNN2(num_points=192, width_multiplier=0.25, voxel_resolution_multiplier=0.125)
    single_process = SimpleNamespace(process_index=0, gather_for_metrics=lambda x: x)
    sizes = {"num_points": 192, "num_nn": 16, "timesteps": 10}

    def metrics() -> dict[str, float]:
        train, test = (SkullBreak(root, name, **sizes, seed=0) for name in ("train", "test"))
        assert test.unit == "mm"
        loader = DataLoader(test, batch_size=5)
        diffusion = Diffusion(sizes["timesteps"])
        pool = recipe.implant_pool(train)
        noise = torch.Generator().manual_seed(0)
        return recipe.evaluate(single_process, model, loader, diffusion, 2, noise, pool, test.unit)

    at_1mm = metrics()
    recorded = json.loads((root / SPACING_FILE).read_text())["spacing"]
    merge_spacing(root, {key: [2.0, 2.0, 2.0] for key in recorded})
    at_2mm = metrics()
    in_mm = [name for name in at_1mm if name.endswith("_mm")]
    assert len(in_mm) == 4 and at_2mm.keys() == at_1mm.keys() and at_2mm["n"] == at_1mm["n"] == 5
    for name in in_mm:
        assert at_1mm[name] > 0 and at_2mm[name] == pytest.approx(2 * at_1mm[name], rel=1e-5)


@pytest.mark.parametrize(
    "value", [[0, 1, 1], [-0.4, 0.4, 0.5], [1, "a", 1], [1, 1], "1 mm", [1, True, 1], [1, 1e400, 1]]
)
def test_a_voxel_spacing_that_is_not_three_positive_numbers_is_refused(tmp_path, value):
    """Zero or negative spacings would still report distances "in mm" (0 mm, or negative),
    others a traceback: each is refused naming the file and the entry, read or merged."""
    root = write_dataset(tmp_path, train_skulls=2, test_skulls=1, points_per_skull=400)
    before = (root / SPACING_FILE).read_text()
    message = "^" + re.escape(f"{root / SPACING_FILE}: entry 'implant/bilateral/000_surf.npy' is ")
    with pytest.raises(DataError, match=message + ".*" + re.escape(SPACING_HELP) + "$"):
        merge_spacing(root, {"implant/bilateral/000_surf.npy": value})
    assert (root / SPACING_FILE).read_text() == before  # nothing written
    document = json.loads(before)
    document["spacing"]["implant/bilateral/000_surf.npy"] = None  # unknown: distances in units
    (root / SPACING_FILE).write_text(json.dumps(document))
    assert SkullBreak(root, "train", num_points=64, num_nn=16, timesteps=10, seed=0).unit == "units"
    document["spacing"]["implant/bilateral/000_surf.npy"] = value
    (root / SPACING_FILE).write_text(json.dumps(document))
    with pytest.raises(DataError, match=message + ".*" + re.escape(SPACING_HELP) + "$"):
        SkullBreak(root, "train", num_points=64, num_nn=16, timesteps=10, seed=0)


ORIGINAL = REPO / "recipes" / "pointcloud" / "configs" / "original.yaml"


dry_run = functools.partial(dry_run_plan, recipe.train)


def parameters(**sizes) -> str:
    return str(sum(p.numel() for p in PVCNN2(**sizes).parameters()))


def test_the_original_preset_plans_the_originals_run_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = dry_run(["--config", str(ORIGINAL)])
    assert plan["parameters"] == parameters() == "27648963"  # the original's PVCNN2
    assert plan["batch"] == "global batch 8 = 8 per device x 1 processes x 1 accumulation steps"
    assert plan["learning rate"].startswith("peak 0.0002 (--lr 0.0002 at --ref-bs 8, linear")
    # its LinearLR warmup and ExponentialLR(gamma 1) step once per epoch (test_lr: the staircase)
    assert plan["learning rate"].endswith("28000 warmup steps, then constant per epoch")
    assert plan["epochs"] == "15000"
    assert list(tmp_path.iterdir()) == []  # no output folder, no example data


def test_a_config_value_is_used_and_a_flag_overrides_it(tmp_path):
    config = tmp_path / "small.yaml"
    config.write_text("width-mult: 0.5\nembed-dim: 16\n")
    assert dry_run(["--config", str(config)])["parameters"] == parameters(
        width_multiplier=0.5, embed_dim=16
    )
    overridden = dry_run(["--config", str(config), "--width-mult", "0.75"])["parameters"]
    assert overridden == parameters(width_multiplier=0.75, embed_dim=16)


@pytest.mark.slow
def test_resume_with_another_diffusion_setting_is_refused_naming_it(pointcloud_data, tmp_path):
    args = ["--data", str(pointcloud_data), "--output-dir", str(tmp_path / "run"), *TINY]
    args += ["--eval-every", "100", "--sample-steps", "2"]
    run_recipe([*args, "--max-steps", "2"], cwd=tmp_path, script=POINTCLOUD)
    changed = [*args, "--max-steps", "3", "--resume", "latest", "--timesteps", "50"]
    refused = run_recipe(changed, cwd=tmp_path, script=POINTCLOUD, check=False)
    assert refused.returncode != 0
    error = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1, refused.stderr
    assert "--timesteps 100 in the checkpoint, 50 now; resume with that run's settings" in error[0]
    # how finely the run is scored may change: the resume says so
    go = run_recipe(
        [*args, "--max-steps", "3", "--resume", "latest", "--sample-steps", "3"],
        cwd=tmp_path,
        script=POINTCLOUD,
    )
    noted = [line for line in go.stdout.splitlines() if line.startswith("resuming with changed")]
    assert len(noted) == 1 and "--sample-steps 2 in the checkpoint, 3 now" in noted[0], go.stdout


def test_training_samples_are_normalised_as_the_original_trains_and_may_be_rotated(tmp_path):
    """Training: by the bounding box of the sampled skull + implant points (the largest extent
    becomes 6, centred); evaluation: by the sampled skull alone. --augment rotates both about
    their centre by up to 10 degrees: distances between the points are kept."""
    root = write_dataset(tmp_path, train_skulls=1, test_skulls=1, points_per_skull=400)
    sizes = {"num_points": 192, "num_nn": 32, "timesteps": 10, "seed": 0}
    train = SkullBreak(root, "train", **sizes, train=True)[0]
    both = torch.cat([train["skull"], train["implant"]])
    extent = both.max(dim=0).values - both.min(dim=0).values
    assert extent.max().item() == pytest.approx(6.0, rel=1e-5)
    middle = (both.max(dim=0).values + both.min(dim=0).values) / 2
    assert middle.abs().max().item() < 1e-5
    test = SkullBreak(root, "test", **sizes)[0]
    skull_extent = test["skull"].max(dim=0).values - test["skull"].min(dim=0).values
    assert skull_extent.max().item() == pytest.approx(6.0, rel=1e-5)
    rotated = SkullBreak(root, "train", **sizes, train=True, augment=True)[0]
    together = torch.cat([rotated["skull"], rotated["implant"]]) * rotated["scale"]
    plain = both * train["scale"]
    assert not torch.allclose(together, plain)
    exact = "donot_use_mm_for_euclid_dist"
    distances = [torch.cdist(p.double(), p.double(), compute_mode=exact) for p in (together, plain)]
    torch.testing.assert_close(distances[0], distances[1], atol=1e-3, rtol=1e-5)


def test_an_ensemble_reports_each_member_and_their_mean(tmp_path):
    root = write_dataset(tmp_path, train_skulls=1, test_skulls=1, points_per_skull=400)
    torch.manual_seed(0)
    model = PVCNN2(num_points=192, width_multiplier=0.25, voxel_resolution_multiplier=0.125)
    single_process = SimpleNamespace(process_index=0, gather_for_metrics=lambda x: x)
    sizes = {"num_points": 192, "num_nn": 16, "timesteps": 10, "seed": 0}
    train = SkullBreak(root, "train", **sizes, train=True)
    test = SkullBreak(root, "test", **sizes)
    loader = DataLoader(test, batch_size=5)
    pool = recipe.implant_pool(train)
    metrics = recipe.evaluate(
        single_process, model, loader, Diffusion(10), 2, torch.Generator().manual_seed(0), pool,
        test.unit, "ddpm", num_ens=3,
    )  # fmt: skip
    members = [metrics[f"chamfer_ens{k}_mm"] for k in range(3)]
    assert len(set(members)) == 3  # different noise per member
    assert metrics["chamfer_mm"] == pytest.approx(sum(members) / 3, rel=1e-5)


class ExactGaussianNoise(torch.nn.Module):
    """The exact noise predictor for implant points drawn i.i.d. from N(mean, std^2) per
    coordinate: E[noise | x_t] = sqrt(1 - a) (x_t - sqrt(a) mean) / (a std^2 + 1 - a), with a the
    cumulative alpha at t. Both samplers driven by it must return that Gaussian."""

    def __init__(self, diffusion: Diffusion, mean: torch.Tensor, std: float, skull_points: int):
        super().__init__()
        self.alphas_cumprod, self.mean, self.std = diffusion.alphas_cumprod, mean, std
        self.skull_points = skull_points

    def forward(self, inputs: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        a = self.alphas_cumprod[t].double()[:, None, None]
        x = inputs.double()
        eps = (1 - a).sqrt() * (x - a.sqrt() * self.mean[None, :, None]) / (a * self.std**2 + 1 - a)
        eps[:, :, : self.skull_points] = 0  # read on the implant points only
        return eps.float()


@pytest.mark.parametrize("sampler", ["ddpm", "ddim"])
def test_samplers_given_the_exact_noise_return_the_data_distribution(sampler):
    """A sampler error (posterior coefficients, variance, x0 from eps, the schedule) moves the
    samples' mean or spread away from the data's; a correct one reproduces them, at T = 100 (the
    CPU default) and T = 1000 (the original's). DDIM runs all T steps here: with fewer it is a
    coarser discretisation that shrinks the spread (measured: std 0.24 at 20 steps, 0.29 at 100,
    0.30 at 1000 for the data's 0.3)."""
    mean, std = torch.tensor([1.5, -0.5, 0.25], dtype=torch.float64), 0.3
    for timesteps in (100, 1000):
        diffusion = Diffusion(timesteps)
        model = ExactGaussianNoise(diffusion, mean, std, skull_points=4)
        skull = torch.zeros(8, 4, 3)
        generator = torch.Generator().manual_seed(0)
        points = diffusion.sample(model, skull, 500, timesteps, generator, sampler).double()
        points = points.reshape(-1, 3)  # 4000 draws: the mean's standard error is 0.005
        torch.testing.assert_close(points.mean(dim=0), mean, atol=0.03, rtol=0)
        expected_std = torch.full((3,), std, dtype=torch.float64)
        torch.testing.assert_close(points.std(dim=0), expected_std, atol=0.03, rtol=0)


def test_complete_normalises_the_skull_as_the_originals_test_loader():
    """The original's test-time loader draws the skull points first and normalises by their
    bounding box (skullbreak_data.py, eval=True): the drawn points span exactly -3..3 along their
    longest axis, centred, and generated points map back by x * scale + centre."""
    rng = np.random.default_rng(0)
    points = rng.normal(size=(5000, 3)) * [30.0, 40.0, 20.0] + [5.0, -7.0, 60.0]
    points = points.astype(np.float32)
    condition, center, scale = recipe.skull_condition(points, 200, torch.Generator().manual_seed(0))
    low, high = condition[0].amin(dim=0), condition[0].amax(dim=0)
    assert condition.shape == (1, 200, 3)
    assert (high - low).max().item() == pytest.approx(6.0, abs=1e-5)
    torch.testing.assert_close((high + low) / 2, torch.zeros(3), atol=1e-5, rtol=0)
    back = condition[0].numpy() * scale + center
    nearest = torch.cdist(torch.from_numpy(back).double(), torch.from_numpy(points).double())
    assert nearest.min(dim=1).values.max().item() < 1e-3  # each is one of the skull's points


@pytest.mark.slow
def test_warmup_rises_from_the_originals_start_factor(pointcloud_data, tmp_path):
    """The original warms up with LinearLR from 0.01 x lr (--lr-warmup-start-factor): the LR
    logged after step k is the peak x (0.01 + 0.99 (k + 1) / W); from 0 it would be (k + 1) / W."""
    out = tmp_path / "run"
    args = ["--data", str(pointcloud_data), "--output-dir", str(out), *TINY]
    args += ["--eval-every", "100", "--sample-steps", "2", "--log-every", "1"]
    run_recipe([*args, "--max-steps", "3", "--warmup-steps", "3"], cwd=tmp_path, script=POINTCLOUD)
    logged = [r["train/lr"] for r in metrics_log(out) if "train/lr" in r]
    peak = 3e-3  # the default --lr at the default batch
    assert logged == pytest.approx([peak * (0.01 + 0.99 * 2 / 3), peak, peak], rel=1e-6)


# --------------------------------------------------------------------------- bad command input


def tiny_export(folder, **changes) -> PVCNN2:
    """An export of the tests' tiny network (random weights), as training writes it."""
    settings = recipe.PointCloudSettings(
        num_points=256, num_nn=32, vox_res_mult=0.125, num_neighbors=8, embed_dim=16, **changes
    )
    torch.manual_seed(0)
    model = recipe.network(settings)
    write_export(
        model.state_dict(), folder, {"recipe": "pointcloud", "config": settings.as_config()}
    )
    return model


def command_app(command) -> typer.Typer:
    """One of the recipe's single-device commands as `python recipe.py NAME` runs it."""
    app = typer.Typer(add_completion=False)
    app.command()(exit_on_error(command))
    return app


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-ens", "0"], "Invalid value for '--num-ens'"),
        (["--num-ens", "-1"], "Invalid value for '--num-ens'"),
        (["--sample-steps", "0"], "Invalid value for '--sample-steps'"),
        (["--sample-steps", "101"], "--sample-steps 101 exceeds the model's --timesteps 100"),
        (["--sampler", "ddpm", "--sample-steps", "10"], "DDPM takes all 100 steps of the model"),
    ],
)
def test_evaluate_refuses_sampling_counts_it_would_silently_replace(tmp_path, flags, message):
    """0 used to fall back to the export's value (`or`), a negative count crashed, more DDIM
    steps than timesteps repeated timesteps, and DDPM ignored --sample-steps."""
    tiny_export(tmp_path / "model")
    data = write_dataset(tmp_path / "data", train_skulls=1, test_skulls=1, points_per_skull=300)
    args = ["--model", str(tmp_path / "model"), "--data", str(data), *flags]
    result = CliRunner().invoke(command_app(recipe.evaluate_export), args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def complete_args(tmp_path, *flags) -> list[str]:
    tiny_export(tmp_path / "model")
    skull = tmp_path / "skull.npy"
    np.save(skull, np.random.default_rng(0).normal(size=(300, 3)).astype(np.float32))
    return ["--model", str(tmp_path / "model"), "--skull", str(skull), *flags]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sample-steps", "0"], "Invalid value for '--sample-steps'"),
        (["--sample-steps", "500"], "--sample-steps 500 exceeds the model's --timesteps 100"),
        (["--out", "implant"], "--out implant: give a file name ending in .npy"),
        (["--sampler", "ddpm", "--sample-steps", "10"], "DDPM takes all 100 steps of the model"),
    ],
)
def test_complete_refuses_what_it_would_silently_change(tmp_path, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)
    args = complete_args(tmp_path, *flags)
    args += [] if "--out" in flags else ["--out", "implant.npy"]
    result = CliRunner().invoke(command_app(recipe.complete), args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not list(tmp_path.glob("implant*"))


def test_complete_writes_no_file_over_another_and_makes_their_folders(tmp_path):
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    out = tmp_path / "implant.npy"
    cases = [
        (["--out", str(out), "--png", str(out)], "--png: give another file than --out"),
        (["--out", str(mine / "implant.npy")], f"implant.npy: {mine} is a file, not a folder"),
        (["--out", str(out), "--png", str(mine / "v.png")], f"v.png: {mine} is a file, not a"),
    ]
    for flags, message in cases:
        result = CliRunner().invoke(command_app(recipe.complete), complete_args(tmp_path, *flags))
        assert result.exit_code == 2, result.output
        assert message in result.output and not out.exists(), result.output
    assert mine.read_text() == "mine"
    png = tmp_path / "new" / "views" / "view.png"
    args = complete_args(tmp_path, "--out", str(out), "--png", str(png), "--sample-steps", "2")
    result = CliRunner().invoke(command_app(recipe.complete), args)
    assert result.exit_code == 0, result.output
    assert np.load(out).shape == (32, 3) and png.read_bytes()[:4] == b"\x89PNG"


def test_complete_keeps_an_existing_picture(tmp_path):
    png = tmp_path / "view.png"
    png.write_bytes(b"mine")
    args = complete_args(tmp_path, "--out", str(tmp_path / "implant.npy"), "--png", str(png))
    result = CliRunner().invoke(command_app(recipe.complete), args)
    assert result.exit_code == 2, result.output
    assert f"--png {png} exists" in result.output
    assert png.read_bytes() == b"mine" and not (tmp_path / "implant.npy").exists()


def test_init_from_names_the_flag_and_what_it_takes(tmp_path):
    model = tiny_export(tmp_path / "export")
    pcdiff = tmp_path / "model_best.pth"
    torch.save({"model_state": {f"model.{k}": v for k, v in model.state_dict().items()}}, pcdiff)
    with pytest.raises(ConfigError, match=r"--init-from .*model_best\.pth: .*--from pcdiff"):
        recipe.initialise_from(model, pcdiff)
    with pytest.raises(ConfigError, match=r"--init-from .*missing: no export there"):
        recipe.initialise_from(model, tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"--init-from .*data: no export there"):
        recipe.initialise_from(
            model, write_dataset(tmp_path / "data", train_skulls=1, test_skulls=1)
        )
    wider = recipe.network(recipe.PointCloudSettings(num_points=256, num_nn=32, width_mult=0.5))
    with pytest.raises(CheckpointError) as refused:
        recipe.initialise_from(wider, tmp_path / "export")
    message = str(refused.value)
    assert "\n" not in message  # one line, not torch's list of every mismatched tensor
    assert "sa_layers.0.0.voxel_layers.0.weight has shape (8, 3, 3, 3, 3)" in message
    assert "(16, 3, 3, 3, 3)" in message
    recipe.initialise_from(recipe.network(recipe.PointCloudSettings(
        num_points=256, num_nn=32, vox_res_mult=0.125, num_neighbors=8, embed_dim=16
    )), tmp_path / "export")  # fmt: skip


def test_a_csv_other_than_the_splits_is_refused_not_replaced(tmp_path):
    """The original trains on the CSV --path names; the recipe reads train.csv beside it, so
    another name would train on a file the user did not give."""
    assert recipe.csv_folder(tmp_path / "train.csv", "--data", "train") == tmp_path
    assert recipe.csv_folder(tmp_path, "--data", "train") == tmp_path
    with pytest.raises(ConfigError, match=r"--data .*train_small\.csv: .*train\.csv"):
        recipe.csv_folder(tmp_path / "train_small.csv", "--data", "train")
    tiny_export(tmp_path / "model")
    data = write_dataset(tmp_path / "data", train_skulls=1, test_skulls=1, points_per_skull=300)
    args = ["--model", str(tmp_path / "model"), "--data", str(data / "train.csv")]
    result = CliRunner().invoke(command_app(recipe.evaluate_export), args)
    assert result.exit_code == 2 and "name the file test.csv" in result.output, result.output


@pytest.mark.parametrize("points", [np.ones((1, 3)), np.ones((40, 3))])
def test_complete_refuses_a_skull_whose_points_coincide(tmp_path, points):
    """Its bounding box has no extent: normalising divides by zero (it crashed in voxelisation)."""
    args = complete_args(tmp_path, "--out", str(tmp_path / "implant.npy"))
    np.save(tmp_path / "skull.npy", points.astype(np.float32))
    result = CliRunner().invoke(command_app(recipe.complete), args)
    assert result.exit_code == 2, result.output
    assert "skull.npy: its points all coincide" in result.output
    assert not (tmp_path / "implant.npy").exists()


def test_an_export_with_an_impossible_setting_names_its_json(tmp_path):
    tiny_export(tmp_path / "model")
    meta = tmp_path / "model" / "model.json"
    document = json.loads(meta.read_text())
    document["config"]["vox_res_mult"] = 0.01  # edited by hand: the 8^3 grid vanishes
    meta.write_text(json.dumps(document))
    with pytest.raises(ConfigError, match=r"model\.json: --vox-res-mult 0\.01"):
        recipe.load_model(tmp_path / "model", torch.device("cpu"))


def test_init_from_says_which_shape_free_settings_differ_from_the_exports(tmp_path):
    """Voxel grids, radii, neighbours and centres change no tensor, so a strict load accepts an
    export trained at others: the run would fine-tune another function without a word."""
    model = tiny_export(tmp_path / "export")
    recorded = recipe.initialise_from(model, tmp_path / "export")
    same = recipe.PointCloudSettings.from_config(recorded["config"])
    assert recipe.unshaped_differences(recorded, same) == ""
    other = recipe.PointCloudSettings.from_config(recorded["config"], vox_res_mult=0.5)
    other.num_neighbors = 32
    note = recipe.unshaped_differences(recorded, other)
    assert (
        "--vox-res-mult 0.125 (this run: 0.5)" in note
        and "--num-neighbors 8 (this run: 32)" in note
    )
