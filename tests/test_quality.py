"""The Crowd-BT quality recipe: the likelihood, learning, exact scaling, scoring, bad input."""

from __future__ import annotations

import csv
import functools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import typer
from PIL import Image
from typer.testing import CliRunner

import recipes.train_quality as recipe
from accel_common.data.images import list_images
from accel_common.errors import CheckpointError, ConfigError, DataError, error_message
from recipes.quality import data as quality_data
from recipes.quality.example import ANNOTATORS, write_dataset
from tests.conftest import (
    QUALITY,
    REPO,
    dry_run_plan,
    exported_params,
    global_relative_difference,
    invoke_train,
    max_relative_difference,
    metrics_log,
    run_recipe,
)


def test_crowd_bt_likelihood():
    q = recipe
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
    q = recipe
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
    rank_correlations = recipe.rank_correlations
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
    model, read, _ = recipe.load_scorer(out / "model")
    read.folder = unseen / "images"
    with torch.no_grad():
        scores = model(torch.stack([read(name) for name in quality]))
    rho, _ = recipe.rank_correlations(scores, torch.tensor(list(quality.values())))
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
    recipe.score_folder(one_process / "model", quality_data / "images", whole, bs=1000)
    chunked = {r["image"]: float(r["score"]) for r in rows}
    in_one = {r["image"]: float(r["score"]) for r in csv.DictReader(whole.open())}
    assert in_one.keys() == chunked.keys()
    assert max(abs(in_one[name] - chunked[name]) for name in chunked) < 1e-5


@pytest.fixture
def broken(tmp_path, quality_data):
    folder = tmp_path / "q"
    shutil.copytree(quality_data, folder)
    return folder


def bad_choice(folder):
    path = folder / "casual" / "comparison_data.json"
    data = json.loads(path.read_text())
    data["comparisons"][7]["choice"] = "both"
    path.write_text(json.dumps(data))
    return "casual/comparison_data.json, record 7: choice is 'both', not left|right|draw|tie|equal"


def missing_image(folder):
    (folder / "images" / "img_005.png").unlink()
    return "records name images that are not there (1 distinct: img_005.png; first in"


def broken_json(folder):
    (folder / "spammer" / "comparison_data.json").write_text("[{")
    return "spammer/comparison_data.json: not valid JSON"


def no_annotations(folder):
    for annotator in ANNOTATORS:
        shutil.rmtree(folder / annotator)
    return "no comparisons: expected <annotator>/comparison_data.json folders"


def truth_without_reliability(folder):
    path = folder / "truth.json"
    path.write_text(json.dumps({"quality": json.loads(path.read_text())["quality"]}))
    return "truth.json: needs a 'reliability' object; fix it, or remove it"


@pytest.mark.slow
@pytest.mark.parametrize(
    "breaker", [bad_choice, missing_image, broken_json, no_annotations, truth_without_reliability]
)
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
    assert "optimizer steps" not in result.stdout  # refused before the run even starts


@pytest.mark.slow
def test_pretrained_without_network_is_a_clear_error(quality_data, tmp_path):
    args = ["--data", str(quality_data), "--backbone", "resnet18", "--pretrained"]
    result = run_recipe(args, cwd=tmp_path, script=QUALITY, check=False)
    assert result.returncode == 2
    assert "--pretrained: could not fetch resnet18's weights" in result.stderr
    assert "--weights FILE" in result.stderr


# --------------------------------------------------------------------------- settings

ORIGINAL = REPO / "recipes" / "quality" / "configs" / "original.yaml"


invoke = functools.partial(invoke_train, recipe.train)
dry_run = functools.partial(dry_run_plan, recipe.train)


def parameters(backbone: str, annotators: int = len(ANNOTATORS)) -> str:
    """The scorer's count, the reliabilities apart."""
    with torch.device("meta"):
        model = recipe.QualityScorer(backbone, annotators, 0.2)
    return str(sum(p.numel() for p in model.parameters()) - annotators)


