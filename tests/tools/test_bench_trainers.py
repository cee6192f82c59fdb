"""The end-to-end benchmark against the originals' trainers (benchmarks/bench_trainers.py), in the
parts that run anywhere: its smoke runs take the recipes' trainers through the whole harness
(the example data in the original's layout, the process, its step log, the timed loop on a GPU,
the table), on the GPU workload (pcdiff) and on the CPU ones (cricket, crystal), and list every
original whose source is not given or not there, or that it cannot drive, as not run in one
line; the example data gives pcdiff's loader exactly the steps asked for; a module an original's
trainer imports that this Python lacks is reported for that workload, not a crash; stepped.py
logs an original's optimizer steps; a side is stopped once its steps are logged. With an
original's source exported under .originals/ (or its variable), its own trainer is started on
the example data too; CI has no originals' source, so those tests skip there, saying why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import bench_trainers
from benchmarks.trainers import pointcloud
from benchmarks.trainers.side import STEPPED, Side, stepped_times
from tests.processes import REPO, recipe_env

PCDIFF = Path(os.environ.get("PCDIFF_SRC") or REPO / ".originals" / "pcdiff")
CRICKET = Path(os.environ.get("CRICKET_SRC") or REPO / ".originals" / "cricketmodel")
COMFORMER = Path(os.environ.get("COMFORMER_SRC") or REPO / ".originals" / "comformer")


def smoke(tmp_path: Path, env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "benchmarks" / "bench_trainers.py"), "--smoke"]
    command += ["--out", str(tmp_path / "out"), "--steps", "2", "--warmup", "1", *flags]
    return subprocess.run(command, cwd=tmp_path, env=recipe_env(tmp_path) | env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.slow
def test_smoke_runs_the_recipe_end_to_end_and_lists_what_did_not_run(tmp_path):
    docs = REPO / "docs" / "BENCHMARKS.md"
    before = docs.read_text()
    sources = {t.variable: "" for t in bench_trainers.TRAINERS}
    done = smoke(tmp_path, sources)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "trainers_bench.json").read_text())
    entries = {e["workload"]: e for e in record["workloads"]}
    assert list(entries) == ["pointcloud", "quality"]  # cricket, crystal: --cpu
    assert entries["quality"]["why"] == bench_trainers.QUALITY_WHY
    (recipe,) = entries["pointcloud"]["recipe"]
    assert "why" not in recipe and recipe["logged_steps"] == 3, recipe
    assert recipe["wall_s"] > 0 and recipe["steps_per_s"] == pytest.approx(3 / recipe["wall_s"])
    assert recipe["samples_per_s"] == pytest.approx(8 * recipe["steps_per_s"])
    assert recipe["steady_samples_per_s"] > 0 and recipe["step_ms"] > 0
    assert 0 < recipe["first_step_s"] < recipe["wall_s"]
    assert entries["pointcloud"]["original"] == [
        {"ran": False, "why": "not run: PCDIFF_SRC not given"}
    ]
    assert entries["pointcloud"]["ratios"] == {}
    table = (tmp_path / "out" / "trainers_bench.md").read_text()
    assert "smoke run" in table and "| pointcloud | recipe |" in table
    assert "| pointcloud | original |" in table and "PCDIFF_SRC not given" in table
    assert docs.read_text() == before


def test_the_example_data_gives_pcdiffs_loader_exactly_the_steps():
    """train_completion.py's loader: 5 samples per skull, batch 8, drop_last; --niter 1."""
    for steps in range(1, 60):
        assert pointcloud.DEFECTS * pointcloud.skulls_for(steps) // 8 == steps


def test_a_module_its_trainer_imports_missing_here_is_reported_not_run(tmp_path, monkeypatch):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train_completion.py").write_text("raise SystemExit('must not run')\n")
    monkeypatch.setattr(pointcloud, "missing_modules", lambda names: names[:1])
    side = pointcloud.original(tmp_path / "src", tmp_path, tmp_path / "w", 3, True)
    row = bench_trainers.run_side(side, 3, 1, 10)
    assert row == {"ran": False, "why": "missing here: matplotlib"}
    assert not (tmp_path / "w" / "w.out").exists()  # nothing was started


def test_a_side_keeps_the_inherited_python_path_behind_its_own(tmp_path, monkeypatch):
    """On the GPU machine PYTHONPATH holds the unpacked wheels (`make bench-gpu WHEELS=`): the
    recipe's process replaced it with the project's folder and lost them."""
    monkeypatch.setenv("PYTHONPATH", "/wheels")
    side = pointcloud.recipe(tmp_path, tmp_path, 3, smoke=True)
    env = bench_trainers.process_env(side.env)
    assert env["PYTHONPATH"] == os.pathsep.join([str(REPO), "/wheels"])
    monkeypatch.delenv("PYTHONPATH")
    assert bench_trainers.process_env(side.env)["PYTHONPATH"] == str(REPO)


