"""The GPU benchmark's parts that run anywhere: its smoke run takes every path on the CPU (every
workload a step, a compiled step, the point ops, pcdiff's parts skipped with a reason), so none
breaks or disappears unseen between GPU runs, and fails when one does; the targets and ratios are
read from the run's own rows; a time budget skips what would end too late, listing it; the
estimate covers every workload it measures; its section of docs/BENCHMARKS.md is rewritten in
place; and without CUDA a real run says so."""

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
from benchmarks.gpu import point_ops, report, steps
from benchmarks.gpu.point_ops import OPS
from benchmarks.gpu.steps import ORIGINAL, PRECISIONS, TORCH_OPS, Step
from benchmarks.memory_estimate import estimate
from benchmarks.original_sizes import workloads
from tests.processes import REPO, recipe_env
from tests.reference.pointcloud_kernels import ReferenceKernels

WORKLOADS = {"pointcloud", "quality", "captioning", "crystal", "cricket"}


TARGETS = [
    "pointcloud fp32 step <= the original's (eager)",
    "goal: pointcloud fp32 step <= half the original's (eager)",
    "pointcloud bf16 >= 1.3x fp32 (eager)",
    "pointcloud fp32 step <= the original's (compiled)",
    "goal: pointcloud fp32 step <= half the original's (compiled)",
    "pointcloud bf16 >= 1.3x fp32 (compiled)",
    "captioning compiled: bf16 >= 1.8x fp32",
    "captioning compiled bf16 >= 25% of the bf16 matmul peak",
]


def fake_row(step: Step, ms: float, tflops: float = 1.0) -> dict:
    return {"workload": step.workload, "precision": step.precision, "compiled": step.compiled,
            "variant": step.variant, "label": step.label, "size": "original", "batch": 8,
            "estimate_gib": 2.0, "samples_per_s": 8e3 / ms, "ms_per_step": ms, "warmup_s": 1.0,
            "peak_gib": 2.5, "tflops": tflops}  # fmt: skip


def fake_record(device: str = "GPU A") -> dict:
    """One run: the recipe's pointcloud 1000 ms against the original's 1250 (eager; compiled
    500 against 1250), bf16 700 ms (1.43x); captioning compiled 100 ms fp32, 50 bf16 at 150
    TFLOP/s of a 700 peak (21%); the original's compiled bf16 step skipped."""
    rows = [
        fake_row(Step("pointcloud", "no"), 1000.0),
        fake_row(Step("pointcloud", "bf16"), 700.0),
        fake_row(Step("pointcloud", "no", variant=TORCH_OPS), 2000.0),
        fake_row(Step("pointcloud", "no", variant=ORIGINAL), 1250.0),
        fake_row(Step("pointcloud", "no", compiled=True), 500.0),
        fake_row(Step("pointcloud", "bf16", compiled=True), 400.0),
        fake_row(Step("pointcloud", "no", compiled=True, variant=ORIGINAL), 1250.0),
        fake_row(Step("captioning", "no", compiled=True), 100.0),
        fake_row(Step("captioning", "bf16", compiled=True), 50.0, tflops=150.0),
    ]
    skipped = {Step("pointcloud", "bf16", variant=ORIGINAL).label: "the original's bf16 note"}
    record = {"device": device, "versions": "torch x", "date": "2026-01-01", "smoke": False,
              "matmul_tflops": 700.0, "steps": rows, "skipped": skipped, "failed": {}}  # fmt: skip
    report.add_ratios(rows)
    return record | {"targets": report.targets(record)}


def test_the_targets_are_read_from_the_runs_own_rows():
    results = {t["target"]: t["result"] for t in fake_record()["targets"]}
    assert list(results) == TARGETS
    assert results[TARGETS[0]] == "PASS" and results[TARGETS[1]] == "MISS"  # 0.8x, not 0.5x
    assert results[TARGETS[2]] == "PASS"  # 1000 / 700 = 1.43x
    assert results[TARGETS[3]] == results[TARGETS[4]] == "PASS"  # 500 of 1250 ms: 0.4x
    assert results[TARGETS[5]] == "MISS"  # 500 / 400 = 1.25x
    assert results[TARGETS[6]] == "PASS" and results[TARGETS[7]] == "MISS"  # 2x; 150 of 700


