"""Real 2-process (gloo) runs of the template: scaling must not change the math.

The runs cross an epoch boundary (16 steps per epoch at global batch 128), where a reshuffle
that depended on the process count would show.

Tolerance: both runs compute the same per-sample gradients; only the order of floating-point sums
differs (one batch of 128 vs two all-reduced halves of 64), which perturbs each step by ~1e-7
relative. Over 24 AdamW steps that stays far below the 1e-5 relative bound used here, while any
real difference (a wrong batch split, a missing gradient average, a scheduler stepped twice)
shows up at 1e-2 or more.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.processes import REPO, run_recipe
from tests.results import exported_params, max_relative_difference, metrics_log

pytestmark = pytest.mark.dist

STEPS = 24
COMMON = ["--epochs", "2", "--max-steps", str(STEPS), "--log-every", "1", "--warmup-steps", "5"]
TOLERANCE = 1e-5


def train(tmp: Path, data: Path, name: str, extra: list[str], nproc: int = 1) -> Path:
    out = tmp / name
    run_recipe(
        ["--data", str(data), "--output-dir", str(out), *COMMON, *extra], cwd=tmp, nproc=nproc
    )
    return out


def per_step(log: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in log if key in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, template_data) -> Path:
    """One process, global batch 128, no accumulation."""
    return train(tmp_path_factory.mktemp("ref"), template_data, "ref", ["--bs", "128"])


@pytest.fixture(scope="module")
def two_process(tmp_path_factory, template_data) -> Path:
    """Two processes at the same global batch, with every tracker on and periodic saves."""
    extra = ["--bs", "128", "--report-to", "all", "--save-every", "8", "--keep-last", "5"]
    return train(tmp_path_factory.mktemp("ddp"), template_data, "ddp", extra, nproc=2)


def test_two_processes_end_with_the_same_parameters(reference, two_process):
    assert metrics_log(two_process)[0]["config"]["num_processes"] == 2
    diff = max_relative_difference(exported_params(reference), exported_params(two_process))
    assert diff <= TOLERANCE


def test_lr_is_the_same_at_every_step(reference, two_process):
    single, double = (
        per_step(metrics_log(reference), "train/lr"),
        per_step(metrics_log(two_process), "train/lr"),
    )
    assert sorted(single) == list(range(1, STEPS + 1))
    assert single == pytest.approx(double, rel=1e-12)
    assert single[1] < single[5]  # warmup really happened, on both


def test_two_processes_with_accumulation_match(tmp_path, template_data, reference):
    out = train(tmp_path, template_data, "ddp-accum", ["--bs", "128", "--grad-accum", "2"], nproc=2)
    assert max_relative_difference(exported_params(reference), exported_params(out)) <= TOLERANCE


def test_accumulating_k_micro_batches_equals_one_big_batch(tmp_path, template_data, reference):
    out = train(tmp_path, template_data, "accum", ["--per-device-bs", "32", "--grad-accum", "4"])
    plan = metrics_log(out)[0]["config"]
    assert (plan["per_device_batch_size"], plan["grad_accum_steps"]) == (32, 4)
    assert max_relative_difference(exported_params(reference), exported_params(out)) <= TOLERANCE


def test_only_the_main_process_writes(two_process):
    wandb_runs = list((two_process / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 1, wandb_runs
    # tensorboard names files events.out.tfevents.<time>.<host>.<pid>.<n>: one writer process
    event_files = list(two_process.rglob("events.out.tfevents.*"))
    assert event_files and len({f.name.split(".")[-2] for f in event_files}) == 1, event_files
    log = metrics_log(two_process)
    steps = [r["step"] for r in log if "train/loss" in r]
    assert steps == sorted(set(steps)) == list(range(1, STEPS + 1))  # one line per step, not two
    checkpoints = sorted((two_process / "checkpoints").iterdir())
    assert [c.name for c in checkpoints] == ["step_16", "step_24", "step_8"]
    for checkpoint in checkpoints:
        assert len(list(checkpoint.glob("model*.safetensors"))) == 1
        # each rank contributes only its own RNG state, needed for an exact resume
        assert sorted(p.name for p in checkpoint.glob("random_states_*")) == [
            "random_states_0.pkl",
            "random_states_1.pkl",
        ]
    assert sorted(p.name for p in (two_process / "model").iterdir()) == [
        "README.md",
        "model.json",
        "model.safetensors",
    ]


def test_gathered_metrics_count_each_test_row_once(two_process):
    evals = [r for r in metrics_log(two_process) if "eval/n" in r]
    assert evals and all(r["eval/n"] == 301 for r in evals)  # 301 rows over 2 processes


def test_dropout_draws_a_stream_per_process_and_a_resume_continues_each(tmp_path):
    """tests/scripts/dropout_streams.py on 2 processes: the weights start alike and stay alike,
    but each process draws its own dropout masks (seeded alike, both drew the same masks for
    their halves of the batch); --one-rng-stream keeps them alike. Stopped after the save of
    step 2 and resumed, each process continues its own stream: bit-equal masks and weights,
    and the loader's global-RNG jitter too, although Accelerate had fetched batch 3 (and drawn
    its jitter) before step 2 was saved: without the state noted before that fetch, the resumed
    run drew it one batch late."""
    script = REPO / "tests" / "scripts" / "dropout_streams.py"

    def ranks(name: str, *args: str) -> list[dict]:
        run_recipe([str(tmp_path / name), *args], cwd=tmp_path, nproc=2, script=script)
        return [json.loads((tmp_path / name / f"rank_{r}.json").read_text()) for r in (0, 1)]

    full = ranks("full", "0", "0", "0")
    assert full[0]["step"] == 8 and len(full[0]["masks"]) == 8
    assert all(a != b for a, b in zip(full[0]["masks"], full[1]["masks"], strict=True))
    assert full[0]["weights"] == full[1]["weights"]
    one = ranks("one", "1", "0", "0")
    assert one[0]["masks"] == one[1]["masks"]

    cut = ranks("cut", "0", "2", "0")
    assert [r["masks"] for r in cut] == [r["masks"][:3] for r in full]  # stopped in step 3
    resumed = ranks("cut", "0", "0", "1")
    per_batch = 4  # items per process and micro-batch: 4 draws each
    for rank in (0, 1):
        assert resumed[rank]["masks"] == full[rank]["masks"][2:]
        assert resumed[rank]["draws"] == full[rank]["draws"][2 * per_batch :]
        assert resumed[rank]["weights"] == full[rank]["weights"]


def test_augmentation_drawn_per_sample_keeps_two_processes_equal_to_one(tmp_path, template_data):
    """The template's --jitter draws each row's noise inside per_sample_rng (seeded by the run's
    seed, the epoch and the row): 2 processes at the same global batch end where 1 does, as
    without augmentation, and the noise really changed the run."""
    jitter = ["--bs", "128", "--jitter", "0.3"]
    one = train(tmp_path, template_data, "one", jitter)
    two = train(tmp_path, template_data, "two", jitter, nproc=2)
    plain = train(tmp_path, template_data, "plain", ["--bs", "128"])
    assert max_relative_difference(exported_params(one), exported_params(two)) <= TOLERANCE
    assert max_relative_difference(exported_params(one), exported_params(plain)) > 1e-3


def test_sync_batchnorm_makes_two_processes_one_on_the_whole_batch(tmp_path):
    """tests/scripts/batchnorm_streams.py (a CNN with BatchNorm2d, global batch 8): without the
    conversion, 2 processes normalise 4 samples each and end elsewhere than 1 process on 8;
    with --sync-batchnorm's conversion (GlobalBatchNorm on the CPU) they end where it does."""
    script = REPO / "tests" / "scripts" / "batchnorm_streams.py"

    def run(name: str, sync: str, nproc: int) -> dict:
        run_recipe([str(tmp_path / name), sync], cwd=tmp_path, nproc=nproc, script=script)
        return exported_params(tmp_path / name)

    one, two = run("one", "1", 1), run("two", "1", 2)
    assert max_relative_difference(one, two) <= TOLERANCE
    plain_two = run("plain-two", "0", 2)
    assert max_relative_difference(one, plain_two) > 1e-3