def test_a_process_past_its_timeout_is_stopped_with_its_children_and_said(tmp_path):
    """pcdiff's trainer starts 24 data workers: a timeout that stopped only the trainer left
    them running on the GPU machine."""
    child = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
    child += "'import time; time.sleep(60)']); open('child', 'w').write(str(p.pid)); time.sleep(60)"
    side = Side([sys.executable, "-c", child], tmp_path / "run")
    row = bench_trainers.run_side(side, 3, 1, timeout=3)
    assert row["why"] == "timed out after 3 s, 0 of 3 steps logged" and row["wall_s"] < 20
    stat = Path(f"/proc/{(tmp_path / 'run' / 'child').read_text()}/stat")
    for _ in range(50):  # gone, or a zombie where nothing reaps orphans
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError("its child outlived the timeout")


def test_pcdiffs_step_lines_are_read_from_its_printed_log(tmp_path):
    lines = [
        "2026-11-27 15:34:07,026 : Dataset: 25 samples, 3 batches/epoch/rank",
        "2026-11-27 15:34:08,000 : [  0/  1][  0/  3]    loss:     1.0000,    grad_norm:  2.0",
        "2026-11-27 15:34:08,000 : [  0/  1][  0/  3]    loss:     1.0000,    grad_norm:  2.0",
        "2026-11-27 15:34:09,500 : [  0/  1][  1/  3]    loss:     0.9000,    grad_norm:  2.0",
    ]
    (tmp_path / f"{tmp_path.name}.out").write_text("\n".join(lines[:2] + lines[3:]) + "\n")
    times = pointcloud.pcdiff_step_times(tmp_path)
    assert len(times) == 2 and times[1] - times[0] == pytest.approx(1.5)


@pytest.mark.slow
@pytest.mark.skipif(
    not (PCDIFF / "train_completion.py").is_file(),
    reason=f"pcdiff's source is not here ({PCDIFF}: export pcdiff-implant @115a399's pcdiff/ "
    "folder as .originals/pcdiff/, or set PCDIFF_SRC); CI has no originals' source",
)
def test_with_pcdiffs_source_its_own_trainer_reads_the_example_data(tmp_path):
    """Its own train_completion.py on the example data in its layout, at the smallest sizes its
    flags allow: on a CPU its fallback ops (Python loops) take minutes a step, so the run is
    cut at its timeout and the record says so; what is checked is that it started, found every
    file of the layout and planned exactly the steps asked for, and that its source stayed as
    it was."""
    before = sorted(p.name for p in PCDIFF.iterdir())
    done = smoke(tmp_path, {"PCDIFF_SRC": str(PCDIFF)}, "--only", "pointcloud",
                 "--original-timeout", "20")  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "trainers_bench.json").read_text())
    (entry,) = record["workloads"]
    (original,) = entry["original"]
    assert original["ran"], original
    log = Path(original["log"]).read_text()
    assert "Dataset: 25 samples, 3 batches/epoch/rank" in log, log[-2000:]
    assert "Traceback" not in log, log[-2000:]
    if "why" in original:  # cut at its timeout: said, with the steps it logged
        assert original["why"].startswith("timed out after 20 s"), original
    else:
        assert original["logged_steps"] == 3 and entry["ratios"]["samples_per_s"]["ratio"] > 0
    assert sorted(p.name for p in PCDIFF.iterdir()) == before  # its runs/ went to the copy