def test_a_missing_row_leaves_its_targets_unmeasured_saying_why():
    record = fake_record()
    record["steps"] = [r for r in record["steps"] if r["variant"] != ORIGINAL]
    record["skipped"][Step("pointcloud", "no", variant=ORIGINAL).label] = "set PCDIFF_SRC"
    results = {t["target"]: t["result"] for t in report.targets(record)}
    assert results[TARGETS[0]] == "UNMEASURED (pointcloud (original) fp32 eager: set PCDIFF_SRC)"
    assert "not in this run" in results[TARGETS[3]]
    assert results[TARGETS[2]] == "PASS"  # the others are still read


def test_ratios_are_speedups_against_the_same_runs_anchors():
    rows = {r["label"]: r for r in fake_record()["steps"]}
    assert rows["pointcloud bf16 eager"]["vs_fp32"] == pytest.approx(1000 / 700)
    assert rows["pointcloud fp32 compiled"]["vs_eager"] == pytest.approx(2.0)
    assert rows["pointcloud fp32 eager"]["vs_original"] == pytest.approx(1.25)
    assert rows["pointcloud fp32 eager"]["vs_torch_ops"] == pytest.approx(2.0)
    assert rows["pointcloud bf16 compiled"]["vs_original"] is None  # its anchor was skipped
    assert rows["pointcloud (original) fp32 eager"]["vs_original"] is None  # not its own anchor


def test_its_section_replaces_itself_and_keeps_the_rest(tmp_path):
    docs = tmp_path / "BENCHMARKS.md"
    docs.write_text("# Benchmarks\n\nkept above\n")
    first = report.section(fake_record("GPU A"), bench_gpu.SMOKE_MATMUL)
    write_section(docs, first, report.SECTION_START, report.SECTION_END)
    docs.write_text(docs.read_text() + "\nkept below\n")
    second = report.section(fake_record("GPU B"), bench_gpu.SMOKE_MATMUL)
    write_section(docs, second, report.SECTION_START, report.SECTION_END)
    text = docs.read_text()
    assert text.count(report.SECTION_START) == 1 and "GPU A" not in text and "GPU B" in text
    assert text.index("kept above") < text.index("GPU B") < text.index("kept below")
    assert f"{report.SECTION_END}\n\nkept below" in text  # the blank line between stays
    row = next(line for line in text.splitlines() if "| pointcloud | recipe | bf16 | eager" in line)
    assert "| 1.43x |" in row  # speed-up against the fp32 row
    assert "| the original's bf16 note" not in text and "skipped: pointcloud (original)" in text
    assert f"| {TARGETS[1]} | 1000 ms against 1250 ms (0.80x the original's time) | MISS |" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without")
def test_without_a_gpu_it_stops_with_one_line(tmp_path, capsys):
    assert bench_gpu.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("kind", ["file", "read-only"])
