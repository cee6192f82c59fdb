"""The Crowd-BT quality recipe: the likelihood, learning, exact scaling, scoring, bad input."""

from __future__ import annotations

import csv
import importlib.util
import json
import shutil

import pytest
import torch

from tests.conftest import (
    QUALITY,
    exported_params,
    global_relative_difference,
    max_relative_difference,
    metrics_log,
    run_recipe,
)


def recipe():
    spec = importlib.util.spec_from_file_location("train_quality", QUALITY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_crowd_bt_likelihood():
    q = recipe()
    diff = torch.tensor([2.0, 2.0, 2.0, 0.5])
    choice = torch.tensor([1.0, -1.0, 1.0, 0.0])
    reliable = torch.tensor([1.0, 1.0, 0.0, 1.0])
    expected = torch.stack(
        [
            -torch.nn.functional.logsigmoid(torch.tensor(2.0)),  # eta 1: plain Bradley-Terry
            -torch.nn.functional.logsigmoid(torch.tensor(-2.0)),
            -torch.nn.functional.logsigmoid(torch.tensor(-2.0)),  # eta 0: the vote is reversed
            torch.tensor(0.1 * 0.5),  # a draw costs draw_weight * |diff|
        ]
    ).mean()
    loss = q.crowd_bt_loss(diff, choice, reliable, 0.1)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)  # eta is clamped to 1e-6
    coin = q.crowd_bt_loss(diff[:2], choice[:2], torch.tensor([0.5, 0.5]), 0.1)
    assert coin.item() == pytest.approx(
        torch.log(torch.tensor(2.0)).item()
    )  # a spammer says nothing


def test_reduced_reliability_forms_stay_in_the_upper_half():
    q = recipe()
    model = torch.nn.Module()
    model.annotator_logits = torch.nn.Parameter(torch.tensor([-5.0, 0.0, 5.0]))
    full = q.reliabilities(model, "full", 0.9)
    assert full[0] < 0.01 and full[2] > 0.99
    shared = q.reliabilities(model, "global", 0.9)
    assert torch.all(shared == shared[0]) and 0.5 <= shared[0] <= 1
    assert torch.allclose(q.reliabilities(model, "fixed", 0.9), torch.full((3,), 0.9))


def test_rank_correlations_handle_ties_whatever_the_row_order():
    """Win rates tie often; tied scores must share their average rank (Spearman) and count as
    ties (Kendall's tau-b), so the baseline is not understated by the order of the rows."""
    rank_correlations = recipe().rank_correlations
    true = torch.arange(8.0)
    tied = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])  # two blocks, right order
    rho, tau = rank_correlations(tied, true)
    for perm in (torch.arange(7, -1, -1), torch.tensor([3, 6, 0, 5, 1, 7, 2, 4])):
        assert rank_correlations(tied[perm], true[perm]) == pytest.approx((rho, tau), abs=1e-12)
    # average ranks: corr([2.5]*4 + [6.5]*4, 1..8) = 0.8729; tau-b = 16 / sqrt(28 * 16)
    assert rho == pytest.approx(0.8729, abs=1e-4)
    assert tau == pytest.approx(16 / (28 * 16) ** 0.5)
    assert rank_correlations(true, true) == pytest.approx((1.0, 1.0))


@pytest.mark.slow
def test_learns_quality_and_finds_the_unreliable_annotators(quality_data, tmp_path):
    out = tmp_path / "run"
    args = ["--data", str(quality_data), "--output-dir", str(out), "--epochs", "6"]
    run_recipe(args, cwd=tmp_path, script=QUALITY, threads=2)
    metrics = json.loads((out / "model" / "model.json").read_text())["metrics"]
    assert metrics["spearman"] > metrics["baseline_spearman"] + 0.1, metrics
    assert metrics["kendall"] > metrics["baseline_kendall"] + 0.1, metrics
    assert metrics["pair_acc"] > metrics["baseline_pair_acc"], metrics
    assert metrics["eta_adversarial"] < 0.5 < min(metrics[f"eta_expert_{k}"] for k in "abc")
    assert abs(metrics["eta_spammer"] - 0.5) < 0.2
    assert metrics["eta_corr"] > 0.8


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, quality_data):
    tmp = tmp_path_factory.mktemp("q1")
    run_recipe(small_run(quality_data, tmp / "run"), cwd=tmp, script=QUALITY)
    return tmp / "run"


