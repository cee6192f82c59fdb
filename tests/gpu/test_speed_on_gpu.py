"""The speed switches on a GPU (accel_common.hardware.speed), where they do what they are for:
torch's fused CUDA optimizer kernels compute the plain kernels' update, TF32 matrix products differ
from fp32 ones on GPUs that have TF32, and a run with the pointcloud preset's switches trains.

Not yet run: no GPU was lent to the session that wrote it (tests/hardware/test_speed.py holds the
same switches to torch's settings and its CPU kernels)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from accel_common.hardware.speed import make_optimizer, set_matmul_precision
from tests.processes import TEMPLATE, run_recipe
from tests.results import metrics_log

# fused and plain kernels differ in the order of a few fp32 operations per element: after 5
# steps the weights agree to ~1e-6 relative; a wrong update (a missed bias correction, weight
# decay applied twice) moves them by the learning rate, 1e-2
FUSED_TOLERANCE = 1e-5


@pytest.mark.parametrize("kind", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD])
def test_the_fused_cuda_kernel_computes_the_plain_update(kind):
    start = torch.randn(4096, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    fused_weights = torch.nn.Parameter(start.clone())
    plain_weights = torch.nn.Parameter(start.clone())
    options = {"lr": 1e-2, "weight_decay": 1e-2}
    fused = make_optimizer(kind, [fused_weights], True, **options)
    plain = make_optimizer(kind, [plain_weights], False, **options)
    assert fused.defaults["fused"] is True and not plain.defaults["fused"]
    for step in range(5):
        generator = torch.Generator("cuda").manual_seed(step)
        gradient = torch.randn(4096, device="cuda", generator=generator)
        fused_weights.grad, plain_weights.grad = gradient.clone(), gradient.clone()
        fused.step()
        plain.step()
    torch.testing.assert_close(fused_weights, plain_weights, rtol=FUSED_TOLERANCE, atol=1e-7)


def test_high_precision_multiplies_in_tf32_where_the_gpu_has_it():
    saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        generator = torch.Generator("cuda").manual_seed(0)
        a = torch.randn(1024, 1024, device="cuda", generator=generator)
        set_matmul_precision("highest")
        exact = a @ a
        set_matmul_precision("high")
        tf32 = a @ a
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cudnn.allow_tf32 = saved[1]
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("no TF32 before Ampere: 'high' multiplies in fp32")
    assert not torch.equal(tf32, exact)  # 10 bits of mantissa: ~1e-3 relative
    torch.testing.assert_close(tf32, exact, rtol=1e-2, atol=1e-1)


def test_a_run_with_the_pointcloud_presets_switches_trains_on_the_gpu(template_data, tmp_path):
    out = tmp_path / "run"
    args = ["--data", str(template_data), "--output-dir", str(out), "--max-steps", "8"]
    args += ["--log-every", "2", "--matmul-precision", "high", "--fused-optimizer"]
    result = run_recipe(args, cwd=tmp_path, script=TEMPLATE)
    assert re.search(r"^  fused optimizer +yes", result.stdout, re.MULTILINE), result.stdout
    losses = [r["train/loss"] for r in metrics_log(out) if "train/loss" in r]
    assert losses and all(math.isfinite(x) for x in losses)
