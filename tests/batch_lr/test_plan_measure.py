"""`accel-recipes plan --measure`: memory = fixed + per sample x batch from measured peaks.

The template MLP's activations grow linearly with the batch, so the per-sample memory fitted at
per-device batches 256 and 512 must predict what a third, larger batch (2048) adds, within 25%,
at two widths (128 and 256: narrow enough that activations, not the optimizer's state, set the
peak). Each peak is taken in a fresh process (on the CPU, from torch's allocation events); both
widths are measured at once (a peak does not depend on what runs beside it).
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from accel_common.batch_lr.batching import BatchPlan
from accel_common.batch_lr.memory import (
    MemoryFit,
    memory_flags,
    nonlinearity,
    parse_max_per_device_bs,
    present_device,
)
from accel_common.errors import ConfigError
from accel_common.tools.measure import measure, measure_peak, plan_rows
from recipes.train_template import MLPSettings
from tests.processes import BIN, recipe_env

FIT_BATCHES, LARGER = [256, 512], 2048  # the largest: the whole training split


def per_sample_at(fit: MemoryFit, peak: int, batch: int) -> float:
    """What `batch` samples added, measured: the peak less the fit's fixed part."""
    return (peak - fit.fixed_bytes) / batch


def cli_fit(tmp: Path, data: Path) -> MemoryFit:
    """Width 256 through the command itself; it writes runs/memory/template.json."""
    command = [str(BIN / "accel-recipes"), "plan", "--measure", "template", "--measure-bs"]
    command += [",".join(map(str, FIT_BATCHES)), "--bs", "1024", "--data", str(data)]
    result = subprocess.run(
        [*command, "--hidden", "256"], cwd=tmp, env=recipe_env(tmp), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "measured" in result.stdout and "capped" in result.stdout
    assert "warning: two batches cannot show whether memory grows linearly" in result.stdout
    return MemoryFit(**json.loads((tmp / "runs" / "memory" / "template.json").read_text()))


@pytest.mark.slow
def test_fitted_memory_per_sample_predicts_a_larger_batch(tmp_path, template_data, monkeypatch):
    narrow = ["--data", str(template_data), "--hidden", "128"]
    with ThreadPoolExecutor(2) as pool:
        wide_fit = pool.submit(cli_fit, tmp_path, template_data)
        narrow_fit, _ = measure("template", narrow, FIT_BATCHES)
        narrow_peak = measure_peak("template", narrow, LARGER)
        wide_fit = wide_fit.result()
    wide = ["--data", str(template_data), "--hidden", "256"]
    wide_peak = measure_peak("template", wide, LARGER)
    for fit, peak in ((narrow_fit, narrow_peak), (wide_fit, wide_peak)):
        measured = per_sample_at(fit, peak, LARGER)
        assert abs(fit.per_sample_bytes - measured) <= 0.25 * measured, (fit, peak)
    assert wide_fit.per_sample_bytes > 1.5 * narrow_fit.per_sample_bytes  # twice as wide

    # --max-per-device-bs auto reads that measurement, for the same flags only
    monkeypatch.chdir(tmp_path)
    defaults = MLPSettings().as_config()  # every template setting, as the measurement records
    flags = memory_flags({**defaults, "hidden": 256}, None)
    cap = parse_max_per_device_bs("auto", "template", flags)
    assert cap == wide_fit.largest_batch(present_device()[2], 1, 1) == 2 * max(FIT_BATCHES)
    with pytest.raises(ConfigError, match="--hidden 256 in the measurement, 64 now"):
        parse_max_per_device_bs("auto", "template", memory_flags(defaults, None))
    with pytest.raises(ConfigError, match=r"no memory measurement at runs/memory/quality\.json"):
        parse_max_per_device_bs("auto", "quality", {})


def test_every_row_keeps_global_equal_per_device_times_processes_times_accumulation():
    gib = 2**30
    fit = MemoryFit(
        recipe="x", device_kind="cuda", device_name="GPU", device_bytes=80 * gib,
        baseline_bytes=0, fixed_bytes=6 * gib, per_sample_bytes=0.3 * gib, grad_bytes=gib,
        batches=[32, 64], peaks=[0, 0], flags={},
    )  # fmt: skip
    params = {"lr": 1e-3, "ref_bs": 64, "lr_scaling": "linear", "grad_accum": 1}
    for batch in ({"bs": 1024, "per_device_bs": None}, {"bs": None, "per_device_bs": 96}):
        rows = plan_rows(fit, {**params, **batch}, [1, 2, 3, 4, 8, 16])
        planned = [r for r in rows if r.per_device is not None]
        assert len(planned) > 20
        for row in planned:
            BatchPlan(row.global_batch, row.per_device, row.devices, row.accum)  # checks it
            assert row.per_device <= row.fits
            if batch["bs"]:
                assert row.global_batch == 1024 and row.lr == pytest.approx(1e-3 * 16)
        # 24 GB holds (0.9 x 24e9 - 6 GiB - buckets) / 0.3 GiB = 44 samples with 2+ devices
        assert [r.fits for r in rows if r.memory == "24 GB" and r.devices == 2] == [43]
        three = {r.basis == "batch not divisible" for r in rows if r.devices == 3}
        assert three == {bool(batch["bs"])}  # 1024 does not split over 3 devices; 96 x 3 does


def test_the_fit_promises_no_batch_past_twice_the_largest_measured():
    """A line through small batches is not evidence about large ones: rows stop at 2x."""
    gib = 2**30
    fit = MemoryFit(
        recipe="x", device_kind="cuda", device_name="GPU", device_bytes=80 * gib,
        baseline_bytes=0, fixed_bytes=gib, per_sample_bytes=2**20, grad_bytes=gib,
        batches=[16, 32, 64], peaks=[0, 0, 0], flags={},
    )  # fmt: skip
    assert fit.predicted_batch(80e9) > 60_000 and fit.largest_batch(80e9) == 128
    params = {"lr": 1e-3, "ref_bs": 64, "lr_scaling": "linear", "grad_accum": 1}
    rows = plan_rows(fit, {**params, "bs": None, "per_device_bs": 64}, [1, 2])
    assert {r.fits for r in rows} == {128}
    assert {r.basis for r in rows} == {"capped"}


def test_memory_that_is_not_linear_in_the_batch_is_named():
    seeds = [64, 512, 2048]  # nodes per seed a sampled subgraph holds: 94.5, 30, 14.6
    nonlinear = [int(4096 * n * s) for n, s in zip([94.5, 30, 14.6], seeds, strict=True)]
    warning = nonlinearity(seeds, nonlinear)
    assert warning.startswith("memory is not linear in the batch (per sample: ")
    assert "at 64-512" in warning and "2x the largest measured batch" in warning
    assert nonlinearity([8, 16, 32], [289636, 290244, 291460]) is None  # the template, measured
    assert "two batches cannot show" in nonlinearity([8, 16], [289636, 290244])
    assert nonlinearity([8, 16, 32], [500, 400, 300]).startswith("memory is not linear")