def test_the_original_preset_plans_its_size_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = dry_run(["--config", str(ORIGINAL)])
    # efficientnet_b4 and the 512-256-1 head with its biases: the original's 18,598,217; one
    # reliability per annotator of the example (no --data: 6), counted apart
    assert plan["parameters"] == str(18_598_217)
    assert plan["annotator reliabilities"] == "6 (not counted above)"
    assert plan["batch"] == "global batch 32 = 32 per device x 1 processes x 1 accumulation steps"
    assert plan["learning rate"].startswith("peak 0.0001 (--lr 0.0001 at --ref-bs 32, linear")
    assert plan["learning rate"].endswith("0 warmup steps, then cosine")
    assert plan["epochs"] == "20" and plan["mixed precision"] == "no"
    assert list(tmp_path.iterdir()) == []  # no output folder, no example data


def test_a_config_value_is_used_and_a_flag_overrides_it(tmp_path):
    config = tmp_path / "q.yaml"
    config.write_text("backbone: resnet18\nlr: 2e-4\nreliability: global\n")
    plan = dry_run(["--config", str(config)])
    assert plan["parameters"] == parameters("resnet18")
    assert plan["learning rate"].startswith("peak 0.0002 (--lr 0.0002 at --ref-bs 32")
    # --backbone on the command line wins; one reliability per annotator folder of --data
    two = tmp_path / "two"
    for annotator in ("a", "b"):
        (two / annotator).mkdir(parents=True)
        (two / annotator / "comparison_data.json").write_text('{"comparisons": []}')
    plan = dry_run(
        ["--config", str(config), "--backbone", "test_efficientnet_gn", "--data", str(two)]
    )
    assert plan["parameters"] == parameters("test_efficientnet_gn", annotators=2)
    assert plan["annotator reliabilities"] == "2 (not counted above)"
    assert plan["learning rate"].startswith("peak 0.0002 (--lr 0.0002 at --ref-bs 32")
    # the recipe's own checks hold for a file as for a flag
    config.write_text("reliability: sometimes\n")
    result = invoke(["--config", str(config), "--dry-run"])
    assert isinstance(result.exception, ConfigError)
    assert str(result.exception) == "--reliability sometimes: choose full, global, fixed or gold"


@pytest.mark.slow
def test_resuming_with_another_draw_weight_is_refused(quality_data, tmp_path):
    args = ["--data", str(quality_data), "--output-dir", str(tmp_path / "run")]
    run_recipe([*args, "--max-steps", "2"], cwd=tmp_path, script=QUALITY)  # saves step_2
    again = [*args, "--max-steps", "4", "--resume", "latest", "--draw-weight", "0.2"]
    result = run_recipe(again, cwd=tmp_path, script=QUALITY, check=False)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "belongs to another run" in errors[0]
    assert "--draw-weight 0.1 in the checkpoint, 0.2 now" in errors[0]


# --------------------------------------------------------------------------- the original's layout

# one annotator's votes, cycled over the pairs: the original's words in mixed case and padding
VOTES = ["left", "Right", "tie", "EQUAL", "draw", " left ", "right", "Left"]


def original_layout(root: Path, *, images: int = 8) -> Path:
    """A folder as the original project's users have it: <annotator>/comparison_data.json (one
    name with a space, as in its EDA report), {"comparisons": [...]} with the fields its app
    writes, images named by paths relative to the image folder, in subfolders."""
    names = [f"iter_{k % 2}/img_{k:05d}_patch_0.png" for k in range(images)]
    for k, name in enumerate(names):
        (root / "images" / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), (30 * k % 256, 90, 160)).save(root / "images" / name)
    for annotator in ("hitul", "rakshitha rp"):
        records = [
            {
                "img1": names[i],
                "img2": names[(i + 1 + j) % images],
                "choice": VOTES[(i + j) % len(VOTES)],
                "timestamp": f"2025-01-26T10:{i:02d}:{j:02d}",
                "time_taken": 2.5 + j,
                "batch_number": 1 + j,
                "pair_type": "regular_regular",
                "img1_category": "",
            }
            for i in range(images)
            for j in range(3)
        ]
        (root / annotator).mkdir()
        comparisons = {"comparisons": records}
        (root / annotator / "comparison_data.json").write_text(json.dumps(comparisons))
    return root


