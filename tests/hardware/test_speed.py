"""The speed switches (accel_common.hardware.speed): --matmul-precision reaches torch,
--fused-optimizer builds torch's fused kernel (or is refused in one line), --ddp-static-graph
reaches the DDP wrapper of a real 2-process launch and is refused where it cannot work; the dry run
shows all three."""

from __future__ import annotations

import json
import re

import pytest
import torch
from accelerate import DistributedDataParallelKwargs
from accelerate.state import AcceleratorState
from accelerate.utils import GradScalerKwargs

from accel_common.batch_lr.batching import BatchRequest
from accel_common.errors import ConfigError
from accel_common.hardware.accelerator import make_accelerator
from accel_common.hardware.speed import MatmulPrecision, require_ddp, with_static_graph
from accel_common.recipe_cli.options import SharedSettings
from recipes.train_template import train
from tests.processes import REPO, dry_run_plan, invoke_train, run_recipe


@pytest.fixture
def torch_precision():
    """torch's process-wide precision switches, put back after the test (the suite's other
    tests compare runs bit for bit), with Accelerate's state reset around it."""
    saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32 = saved[1]


@pytest.mark.parametrize(
    ("precision", "tf32"), [("highest", False), ("high", True), ("medium", True)]
)
def test_matmul_precision_sets_torch_and_both_tf32_switches_alike(
    precision, tf32, torch_precision, tmp_path
):
    args = SharedSettings(
        output_dir=tmp_path, bs=8, cpu=True, matmul_precision=MatmulPrecision(precision)
    )
    args.make_accelerator()
    assert torch.get_float32_matmul_precision() == precision
    assert torch.backends.cuda.matmul.allow_tf32 is tf32  # cuBLAS
    assert torch.backends.cudnn.allow_tf32 is tf32  # convolutions


def test_without_matmul_precision_torch_keeps_its_defaults(torch_precision, tmp_path):
    torch.set_float32_matmul_precision("medium")  # whatever was there stays
    make_accelerator(output_dir=tmp_path, batch=BatchRequest(8), cpu=True)
    assert torch.get_float32_matmul_precision() == "medium"


def test_fused_optimizer_builds_torchs_fused_kernel_on_the_cpu():
    weights = [torch.nn.Parameter(torch.ones(3))]
    for kind in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        fused = SharedSettings(fused_optimizer=True).make_optimizer(kind, weights, lr=0.1)
        assert type(fused) is kind and fused.defaults["fused"] is True
        plain = SharedSettings().make_optimizer(kind, weights, lr=0.1)
        assert not plain.defaults["fused"]  # the default one, exactly as before
        weights[0].grad = torch.ones(3)
        fused.step()  # the kernel runs here


@pytest.mark.parametrize(
    ("kind", "extra", "why"),
    [
        (torch.optim.RMSprop, {}, "has no fused RMSprop"),
        (torch.optim.Adam, {"differentiable": True}, "refuses a fused Adam here"),
    ],
)
def test_a_fused_optimizer_torch_lacks_is_refused_in_one_line(kind, extra, why):
    args = SharedSettings(fused_optimizer=True)
    with pytest.raises(ConfigError) as refused:
        args.make_optimizer(kind, [torch.nn.Parameter(torch.ones(3))], lr=0.1, **extra)
    message = str(refused.value)
    assert message.startswith("--fused-optimizer: torch ") and why in message
    assert message.endswith("drop --fused-optimizer") and "\n" not in message


def test_static_graph_joins_the_recipes_own_ddp_handler():
    """cricket passes find_unused_parameters, crystal broadcast_buffers: kept, in one handler
    (Accelerate takes one of each kind)."""
    scaler = GradScalerKwargs(init_scale=1024)
    own = DistributedDataParallelKwargs(find_unused_parameters=True, broadcast_buffers=False)
    handlers = with_static_graph([scaler, own])
    ddp = [h for h in handlers if isinstance(h, DistributedDataParallelKwargs)]
    assert scaler in handlers and len(ddp) == 1
    assert ddp[0].to_kwargs() == {
        "find_unused_parameters": True, "broadcast_buffers": False, "static_graph": True
    }  # fmt: skip
    assert not own.static_graph  # the recipe's object is left as it was
    assert with_static_graph([])[0].to_kwargs() == {"static_graph": True}


