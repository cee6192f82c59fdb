"""A run killed with SIGKILL and resumed ends exactly where the uninterrupted run ends."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from accel_common.checkpoint import list_checkpoints
from tests.conftest import (
    TEMPLATE,
    exported_params,
    launch_command,
    metrics_log,
    recipe_env,
    run_recipe,
)

KILL_AT_STEP = 80  # 16 steps into the second epoch (64 steps per epoch at --bs 32)
TOTAL_STEPS = 192


def test_sigkill_mid_epoch_then_resume_matches_uninterrupted_run(tmp_path, template_data):
    args = ["--data", str(template_data), "--bs", "32", "--epochs", "3", "--save-every", "10"]
    args += ["--hidden", "256", "--depth", "3", "--keep-last", "3"]
    full = tmp_path / "full"
    run_recipe([*args, "--output-dir", str(full)], cwd=tmp_path)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        launch_command(TEMPLATE, [*args, "--output-dir", str(killed)], nproc=1),
        cwd=tmp_path,
        env=recipe_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    marker = killed / "checkpoints" / f"step_{KILL_AT_STEP}" / "progress.json"
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert proc.poll() is None, "the run ended before the test could kill it"
        assert time.monotonic() < deadline, "no checkpoint appeared in time"
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    latest = int(list_checkpoints(killed)[-1].name.removeprefix("step_"))
    assert KILL_AT_STEP <= latest < TOTAL_STEPS
    assert not (killed / "model").exists()  # it really died before finishing

    result = run_recipe([*args, "--output-dir", str(killed), "--resume", "latest"], cwd=tmp_path)
    assert f"resumed from {killed / 'checkpoints' / f'step_{latest}'}" in result.stdout
    expected, resumed = exported_params(full), exported_params(killed)
    assert expected.keys() == resumed.keys()
    for key in expected:
        assert (expected[key] == resumed[key]).all(), key  # bit-identical on the same machine
    final_eval = [
        [r for r in metrics_log(run) if "eval/test_mse" in r][-1] for run in (full, killed)
    ]
    assert final_eval[0]["step"] == final_eval[1]["step"] == TOTAL_STEPS
    assert final_eval[0]["eval/test_mse"] == final_eval[1]["eval/test_mse"]