def add_records_naming_missing_images(root: Path) -> None:
    path = root / "hitul" / "comparison_data.json"
    data = json.loads(path.read_text())
    for gone in ("iter_0/gone_a.png", "iter_1/gone_b.png", "iter_0/gone_a.png"):
        data["comparisons"].append({"img1": data["comparisons"][0]["img1"], "img2": gone,
                                    "choice": "left"})  # fmt: skip
    path.write_text(json.dumps(data))


def test_the_original_layout_loads_with_its_choices_and_subfolder_names(tmp_path):
    root = original_layout(tmp_path)
    data = quality_data.read_comparisons(root, root / "images")
    assert data.layout == "<annotator>/comparison_data.json"
    assert data.annotators == ["hitul", "rakshitha rp"]  # the folders' names
    assert len(data.images) == 8 and data.images[0] == "iter_0/img_00000_patch_0.png"
    assert len(data.records) == 48 and data.dropped == 0
    choices = [r[2] for r in data.records]
    # per annotator and pair offset, each of the 8 votes once: 3 left, 2 right, 3 draws
    assert (choices.count(1), choices.count(-1), choices.count(0)) == (18, 12, 18)
    assert data.records[0] == ("iter_0/img_00000_patch_0.png", "iter_1/img_00001_patch_0.png",
                               1, "hitul", "regular_regular")  # fmt: skip
    assert data.categories == {}  # the empty img1_category is no category
    assert list_images(root / "images") == data.images  # what `score` rates


def test_the_earlier_flat_layout_still_loads(tmp_path):
    root = original_layout(tmp_path)
    (root / "annotations").mkdir()
    for annotator in ("hitul", "rakshitha rp"):
        folder = root / annotator
        records = json.loads((folder / "comparison_data.json").read_text())["comparisons"]
        (root / "annotations" / f"{annotator}.json").write_text(json.dumps(records))
        shutil.rmtree(folder)
    data = quality_data.read_comparisons(root, root / "images")
    assert data.layout == "annotations/<annotator>.json"
    assert data.annotators == ["hitul", "rakshitha rp"] and len(data.records) == 48
    (root / "hitul").mkdir()
    (root / "hitul" / "comparison_data.json").write_text('{"comparisons": []}')
    with pytest.raises(DataError, match=r"holds both <annotator>/comparison_data\.json folders"):
        quality_data.read_comparisons(root, root / "images")


def test_records_naming_missing_images_are_refused_or_dropped(tmp_path):
    root = original_layout(tmp_path)
    add_records_naming_missing_images(root)
    with pytest.raises(DataError) as error:
        quality_data.read_comparisons(root, root / "images")
    message = error_message(error.value)
    assert "3 of 51 comparison records name images that are not there" in message
    assert "(2 distinct: iter_0/gone_a.png, iter_1/gone_b.png; first in " in message
    assert "hitul/comparison_data.json, record 24)" in message
    assert "--skip-missing-images" in message and "\n" not in message
    data = quality_data.read_comparisons(root, root / "images", skip_missing_images=True)
    assert data.dropped == 3 and len(data.records) == 48
    assert not any("gone" in name for name in data.images)


# records the original skips silently (its data_loader.py and create_user_choice_training_data.py)
INVALID = {
    "choice is None, not left|right|draw|tie|equal (any case)": {"choice": None},
    "choice is '', not left|right|draw|tie|equal (any case)": {"choice": ""},
    "choice is 'both', not left|right|draw|tie|equal (any case)": {"choice": "both"},
    "has no choice": {},
    "img1 and img2 must be image names, got ('iter_0/img_00000_patch_0.png', None)": {
        "choice": "left", "img2": None
    },
}  # fmt: skip


