"""Running recipes in the tests: as real processes (1 process, or 2 CPU processes over gloo;
forked from a server that imported torch, tests/forked.py), or a recipe's command in this
process through Typer's test runner; the recipes' paths and the tests' small model sizes."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accel_common.tools.check import processes as checked_runs
from accel_common.tools.check.processes import recipe_env  # re-exported for the tests
from accel_common.tools.ports import free_port  # re-exported for the tests
from tests import forked

if TYPE_CHECKING:
    import pytest

    from accel_common.tools.check.recipe import Recipe

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "recipes" / "train_template.py"
POINTCLOUD = REPO / "recipes" / "train_pointcloud.py"
QUALITY = REPO / "recipes" / "train_quality.py"
CAPTIONING = REPO / "recipes" / "train_captioning.py"
CAPTIONING_TINY = ["--dim", "32", "--depth", "1", "--decoder-depth", "1"]
CRYSTAL = REPO / "recipes" / "train_crystal.py"
CRYSTAL_TINY = ["--width", "16", "--layers", "2", "--max-neighbors", "8", "--rbf-bins", "16"]
# a point-cloud model small enough for many short runs in the tests
# (PVCNN2 at its narrowest, 4^3 voxels; dropout off so that 1 and 2 processes compute alike)
POINTCLOUD_TINY = ["--num-points", "256", "--num-nn", "32", "--vox-res-mult", "0.125"]
POINTCLOUD_TINY += ["--num-neighbors", "8", "--embed-dim", "16", "--dropout", "0"]
POINTCLOUD_TINY += ["--head-dropout", "0", "--sampler", "ddim"]
CRICKET = REPO / "recipes" / "train_cricket.py"
CRICKET_TINY = ["--hidden", "16", "--heads", "2", "--layers", "2", "--history", "6"]
CPU_2PROC = REPO / "accelerate_configs" / "cpu_2proc.yaml"
BIN = Path(sys.executable).parent


# `accelerate launch` as a module: the `accelerate` command imports every subcommand, and its
# memory estimator brings timm and torchvision (~8 CPU-s per launch instead of ~4)
ACCELERATE_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]


def launch_command(script: Path, args: list[str], nproc: int) -> list[str]:
    """What a user types: `python script` or `accelerate launch` on 2 CPU processes."""
    if nproc == 1:
        return [sys.executable, str(script), *args]
    return [
        *ACCELERATE_LAUNCH,
        "--config_file", str(CPU_2PROC),
        "--num_processes", str(nproc),
        "--main_process_port", str(free_port()),
        str(script), *args,
    ]  # fmt: skip


def kill_once_written(script: Path, args: list[str], *, cwd: Path, marker: Path) -> None:
    """Run `python script args` and SIGKILL it, its whole session, as soon as `marker` exists
    (a checkpoint's last file): a crash at whatever point the run had reached by then."""
    why = checked_runs.kill_once_written(script, args, cwd=cwd, marker=marker, start=forked.start)
    assert why is None, why


def run_processes(
    script: Path, args: list[str], nproc: int, *, cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    """`python script args` as one process, or as `nproc` ranks over gloo given the environment
    torchrun gives its workers (accel_common.tools.check.processes.run_processes); each process
    is forked from a server that has imported torch already, or, where CUDA is present, a fresh
    interpreter (tests/forked.py).

    No launcher process: `accelerate launch` is one more Python process importing torch and
    Accelerate per run, and the tests that compare N processes with one do not need it; the
    launchers are tested where they matter (test_launch, test_processes, test_multinode,
    test_recovery, test_nonfinite, test_sharded), with real `accelerate launch` processes.
    """
    return checked_runs.run_processes(
        script, args, nproc, cwd=cwd, env=env, timeout=timeout, start=forked.start
    )


def run_recipe(
    args: list[str],
    *,
    cwd: Path,
    nproc: int = 1,
    script: Path = TEMPLATE,
    check: bool = True,
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """Run a recipe as real processes: one, or `nproc` ranks over gloo (see `run_processes`)."""
    env = recipe_env(cwd)
    result = run_processes(script, args, nproc, cwd=cwd, env=env, timeout=timeout)
    if check and result.returncode != 0:
        output = f"{result.stdout}\n{result.stderr}"
        raise AssertionError(f"recipe failed ({result.returncode}):\n{output}")
    return result


def run_together(jobs: dict[str, tuple[Path, list[str], Path]], timeout: float = 600) -> None:
    """Independent one-process runs {name: (script, args, cwd)} at the same time (the GPU suite:
    one GPU has room for several small runs, and start-up is most of each); fails naming the
    first run that failed, with its output, once all have ended."""
    logs = Path(tempfile.mkdtemp(prefix="together-"))
    children = {}
    for name, (script, args, cwd) in jobs.items():
        (logs / name).mkdir()
        children[name] = forked.start(script, args, cwd=cwd, env=recipe_env(cwd), logs=logs / name)
    deadline = time.monotonic() + timeout
    for child in children.values():
        child.join(max(deadline - time.monotonic(), 0))
    late = [name for name, child in children.items() if child.exitcode is None]
    for name in late:
        children[name].kill()
        children[name].join()
    failed = [(name, child.exitcode) for name, child in children.items() if child.exitcode]
    outputs = {name: (logs / name / "out").read_text() + (logs / name / "err").read_text()
               for name, _ in failed}  # fmt: skip
    shutil.rmtree(logs)
    if late:
        raise AssertionError(f"runs {late} still running after {timeout} s: killed")
    if failed:
        name, code = failed[0]
        raise AssertionError(f"run {name} failed ({code}):\n{outputs[name]}")


def run_to_the_end(
    recipe: Recipe,
    args: list[str],
    cwd: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> str:
    """Run the recipe to the end in this process and return what it printed, set up as
    run_recipe sets up a process (one thread, the datasets cache under cwd/hf, so it shares a
    killed run's preprocessing cache). Only a killed run needs a process of its own: the
    recipes' imports beyond torch (datasets, PyG, tokenizers) cost 1 to 4 CPU-s a process, as
    much as a small run's training."""
    import datasets
    import torch
    from accelerate.state import AcceleratorState

    from accel_common.recipe_cli.entry import train_in_python

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cwd / "hf" / "datasets"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    capsys.readouterr()
    try:
        train_in_python(recipe.module.train, args, cwd, script=recipe.script)
    finally:
        torch.set_num_threads(threads)
        AcceleratorState._reset_state(reset_partial_state=True)
    return capsys.readouterr().out


def invoke_train(train: Callable[..., Any], args: list[str]) -> Any:
    """A recipe's training command in this process, through Typer's test runner."""
    import typer
    from typer.testing import CliRunner

    app = typer.Typer()
    app.command()(train)
    return CliRunner().invoke(app, args)


def dry_run_plan(train: Callable[..., Any], args: list[str]) -> dict[str, str]:
    """A recipe's `--dry-run` in this process: the `name: value` lines of its plan."""
    result = invoke_train(train, [*args, "--dry-run"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("dry run: nothing is trained or written to --output-dir")
    return dict(line.strip().split(": ", 1) for line in result.output.splitlines()[1:])