@pytest.mark.dist
def test_static_graph_reaches_ddp_in_a_two_process_launch(tmp_path):
    script = REPO / "tests" / "scripts" / "static_graph.py"
    result = run_recipe([str(tmp_path / "out")], cwd=tmp_path, nproc=2, script=script)
    built = json.loads(result.stdout.strip().splitlines()[-1])
    assert built == {"static_graph": True, "find_unused": True, "type": "DistributedDataParallel"}


@pytest.mark.parametrize(
    ("runs_as", "accumulation", "says"),
    [
        ("NO", 1, "one process has no DistributedDataParallel to configure"),
        ("FSDP", 1, "runs as FSDP, which wraps the model its own way"),
        ("DEEPSPEED", 1, "runs as DEEPSPEED, which wraps the model its own way"),
        ("MULTI_GPU", 2, "with 2 accumulation steps"),
    ],
)
def test_static_graph_without_a_ddp_it_can_serve_is_refused_in_one_line(
    runs_as, accumulation, says
):
    with pytest.raises(ConfigError) as refused:
        require_ddp(runs_as, accumulation)
    message = str(refused.value)
    assert message.startswith("--ddp-static-graph") and says in message and "\n" not in message
    require_ddp("MULTI_CPU", 1)  # what it serves: data-parallel processes, no accumulation
    require_ddp("MULTI_GPU", 1)


def test_a_single_process_run_with_static_graph_is_refused_before_training(
    torch_precision, tmp_path
):
    args = SharedSettings(output_dir=tmp_path / "run", bs=8, cpu=True, ddp_static_graph=True)
    with pytest.raises(ConfigError, match=r"^--ddp-static-graph: one process has no"):
        args.make_accelerator()


def test_the_dry_run_shows_the_three_and_refuses_what_the_run_refuses(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    plain = dry_run_plan(train, [])
    assert plain["matmul precision"].startswith("torch's default (fp32 matrix products")
    assert (plain["fused optimizer"], plain["DDP static graph"]) == ("no", "no")
    flags = ["--matmul-precision", "high", "--fused-optimizer", "--ddp-static-graph"]
    asked = dry_run_plan(train, [*flags, "--processes", "2"])
    assert asked["matmul precision"].startswith("high (TF32 matrix products")
    assert asked["fused optimizer"] == "yes (--fused-optimizer)"
    assert asked["DDP static graph"] == "yes (--ddp-static-graph)"
    assert "AdamW state (2 x the weights)" in asked["memory per device"]  # fused: same state
    for extra in (["--processes", "1"], ["--processes", "2", "--grad-accum", "2"]):
        refused = invoke_train(train, ["--ddp-static-graph", *extra, "--dry-run"])
        assert refused.exit_code != 0
        assert "--ddp-static-graph" in str(refused.exception)


def test_the_banner_shows_them_and_only_the_precision_binds_a_resume(tmp_path, template_data):
    """TF32 changes the numbers: a resume at another --matmul-precision is another run, refused
    by name. A fused kernel computes the same update (as --compile): a run may resume without
    it, its fused optimizer's state loaded into the default one."""
    out = tmp_path / "out"
    args = ["--data", str(template_data), "--output-dir", str(out), "--bs", "256"]
    args += ["--hidden", "8", "--depth", "1", "--matmul-precision", "highest"]
    first = run_recipe([*args, "--max-steps", "2", "--fused-optimizer"], cwd=tmp_path)
    banner = dict(re.findall(r"^  (\S.*?\S)  +(\S.*)$", first.stdout, re.MULTILINE))
    assert banner["matmul precision"].startswith("highest (fp32 matrix products")
    assert banner["fused optimizer"] == "yes (--fused-optimizer)"
    assert banner["DDP static graph"] == "no"
    again = [*args, "--max-steps", "3", "--resume", "latest"]
    again[again.index("highest")] = "high"
    refused = run_recipe(again, cwd=tmp_path, check=False)
    assert refused.returncode == 2, refused.stderr
    assert "--matmul-precision highest in the checkpoint, high now" in refused.stderr
    resumed = run_recipe([*args, "--max-steps", "3", "--resume", "latest"], cwd=tmp_path)
    assert "resumed from" in resumed.stdout and "step 2" in resumed.stdout