def test_an_out_it_cannot_write_is_one_line_before_the_work(tmp_path, capsys, kind, request):
    """It failed at the first table, after a measurement (minutes on a GPU), in a traceback."""
    if kind == "file":
        out = tmp_path / "table"
        out.write_text("keep\n")
    else:
        out = request.getfixturevalue("read_only_folder") / "gpu"
    assert bench_gpu.main(["--smoke", "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: --out {out}: ")
    assert ("is a file, not a folder" if kind == "file" else "cannot write in") in line
    assert not out.exists() or out.read_text() == "keep\n"


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
def test_smoke_takes_every_path_of_the_benchmark_on_this_device(tmp_path):
    """The command CI runs for the GPU benchmark, at small sizes, one step: every workload at
    every precision, pointcloud on its plain-PyTorch ops, one compiled step, each point op
    forward and backward, the targets; pcdiff's parts (and, without CUDA, Triton's) skipped
    with a reason. Its record goes to --out, docs/BENCHMARKS.md stays as it is. A part that
    disappears from the run fails here."""
    docs = REPO / "docs" / "BENCHMARKS.md"
    before = docs.read_text()
    out = tmp_path / "smoke"
    command = [sys.executable, str(REPO / "benchmarks" / "bench_gpu.py"), "--smoke"]
    env = recipe_env(tmp_path) | {"PCDIFF_SRC": ""}
    done = subprocess.run(
        [*command, "--out", str(out)], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((out / "gpu_bench.json").read_text())
    assert record["smoke"] and record["failed"] == {}
    rows = {r["label"]: r for r in record["steps"]}
    expected = [Step(w, p) for w in sorted(WORKLOADS) for p in PRECISIONS]
    expected += [Step("pointcloud", "no", variant=TORCH_OPS)]
    expected += [Step("captioning", p, compiled=True) for p in ("no", "bf16")]
    assert set(rows) == {s.label for s in expected}
    for label, r in rows.items():
        assert r["samples_per_s"] > 0 and math.isfinite(r["samples_per_s"]), (label, r)
        assert math.isfinite(r["loss"]) and r["tflops"] >= 0, (label, r)
    assert rows["captioning fp32 compiled"]["vs_eager"] > 0  # the ratio against its eager row
    assert rows["captioning bf16 compiled"]["compiler"] == "aot_eager"
    assert rows["captioning bf16 eager"]["compiler"] == "no"
    assert rows["pointcloud bf16 eager"]["vs_fp32"] > 0
    original = {Step("pointcloud", p, variant=ORIGINAL).label for p in ("no", "bf16")}
    assert set(record["skipped"]) == original
    assert all("PCDIFF_SRC" in why for why in record["skipped"].values())
    calls = record["ops"]["calls"]
    assert {c["op"] for c in calls} == set(OPS)
    for call in calls:
        timed = call["torch"]
        assert timed["forward_ms"] > 0, call
        has_backward = call["op"] not in ("furthest_point_sample", "ball_query")
        assert (timed["backward_ms"] is not None) == has_backward, call
    assert "PCDIFF_SRC" in record["ops"]["backends"]["pcdiff"]
    if not torch.cuda.is_available():
        assert "no CUDA" in record["ops"]["backends"]["triton"]
    assert [t["target"] for t in record["targets"]] == TARGETS
    results = {t["target"]: t["result"].split()[0] for t in record["targets"]}
    assert set(results.values()) <= {"PASS", "MISS", "UNMEASURED"}
    assert results[TARGETS[0]] == "UNMEASURED"  # no original here
    assert results[TARGETS[6]] in ("PASS", "MISS")  # captioning compiled in both precisions
    table = (out / "gpu_bench.md").read_text()
    assert "smoke run" in table and "| captioning | recipe | fp32 | compiled |" in table
    for heading in ("### Targets", "### Training steps", "### Point ops"):
        assert heading in table
    assert all(f": {target}" in done.stdout for target in TARGETS)  # one line each, printed
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
    monkeypatch.setattr("benchmarks.gpu.steps.SMOKE_COMPILED", "none")  # no compile here
    assert bench_gpu.main(["--smoke", "--out", str(tmp_path)]) == 1
    record = json.loads((tmp_path / "gpu_bench.json").read_text())
    labels = {f"{name} {p} eager" for name in ("failing", "nan") for p in ("fp32", "bf16", "fp16")}
    assert set(record["failed"]) == labels
    assert "index 7 is out of bounds" in record["failed"]["failing fp32 eager"]
    assert "not finite" in record["failed"]["nan bf16 eager"]
    assert {r["workload"] for r in record["steps"]} == {"captioning"}  # the others still ran
    assert len(record["steps"]) == 3


def test_a_time_budget_skips_what_would_end_too_late_and_lists_it(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_gpu, "RESERVE", {"eager": 1e6, "compiled": 1e6, "ops": 1e6})
    assert bench_gpu.main(["--smoke", "--out", str(tmp_path), "--budget", "60"]) == 0
    record = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert record["steps"] == [] and "ops" not in record
    assert set(record["skipped"]) >= {"point ops", "pointcloud fp32 eager", "cricket fp16 eager"}
    assert all(why == "time budget (60.0 s)" for why in record["skipped"].values())
    assert all(t["result"].startswith("UNMEASURED") for t in record["targets"])
    assert (
        "skipped: captioning fp32 compiled: time budget" in (tmp_path / "gpu_bench.md").read_text()
    )


def test_smoke_refuses_to_write_the_docs(tmp_path, capsys):
    docs = tmp_path / "BENCHMARKS.md"
    assert bench_gpu.main(["--smoke", "--out", str(tmp_path), "--docs", str(docs)]) == 2
    assert "--smoke" in capsys.readouterr().err and not docs.exists()


def test_the_point_ops_drive_pcdiffs_interface_as_its_kernels_take_it():
    """pcdiff's side of the point-op timings, on the CPU: its backend's interface implemented by
    the brute-force transcriptions of its kernels (tests/reference), so that a wrong argument
    order or return shape fails here and not on the next GPU with PCDIFF_SRC."""
    pointcloud = next(w for w in workloads(smoke=True) if w.name == "pointcloud")
    reasons = {"torch": "", "triton": "not here", "pcdiff": ""}
    ops = point_ops.run_ops(pointcloud, ReferenceKernels, reasons, repeats=1)
    assert {c["op"] for c in ops["calls"]} == set(OPS)
    for call in ops["calls"]:
        assert "error" not in call["pcdiff"], call
        no_backward = call["op"] in ("furthest_point_sample", "ball_query")
        assert (call["pcdiff"]["backward_ms"] is None) == no_backward, call
        assert "triton" not in call
    table = "\n".join(report.ops_table(ops))
    assert "- not run: triton: not here" in table
    row = next(line for line in table.splitlines() if line.startswith("| grouping |"))
    cells = [cell.strip() for cell in row.split("|")[1:-1]]
    assert len(cells) == 10 and cells[4:6] == ["", ""]  # Triton: not timed
    assert all(float(cell) > 0 for cell in cells[2:4] + cells[6:8])  # PyTorch's, pcdiff's


def test_the_full_plan_measures_the_targets_steps_first_and_every_variant():
    names = ["pointcloud", "quality", "captioning", "crystal", "cricket"]
    first, rest = steps.plan(names, smoke=False)
    assert [s.label for s in first] == [
        "pointcloud fp32 eager", "pointcloud bf16 eager", "captioning fp32 eager",
        "captioning bf16 eager", "pointcloud (original) fp32 eager",
        "pointcloud (original) bf16 eager", "captioning fp32 compiled", "captioning bf16 compiled",
    ]  # fmt: skip
    labels = {s.label for s in rest}
    for name in ("pointcloud", "crystal"):
        assert {f"{name} fp32 compiled", f"{name} bf16 compiled"} <= labels
    assert {"pointcloud (original) fp32 compiled", "pointcloud (original) bf16 compiled"} <= labels
    assert "pointcloud (recipe, PyTorch ops) fp32 eager" in labels
    assert not any(s.compiled for s in rest if s.workload in ("quality", "cricket"))
    assert len(first) + len(rest) == 5 * 3 + 3 * 2 + 4 + 1


def test_pointcloud_on_plain_pytorch_ops_is_not_compiled(monkeypatch):
    """dynamo would unroll farthest-point sampling's loop (13,600 centres at the original's
    size) for minutes: the step is skipped, saying why."""
    monkeypatch.setenv("POINTCLOUD_KERNELS", "torch")
    pointcloud = next(w for w in workloads(smoke=True) if w.name == "pointcloud")
    with pytest.raises(steps.Skipped, match="plain-PyTorch point ops"):
        steps.run(steps.Step("pointcloud", "no", compiled=True), pointcloud, "", True, 1, 0)
