"""A NaN loss on ONE of two processes is seen by both at the same optimizer step.

tests/scripts/nan_injection.py runs the template recipe with a NaN loss on rank 1 at step 6, and
reports what each rank did. --log-every is far above the run's length, so detection cannot lean on a
logged (reduced) loss: it is the loop's per-step flag.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from accel_common.checkpoints.checkpoint import list_checkpoints
from tests.processes import REPO, launch_command, recipe_env
from tests.results import exported_params, metrics_log

pytestmark = pytest.mark.dist

SCRIPT = REPO / "tests" / "scripts" / "nan_injection.py"
NAN_STEP = 6
COMMON = ["--bs", "32", "--max-steps", "12", "--save-every", "5", "--log-every", "1000"]


def run_injected(tmp: Path, data: Path, *flags: str) -> tuple[subprocess.CompletedProcess, list]:
    out, reports = tmp / "out", tmp / "reports"
    reports.mkdir()
    args = ["--data", str(data), "--output-dir", str(out), *COMMON, *flags]
    env = {**recipe_env(tmp), "NAN_RANK": "1", "NAN_STEP": str(NAN_STEP)}
    env["NAN_REPORT"] = str(reports)
    result = subprocess.run(
        launch_command(SCRIPT, args, nproc=2), cwd=tmp, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    ranks = [json.loads((reports / f"rank_{r}.json").read_text()) for r in (0, 1)]
    return result, ranks


def test_stop_names_the_step_and_the_last_good_checkpoint_on_every_rank(tmp_path, template_data):
    result, ranks = run_injected(tmp_path, template_data)
    assert result.returncode != 0
    out = tmp_path / "out"
    expected = (
        f"error: the training loss went non-finite (nan) on process 1 at optimizer step "
        f"{NAN_STEP}; stopped without saving or exporting. The last good checkpoint is "
        f"{out / 'checkpoints' / 'step_5'}"
    )
    assert expected in result.stderr
    # both ranks stopped after the same forward pass: rank 0 did not go on to step 7
    assert [r["forward"] for r in ranks] == [NAN_STEP, NAN_STEP]
    assert [p.name for p in list_checkpoints(out)] == ["step_5"]
    assert not (out / "model").exists()


def test_skip_skips_that_step_on_every_rank_and_counts_it(tmp_path, template_data):
    result, ranks = run_injected(tmp_path, template_data, "--on-nonfinite", "skip")
    assert result.returncode == 0, result.stderr
    assert f"optimizer step {NAN_STEP}: non-finite loss or gradients on some process" in (
        result.stdout + result.stderr
    )
    # every rank ran 12 steps, took 11 updates, and holds the same weights
    assert [(r["forward"], r["updates"]) for r in ranks] == [(12, 11), (12, 11)]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
    out = tmp_path / "out"
    logged = [r for r in metrics_log(out) if "train/nonfinite_skipped" in r]
    assert [(r["step"], r["train/nonfinite_skipped"]) for r in logged] == [(NAN_STEP, 1)]
    meta = json.loads((out / "model" / "model.json").read_text())
    assert meta["metrics"]["nonfinite_skipped"] == 1
    assert all(math.isfinite(v) for t in exported_params(out).values() for v in t.flatten())
