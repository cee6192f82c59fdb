"""fp16's loss scaler on CUDA, through Accelerate's real fp16 path and the loop the recipes use:
an injected overflow is one skipped step that leaves the weights unchanged, the scale halves and
grows back, and scale and skipped count are restored exactly on resume; an export of the best
epoch records the run's skipped steps (tests/scaler_check.py; the CPU suite runs the same checks
with a stand-in scaler)."""

from __future__ import annotations

from tests.scaler_check import (
    check_a_best_epoch_export_counts_skipped_steps,
    check_overflow_is_skipped_and_resumes,
)


def test_an_overflow_on_the_gpu_is_a_skipped_step_that_survives_resume(tmp_path, record):
    # the whole trace goes to GPU_OUT's JSONL first, so a failure shows which steps were skipped
    record(**check_overflow_is_skipped_and_resumes(tmp_path, gpu=True, record=record))


def test_a_best_epoch_export_on_the_gpu_records_skipped_steps(tmp_path):
    check_a_best_epoch_export_counts_skipped_steps(tmp_path, gpu=True)