def small_run(data, out) -> list[str]:
    args = ["--data", str(data), "--output-dir", str(out), "--bs", "32", "--max-steps", "20"]
    return [*args, "--dropout", "0", "--log-every", "1", "--epochs", "1"]


@pytest.mark.dist
def test_two_processes_end_with_the_same_parameters(one_process, quality_data, tmp_path):
    """GroupNorm backbone, dropout off: only the order of float sums differs. The reliabilities
    are parameters and are averaged too.

    Tolerance: 1e-5 over all parameters together, as in test_distributed; per tensor 1e-4,
    because Adam divides each update by the gradient's own scale, which magnifies sum-order noise
    in tensors whose gradients are tiny (here a 256-wide bias reaches ~2e-5 after 20 steps)."""
    run_recipe(small_run(quality_data, tmp_path / "run"), cwd=tmp_path, nproc=2, script=QUALITY)
    assert metrics_log(tmp_path / "run")[0]["config"]["num_processes"] == 2
    single, double = exported_params(one_process), exported_params(tmp_path / "run")
    assert global_relative_difference(single, double) <= 1e-5
    assert max_relative_difference(single, double) <= 1e-4


@pytest.mark.slow
def test_score_command_rates_a_folder(one_process, quality_data, tmp_path):
    out = tmp_path / "scores.csv"
    args = ["score", "--model", str(one_process / "model"), "--images"]
    run_recipe(
        [*args, str(quality_data / "images"), "--out", str(out)], cwd=tmp_path, script=QUALITY
    )
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 160
    scores = [float(r["score"]) for r in rows]
    assert scores == sorted(scores, reverse=True)
    again = run_recipe([*args, str(quality_data / "images"), "--out", str(out)], cwd=tmp_path,
                       script=QUALITY, check=False)  # fmt: skip
    assert again.returncode == 2 and "exists" in again.stderr


@pytest.fixture
def broken(tmp_path, quality_data):
    folder = tmp_path / "q"
    shutil.copytree(quality_data, folder)
    return folder


def bad_choice(folder):
    path = folder / "annotations" / "casual.json"
    records = json.loads(path.read_text())
    records[7]["choice"] = "both"
    path.write_text(json.dumps(records))
    return "casual.json, record 7: choice is 'both', not left|right|draw"


def missing_image(folder):
    (folder / "images" / "img_005.png").unlink()
    return "images/img_005.png not found"


def broken_json(folder):
    (folder / "annotations" / "spammer.json").write_text("[{")
    return "spammer.json: not valid JSON"


def no_annotations(folder):
    shutil.rmtree(folder / "annotations")
    return "annotations: no annotation .json files"


@pytest.mark.slow
@pytest.mark.parametrize("breaker", [bad_choice, missing_image, broken_json, no_annotations])
def test_bad_data_gives_one_clear_error(breaker, broken, tmp_path):
    message = breaker(broken)
    result = run_recipe(
        ["--data", str(broken), "--output-dir", str(tmp_path / "run")],
        cwd=tmp_path,
        script=QUALITY,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_pretrained_without_network_is_a_clear_error(quality_data, tmp_path):
    args = ["--data", str(quality_data), "--backbone", "resnet18", "--pretrained"]
    result = run_recipe(args, cwd=tmp_path, script=QUALITY, check=False)
    assert result.returncode == 2
    assert "--pretrained: could not fetch resnet18's weights" in result.stderr
    assert "--weights FILE" in result.stderr
