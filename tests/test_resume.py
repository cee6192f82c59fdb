"""A run killed with SIGKILL and resumed ends exactly where the uninterrupted run ends."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from accel_common.checkpoint import list_checkpoints
from tests.conftest import (
    CAPTIONING,
    CAPTIONING_TINY,
    CRICKET,
    CRICKET_TINY,
    CRYSTAL,
    CRYSTAL_TINY,
    POINTCLOUD,
    POINTCLOUD_TINY,
    QUALITY,
    TEMPLATE,
    exported_params,
    launch_command,
    metrics_log,
    recipe_env,
    run_recipe,
)

pytestmark = pytest.mark.slow

CASES = {
    # 64 steps per epoch at --bs 32: killed 16 steps into the second epoch
    "template": (TEMPLATE, "template_data", 80, 192, ["--bs", "32", "--epochs", "3"]),
    # 15 steps per epoch (120 samples, --bs 8): killed 5 steps into the second epoch; the EMA of
    # the weights (the export) is restored too
    "pointcloud": (POINTCLOUD, "pointcloud_data", 20, 45, ["--epochs", "3", "--ema-decay", "0.9"]),
    # 63 steps per epoch (2040 training comparisons, --batch-size 32), cut to 84 steps: killed 7
    # steps into the second epoch; dropout stays on, so the restored RNG state is tested too
    "quality": (QUALITY, "quality_data", 70, 84, ["--epochs", "2", "--max-steps", "84"]),
    # 50 micro-batches of 16 per epoch (800 images), 4 per optimizer step, so windows run across
    # epoch ends: 37 steps in 3 epochs, killed 3 steps into the second epoch
    "captioning": (CAPTIONING, "captioning_data", 15, 37, ["--epochs", "3"]),
    # 12 steps per epoch (800 training structures, --bs 64): killed 3 steps into the second
    "crystal": (CRYSTAL, "crystal_data", 15, 36, ["--epochs", "3"]),
    # every 8th delivery of 100 matches: about 2,300 training graphs, ~36 steps at --bs 64,
    # cut to 20 steps (one evaluation, so the exported best epoch is the final model): killed
    # 15 steps into the epoch; dropout stays on
    "cricket": (CRICKET, "cricket_data", 15, 20, ["--epochs", "1", "--max-steps", "20"]),
}
SMALL = {
    "template": ["--hidden", "256", "--depth", "3"],
    "pointcloud": POINTCLOUD_TINY,
    "quality": [],
    "captioning": CAPTIONING_TINY,
    "crystal": CRYSTAL_TINY,
    "cricket": [*CRICKET_TINY, "--sample-every", "8"],
}


@pytest.mark.parametrize("recipe", CASES)
def test_sigkill_mid_epoch_then_resume_matches_uninterrupted_run(recipe, tmp_path, request):
    script, data_fixture, kill_at, total_steps, flags = CASES[recipe]
    data = request.getfixturevalue(data_fixture)
    args = ["--data", str(data), "--save-every", "5", "--keep-last", "3", *flags, *SMALL[recipe]]
    full = tmp_path / "full"
    run_recipe([*args, "--output-dir", str(full)], cwd=tmp_path, script=script)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        launch_command(script, [*args, "--output-dir", str(killed)], nproc=1),
        cwd=tmp_path,
        env=recipe_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    marker = killed / "checkpoints" / f"step_{kill_at}" / "progress.json"
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert proc.poll() is None, "the run ended before the test could kill it"
        assert time.monotonic() < deadline, "no checkpoint appeared in time"
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    latest = int(list_checkpoints(killed)[-1].name.removeprefix("step_"))
    assert kill_at <= latest < total_steps
    assert not (killed / "model").exists()  # it really died before finishing

    resume = [*args, "--output-dir", str(killed), "--resume", "latest"]
    result = run_recipe(resume, cwd=tmp_path, script=script)
    assert f"resumed from {killed / 'checkpoints' / f'step_{latest}'}" in result.stdout
    expected, resumed = exported_params(full), exported_params(killed)
    assert expected.keys() == resumed.keys()
    for key in expected:
        assert (expected[key] == resumed[key]).all(), key  # bit-identical on the same machine
    # the same test metrics; the mean training loss since the last evaluation is not
    # checkpointed, so after a resume it covers only the steps since the resume
    final = [
        {k: v for k, v in record.items() if k not in ("time", "eval/train_loss")}
        for record in (
            [r for r in metrics_log(run) if "eval/train_loss" in r][-1] for run in (full, killed)
        )
    ]
    assert final[0]["step"] == total_steps
    assert final[0] == final[1]
