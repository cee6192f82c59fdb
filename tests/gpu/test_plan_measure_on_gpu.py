"""`plan --measure` on a GPU: the fit from the allocator's peaks at two batches predicts the peak
at a larger batch within 15% (docs/BENCHMARKS.md, "Memory fit of plan --measure")."""

from __future__ import annotations

import torch

from accel_common.tools.measure import measure, measure_peak

FIT_BATCHES, LARGER = [4, 8], 16  # per-device point clouds; the default model, 512 points
TOLERANCE = 0.15


def test_the_fit_predicts_the_peak_at_a_batch_outside_it(pointcloud_data, record):
    argv = ["--data", str(pointcloud_data)]
    fit, _params = measure("pointcloud", argv, FIT_BATCHES)
    assert fit.device_kind == "cuda", fit  # the allocator's peak, not the CPU's
    measured = measure_peak("pointcloud", argv, LARGER)
    predicted = fit.fixed_bytes + fit.per_sample_bytes * LARGER
    error = (predicted - measured) / measured
    record(
        device=torch.cuda.get_device_name(),
        fit_batches=FIT_BATCHES,
        fit_peaks=fit.peaks,
        batch=LARGER,
        predicted_bytes=predicted,
        measured_bytes=measured,
        relative_error=error,
    )
    assert abs(error) <= TOLERANCE, (fit, measured)