def add_invalid_records(root: Path, fields: list[dict]) -> None:
    """Appended to hitul's file: from record 24 on in original_layout's."""
    path = root / "hitul" / "comparison_data.json"
    data = json.loads(path.read_text())
    pair = {"img1": "iter_0/img_00000_patch_0.png", "img2": "iter_1/img_00001_patch_0.png"}
    data["comparisons"] += [pair | extra for extra in fields]
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("detail", INVALID)
def test_an_invalid_record_is_named_with_what_to_do(tmp_path, detail):
    root = original_layout(tmp_path)
    add_invalid_records(root, [INVALID[detail]])
    with pytest.raises(DataError) as error:
        quality_data.read_comparisons(root, root / "images")
    message = error_message(error.value)
    where = f"{root / 'hitul' / 'comparison_data.json'}, record 24"
    assert message == (
        f"{where}: {detail}; fix or remove the record, or pass --skip-invalid-records to drop "
        "such records (the original skipped them silently)"
    )


def test_invalid_records_are_dropped_and_counted_by_reason(tmp_path):
    root = original_layout(tmp_path)
    add_invalid_records(root, [*INVALID.values(), {"choice": "  "}])
    data = quality_data.read_comparisons(root, root / "images", skip_invalid_records=True)
    assert len(data.records) == 48 and data.dropped == 0  # every valid record kept
    assert data.invalid == {
        "with no choice": 4,  # null, "", "  " and no choice key
        "with an unknown choice": 1,
        "without img1/img2": 1,
    }


def test_truth_problems_are_one_line_naming_file_and_key(tmp_path):
    root = original_layout(tmp_path)
    data = quality_data.read_comparisons(root, root / "images")
    path = root / "truth.json"
    assert quality_data.read_truth(path, data.images, data.annotators) is None  # optional
    quality = dict.fromkeys(data.images, 0.5)
    reliability = {"hitul": 0.9, "rakshitha rp": 0.8}
    cases = {
        "needs a 'reliability' object": {"quality": quality},
        "quality has no entry 'iter_1/img_00007_patch_0.png'": {
            "quality": {k: v for k, v in quality.items() if "00007" not in k},
            "reliability": reliability,
        },
        "reliability['hitul'] is 'high', not a finite number": {
            "quality": quality, "reliability": {**reliability, "hitul": "high"}
        },
    }  # fmt: skip
    for expected, truth in cases.items():
        path.write_text(json.dumps(truth))
        with pytest.raises(DataError) as error:
            quality_data.read_truth(path, data.images, data.annotators)
        message = error_message(error.value)
        assert message.startswith(f"{path}: {expected}; fix it, or remove it"), message
        assert "\n" not in message
    path.write_text(json.dumps({"quality": quality, "reliability": reliability}))
    truth = quality_data.read_truth(path, data.images, data.annotators)
    assert truth["quality"]["iter_1/img_00007_patch_0.png"] == 0.5  # subfolder names as keys


@pytest.mark.slow
def test_trains_on_the_original_layout_without_truth(tmp_path):
    """Annotations in one folder, images elsewhere (--image-dir), no truth.json; records the
    original skips (missing images, no or an unknown choice) dropped with a count."""
    root = original_layout(tmp_path / "logs")
    add_records_naming_missing_images(root)
    add_invalid_records(root, [{"choice": None}, {"choice": "both"}, {"choice": ""}])
    shutil.move(root / "images", tmp_path / "iter_images")
    args = ["--data", str(root), "--image-dir", str(tmp_path / "iter_images")]
    args += ["--output-dir", str(tmp_path / "run"), "--bs", "8", "--epochs", "1"]
    args += ["--image-size", "16", "--skip-missing-images", "--skip-invalid-records"]
    result = run_recipe(args, cwd=tmp_path, script=QUALITY)
    assert "read 48 comparisons (18 draws) by 2 annotators of 8 images" in result.stdout
    assert "--skip-missing-images: dropped 3 records" in result.stdout
    dropped = "dropped 3 invalid records (2 with no choice, 1 with an unknown choice)"
    assert f"--skip-invalid-records: {dropped}" in result.stdout
    assert "no truth.json" in result.stdout
    metrics = json.loads((tmp_path / "run" / "model" / "model.json").read_text())["metrics"]
    assert {"pair_acc", "baseline_pair_acc", "eta_hitul", "eta_rakshitha rp"} <= metrics.keys()
    assert "spearman" not in metrics and "eta_corr" not in metrics


