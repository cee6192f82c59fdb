"""`--deterministic`: what it sets, that it is part of the run's identity, and the one line an op
without a deterministic kernel stops the run with.

On the CPU the recipes are deterministic with or without the flag, so two equal runs here prove
that the flag keeps a run repeatable (workers, seeds and all), not that it removes GPU
nondeterminism: the GPU suite checks that (tests/gpu, bit-equal resume and FSDP runs).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from accel_common.checkpoints.checkpoint import list_checkpoints
from accel_common.errors import refused_op
from accel_common.hardware.determinism import make_deterministic
from tests.processes import TEMPLATE, run_recipe
from tests.results import exported_params

SMALL = ["--bs", "64", "--max-steps", "6", "--save-every", "3", "--log-every", "1"]

# A template run whose every Linear layer first calls max_unpool1d, which has no deterministic
# CPU kernel: the CPU stand-in for a GPU op such as a scatter-add's backward.
NONDETERMINISTIC_OP = """
import runpy, sys, torch
from torch.nn import functional as F
linear = torch.nn.Linear.forward
def forward(self, x):
    pooled, where = F.max_pool1d(torch.ones(1, 1, 2), 2, return_indices=True)
    F.max_unpool1d(pooled, where, 2)
    return linear(self, x)
torch.nn.Linear.forward = forward
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture
def restore_determinism():
    """make_deterministic changes process-wide state: put it back after the test."""
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:3]
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    if before[3] is not None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = before[3]


@pytest.mark.parametrize("given", [None, "bogus", ":16:8"])
def test_what_deterministic_mode_sets(restore_determinism, monkeypatch, given):
    if given is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", given)
    torch.backends.cudnn.benchmark = True
    make_deterministic()
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    # a valid workspace the user chose stays; anything else becomes the documented one
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == (":16:8" if given == ":16:8" else ":4096:8")


def test_torchs_refusal_is_recognised_and_nothing_else(restore_determinism):
    make_deterministic()
    pooled, where = torch.nn.functional.max_pool1d(torch.ones(1, 1, 2), 2, return_indices=True)
    with pytest.raises(RuntimeError) as refusal:
        torch.nn.functional.max_unpool1d(pooled, where, 2)
    assert refused_op(refusal.value) == "max_unpooling2d_forward_out"
    assert refused_op(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None


@pytest.mark.slow
def test_two_deterministic_runs_with_workers_are_equal(tmp_path, template_data):
    args = ["--data", str(template_data), *SMALL, "--deterministic", "--workers", "2"]
    for name in ("a", "b"):
        run_recipe([*args, "--output-dir", name], cwd=tmp_path)
    first, second = exported_params(tmp_path / "a"), exported_params(tmp_path / "b")
    assert all(torch.equal(first[k], second[k]) for k in first)
    config = json.loads((tmp_path / "a" / "model" / "model.json").read_text())["config"]
    assert config["deterministic"] is True


@pytest.mark.slow
def test_deterministic_is_part_of_the_runs_identity(tmp_path, template_data):
    args = ["--data", str(template_data), *SMALL, "--output-dir", "out", "--max-steps", "3"]
    run_recipe(args, cwd=tmp_path)
    assert [p.name for p in list_checkpoints(tmp_path / "out")] == ["step_3"]
    longer = [*args[:-2], "--max-steps", "6", "--resume", "latest"]
    refused = run_recipe([*longer, "--deterministic"], cwd=tmp_path, check=False)
    assert refused.returncode == 2, refused.stderr
    assert "--deterministic" in refused.stderr.strip().splitlines()[-1], refused.stderr
    assert "resumed from" in run_recipe(longer, cwd=tmp_path).stdout


@pytest.mark.slow
def test_an_op_without_a_deterministic_kernel_stops_the_run_in_one_line(tmp_path, template_data):
    shim = tmp_path / "nondeterministic_op.py"
    shim.write_text(NONDETERMINISTIC_OP)
    args = [str(TEMPLATE), "--data", str(template_data), *SMALL]
    result = run_recipe([*args, "--output-dir", "on", "--deterministic"], cwd=tmp_path,
                        script=shim, check=False)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: --deterministic: max_unpooling2d_forward_out has no deterministic implementation "
        "on this device, so the template recipe cannot run deterministically here; run without "
        "--deterministic (two runs may then differ in the last bits)"
    ]
    assert not (tmp_path / "on" / "model").exists()
    # the same op without the flag runs: only the deterministic mode refuses it
    run_recipe([*args, "--output-dir", "off", "--max-steps", "1"], cwd=tmp_path, script=shim)
    assert (tmp_path / "off" / "model" / "model.safetensors").exists()