def test_make_bench_gpu_runs_it_after_the_step_benchmark_with_every_source():
    result = subprocess.run(
        ["make", "-n", "bench-gpu", "WHEELS=wheels", "GPU_SITE=site", "PCDIFF_SRC=/pcdiff",
         "CRICKET_SRC=/cricket"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    text = result.stdout
    assert "rm -f runs/gpu/gpu_bench.* runs/gpu/trainers_bench.*" in text
    sources = "PCDIFF_SRC=/pcdiff COMFORMER_SRC= CROWDBT_SRC= CRICKET_SRC=/cricket"
    command = f"timeout -k 5 360 env {sources} PYTHONPATH={REPO / 'site'}:{REPO} python3 "
    command += "benchmarks/bench_trainers.py --out runs/gpu --work runs/trainers --docs "
    command += "docs/BENCHMARKS.md --timeout 120 --original-timeout 180 --steps 5 --warmup 2"
    assert command in text
    assert text.index("benchmarks/bench_gpu.py") < text.index("benchmarks/bench_trainers.py")


@pytest.mark.slow
def test_cpu_smoke_runs_the_cricket_and_crystal_recipes_and_skips_absent_originals(tmp_path):
    """`make bench`'s part (--cpu) on the recipes' side: each preset's process, its time to
    first step and rates, and each original absent in one line (not given; given, not there)."""
    docs = REPO / "docs" / "BENCHMARKS.md"
    before = docs.read_text()
    absent = tmp_path / "no-cricketmodel"
    done = smoke(tmp_path, {"CRICKET_SRC": str(absent), "COMFORMER_SRC": ""}, "--cpu")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "trainers_bench.json").read_text())
    entries = {e["workload"]: e for e in record["workloads"]}
    assert list(entries) == ["crystal", "quality", "cricket"]
    assert record["device"] == "CPU" and "cores" in record["machine"]
    for name in ("crystal", "cricket"):
        (recipe,) = entries[name]["recipe"]
        assert "why" not in recipe and recipe["logged_steps"] == 3, recipe
        assert entries[name]["batch"] == 8
        assert 0 < recipe["first_step_s"] < recipe["wall_s"]
        assert recipe["samples_per_s"] == pytest.approx(8 * 3 / recipe["wall_s"])
        assert recipe["steady_samples_per_s"] > 0 and "step_ms" not in recipe
        assert entries[name]["ratios"] == {}
    assert entries["crystal"]["original"] == [
        {"ran": False, "why": "not run: COMFORMER_SRC not given"}
    ]
    assert entries["cricket"]["original"] == [
        {
            "ran": False,
            "why": f"missing here: {absent}/train.py (CRICKET_SRC: lyndonkl/cricketmodel @a97d68e)",
        }
    ]
    assert entries["quality"]["why"] == bench_trainers.QUALITY_WHY
    # its graphs built in the run, not read from a cache an earlier run left: as the originals'
    (crystal,) = entries["crystal"]["recipe"]
    assert " graphs built in " in Path(crystal["log"]).read_text()
    table = (tmp_path / "out" / "trainers_bench.md").read_text()
    assert "| cricket | recipe | 1 |" in table and "| crystal | original | 1 |" in table
    assert f"CRICKET_SRC={absent} python benchmarks/bench_trainers.py --smoke" in table
    assert " --cpu" in table and "cores" in table
    assert table.startswith(bench_trainers.CPU_SECTION_START)
    assert docs.read_text() == before


def test_ratios_are_of_the_repeats_means_with_their_min_and_max():
    entry = {
        "recipe": [{"samples_per_s": 30.0, "first_step_s": 5.0}, {"samples_per_s": 50.0}],
        "original": [{"samples_per_s": 10.0, "first_step_s": 50.0}, {"samples_per_s": 10.0}],
    }
    found = bench_trainers.ratios(entry)
    assert found == {"samples_per_s": {"ratio": 4.0, "min": 3.0, "max": 5.0}}  # 80 / 20
    entry["recipe"][1]["first_step_s"], entry["original"][1]["first_step_s"] = 15.0, 50.0
    entry["recipe"][0]["step_ms"], entry["original"][0]["step_ms"] = 100.0, 300.0
    entry["recipe"][1]["step_ms"], entry["original"][1]["step_ms"] = 100.0, 100.0
    found = bench_trainers.ratios(entry)
    assert found["first_step_s"] == {"ratio": 0.2, "min": 0.1, "max": 0.3}  # recipe / original
    assert found["step_ms"] == {"ratio": 2.0, "min": 1.0, "max": 3.0}  # original / recipe


TRAINS = """import torch
model = torch.nn.Linear(2, 1)
optimizer = torch.optim.AdamW(model.parameters())
for _ in range({steps}):
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
"""