# --------------------------------------------------------------------------- the original's code
# Fixtures made by running hituldesai03/crowd-bt's own code (tests/fixtures/quality/README.md).

FIXTURES = Path(__file__).parent / "fixtures" / "quality"
IMAGENET = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # the original's dataset.py 29-33


def original_facts() -> dict:
    return json.loads((FIXTURES / "original_outputs.json").read_text())


def original_checkpoint(path: Path) -> Path:
    """The dict the original's train.save_checkpoint writes, rebuilt from the fixtures (its
    optimizer and scheduler state left empty: the import does not read them)."""
    from safetensors.torch import load_file

    facts = original_facts()
    checkpoint = {
        "epoch": facts["epoch"],
        "model": load_file(str(FIXTURES / "original_model.safetensors")),
        "optimizer": {"state": {}, "param_groups": []},
        "scheduler": {"last_epoch": 1},
        "metrics": facts["metrics"],
        "config": facts["config"],
        "eta_logit": facts["eta_logit"],
    }
    assert sorted(checkpoint) == facts["checkpoint_keys"]
    torch.save(checkpoint, path)
    return path


@pytest.fixture
def imported(tmp_path) -> Path:
    """`accel-recipes convert --from crowd-bt` of the original's checkpoint."""
    from accel_common.tools.cli import app

    source = original_checkpoint(tmp_path / "last.pt")
    result = CliRunner().invoke(
        app, ["convert", str(source), str(tmp_path / "model"), "--from", "crowd-bt"]
    )
    assert result.exit_code == 0, result.output
    return tmp_path / "model"


def imported_scorer(model_dir: Path) -> recipe.QualityScorer:
    from accel_common.checkpoint import load_exported

    config = json.loads((model_dir / "model.json").read_text())["config"]
    model = recipe.QualityScorer(config["backbone"], len(config["annotators"]), config["dropout"])
    load_exported(model_dir, model)  # strict: no missing or unexpected key
    return model.eval()


def test_the_original_preprocessing_is_reproduced():
    from safetensors.torch import load_file

    expected = load_file(str(FIXTURES / "original_inputs.safetensors"))["images"]
    read = quality_data.ImageReader(FIXTURES / "images", 32, *IMAGENET)
    ours = torch.stack([read(name) for name in original_facts()["images"]])
    assert torch.equal(ours, expected)


def test_an_original_checkpoint_imports_strictly_and_scores_as_the_original(imported):
    from safetensors.torch import load_file

    facts = original_facts()
    model = imported_scorer(imported)
    state = load_file(str(FIXTURES / "original_model.safetensors"))
    assert set(model.scorer_state_dict()) == set(state)  # one to one, no renaming
    assert json.loads((imported / "model.json").read_text())["config"]["backbone"] == (
        "test_efficientnet"
    )
    images = load_file(str(FIXTURES / "original_inputs.safetensors"))["images"]
    with torch.no_grad():
        scores = model(images)
    expected = torch.tensor(facts["scores"])
    assert torch.allclose(scores, expected, rtol=1e-5, atol=0), (scores, expected)
    # its loss on a fixed batch, in the matching modes: its global eta (the imported logit,
    # --reliability global) and its per-annotation fixed etas
    batch = facts["loss_batch"]
    diff = scores[batch["i"]] - scores[batch["j"]]
    labels = torch.tensor(batch["labels"])
    eta = recipe.reliabilities(model, "global", 0.8)[torch.zeros(4, dtype=torch.long)]
    assert recipe.likelihood("global") is recipe.original_loss
    loss = recipe.original_loss(diff, labels, eta, 0.5)
    assert loss.item() == pytest.approx(facts["loss_global_eta"], rel=1e-5)
    fixed = recipe.original_loss(diff, labels, torch.tensor(batch["annotator_reliability"]), 0.5)
    assert fixed.item() == pytest.approx(facts["loss_fixed_eta"], rel=1e-5)


