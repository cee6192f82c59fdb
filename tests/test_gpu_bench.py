"""The GPU benchmark's parts that run anywhere: its smoke run trains every workload one step on
the CPU (so none breaks unseen between GPU runs) and fails when one does, the estimate covers
every workload it measures, its section of docs/BENCHMARKS.md is rewritten in place, and without
CUDA a real run says so."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from accel_common.tools.bench.report import write_section
from benchmarks import bench_gpu
from benchmarks.memory_estimate import estimate
from benchmarks.original_sizes import workloads
from tests.processes import REPO, recipe_env

WORKLOADS = {"pointcloud", "quality", "captioning", "crystal", "cricket"}


def fake_results() -> dict:
    rates = {"no": 10.0, "bf16": 25.0, "fp16": 24.0}
    entry = {"size": "original", "batch": 8, "estimate_gib": 2.0}
    for precision, rate in rates.items():
        entry[precision] = {"samples_per_s": rate, "ms_per_step": 800 / rate,
                            "peak_gib": 2.5, "tflops": 3 * rate}  # fmt: skip
    return {"pointcloud": entry}


def test_its_section_replaces_itself_and_keeps_the_rest(tmp_path):
    docs = tmp_path / "BENCHMARKS.md"
    docs.write_text("# Benchmarks\n\nkept above\n")
    first = bench_gpu.table(fake_results(), "GPU A", 800.0, "2026-01-01", "torch x")
    write_section(docs, first, bench_gpu.SECTION_START, bench_gpu.SECTION_END)
    docs.write_text(docs.read_text() + "\nkept below\n")
    second = bench_gpu.table(fake_results(), "GPU B", 700.0, "2026-01-02", "torch y")
    write_section(docs, second, bench_gpu.SECTION_START, bench_gpu.SECTION_END)
    text = docs.read_text()
    assert text.count(bench_gpu.SECTION_START) == 1 and "GPU A" not in text and "GPU B" in text
    assert text.index("kept above") < text.index("GPU B") < text.index("kept below")
    assert f"{bench_gpu.SECTION_END}\n\nkept below" in text  # the blank line between stays
    row = next(line for line in text.splitlines() if "| bf16 |" in line)
    assert "| 2.50x |" in row  # throughput relative to the fp32 row


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without")
def test_without_a_gpu_it_stops_with_one_line(tmp_path, capsys):
    assert bench_gpu.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.slow
def test_every_measured_workload_has_an_estimate():
    names = set()
    parameters = {}
    for workload in workloads():
        e = estimate(workload)
        parameters[workload.name] = e["parameters"]
        assert e["fixed_bytes"] == 16 * e["parameters"], workload.name
        if workload.activations_estimable:
            assert e["per_sample_bytes"] > 0, workload.name
            total = e["fixed_bytes"] + workload.per_gpu_batch * e["per_sample_bytes"]
            assert e["total_bytes"] == total
        else:  # PVCNN2's sampling ops need point values: the GPU benchmark measures it
            assert e["total_bytes"] is None, workload.name
        names.add(workload.name)
    assert names == WORKLOADS
    # the networks are the recipes' own, at their original presets: the originals' counts
    assert parameters["pointcloud"] == 27_648_963 and parameters["crystal"] == 4_966_497
    assert parameters["quality"] - 18_598_217 < 100  # plus one reliability per annotator
    assert parameters["cricket"] == 18_142_593  # on the T20 download's vocabulary


@pytest.mark.slow
def test_smoke_trains_every_workload_a_step_on_this_device(tmp_path):
    """The command CI runs for the GPU benchmark: every workload, every precision, one step at
    a small size; its record goes to --out, docs/BENCHMARKS.md stays as it is."""
    docs = REPO / "docs" / "BENCHMARKS.md"
    before = docs.read_text()
    out = tmp_path / "smoke"
    command = [sys.executable, str(REPO / "benchmarks" / "bench_gpu.py"), "--smoke"]
    done = subprocess.run(
        [*command, "--out", str(out)], cwd=tmp_path, env=recipe_env(tmp_path),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((out / "gpu_bench.json").read_text())
    assert record["smoke"] and record["failed"] == {}
    assert set(record["results"]) == WORKLOADS
    for name, entry in record["results"].items():
        for precision in bench_gpu.PRECISIONS:
            r = entry[precision]
            assert r["samples_per_s"] > 0 and math.isfinite(r["samples_per_s"]), (name, r)
            assert math.isfinite(r["loss"]), (name, precision, r)
    assert "smoke run" in (out / "gpu_bench.md").read_text()
    assert docs.read_text() == before


def broken(message: str) -> object:
    """A stand-in for a workload's loss that fails as the quality workload did on the H100."""

    def loss(model: torch.nn.Module, batch: object) -> torch.Tensor:
        raise IndexError(message)

    return loss


def test_a_failing_workload_fails_the_smoke_run_and_the_others_still_run(tmp_path, monkeypatch):
    captioning = next(w for w in workloads(smoke=True) if w.name == "captioning")
    nan = replace(captioning, name="nan", loss=lambda m, b: captioning.loss(m, b) * math.nan)
    failing = replace(captioning, name="failing", loss=broken("index 7 is out of bounds"))
    monkeypatch.setattr(bench_gpu, "workloads", lambda smoke: [failing, captioning, nan])
    assert bench_gpu.main(["--smoke", "--out", str(tmp_path)]) == 1
    record = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert set(record["failed"]) == {"failing", "nan"}
    assert "index 7 is out of bounds" in record["failed"]["failing"]
    assert "not finite" in record["failed"]["nan"]
    assert set(record["results"]) == {"captioning"}  # a failure stops no other workload


def test_smoke_refuses_to_write_the_docs(tmp_path, capsys):
    docs = tmp_path / "BENCHMARKS.md"
    assert bench_gpu.main(["--smoke", "--out", str(tmp_path), "--docs", str(docs)]) == 2
    assert "--smoke" in capsys.readouterr().err and not docs.exists()