def test_stepped_logs_each_optimizer_step_of_a_script_and_of_a_function(tmp_path):
    """Neither original logs a time per step: stepped.py runs it unchanged and logs one after
    each optimizer step, for a trainer run as a script (cricketmodel's train.py, its argv
    and folder as `python train.py` gives them) and as a function (ComFormer's Python API)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text(
        "import sys, helper\nassert sys.argv[1:] == ['--steps', '3']\n"
        + TRAINS.format(steps="int(sys.argv[2])")
    )
    (src / "helper.py").write_text("")  # found beside its script, as `python train.py` finds it
    (src / "api.py").write_text(
        "def train(steps):\n"
        + "".join(f"    {line}\n" for line in TRAINS.format(steps="steps").splitlines())
    )
    for name, how in (("script", ["--script", str(src / "train.py"), "--steps", "3"]),
                      ("call", ["--call", "api:train", json.dumps({"steps": 3})])):  # fmt: skip
        run = tmp_path / name
        run.mkdir()
        env = os.environ | {"PYTHONPATH": str(src)}
        done = subprocess.run([sys.executable, str(STEPPED), *how], cwd=run, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        times = stepped_times(run)
        assert len(times) == 3 and times == sorted(times), times


def test_a_side_that_stops_when_logged_is_stopped_once_its_steps_are_logged(tmp_path):
    """The CPU workloads' sides: what comes after the steps (evaluation, export) is no part of
    the comparison; the process and its children are stopped there and the run counts."""
    logs = "import json, time\nwith open('steps.jsonl', 'a', buffering=1) as f:\n"
    logs += "    for i in range(3): f.write(json.dumps({'time': time.time()}) + '\\n')\n"
    logs += "time.sleep(120)\n"
    side = Side([sys.executable, "-c", logs], tmp_path / "run", step_times=stepped_times)
    side.stop_when_logged = True
    row = bench_trainers.run_side(side, 3, 1, timeout=100, batch=4)
    assert "why" not in row and row["logged_steps"] == 3 and row["wall_s"] < 60, row
    assert row["samples_per_s"] == pytest.approx(12 / row["wall_s"]) and row["first_step_s"] > 0


def test_make_bench_runs_the_cpu_trainers_from_the_originals_folder_or_the_given_source():
    def dry(*variables: str) -> str:
        return subprocess.run(["make", "-n", "bench", *variables], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout  # fmt: skip

    command = "OMP_NUM_THREADS=1 CRICKET_SRC={} COMFORMER_SRC={} \\\n  .venv/bin/python "
    command += "benchmarks/bench_trainers.py --cpu --out runs/trainers-cpu \\\n  --docs "
    command += "docs/BENCHMARKS.md --steps 2 --warmup 1 --repeats 2 --timeout 900"
    text = dry()
    assert command.format(".originals/cricketmodel", ".originals/comformer") in text
    assert "git archive a97d68e src train.py | tar -x -C .originals/cricketmodel" in text
    assert "pip install --no-deps --target .originals/deps/comformer jarvis-tools" in text
    assert command.format("/c", "/x") in dry("CRICKET_SRC=/c", "COMFORMER_SRC=/x")


@pytest.mark.slow
@pytest.mark.skipif(
    not (CRICKET / "train.py").is_file() or not (COMFORMER / "comformer").is_dir(),
    reason=f"cricketmodel's or ComFormer's source is not here ({CRICKET}, {COMFORMER}: `make "
    "bench` says how to fetch them); CI has no originals' source",
)
def test_with_the_originals_source_their_own_trainers_run_beside_the_recipes(tmp_path):
    """cricketmodel's train.py and ComFormer's train_from_extxyz, unchanged, on the example
    data at the smoke's sizes: each logs the steps asked for, and the ratios are there."""
    sources = {"CRICKET_SRC": str(CRICKET), "COMFORMER_SRC": str(COMFORMER)}
    done = smoke(tmp_path, sources, "--cpu", "--only", "cricket", "crystal", "--timeout", "280")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "trainers_bench.json").read_text())
    for entry in record["workloads"]:
        (original,) = entry["original"]
        assert "why" not in original and original["logged_steps"] == 3, original
        assert set(entry["ratios"]) == {"samples_per_s", "steady_samples_per_s", "first_step_s"}


def test_the_cpu_and_gpu_parts_each_rewrite_only_their_own_section(tmp_path):
    """`make bench` (--cpu) and `make bench-gpu` write the same docs/BENCHMARKS.md: neither
    replaces the other's table."""
    from accel_common.tools.bench.report import write_section

    record = {"device": "CPU", "machine": "m", "versions": "v", "date": "d", "smoke": False,
              "steps": 2, "warmup": 1, "repeats": 2, "workloads": []}  # fmt: skip
    docs = tmp_path / "BENCHMARKS.md"
    for cpu in (False, True, True):
        text = bench_trainers.section(record | {"cpu": cpu}, f"run {cpu}")
        write_section(docs, text, *bench_trainers.markers(cpu))
    written = docs.read_text()
    assert written.count("run False") == 1 and written.count("run True") == 1
    assert written.count(bench_trainers.SECTION_START) == 1
    assert written.count(bench_trainers.CPU_SECTION_START) == 1
