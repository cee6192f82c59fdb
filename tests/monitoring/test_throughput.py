"""The FLOPs, TFLOP/s and MFU every recipe logs (accel_common.monitoring.throughput): counted on the
first optimizer step, by the peak of the device the run is on."""

from __future__ import annotations

import json
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from accelerate.state import AcceleratorState
from torch import nn
from torch.utils.data import TensorDataset

from accel_common.batch_lr.batching import BatchRequest
from accel_common.batch_lr.lr import Decay, LRSettings, make_lr_schedule
from accel_common.data.loaders import make_train_loader
from accel_common.hardware.accelerator import make_accelerator
from accel_common.monitoring.throughput import (
    StepFlops,
    device_peak,
    known_peak,
    matmul_precision,
    mfu,
)
from accel_common.monitoring.tracking import StepLogger
from accel_common.training.loop import TrainLoop
from accel_common.training.policy import LoopPolicy, SavePolicy
from accel_common.training.run import Run, RunConfig, StartRequest
from tests.processes import invoke_train, run_recipe

B, IN, OUT, ACCUMULATION = 4, 5, 3, 2


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture
def accelerator_plan(tmp_path):
    return make_accelerator(
        output_dir=tmp_path,
        batch=BatchRequest(per_device_batch_size=B, grad_accum_steps=ACCUMULATION),
        cpu=True,
    )


