"""The quality recipe trained: it learns quality and finds the unreliable annotators, 2 processes
end with 1 process's parameters, the score command rates a folder.
"""

from __future__ import annotations

import csv
import json

import pytest
import torch

from accel_common.data.images import list_images
from recipes.quality.commands import load_scorer, score_folder
from recipes.quality.example import write_dataset
from recipes.quality.metrics import rank_correlations
from tests.processes import QUALITY, run_recipe
from tests.results import (
    exported_params,
    global_relative_difference,
    max_relative_difference,
    metrics_log,
)


@pytest.mark.slow
def test_learns_quality_and_finds_the_unreliable_annotators(quality_data, tmp_path):
    """With the original's augmentation (the default), the scorer beats the win-rate baseline
    on the rated images and ranks images it never saw: it learned what quality looks like,
    not which image won."""
    out = tmp_path / "run"
    args = ["--data", str(quality_data), "--output-dir", str(out), "--epochs", "6"]
    run_recipe(args, cwd=tmp_path, script=QUALITY)
    metrics = json.loads((out / "model" / "model.json").read_text())["metrics"]
    assert metrics["spearman"] > metrics["baseline_spearman"] + 0.1, metrics
    assert metrics["kendall"] > metrics["baseline_kendall"] + 0.1, metrics
    assert metrics["pair_acc"] > metrics["baseline_pair_acc"], metrics
    assert metrics["eta_adversarial"] < 0.5 < min(metrics[f"eta_expert_{k}"] for k in "abc")
    assert abs(metrics["eta_spammer"] - 0.5) < 0.2
    assert metrics["eta_corr"] > 0.8
    unseen = write_dataset(tmp_path / "unseen", images=200, comparisons_per_annotator=1, seed=1)
    quality = json.loads((unseen / "truth.json").read_text())["quality"]
    model, read, _ = load_scorer(out / "model")
    read.folder = unseen / "images"
    with torch.no_grad():
        scores = model(torch.stack([read(name) for name in quality]))
    rho, _ = rank_correlations(scores, torch.tensor(list(quality.values())))
    assert rho > 0.4, rho


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, quality_data):
    tmp = tmp_path_factory.mktemp("q1")
    run_recipe(small_run(quality_data, tmp / "run"), cwd=tmp, script=QUALITY)
    return tmp / "run"


def small_run(data, out) -> list[str]:
    args = ["--data", str(data), "--output-dir", str(out), "--bs", "32", "--max-steps", "20"]
    # dropout off (each process draws its own masks); the augmentation stays on: its draws
    # depend on (seed, epoch, pair) alone
    return [*args, "--dropout", "0", "--log-every", "1", "--epochs", "1"]


@pytest.mark.dist
def test_two_processes_end_with_the_same_parameters(one_process, quality_data, tmp_path):
    """GroupNorm backbone, dropout off: global batch 32 on 2 processes is the same training as on
    1 process. The reliabilities are parameters and are averaged too.

    Two references, because the order of float sums differs between 1 and 2 processes:
    - 1 process accumulating 2 micro-batches of 16 sums the same per-sample gradients in the same
      halves as 2 processes of 16 do; only the all-reduce replaces the accumulation. Bound 1e-6
      (measured: bit-equal on AMD EPYC).
    - 1 process at batch 32 in one micro-batch differs from both by summation order alone, and
      Adam magnifies that noise in tensors whose gradients are tiny (measured: 1.06e-3 in a
      24-wide norm bias of norm 1.4e-3, the same in the accumulating run; 2.2e-6 over all
      parameters together). So the 2-process run may be no further from it than the accumulating
      run is (x2, + 1e-6 per tensor, + 1e-7 over all parameters)."""
    accumulated = tmp_path / "accum"
    run_recipe(
        [*small_run(quality_data, accumulated), "--grad-accum", "2"], cwd=tmp_path, script=QUALITY
    )
    run_recipe(small_run(quality_data, tmp_path / "run"), cwd=tmp_path, nproc=2, script=QUALITY)
    assert metrics_log(tmp_path / "run")[0]["config"]["num_processes"] == 2
    single, double = exported_params(one_process), exported_params(tmp_path / "run")
    same_halves = exported_params(accumulated)
    assert max_relative_difference(same_halves, double) <= 1e-6
    global_floor = global_relative_difference(single, same_halves)
    assert global_relative_difference(single, double) <= 2 * global_floor + 1e-7
    sum_order_floor = max_relative_difference(single, same_halves)
    assert max_relative_difference(single, double) <= 2 * sum_order_floor + 1e-6


@pytest.mark.slow
def test_score_command_rates_a_folder(one_process, quality_data, tmp_path):
    out = tmp_path / "scores.csv"
    args = ["score", "--model", str(one_process / "model"), "--images"]
    run_recipe(
        [*args, str(quality_data / "images"), "--out", str(out)], cwd=tmp_path, script=QUALITY
    )
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == len(list_images(quality_data / "images"))
    scores = [float(r["score"]) for r in rows]
    assert scores == sorted(scores, reverse=True)
    again = run_recipe([*args, str(quality_data / "images"), "--out", str(out)], cwd=tmp_path,
                       script=QUALITY, check=False)  # fmt: skip
    assert again.returncode == 2 and "exists" in again.stderr
    # the command scored in chunks of 64; one batch of all images gives the same scores
    whole = tmp_path / "whole.csv"
    score_folder(one_process / "model", quality_data / "images", whole, bs=1000)
    chunked = {r["image"]: float(r["score"]) for r in rows}
    in_one = {r["image"]: float(r["score"]) for r in csv.DictReader(whole.open())}
    assert in_one.keys() == chunked.keys()
    assert max(abs(in_one[name] - chunked[name]) for name in chunked) < 1e-5


@pytest.mark.slow
def test_pretrained_without_network_is_a_clear_error(quality_data, tmp_path):
    args = ["--data", str(quality_data), "--backbone", "resnet18", "--pretrained"]
    result = run_recipe(args, cwd=tmp_path, script=QUALITY, check=False)
    assert result.returncode == 2
    assert "--pretrained: could not fetch resnet18's weights" in result.stderr
    assert "--weights FILE" in result.stderr
