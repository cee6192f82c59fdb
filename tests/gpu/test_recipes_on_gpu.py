"""Every recipe on one GPU: fp32, bf16 and fp16, resume after a kill, the export on the CPU, FSDP.

Each recipe trains STEPS optimizer steps at its small test size (the data fixtures of
tests/conftest.py), once per precision. Tolerances, and why:

- bf16 and fp16 against fp32: the mean training loss of the last two logging windows within
  MIXED_LOSS_TOL (relative). Same seed, data order and noise; only the arithmetic differs, so a
  broken autocast, a scaler that never unscales, or a precision that diverges shows as a
  different loss, while rounding alone moves it by a few percent at most.
- Resume and FSDP against the uninterrupted fp32 run: parameters within GPU_RESUME_TOL
  (relative, per tensor). On a GPU, scatter-adds (the voxel grid, graph messages, embedding
  gradients) sum in a nondeterministic order, so two identical GPU runs already differ in the
  last bits; the CPU suite, which is deterministic, checks bit-identity. A wrong data position,
  RNG state, optimizer state or a missing shard shows as 1e-2 or more.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from accel_common.checkpoint import list_checkpoints
from tests.conftest import (
    BIN,
    REPO,
    exported_params,
    free_port,
    kill_once_written,
    max_relative_difference,
    metrics_log,
    recipe_env,
    run_recipe,
)
from tests.gpu.conftest import RECIPES

STEPS, SAVE_EVERY, KILL_AT = 40, 10, 20
MIXED_LOSS_TOL = 0.10
GPU_RESUME_TOL = 1e-3
COMMON = ["--max-steps", str(STEPS), "--log-every", "5", "--save-every", str(SAVE_EVERY)]
COMMON += ["--keep-last", "5", "--warmup-steps", "5"]


def by_recipe(*names: str):
    """One pytest param per recipe, each recipe's tests on one xdist worker (its fp32 run is
    shared by the tests of that recipe)."""
    return pytest.mark.parametrize(
        "recipe", [pytest.param(n, marks=pytest.mark.xdist_group(n)) for n in names]
    )


ALL = tuple(RECIPES)
_fp32_runs: dict[str, Path] = {}


def recipe_args(recipe: str, request: pytest.FixtureRequest, out: Path, precision: str) -> list:
    _script, data_fixture, flags = RECIPES[recipe]
    data = request.getfixturevalue(data_fixture)
    return ["--data", str(data), "--output-dir", str(out), "--mixed-precision", precision,
            *COMMON, *flags]  # fmt: skip


def train(recipe: str, request: pytest.FixtureRequest, out: Path, precision: str) -> Path:
    script = RECIPES[recipe][0]
    run_recipe(recipe_args(recipe, request, out, precision), cwd=out.parent, script=script)
    return out


def fp32_run(recipe: str, request: pytest.FixtureRequest, tmp_factory) -> Path:
    """The uninterrupted fp32 run of `recipe`, trained once per worker."""
    if recipe not in _fp32_runs:
        _fp32_runs[recipe] = train(recipe, request, tmp_factory.mktemp(recipe) / "fp32", "no")
    return _fp32_runs[recipe]


def final_loss(run: Path) -> float:
    """Mean training loss of the last two logging windows."""
    losses = [r["train/loss"] for r in metrics_log(run) if "train/loss" in r]
    assert len(losses) >= 2 and all(math.isfinite(v) for v in losses), losses
    return sum(losses[-2:]) / 2


def export_metrics(run: Path) -> dict:
    return json.loads((run / "model" / "model.json").read_text())["metrics"]


@by_recipe(*ALL)
def test_mixed_precision_trains_like_fp32(recipe, request, tmp_path_factory, record):
    reference = final_loss(fp32_run(recipe, request, tmp_path_factory))
    numbers = {"fp32_loss": reference}
    for precision in ("bf16", "fp16"):
        run = train(recipe, request, tmp_path_factory.mktemp(recipe) / precision, precision)
        loss = final_loss(run)
        numbers[f"{precision}_loss"] = loss
        numbers[f"{precision}_relative_difference"] = abs(loss - reference) / abs(reference)
        if precision == "fp16":
            scales = [r["train/loss_scale"] for r in metrics_log(run) if "train/loss" in r]
            assert len(scales) == STEPS // 5 and all(s > 0 for s in scales), scales
            skipped = export_metrics(run)["skipped_steps"]
            assert 0 <= skipped < STEPS // 4  # a few overflows while the scale settles
            numbers |= {"fp16_final_scale": scales[-1], "fp16_skipped_steps": skipped}
    record(recipe=recipe, **numbers)
    for precision in ("bf16", "fp16"):
        assert numbers[f"{precision}_relative_difference"] <= MIXED_LOSS_TOL, numbers


@by_recipe(*ALL)
def test_resume_after_a_kill_on_the_gpu(recipe, request, tmp_path_factory, record):
    full = fp32_run(recipe, request, tmp_path_factory)
    killed = tmp_path_factory.mktemp(recipe) / "killed"
    script = RECIPES[recipe][0]
    args = recipe_args(recipe, request, killed, "no")
    marker = killed / "checkpoints" / f"step_{KILL_AT}" / "progress.json"
    kill_once_written(script, args, cwd=killed.parent, marker=marker)
    latest = int(list_checkpoints(killed)[-1].name.removeprefix("step_"))
    assert KILL_AT <= latest < STEPS and not (killed / "model").exists()

    result = run_recipe([*args, "--resume", "latest"], cwd=killed.parent, script=script)
    assert f"resumed from {killed / 'checkpoints' / f'step_{latest}'}" in result.stdout
    difference = max_relative_difference(exported_params(full), exported_params(killed))
    record(recipe=recipe, resumed_from=latest, max_relative_difference=difference)
    assert difference <= GPU_RESUME_TOL


# the one command of each recipe that loads an export on one device, and what it needs
def single_device_command(recipe: str, model: Path, data: Path, tmp: Path) -> list[str]:
    return {
        "template": ["evaluate", "--model", str(model), "--data", str(data)],
        "pointcloud": ["evaluate", "--model", str(model), "--data", str(data),
                       "--sample-steps", "2"],
        "quality": ["score", "--model", str(model), "--images", str(data / "images"),
                    "--out", str(tmp / "scores.csv")],
        "captioning": ["caption", "--model", str(model), "--images", str(data / "test"),
                       "--out", str(tmp / "captions.txt")],
        "crystal": ["predict", "--model", str(model), "--data", str(data / "structures.extxyz"),
                    "--out", str(tmp / "predictions.csv")],
    }[recipe]  # fmt: skip


@by_recipe(*ALL)
def test_the_gpu_export_loads_and_runs_on_the_cpu(recipe, request, tmp_path_factory, tmp_path):
    run = fp32_run(recipe, request, tmp_path_factory)
    tensors = load_file(str(run / "model" / "model.safetensors"), device="cpu")
    assert not [k for k in tensors if k.startswith(("module.", "_orig_mod."))]
    assert all(t.device.type == "cpu" for t in tensors.values())
    script, data_fixture, _ = RECIPES[recipe]
    data = request.getfixturevalue(data_fixture)
    command = single_device_command(recipe, run / "model", data, tmp_path)
    env = {**recipe_env(tmp_path), "CUDA_VISIBLE_DEVICES": ""}  # as on a machine without a GPU
    result = subprocess.run(
        [str(BIN / "python"), str(script), *command],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def fsdp_one_gpu_config(tmp: Path) -> Path:
    """fsdp_8gpu.yaml with only the hardware keys changed: 1 process, fp32, and units small
    enough that the small test models are split into several FSDP units."""
    config = yaml.safe_load((REPO / "accelerate_configs" / "fsdp_8gpu.yaml").read_text())
    config |= {"num_processes": 1, "mixed_precision": "no"}
    config["fsdp_config"]["fsdp_min_num_params"] = 1000
    path = tmp / "fsdp_1gpu.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@by_recipe(*ALL)
def test_fsdp_on_one_gpu_exports_what_the_plain_run_exports(
    recipe, request, tmp_path_factory, record
):
    plain = fp32_run(recipe, request, tmp_path_factory)
    out = tmp_path_factory.mktemp(recipe) / "fsdp"
    script = RECIPES[recipe][0]
    command = [
        str(BIN / "accelerate"), "launch",
        "--config_file", str(fsdp_one_gpu_config(out.parent)),
        "--main_process_port", str(free_port()),
        str(script), *recipe_args(recipe, request, out, "no"),
    ]  # fmt: skip
    result = subprocess.run(
        command, cwd=out.parent, env=recipe_env(out.parent), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FSDP" in result.stdout + result.stderr  # the banner names the distributed type
    difference = max_relative_difference(exported_params(plain), exported_params(out))
    record(recipe=recipe, fsdp_max_relative_difference=difference)
    assert difference <= GPU_RESUME_TOL
