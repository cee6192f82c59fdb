"""Tied parameters (tests/tied_model.py: `lm_head.weight = wte.weight`) in every file a run
writes and reads: checkpoints, `convert`, the export, and FSDP's units
(accel_common.checkpoints.ties, accel_common.hardware.sharding)."""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from accel_common.batch_lr.batching import plan_batch
from accel_common.checkpoints.checkpoint import load_checkpoint, save_checkpoint
from accel_common.checkpoints.export import load_exported
from accel_common.checkpoints.ties import TIES_FILE
from accel_common.errors import CheckpointError
from accel_common.hardware.sharding import keeping_ties_whole, without_containers
from accel_common.tools.cli import app
from tests.checkpoints.test_checkpoint import at_step
from tests.hardware.test_sharded import TOLERANCE, launch_fsdp
from tests.processes import REPO, run_recipe
from tests.results import max_relative_difference
from tests.tied_model import TiedGPT

SCRIPT = REPO / "tests" / "scripts" / "tied_gpt.py"
REMOVED = "Removed shared tensor"
HEAD, EMBEDDING = "lm_head.weight", "transformer.wte.weight"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def converted(source: Path, target: Path) -> dict[str, torch.Tensor]:
    """`accel-recipes convert SOURCE TARGET`, then the file loaded strictly by plain torch."""
    result = CliRunner().invoke(app, ["convert", str(source), str(target)])
    assert result.exit_code == 0, result.output
    state = load_file(str(target / "model.safetensors"))
    TiedGPT().load_state_dict(state, strict=True)
    return state


def test_a_save_records_the_tie_warns_nothing_and_converts_to_every_name(
    accelerator, tmp_path, caplog
):
    torch.manual_seed(0)
    plan = plan_batch(1, global_batch_size=8)
    model = accelerator.prepare(TiedGPT())
    with caplog.at_level(logging.WARNING):
        accelerator.save_state(str(tmp_path / "plain"))  # Accelerate alone: its warning
        assert REMOVED in caplog.text
        caplog.clear()
        path = save_checkpoint(accelerator, tmp_path, at_step(1), plan=plan)
    assert REMOVED not in caplog.text
    assert HEAD not in load_file(str(path / "model.safetensors"))  # safetensors: one name
    assert json.loads((path / TIES_FILE).read_text()) == {"models": {"0": [[EMBEDDING, HEAD]]}}
    for index, source in enumerate((path, path / "model.safetensors")):
        state = converted(source, tmp_path / f"out_{index}")
        assert torch.equal(state[HEAD], model.lm_head.weight.detach())
    with torch.no_grad():
        model.transformer["wte"].weight.zero_()
    load_checkpoint(accelerator, path, plan)  # the resume finds the tie in the model
    assert torch.equal(model.lm_head.weight, load_file(str(path / "model.safetensors"))[EMBEDDING])


def test_an_export_missing_a_tied_name_says_so_not_the_width_flags(tmp_path):
    state = {k: v for k, v in TiedGPT().state_dict().items() if k != HEAD}
    save_file({k: v.clone() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as error:
        load_exported(tmp_path, TiedGPT())
    message = str(error.value)
    assert f"{HEAD} is tied to {EMBEDDING} in this model and is absent from the file" in message
    assert "width/depth" not in message and "\n" not in message


def over_1000(module: torch.nn.Module) -> bool:
    """Accelerate's FSDP2 size policy at fsdp_min_num_params 1000."""
    return sum(p.numel() for p in module.parameters()) > 1000


def test_the_fsdp_size_policy_never_splits_a_tie():
    """Above 1000 parameters the embedding and the head (2048 each) would be units of their own,
    and fully_shard refuses the second ('shared with a parameter already managed by another FSDP
    group'); the blocks still are units."""
    model = TiedGPT()
    policy = keeping_ties_whole(without_containers(over_1000), model)
    units = {name for name, module in model.named_modules() if name and policy(module)}
    assert {"transformer.h.0", "transformer.h.1.mlp"} <= units
    assert not units & {"lm_head", "transformer.wte", "transformer"}
    assert over_1000(model.lm_head) and over_1000(model.transformer["wte"])  # out for the tie
    shared = torch.nn.Linear(40, 40)  # one module in two places: no unit holds one place only
    pair = torch.nn.ModuleDict({"a": torch.nn.Sequential(shared), "b": torch.nn.Sequential(shared)})
    policy = keeping_ties_whole(without_containers(over_1000), pair)
    assert [name for name, m in pair.named_modules() if name and policy(m)] == ["a.0"]


def exported(out: Path) -> dict[str, torch.Tensor]:
    """A run's export, loaded strictly into a plain TiedGPT by plain torch."""
    state = load_file(str(out / "model" / "model.safetensors"))
    TiedGPT().load_state_dict(state, strict=True)
    return state


def run_tied(out: Path, stop_after: int = 0, resume: int = 0) -> subprocess.CompletedProcess:
    """tests/scripts/tied_gpt.py on 2 processes (DDP over gloo)."""
    args = [str(out), str(stop_after), str(resume)]
    return run_recipe(args, cwd=out.parent, nproc=2, script=SCRIPT)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A whole run of the tied model on 2 processes: 4 steps, a save after each, the export."""
    out = tmp_path_factory.mktemp("tied") / "full"
    return out, run_tied(out)


@pytest.mark.dist
def test_a_tied_model_trains_resumes_and_converts_on_2_processes(ddp, tmp_path):
    full, result = ddp
    assert REMOVED not in result.stdout + result.stderr
    run_tied(tmp_path / "cut", stop_after=2)
    run_tied(tmp_path / "cut", resume=1)
    ends, resumed = exported(full), exported(tmp_path / "cut")
    assert ends.keys() == resumed.keys()
    assert all(torch.equal(ends[k], resumed[k]) for k in ends)
    state = converted(full / "checkpoints" / "step_4", tmp_path / "merged")
    assert state.keys() == ends.keys()
    assert all(torch.equal(state[k], ends[k]) for k in ends)


@pytest.mark.dist
def test_a_tied_model_runs_under_fsdp_with_the_tie_in_one_unit(ddp, tmp_path):
    """fsdp_8gpu.yaml's size policy at 1000 parameters on 2 CPU processes (the FSDP shim): the
    run, its export and the merged sharded checkpoint load strictly, and equal plain DDP's."""
    result = launch_fsdp(tmp_path, [str(tmp_path / "fsdp"), "0", "0"], recipe=SCRIPT)
    assert result.returncode == 0, result.stdout + result.stderr
    units = [line for line in result.stdout.splitlines() if line.startswith("fsdp unit: ")]
    assert units.count("fsdp unit: Block") == 2 and "fsdp unit: Embedding" not in units, units
    ends = exported(tmp_path / "fsdp")
    state = converted(tmp_path / "fsdp" / "checkpoints" / "step_4", tmp_path / "merged")
    assert state.keys() == ends.keys()
    assert all(torch.equal(state[k], ends[k]) for k in ends)
    assert max_relative_difference(exported(ddp[0]), ends) <= TOLERANCE