def test_an_export_converts_back_to_the_original_format(imported, tmp_path):
    from safetensors.torch import load_file

    from accel_common.tools.cli import app

    target = tmp_path / "crowd_bt.pt"
    result = CliRunner().invoke(app, ["convert", str(imported), str(target), "--to", "crowd-bt"])
    assert result.exit_code == 0, result.output
    checkpoint = torch.load(target, weights_only=True)
    facts = original_facts()
    assert checkpoint["config"] == facts["config"]
    assert checkpoint["eta_logit"] == pytest.approx(facts["eta_logit"])
    original = load_file(str(FIXTURES / "original_model.safetensors"))
    assert set(checkpoint["model"]) == set(original)
    assert all(torch.equal(checkpoint["model"][k], original[k]) for k in original)


def test_a_checkpoint_of_another_network_is_refused_naming_the_tensor(tmp_path):
    from recipes.quality.convert import import_checkpoint

    source = original_checkpoint(tmp_path / "last.pt")
    checkpoint = torch.load(source, weights_only=True)
    right = checkpoint["model"]["head.3.weight"]
    checkpoint["model"]["head.3.weight"] = torch.zeros(128, 512)
    torch.save(checkpoint, source)
    with pytest.raises(
        CheckpointError,
        match=r"head\.3\.weight has shape \(128, 512\) in the "
        r"checkpoint, \(256, 512\) in this recipe.s network",
    ):
        import_checkpoint(source)
    checkpoint["model"]["head.3.weight"] = right
    del checkpoint["model"]["head.6.bias"]
    torch.save(checkpoint, source)
    with pytest.raises(CheckpointError, match=r"missing tensor head\.6\.bias \(1,\)"):
        import_checkpoint(source)
    checkpoint["model"]["head.6.bias"] = torch.zeros(1)
    checkpoint["model"]["head.9.weight"] = torch.zeros(2)
    torch.save(checkpoint, source)
    with pytest.raises(CheckpointError, match=r"unexpected tensor head\.9\.weight \(2,\)"):
        import_checkpoint(source)


def test_gold_reliabilities_and_metrics_follow_the_original():
    """compute_user_reliability (data_loader.py 95-133): accuracy on gold_gold pairs, half a
    point for a draw between adjacent ranks, 0.5 without gold pairs; the metrics: the 0.1 draw
    margin, by pair type, against the gold ranking, linear NDCG."""
    categories = {"a": "POS_5", "b": "sanding_POS_4", "c": "POS_1", "d": "goldensample"}
    vote = quality_data.Vote
    records = [
        vote("a", "b", 1, "good", "gold_gold"),  # right
        vote("a", "b", 0, "good", "gold_gold"),  # a draw between ranks 5 and 4: half
        vote("c", "a", 1, "bad", "gold_gold"),  # wrong
        vote("b", "d", 0, "bad", "gold_gold"),  # a draw against a golden sample: wrong
        vote("a", "c", 1, "none", "gold_real"),
    ]
    etas = quality_data.gold_reliabilities(records, categories)
    assert etas == {"good": 0.75, "bad": 0.0, "none": 0.5}
    index = {name: k for k, name in enumerate("abcd")}
    scores = torch.tensor([5.0, 4.95, 1.0, 100.0])  # a and b within the 0.1 margin
    assert recipe.margin_accuracy(scores, records, index, 0.1) == pytest.approx(2 / 5)
    metrics = recipe.evaluate(scores, records, records, index, None, list("abcd"), categories)
    assert metrics["pair_acc_gold_gold"] == pytest.approx(1 / 2)  # non-draw votes only
    assert metrics["pair_acc_gold_real"] == 1.0
    assert metrics["spearman_gold"] == pytest.approx(1.0)
    assert metrics["ndcg_gold"] == pytest.approx(1.0)
    # the reverse order: relevances 1, 2, 3 at ranks 1, 2, 3 against the ideal 3, 2, 1
    log3 = math.log2(3)
    reverse = recipe.linear_ndcg(torch.tensor([3.0, 2.0, 1.0]), torch.tensor([0.0, 1.0, 2.0]))
    assert reverse == pytest.approx((1 + 2 / log3 + 3 / 2) / (3 + 2 / log3 + 1 / 2))


