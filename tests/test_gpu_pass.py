"""`make gpu-pass WHEELS=DIR`, the GPU pass on a machine without registry access, in the parts a
CPU can check: the wheels install from nothing but DIR and come first on each part's path, every
part runs under its timeout even after one before it failed, the exit code says whether all
passed, and GPU_OUT receives only the log and the parts' own files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.processes import REPO

# imported by every Python started with the unpacked wheels on its path: it notes the command
PROBE = """import os, sys
with open(os.environ["GPU_PASS_PROBE"], "a") as handle:
    handle.write(" ".join(sys.orig_argv) + "\\n")
"""


def probe_wheel(folder: Path) -> Path:
    """A pure wheel holding a sitecustomize module that records each Python it starts in."""
    folder.mkdir()
    info = "gpu_pass_probe-1.0.dist-info"
    files = {
        "sitecustomize.py": PROBE,
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: gpu-pass-probe\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    path = folder / "gpu_pass_probe-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
    return path


def make(tmp_path: Path, *variables: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPU_PASS_PROBE": str(tmp_path / "probe.txt"), "OMP_NUM_THREADS": "1"}
    command = ["make", "--no-print-directory", "gpu-pass", f"PYTHON={sys.executable}"]
    command += [f"GPU_SITE={tmp_path / 'site'}", f"GPU_OUT={tmp_path / 'out'}", *variables]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="nvidia-smi may list a GPU")
def test_a_machine_without_a_gpu_is_one_line_before_anything_runs(tmp_path):
    """It started, skipped every GPU test and reported the kernel comparison as passed."""
    probe_wheel(tmp_path / "wheels")
    result = make(tmp_path, f"WHEELS={tmp_path / 'wheels'}")
    assert result.returncode != 0
    (line,) = result.stderr.strip().splitlines()[:1]
    assert line.startswith("error: make gpu-pass: nvidia-smi lists no GPU on this machine")
    assert not (tmp_path / "site").exists() and not (tmp_path / "out").exists()


def test_a_folder_without_wheels_is_one_line_before_anything_runs(tmp_path):
    result = make(tmp_path, f"WHEELS={tmp_path / 'missing'}", "REQUIRE_GPU=0")
    assert result.returncode != 0
    (line,) = result.stderr.strip().splitlines()[:1]
    assert line.startswith(f"error: WHEELS={tmp_path / 'missing'}: no .whl files")
    assert "make wheelhouse" in line
    assert not (tmp_path / "site").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["file", "under-a-file", "read-only"])
def test_a_wheelhouse_dir_it_cannot_write_is_one_line_before_any_download(tmp_path, kind, request):
    """pip failed after resolving, in its own traceback-like report; PYTHON=false shows that
    nothing past the check runs."""
    (tmp_path / "file").write_text("keep\n")
    folder = {"file": tmp_path / "file", "under-a-file": tmp_path / "file" / "wheels"}.get(kind)
    if folder is None:
        folder = request.getfixturevalue("read_only_folder") / "wheels"
    command = ["make", "--no-print-directory", "wheelhouse", f"DIR={folder}", "PYTHON=false"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()[:1]
    assert line.startswith(f"error: DIR={folder}: ")
    expected = "cannot write in" if kind == "read-only" else "is a file, not a folder"
    assert expected in line and "(nothing was downloaded)" in line
    assert (tmp_path / "file").read_text() == "keep\n"


def test_the_dry_run_names_each_part_with_its_timeout_and_the_wheels_on_its_path(tmp_path):
    result = subprocess.run(
        ["make", "-n", "gpu-pass", "WHEELS=wheels", "GPU_SITE=site", "PCDIFF_SRC=/pcdiff"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    text = result.stdout
    assert "pip install --quiet --no-index --no-deps --target site wheels/*.whl" in text
    path = f"PYTHONPATH={REPO / 'site'}:{REPO} python3"
    assert f"timeout -k 5 270 env GPU_OUT={REPO / 'runs/gpu'} {path} -m pytest tests/gpu" in text
    bench = f"timeout -k 5 210 env PCDIFF_SRC=/pcdiff {path} benchmarks/bench_gpu.py --out runs/gpu"
    assert f"{bench} --docs docs/BENCHMARKS.md --budget 195 --steps 3 --warmup 1" in text
    assert f"timeout -k 5 60 env GPU_OUT={REPO / 'runs/gpu'} PCDIFF_SRC=/pcdiff {path}" in text
    assert ".venv" not in text  # no project install


@pytest.mark.slow
def test_every_part_runs_and_reports_and_only_its_files_land_in_gpu_out(tmp_path):
    """On a CPU (past the GPU check): the suite is stopped by a 1 s timeout, the benchmark fails
    (no CUDA), the kernel comparison skips every test, which is no pass; each ran with the
    wheels' module importable."""
    probe_wheel(tmp_path / "wheels")
    variables = ["SUITE_TIMEOUT=1", "GPU_WORKERS=0", "REQUIRE_GPU=0"]
    result = make(tmp_path, f"WHEELS={tmp_path / 'wheels'}", *variables)
    assert result.returncode != 0, result.stdout
    assert (tmp_path / "site" / "sitecustomize.py").is_file()
    log = (tmp_path / "out" / "gpu-pass.log").read_text()
    assert "== suite: TIMED OUT after 1 s" in log
    assert "== bench: FAILED (exit 2)" in log and "needs a CUDA GPU" in log
    assert "== kernels: RAN NOTHING (every test skipped, or none collected): not a pass" in log
    assert "passed" not in log.replace("every part passed", "")
    assert log.rstrip().endswith("== gpu-pass: failed: suite bench kernels")
    started = (tmp_path / "probe.txt").read_text()
    assert "benchmarks/bench_gpu.py" in started
    assert "tests/gpu/test_pointcloud_kernels_on_gpu.py" in started
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "gpu-pass.log",
        "gpu_kernels.xml",
    ]
