"""The point-cloud diffusion recipe trained: it learns to place the implant, 2 processes see the
same noise and end with 1 process's parameters, complete and evaluate on its export, warmup.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import recipes.train_pointcloud as recipe
from recipes.pointcloud.data import DEFECTS
from recipes.pointcloud.diffusion import Diffusion
from tests.processes import POINTCLOUD, run_recipe
from tests.recipes.pointcloud.helpers import TINY
from tests.results import (
    exported_params,
    global_relative_difference,
    max_relative_difference,
    metrics_log,
)

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
# 367 s alone on a 2-core AMD EPYC, 525-600 s in CI beside the other worker's tests; past the
# suite's 600 s when that worker runs a multi-process check (the ResNet and attention checks)
@pytest.mark.timeout(1200)
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
    run_recipe(args, cwd=tmp_path, nproc=2, script=POINTCLOUD, timeout=1100)
    metrics = json.loads((out / "model" / "model.json").read_text())["metrics"]
    assert metrics["n"] == 30
    assert metrics["chamfer_mm"] < CHAMFER_BOUND * metrics["baseline_skull_agnostic_mm"], metrics
    own, other = chamfer_with_own_and_other_skull(out / "model", pointcloud_data)
    assert own < OWN_OTHER_BOUND * other, (own, other, metrics)


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


@pytest.mark.slow
def test_warmup_rises_from_the_originals_start_factor(pointcloud_data, tmp_path):
    """The original warms up with LinearLR from 0.01 x lr (--lr-warmup-start-factor): the LR
    logged at step k (from 1), the LR that step used, is the peak x (0.01 + 0.99 k / W); from 0
    it would be k / W."""
    out = tmp_path / "run"
    args = ["--data", str(pointcloud_data), "--output-dir", str(out), *TINY]
    args += ["--eval-every", "100", "--sample-steps", "2", "--log-every", "1"]
    run_recipe([*args, "--max-steps", "3", "--warmup-steps", "3"], cwd=tmp_path, script=POINTCLOUD)
    logged = [r["train/lr"] for r in metrics_log(out) if "train/lr" in r]
    peak = 3e-3  # the default --lr at the default batch
    expected = [peak * (0.01 + 0.99 * k / 3) for k in (1, 2, 3)]
    assert logged == pytest.approx(expected, rel=1e-6)