def train_linear(out, max_steps: int = 0, resume: str | None = None) -> TrainLoop:
    """A Linear layer trained by the loop (8 micro-batches of B, 2 a step: 4 steps), its input
    needing a gradient, evaluated after every step (--eval-every 1); returns the loop."""
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator, plan = make_accelerator(
        output_dir=out,
        batch=BatchRequest(per_device_batch_size=B, grad_accum_steps=ACCUMULATION),
        cpu=True,
    )
    torch.manual_seed(0)
    model = nn.Linear(IN, OUT)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(8 * B, IN), torch.randn(8 * B, OUT))
    loader = make_train_loader(data, plan.per_device_batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    settings = LRSettings(1e-3, ref_bs=B, decay=Decay.constant)
    schedule = make_lr_schedule(
        accelerator, optimizer, plan, settings, steps_per_epoch=len(loader), epochs=1
    )
    run = Run.open(
        accelerator, plan, schedule, RunConfig("toy", {}), output_dir=out,
        start=StartRequest(resume=resume),
    )  # fmt: skip
    policy = LoopPolicy(SavePolicy(log_every=1, save_every=1, eval_every=1))
    loop = TrainLoop(accelerator, plan, loader, schedule, run, policy)
    for _epoch in loop.epochs():
        for x, y in loop.batches():
            with accelerator.accumulate(model):
                loss = (model(x.requires_grad_()) - y).pow(2).mean()
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            loop.record(loss)
            if loop.eval_due():
                loop.log_eval({"out": model(torch.randn(64, IN)).sum().item()})
            if max_steps and loop.step == max_steps:
                return loop
        loop.end_epoch({})
    loop.finish(model)
    return loop


def test_the_logged_step_flops_are_the_counters_for_a_linear_layer_evaluations_left_out(
    tmp_path, capsys
):
    """A Linear layer whose input needs a gradient: 2*B*in*out FLOPs forward, twice that
    backward (input and weight gradients), for each of the step's 2 micro-batches. The
    evaluation after step 1 runs after the count: it adds nothing."""
    loop = train_linear(tmp_path)
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    logged = [r for r in map(json.loads, lines) if "train/loss" in r]
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    expected = ACCUMULATION * 3 * (2 * B * IN * OUT)
    for record in logged:
        assert record["train/flops_per_step"] == expected
        steps_per_s = record["train/samples_per_s"] / loop.plan.global_batch_size
        assert record["train/tflops_per_device"] == pytest.approx(expected * steps_per_s / 1e12)
        assert "train/mfu" not in record  # the CPU has no peak
    printed = capsys.readouterr().out.splitlines()
    assert [line for line in printed if "MFU" in line] == [
        "MFU is not logged on the CPU: it has no known peak FLOP/s to divide by (the step's "
        "FLOPs and train/tflops_per_device are logged)"
    ]


def test_a_resumed_run_takes_the_count_from_its_checkpoint_and_counts_nothing(
    tmp_path, monkeypatch
):
    """The checkpoint keeps the count: a resumed run logs it and counts nothing again."""
    train_linear(tmp_path, max_steps=2)  # saved step_1 and step_2
    progress = json.loads((tmp_path / "checkpoints" / "step_2" / "progress.json").read_text())
    expected = ACCUMULATION * 3 * (2 * B * IN * OUT)
    assert progress["progress"]["flops_per_step"] == expected
    counted = []
    monkeypatch.setattr(
        "accel_common.monitoring.throughput.eager_flop_counter", lambda stack: counted.append(1)
    )
    loop = train_linear(tmp_path, resume="latest")
    assert loop.step == 4 and not counted
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    logged = [r for r in map(json.loads, lines) if "train/loss" in r and r["step"] > 2]
    assert [r["train/flops_per_step"] for r in logged] == [expected, expected]


def test_a_compiled_module_is_counted_eagerly_with_the_same_flops(accelerator_plan):
    """The counted step runs eagerly: a compiled module's kernels would hide their FLOPs."""
    accelerator, _ = accelerator_plan
    model = nn.Linear(IN, OUT)
    model.compile(backend="eager")
    model(torch.randn(B, IN))  # compiled before the count
    flops = StepFlops(accelerator)
    flops.begin()
    model(torch.randn(B, IN, requires_grad=True)).sum().backward()
    flops.step_done()
    assert flops.per_step == 3 * (2 * B * IN * OUT)
    flops.begin()  # counted once: later steps cost nothing
    assert flops._counting is None


def test_mfu_is_the_achieved_share_of_the_given_peak(accelerator_plan):
    """2.5e13 FLOPs a step at 2 steps/s on 1 process: 50 TFLOP/s, half of a 100 TFLOP/s peak."""
    accelerator, plan = accelerator_plan
    logger = StepLogger(
        accelerator, total_steps=1, initial_step=0, log_every=1,
        global_batch_size=plan.global_batch_size, desc="toy",
    )  # fmt: skip
    logger.peak = 100.0
    record = logger.flops_record(2.5e13, samples_per_s=2 * plan.global_batch_size)
    logger.close()
    assert record["train/tflops_per_device"] == pytest.approx(50.0)
    assert record["train/mfu"] == pytest.approx(0.5)
    assert mfu(494.7, 989.4) == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("device", "precision", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", ("H100 SXM", 989.4)),
        ("NVIDIA H100 PCIe", "tf32", ("H100 PCIe", 378.0)),
        ("NVIDIA H100 NVL", "fp16", ("H100 NVL", 835.5)),
        ("NVIDIA H200", "fp32", ("H200", 66.9)),
        ("NVIDIA A100-SXM4-80GB", "bf16", ("A100", 312.0)),
        ("NVIDIA A100 80GB PCIe", "tf32", ("A100", 156.0)),
        ("NVIDIA A10", "bf16", ("A10", 125.0)),
        ("NVIDIA L4", "bf16", ("L4", 121.0)),
        ("NVIDIA L40S", "fp32", ("L40S", 91.6)),
        ("Tesla T4", "bf16", ("T4", None)),  # no bf16 tensor cores
        ("Tesla V100-SXM2-16GB", "fp16", ("V100 SXM", 125.0)),
        ("Some Future GPU", "bf16", None),
    ],
)
def test_the_known_device_table_picks_the_peak_of_the_device_and_precision(
    device, precision, expected
):
    assert known_peak(device, precision) == expected


def test_fp32_runs_use_the_tf32_peak_where_torch_allows_tf32():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert matmul_precision("no") == "fp32"
        torch.set_float32_matmul_precision("high")
        assert matmul_precision("no") == "tf32"
        assert matmul_precision("bf16") == "bf16"
    finally:
        torch.set_float32_matmul_precision(before)


def test_the_cpu_has_no_peak(accelerator_plan):
    peak, line = device_peak(accelerator_plan[0])
    assert peak is None and line.startswith("MFU is not logged on the CPU:")


