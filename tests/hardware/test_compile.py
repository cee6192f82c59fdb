"""`--compile`: a compiled run trains, resumes uncompiled and compiled again, and exports plain
keys that load into an uncompiled model and score as the compiled model did in memory.

The template compiles with inductor (C++ kernels, gcc on the CPU). Crystal, the graph recipe,
compiles through an accelerate config's dynamo backend set to aot_eager (what `accelerate launch`
passes its processes as ACCELERATE_DYNAMO_BACKEND): the same dynamo tracing, graph breaks and
autograd graphs as inductor, without minutes of code generation for PyG's varying shapes on 2
shared cores; that path is also the one where a config and --compile meet.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from accelerate.state import AcceleratorState
from accelerate.utils import DynamoBackend
from safetensors.torch import load_file
from torch._dynamo.utils import counters

from accel_common.batch_lr.batching import BatchRequest
from accel_common.checkpoints.checkpoint import list_checkpoints
from accel_common.checkpoints.export import load_exported, read_export_metadata
from accel_common.errors import ConfigError
from accel_common.hardware.compilation import requested_compilation
from accel_common.recipe_cli.entry import train_in_python
from recipes import load_recipe
from tests.processes import CRYSTAL, CRYSTAL_TINY, TEMPLATE, dry_run_plan
from tests.results import exported_params, max_relative_difference

TEMPLATE_SMALL = ["--hidden", "16", "--depth", "1", "--schedule", "constant", "--bs", "64"]


def train(recipe: str, script: Path, args: list[str], out: Path) -> int:
    """Train `recipe` in this process on one thread; return the graphs dynamo compiled."""
    torch._dynamo.reset()
    counters.clear()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_in_python(
            load_recipe(recipe).train, [*args, "--output-dir", str(out)], out, script=script
        )
    finally:
        torch.set_num_threads(threads)
        AcceleratorState._reset_state(reset_partial_state=True)
    return counters["stats"]["unique_graphs"]


def wrapper_keys(keys: list[str]) -> list[str]:
    return [key for key in keys if "_orig_mod" in key or key.startswith("module.")]


def checkpoint_keys(out: Path) -> list[str]:
    return list(load_file(str(list_checkpoints(out)[-1] / "model.safetensors")))


def test_template_compiles_trains_resumes_either_way_and_exports_plain_keys(
    tmp_path, template_data
):
    args = [*TEMPLATE_SMALL, "--data", str(template_data), "--epochs", "1"]
    out = tmp_path / "mixed"
    assert train("template", TEMPLATE, [*args, "--compile", "--max-steps", "4"], out) > 0
    assert not wrapper_keys(checkpoint_keys(out))
    # compiled -> uncompiled -> compiled, against one uncompiled run of the same 12 steps
    assert train("template", TEMPLATE, [*args, "--resume", "latest", "--max-steps", "8"], out) == 0
    resume = [*args, "--resume", "latest", "--max-steps", "12", "--compile"]
    assert train("template", TEMPLATE, resume, out) > 0
    train("template", TEMPLATE, [*args, "--max-steps", "12"], tmp_path / "eager")
    assert read_export_metadata(out / "model")["step"] == 12
    assert max_relative_difference(exported_params(tmp_path / "eager"), exported_params(out)) < 1e-4

    # the export loads strictly into a plain model and scores as the compiled model did
    module = load_recipe("template")
    test_set = module.load_split(template_data, "test")
    model = module.MLPRegressor(test_set.tensors[0].shape[1], 16, 1)
    meta = load_exported(out / "model", model)
    x, y = test_set.tensors
    with torch.no_grad():
        mse = F.mse_loss(model(x), y).item()
    assert mse == pytest.approx(meta["metrics"]["test_mse"], rel=1e-5)


@pytest.mark.slow
def test_crystal_compiles_trains_resumes_and_exports_plain_keys(
    tmp_path, crystal_data, monkeypatch
):
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "AOT_EAGER")
    args = [*CRYSTAL_TINY, "--data", str(crystal_data), "--epochs", "1", "--bs", "64"]
    args += ["--schedule", "constant", "--warmup-steps", "0"]
    out = tmp_path / "compiled"
    assert train("crystal", CRYSTAL, [*args, "--compile", "--max-steps", "2"], out) > 0
    assert not wrapper_keys(checkpoint_keys(out))
    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND")
    # resumed uncompiled: the checkpoint loads strictly (the template's test compares numbers)
    assert train("crystal", CRYSTAL, [*args, "--resume", "latest", "--max-steps", "3"], out) == 0
    assert read_export_metadata(out / "model")["step"] == 3
    assert not wrapper_keys(list(exported_params(out)))


def test_dry_run_says_whether_it_compiles(monkeypatch):
    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    train_fn = load_recipe("template").train
    assert dry_run_plan(train_fn, [])["compile"] == "no"
    assert dry_run_plan(train_fn, ["--compile"])["compile"] == "inductor (--compile)"


def test_a_config_dynamo_backend_compiles_once_with_its_settings(monkeypatch, tmp_path):
    """--compile under a config that sets a backend: one compile, the config's; Accelerate's own
    (a wrapper with `_orig_mod.` keys) stays off."""
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "max-autotune")
    chosen = requested_compilation(True)
    assert chosen.describe() == "inductor, mode max-autotune (the accelerate config)"
    assert requested_compilation(False) == chosen  # the config alone compiles too

    from accel_common.hardware.accelerator import make_accelerator

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator, _ = make_accelerator(output_dir=tmp_path, batch=BatchRequest(8), cpu=True)
        assert accelerator.state.dynamo_plugin.backend == DynamoBackend.NO
        model = torch.nn.Linear(2, 2)
        chosen.apply(model)
        prepared = accelerator.prepare(model)
        assert prepared is model and list(prepared.state_dict()) == ["weight", "bias"]
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_regional_compilation_in_a_config_is_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "true")
    with pytest.raises(ConfigError, match="dynamo_use_regional_compilation"):
        requested_compilation(True)


def test_pvcnn2_compiles_whole_with_its_point_ops_and_computes_the_same():
    """fullgraph: a graph break (a point op's .item(), its sampling loop unrolled or skipped)
    fails here; the eager backend traces as inductor does, in seconds."""
    from recipes.pointcloud.model import PVCNN2

    torch.manual_seed(0)
    model = PVCNN2(
        num_points=192, embed_dim=16, width_multiplier=0.25, voxel_resolution_multiplier=0.125,
        num_neighbors=8, dropout=0.0, head_dropout=0.0,
    ).eval()  # fmt: skip
    inputs, t = torch.randn(2, 3, 192), torch.tensor([3, 7])
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(inputs, t), model(inputs, t))