def run_command(command, args: list[str]):
    app = typer.Typer()
    app.command()(command)
    return CliRunner().invoke(app, args)


def test_one_image_is_scored_and_two_compared_as_the_original_does(imported):
    facts = original_facts()
    first, second = (str(FIXTURES / "images" / name) for name in facts["images"][:2])
    result = run_command(recipe.compare, ["--model", str(imported), first])
    assert result.exit_code == 0, result.output
    score = float(result.output.split("score ")[1])
    assert score == pytest.approx(facts["scores"][0], rel=1e-5)  # same preprocessing and weights
    result = run_command(recipe.compare, ["--model", str(imported), first, second])
    assert result.exit_code == 0, result.output
    diff = facts["scores"][0] - facts["scores"][1]  # 0.154: above the 0.1 draw margin
    probability = torch.sigmoid(torch.tensor(diff)).item()
    assert result.output.splitlines()[-1] == f"{first} is better, probability {probability:.4f}"
    result = run_command(recipe.compare, ["--model", str(imported), first, second, "--margin", "1"])
    assert result.output.splitlines()[-1].startswith("draw (|difference| 0.1536 <= 1.0)")


def test_the_onnx_export_scores_as_pytorch(imported, tmp_path):
    """Needs onnx and onnxruntime: pip install 'accel-recipes[onnx]' (skipped without them)."""
    pytest.importorskip("onnx")
    onnxruntime = pytest.importorskip("onnxruntime")
    from safetensors.torch import load_file

    out = tmp_path / "scorer.onnx"
    result = run_command(recipe.export_onnx, ["--model", str(imported), "--out", str(out)])
    assert result.exit_code == 0, result.output
    images = load_file(str(FIXTURES / "original_inputs.safetensors"))["images"]
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (scores,) = session.run(None, {"image": images.numpy()})
    expected = torch.tensor(original_facts()["scores"]).unsqueeze(1)
    assert torch.allclose(torch.from_numpy(scores), expected, rtol=1e-5, atol=1e-6)


def test_init_from_starts_from_an_imported_checkpoint(imported):
    from recipes.quality.model import start_from

    model = recipe.QualityScorer("test_efficientnet", len(ANNOTATORS), 0.2)
    fresh = model.annotator_logits.detach().clone()
    start_from(model, imported)
    reference = imported_scorer(imported)
    state = reference.scorer_state_dict()
    assert all(torch.equal(model.scorer_state_dict()[k], state[k]) for k in state)
    assert torch.equal(model.annotator_logits, fresh)  # one logit there, six here: afresh
    other = recipe.QualityScorer("test_efficientnet_gn", len(ANNOTATORS), 0.2)
    with pytest.raises(ConfigError, match=r"--init-from .*: not this scorer"):
        start_from(other, imported)


def test_reading_a_pair_seeds_the_cpus_generator_only(monkeypatch):
    """The augmentation's per-item seed goes to the CPU's generator, restored after: a GPU's
    generator, which dropout there draws from, is left alone (torch.manual_seed reseeded it on
    every item read in the main process: its dropout masks then depended on the loader's
    workers)."""
    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)
    vote = quality_data.Vote("a.png", "b.png", 1, "expert_a")
    pairs = quality_data.Pairs([vote], lambda name: torch.rand(3), ["expert_a"], seed=3)
    before = torch.get_rng_state()
    first, again = pairs[0], pairs[0]
    assert seeded == []
    assert torch.equal(first[0], again[0]) and not torch.equal(first[0], first[1])
    assert torch.equal(torch.get_rng_state(), before)
