"""Sharded training: the FSDP/DeepSpeed configs, exports under FSDP, merging sharded checkpoints.

What runs here, on 2 CPU processes over gloo:

- Accelerate 1.15 turns FSDP on only with an accelerator: `AcceleratorState` enters its FSDP
  branch only for MULTI_GPU-like distributed types, and a CPU launch is MULTI_CPU, so an FSDP
  config on the CPU silently trains as DDP (no error). The recipes now refuse that launch
  (`require_requested_sharding`), which a test below checks.
- PyTorch's FSDP2 (`fully_shard`) and DCP do run on CPU/gloo. The end-to-end tests therefore launch
  the unchanged template recipe through a short wrapper that sets Accelerate's state to FSDP
  after it has been built on the CPU (what `accelerate launch` does on GPUs); everything after
  that is Accelerate's real FSDP2 code: `prepare` (fully_shard with the config's wrap policy),
  clipping, `save_state` with SHARDED_STATE_DICT (DCP shards), `load_state`, `get_state_dict`.
  The config it launches with is fsdp_8gpu.yaml itself, with only the hardware keys changed.
- DeepSpeed is not installed here and needs a GPU: its configs are checked as far as Accelerate
  turns them into DeepSpeed settings, without DeepSpeed.

Tolerance against DDP: FSDP2 reduce-scatters gradients where DDP all-reduces them, so the order
of the floating-point sums can differ (~1e-7 relative per step). Over 8 AdamW steps that stays
far below 1e-5, the bound test_distributed uses for 1 vs 2 processes; a wrong shard, a gradient
missing its average, or a rank-local export would differ by 1e-2 or more.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DeepSpeedPlugin
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env
from safetensors.torch import load_file
from typer.testing import CliRunner

from accel_common.checkpoints.export import load_exported
from accel_common.conversion.convert import convert_checkpoint
from accel_common.errors import CheckpointError
from accel_common.hardware.launch_guard import sharding_refusal
from accel_common.tools.check.recipe import discovered, find_recipe
from accel_common.tools.check.session import FSDP_SHIM, fsdp_cpu_config
from accel_common.tools.cli import app
from tests.processes import (
    ACCELERATE_LAUNCH,
    REPO,
    TEMPLATE,
    free_port,
    recipe_env,
    run_recipe,
)
from tests.results import exported_params, max_relative_difference, metrics_log

CONFIGS = REPO / "accelerate_configs"
SHARDED_CONFIGS = sorted(CONFIGS.glob("fsdp_*.yaml")) + sorted(CONFIGS.glob("deepspeed_*.yaml"))
STEPS = 8
COMMON = ["--bs", "128", "--max-steps", str(STEPS), "--warmup-steps", "2", "--save-every", "4"]
COMMON += ["--keep-last", "5", "--clip-grad", "0.5", "--log-every", "1"]
TOLERANCE = 1e-5
# every recipe's own model, 4 AdamW steps: cricket's HeteroConv attention measured 1.1e-5 (Intel
# CI, 4 samples a process) and 1.85e-5 (AMD EPYC, 8 a process) against DDP; a wrong shard or a
# gradient missing its average is 1e-2 or more, so 1e-4 keeps a 100x margin on both sides
RECIPE_TOLERANCE = 1e-4
# DCP warns that it saves/loads in one process when no process group exists: here on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def template_module():
    return importlib.import_module("recipes.train_template")


def launch_fsdp(
    tmp: Path,
    args: list[str],
    *,
    wrapped: bool = True,
    recipe: Path = TEMPLATE,
    min_num_params: int = 1000,
) -> subprocess.CompletedProcess:
    """`recipe` under the CPU FSDP config; `wrapped` runs it through the library's shim that
    enables FSDP on the CPU (accel_common/tools/check/fsdp_on_cpu.py)."""
    script = [str(FSDP_SHIM), str(recipe)] if wrapped else [str(recipe)]
    command = [
        *ACCELERATE_LAUNCH,
        "--config_file", str(fsdp_cpu_config(tmp, min_num_params)),
        "--main_process_ip", "127.0.0.1",
        "--main_process_port", str(free_port()),
        *script, *args,
    ]  # fmt: skip
    return subprocess.run(
        command, cwd=tmp, env=recipe_env(tmp), capture_output=True, text=True, timeout=240
    )


def checked(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    return result


# --------------------------------------------------------------------------- configs


def launch_args(config: Path):
    """What `accelerate launch --config_file CONFIG` makes of the file (its own parser)."""
    args = launch_command_parser().parse_args(["--config_file", str(config), "train.py"])
    return _validate_launch_command(args)[0]


@pytest.mark.parametrize("config", SHARDED_CONFIGS, ids=lambda p: p.name)
def test_config_starts_with_its_command_and_has_no_unknown_keys(config):
    lines = config.read_text().splitlines()
    command = next(line for line in lines if "accelerate launch" in line)
    assert lines[0].startswith("#") and command.startswith("#")
    assert f"--config_file accelerate_configs/{config.name} recipes/train_" in command
    assert any("Pick it when" in line for line in lines if line.startswith("#"))
    # Accelerate copies fsdp_config / deepspeed_config entries onto its launch arguments and
    # silently ignores any it does not know, so a misspelt key would never take effect.
    known = {action.dest for action in launch_command_parser()._actions}
    section = yaml.safe_load(config.read_text()).get("fsdp_config") or yaml.safe_load(
        config.read_text()
    ).get("deepspeed_config")
    assert section and set(section) <= known, set(section) - known


def test_fsdp_config_is_fsdp2_with_sharded_checkpoints():
    env = prepare_multi_gpu_env(launch_args(CONFIGS / "fsdp_8gpu.yaml"))
    assert env["ACCELERATE_USE_FSDP"] == "true"
    assert env["FSDP_VERSION"] == "2"
    assert env["FSDP_STATE_DICT_TYPE"] == "SHARDED_STATE_DICT"
    assert env["FSDP_AUTO_WRAP_POLICY"] == "SIZE_BASED_WRAP"


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_configs_become_the_intended_deepspeed_settings(stage, monkeypatch):
    args = launch_args(CONFIGS / f"deepspeed_zero{stage}_8gpu.yaml")
    args.deepspeed_fields_from_accelerate_config = ""  # what launch_command sets before this call
    _, env = prepare_deepspeed_cmd_env(args)
    for key, value in env.items():
        if key.startswith("ACCELERATE_"):
            monkeypatch.setenv(key, value)
    ds = DeepSpeedPlugin().deepspeed_config
    assert ds["zero_optimization"]["stage"] == stage
    # "auto": filled from the recipe's batch plan when the model is prepared
    assert ds["gradient_accumulation_steps"] == ds["train_micro_batch_size_per_gpu"] == "auto"
    # no key (Accelerate 1.15) or 0.0 (1.16 writes the config's value): DeepSpeed clips only
    # above 0; never "auto", which would become 1.0 at prepare
    assert ds.get("gradient_clipping", 0.0) == 0.0
    # ZeRO-3 can export only if the shards are gathered in 16 bit on save
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] == (stage == 3)


# --------------------------------------------------------------------------- FSDP end to end


@pytest.fixture(scope="module")
def ddp(tmp_path_factory, template_data) -> Path:
    """The reference: plain 2-process DDP, same seed and global batch."""
    tmp = tmp_path_factory.mktemp("ddp")
    run_recipe(["--data", str(template_data), "--output-dir", "out", *COMMON], cwd=tmp, nproc=2)
    return tmp / "out"


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory, template_data) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("fsdp")
    result = checked(
        launch_fsdp(tmp, ["--data", str(template_data), "--output-dir", "out", *COMMON])
    )
    return tmp / "out", result.stdout


@pytest.mark.dist
def test_fsdp_run_is_sharded(fsdp):
    out, stdout = fsdp
    assert any(line.split()[:2] == ["distributed", "FSDP"] for line in stdout.splitlines())
    for step in (4, STEPS):
        checkpoint = out / "checkpoints" / f"step_{step}"
        shards = sorted(p.name for p in (checkpoint / "pytorch_model_fsdp_0").glob("*.distcp"))
        assert shards == ["__0_0.distcp", "__1_0.distcp"]  # one per rank, no gathered copy
        assert not (checkpoint / "model.safetensors").exists()


@pytest.mark.dist
def test_fsdp_export_is_the_full_model_and_matches_ddp(fsdp, ddp, template_data):
    recipe = template_module()
    test_set = recipe.load_split(template_data, "test")
    outputs = {}
    for name, out in (("fsdp", fsdp[0]), ("ddp", ddp)):
        model = recipe.MLPRegressor(test_set.tensors[0].shape[1], 64, 2)
        meta = load_exported(out / "model", model)  # strict: every key, every full shape
        assert meta["step"] == STEPS
        with torch.no_grad():
            outputs[name] = model(test_set.tensors[0])
    assert max_relative_difference(exported_params(ddp), exported_params(fsdp[0])) <= TOLERANCE
    difference = (outputs["fsdp"] - outputs["ddp"]).norm() / outputs["ddp"].norm()
    assert difference <= TOLERANCE


@pytest.mark.dist
def test_fsdp_clips_by_the_global_gradient_norm(fsdp, ddp):
    """A norm over one rank's shard only would be about 1/sqrt(2) of DDP's and clip differently."""
    norms = {}
    for name, out in (("fsdp", fsdp[0]), ("ddp", ddp)):
        norms[name] = [r["train/grad_norm"] for r in metrics_log(out) if "train/grad_norm" in r]
    assert len(norms["ddp"]) == STEPS and len(norms["fsdp"]) == STEPS
    assert max(norms["ddp"]) > 0.5  # clipping at 0.5 did engage
    for ours, reference in zip(norms["fsdp"], norms["ddp"], strict=True):
        assert abs(ours - reference) <= TOLERANCE * reference


@pytest.mark.dist
def test_convert_merges_the_sharded_checkpoint_into_the_export(fsdp, tmp_path):
    out, _ = fsdp
    result = CliRunner().invoke(
        app, ["convert", str(out / "checkpoints" / f"step_{STEPS}"), str(tmp_path / "merged")]
    )
    assert result.exit_code == 0, result.output
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    exported = exported_params(out)
    assert merged.keys() == exported.keys()
    for key in exported:
        assert torch.equal(merged[key], exported[key]), key


@pytest.mark.dist
def test_resume_from_a_sharded_checkpoint_ends_where_the_full_run_ends(fsdp, template_data):
    out, _ = fsdp
    tmp = out.parent
    resume = ["--resume", str(out / "checkpoints" / "step_4")]
    args = ["--data", str(template_data), "--output-dir", "resumed", *COMMON, *resume]
    checked(launch_fsdp(tmp, args))
    resumed, full = exported_params(tmp / "resumed"), exported_params(out)
    for key in full:
        assert torch.equal(resumed[key], full[key]), key


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("name", discovered())
def test_every_recipe_under_fsdp_exports_what_it_exports_under_ddp(name, check_example, tmp_path):
    """Every recipe there is (recipes/train_*.py), at the size it declares for `accel-recipes
    check` (CHECK_ARGS on its CHECK_DATA example) but 8 samples a process (at CHECK_ARGS's 4,
    cricket's runs differed by 1.1e-5, over this test's fixed bound): 4 optimizer steps, then its
    evaluation (a forward under FSDP is a collective: captioning's greedy decoding must run as
    many on every process) and the export. At fsdp_min_num_params 1000 each model splits into
    several units, among them the blocks of a ModuleList / ModuleDict, which Accelerate's size
    policy alone would make units of too (and fully_shard refuse: accel_common.hardware.sharding).
    The tensors the recipe declares rounding noise (CHECK_NOISE) are left out, as `check` does."""
    recipe = find_recipe(name)
    args = ["--data", str(check_example(name)), *recipe.args, "--bs", "16", "--max-steps", "4"]
    args += ["--log-every", "1"]
    run_recipe([*args, "--output-dir", "ddp"], cwd=tmp_path, nproc=2, script=recipe.script)
    result = checked(launch_fsdp(tmp_path, [*args, "--output-dir", "fsdp"], recipe=recipe.script))
    units = [line for line in result.stdout.splitlines() if line.startswith("fsdp unit: ")]
    assert len(units) >= 3, result.stdout  # the root and at least two blocks of its own
    assert not [u for u in units if u.endswith(("ModuleList", "ModuleDict"))], units
    ddp, fsdp = (
        {k: v for k, v in exported_params(tmp_path / run).items() if not k.endswith(recipe.noise)}
        for run in ("ddp", "fsdp")
    )
    assert max_relative_difference(ddp, fsdp) <= RECIPE_TOLERANCE


@pytest.mark.slow
def test_fsdp_config_on_cpu_is_refused_not_silently_unsharded(tmp_path, template_data):
    args = ["--data", str(template_data), "--output-dir", "out", "--max-steps", "1"]
    result = launch_fsdp(tmp_path, args, wrapped=False)
    assert result.returncode != 0
    assert "asks for FSDP" in result.stderr and "MULTI_CPU" in result.stderr, result.stderr
    assert not (tmp_path / "out" / "model").exists()


def test_fsdp_on_the_cpu_is_refused_by_the_dry_run_and_the_doctor_in_the_runs_words(
    tmp_path, template_data
):
    """The run refuses it (above); its dry run and the doctor used to plan it and find "No
    problems": all three now say the launch guard's one line."""
    message, advice = sharding_refusal("FSDP", "MULTI_CPU")
    # what `accelerate launch` with an FSDP config gives the first of 2 workers
    env = {**recipe_env(tmp_path), "ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2", "RANK": "0"}
    command = [sys.executable, str(TEMPLATE), "--data", str(template_data), "--cpu", "--dry-run"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 2, result.stdout
    assert result.stderr.splitlines() == [f"error: {message}; {advice}"]
    assert "dry run" not in result.stdout
    config = fsdp_cpu_config(tmp_path)
    doctor = CliRunner().invoke(app, ["doctor", "--json", "--config-file", str(config)])
    assert doctor.exit_code == 1, doctor.output
    problems = json.loads(doctor.stdout)["problems"]
    assert {"severity": "blocker", "message": message, "advice": advice} in problems


# --------------------------------------------------------------------------- DCP folders


def dcp_folder(tmp_path: Path, state: dict) -> Path:
    """A DCP folder laid out as Accelerate writes one (weights under the key "model")."""
    folder = tmp_path / "step" / "pytorch_model_fsdp_0"
    dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    return folder


def reference_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return {k: v.to(torch.bfloat16) if "bias" in k else v for k, v in net.state_dict().items()}


@pytest.mark.parametrize("which", ["save_state folder", "DCP folder"])
def test_dcp_folder_converts_with_dtypes_and_clean_keys(tmp_path, which):
    expected = reference_state()
    folder = dcp_folder(tmp_path, expected)
    converted = load_file(
        str(convert_checkpoint(folder.parent if which == "save_state folder" else folder, tmp_path))
    )
    assert converted.keys() == expected.keys()
    for key in expected:
        assert converted[key].dtype == expected[key].dtype
        assert torch.equal(converted[key], expected[key])


def test_pickled_code_in_the_dcp_index_is_refused_without_running_it(tmp_path):
    folder = dcp_folder(tmp_path, reference_state())
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (folder / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(CheckpointError, match="arbitrary code"):
        convert_checkpoint(folder.parent, tmp_path / "out")
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_truncated_shard_is_a_clear_error(tmp_path):
    folder = dcp_folder(tmp_path, reference_state())
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="missing, corrupt or truncated"):
        convert_checkpoint(folder, tmp_path / "out")


def test_optimizer_folder_is_not_mistaken_for_weights(tmp_path):
    folder = tmp_path / "optimizer_0"
    state = {"state": {"0.weight": {"exp_avg": torch.zeros(2)}}}
    dcp.save({"optimizer": state}, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    with pytest.raises(CheckpointError, match=r"top-level keys are \[optimizer\]"):
        convert_checkpoint(folder, tmp_path / "out")


def test_fsdp_full_state_dict_file_converts(tmp_path):
    """FULL_STATE_DICT checkpoints are one torch.save file, pytorch_model_fsdp.bin."""
    expected = reference_state()
    (tmp_path / "step").mkdir()
    torch.save(expected, tmp_path / "step" / "pytorch_model_fsdp.bin")
    converted = load_file(str(convert_checkpoint(tmp_path / "step", tmp_path / "out")))
    assert all(torch.equal(converted[k], expected[k]) for k in expected)


def test_deepspeed_checkpoint_points_to_zero_to_fp32(tmp_path):
    (tmp_path / "step" / "pytorch_model").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"zero_to_fp32\.py .* --tag pytorch_model"):
        convert_checkpoint(tmp_path / "step", tmp_path / "out")
