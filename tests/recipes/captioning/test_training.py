"""The captioning recipe trained: it learns in fp32 and bf16, captions images, 2 processes with
accumulation equal 1 process over varying caption lengths, fp16 overflows are skipped steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import recipes.train_captioning as recipe
from accel_common.errors import ConfigError
from recipes.captioning.data import read_split
from tests.processes import CAPTIONING, CAPTIONING_TINY, run_recipe
from tests.results import exported_params, max_relative_difference, metrics_log
from tests.scaler_check import check_overflow_is_skipped_and_resumes


@pytest.fixture(scope="module")
def trained(captioning_data, tmp_path_factory) -> Path:
    """The example at its defaults, fp32 (about 35 s of training on one thread)."""
    tmp = tmp_path_factory.mktemp("caption-run")
    args = ["--data", str(captioning_data), "--output-dir", str(tmp / "run")]
    run_recipe([*args, "--mixed-precision", "no"], cwd=tmp, script=CAPTIONING)
    return tmp / "run"


@pytest.mark.slow
def test_learns_to_caption_from_pixels(trained):
    metrics = json.loads((trained / "model" / "model.json").read_text())["metrics"]
    assert metrics["n"] == 100
    assert metrics["token_accuracy"] > metrics["baseline_majority_token_accuracy"] + 0.5, metrics
    assert metrics["cross_entropy"] < 0.3 * metrics["baseline_uniform_cross_entropy"], metrics
    assert metrics["exact_caption_share"] > 0.5, metrics


@pytest.mark.slow
def test_bf16_on_the_cpu_learns(captioning_data, tmp_path):
    """3 epochs only: a CPU without bf16 instructions (this project's CI machine) emulates bf16
    matrix products, about 3.5x slower than fp32 (docs/recipes/captioning.md). 37 optimizer steps
    already put token accuracy far above the majority baseline (about 0.63 against 0.165)."""
    args = ["--data", str(captioning_data), "--output-dir", str(tmp_path / "run"), "--epochs", "3"]
    run_recipe([*args, "--mixed-precision", "bf16"], cwd=tmp_path, script=CAPTIONING)
    metrics = json.loads((tmp_path / "run" / "model" / "model.json").read_text())["metrics"]
    assert metrics["token_accuracy"] > metrics["baseline_majority_token_accuracy"] + 0.3, metrics
    assert metrics["cross_entropy"] < 0.6 * metrics["baseline_uniform_cross_entropy"], metrics
    assert metrics_log(tmp_path / "run")[0]["config"]["mixed_precision"] == "bf16"


@pytest.mark.slow
def test_caption_command_writes_one_line_per_image(trained, captioning_data, tmp_path):
    out = tmp_path / "captions.tsv"
    args = ["caption", "--model", str(trained / "model"), "--images", str(captioning_data / "test")]
    run_recipe([*args, "--out", str(out)], cwd=tmp_path, script=CAPTIONING)
    written = dict(line.split("\t") for line in out.read_text().splitlines())
    truth = dict(read_split(captioning_data, "test")[1])
    assert written.keys() == truth.keys()
    assert sum(written[name] == truth[name] for name in truth) > 50  # most are exactly right
    again = run_recipe([*args, "--out", str(out)], cwd=tmp_path, script=CAPTIONING, check=False)
    assert again.returncode == 2 and "exists" in again.stderr
    # in chunks of 7 and at most 3 tokens ([BOS] and two words): the first two words of each
    short = tmp_path / "short.tsv"
    model, images = trained / "model", captioning_data / "test"
    recipe.caption(model, images, short, max_tokens=3, bs=7)
    cut = dict(line.split("\t") for line in short.read_text().splitlines())
    assert cut == {name: " ".join(text.split()[:2]) for name, text in written.items()}
    with pytest.raises(ConfigError, match="--max-tokens 99: the model was trained for at most"):
        recipe.caption(model, images, tmp_path / "long.tsv", max_tokens=99, bs=7)


@pytest.mark.dist
def test_two_processes_with_accumulation_equal_one_process_over_varying_caption_lengths(
    captioning_data, tmp_path
):
    """Captions hold 6 to 10 tokens, so a per-micro-batch mean would weigh tokens unequally;
    the global token mean makes 2 processes x 2 micro-batches equal 1 process (fp32, 20 steps;
    1e-5 leaves room for the order of floating-point sums only)."""
    base = ["--data", str(captioning_data), *CAPTIONING_TINY, "--bs", "16", "--max-steps", "20"]
    base += ["--log-every", "1", "--mixed-precision", "no"]
    one, two = tmp_path / "one", tmp_path / "two"
    run_recipe(
        [*base, "--grad-accum", "1", "--output-dir", str(one)], cwd=tmp_path, script=CAPTIONING
    )
    run_recipe(
        [*base, "--grad-accum", "2", "--output-dir", str(two)],
        cwd=tmp_path,
        script=CAPTIONING,
        nproc=2,
    )
    assert metrics_log(two)[0]["config"]["num_processes"] == 2
    assert max_relative_difference(exported_params(one), exported_params(two)) <= 1e-5
    # the captions were balanced by token count over the 2 x 2 micro-batches of every step: no
    # process's tokens more than the longest caption (10 of ~64 per slot) above the mean
    imbalances = [
        r["train/rank_imbalance"] for r in metrics_log(two) if "train/rank_imbalance" in r
    ]
    assert len(imbalances) == 20 and all(1 <= i <= 1 + 10 / 48 for i in imbalances)
    final = [
        json.loads((run / "model" / "model.json").read_text())["metrics"] for run in (one, two)
    ]
    assert final[0]["token_accuracy"] == pytest.approx(final[1]["token_accuracy"], abs=1e-9)


def test_an_overflow_is_a_skipped_step_that_leaves_the_weights_and_survives_resume(tmp_path):
    """On the CPU through the stand-in scaler; tests/gpu runs the same check on CUDA's fp16."""
    check_overflow_is_skipped_and_resumes(tmp_path, gpu=False)