def test_a_recipe_run_logs_its_flops_and_tflops(template_data, tmp_path):
    """The template recipe, unchanged, logs the step's FLOPs and TFLOP/s on every logging step
    and says once why MFU is missing."""
    from recipes.train_template import train

    out = tmp_path / "run"
    args = ["--data", str(template_data), "--output-dir", str(out), "--epochs", "0"]
    args += ["--max-steps", "3", "--log-every", "1", "--hidden", "8", "--cpu"]
    AcceleratorState._reset_state(reset_partial_state=True)
    result = invoke_train(train, args)
    AcceleratorState._reset_state(reset_partial_state=True)
    assert result.exit_code == 0, result.output
    lines = (out / "logs" / "metrics.jsonl").read_text().splitlines()
    logged = [r for r in map(json.loads, lines) if "train/loss" in r]
    assert [r["step"] for r in logged] == [1, 2, 3]
    assert len({r["train/flops_per_step"] for r in logged}) == 1
    assert all(r["train/flops_per_step"] > 0 < r["train/tflops_per_device"] for r in logged)
    assert result.output.count("MFU is not logged on the CPU") == 1
    assert "TFLOP/s=" in result.output


@pytest.mark.dist
def test_two_processes_log_the_flops_of_the_whole_step(template_data, tmp_path):
    """The same global batch (32) on 1 process and on 2 x 16 over gloo (under DDP): each process
    counts its half and the logged step's FLOPs are the sum, the 1-process run's."""
    flops = {}
    for nproc in (1, 2):
        out = tmp_path / str(nproc)
        args = ["--data", str(template_data), "--output-dir", str(out), "--epochs", "0"]
        args += ["--max-steps", "2", "--log-every", "1", "--bs", "32", "--cpu"]
        run_recipe(args, cwd=tmp_path, nproc=nproc)
        lines = (out / "logs" / "metrics.jsonl").read_text().splitlines()
        logged = [r for r in map(json.loads, lines) if "train/loss" in r]
        flops[nproc] = [r["train/flops_per_step"] for r in logged]
    assert flops[1] == flops[2] and len(flops[1]) == 2 and flops[1][0] > 0


@pytest.mark.parametrize(
    ("name", "precision", "peak", "line"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4, "MFU against the H100 SXM's dense bf16 peak"),
        ("Tesla T4", "bf16", None, "MFU is not logged: no bf16 peak is known for Tesla T4"),
        ("NVIDIA Future GPU", "fp16", 123.0, "MFU against a fp16 matrix product measured on"),
    ],
)
def test_a_gpus_peak_is_the_tables_else_a_measured_matrix_product(
    monkeypatch, name, precision, peak, line
):
    """Without a GPU: the device's name and the measurement stand in (a torch.float16 product
    for an fp16 run on a GPU the table lacks)."""
    measured = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: name)
    monkeypatch.setattr(
        "accel_common.monitoring.throughput.matmul_peak",
        lambda size, repeats, dtype: measured.append(dtype) or 123.0,
    )
    accelerator = SimpleNamespace(device=torch.device("cuda"), mixed_precision=precision)
    found, said = device_peak(accelerator)
    assert found == peak and said.startswith(line)
    assert measured == ([torch.float16] if "Future" in name else [])


def test_a_counted_step_is_the_uncounted_step_bit_for_bit():
    """torch's FlopCounterMode ran SiLU's backward as its decomposition, which rounds otherwise;
    FlopCount runs every op as it is, and counts what FlopCounterMode counts."""
    from torch.utils.flop_counter import FlopCounterMode

    from accel_common.monitoring.throughput import FlopCount

    def step(counter) -> tuple[list[torch.Tensor], int]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv1d(4, 16, 3), nn.SiLU(), nn.Flatten(), nn.Linear(16 * 30, 8))
        x = torch.randn(5, 4, 32)
        with counter:
            model(x).square().mean().backward()
        if isinstance(counter, FlopCounterMode):
            return [p.grad for p in model.parameters()], counter.get_total_flops()
        return [p.grad for p in model.parameters()], getattr(counter, "total", 0)

    plain, _ = step(nullcontext())
    ours, counted = step(FlopCount())
    _, expected = step(FlopCounterMode(display=False))
    assert all(torch.equal(a, b) for a, b in zip(plain, ours, strict=True))
    assert counted == expected > 0
