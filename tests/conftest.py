"""Helpers for running recipes as real processes (1 process, or 2 CPU processes over gloo)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from filelock import FileLock
from safetensors.torch import load_file

from accel_common.tools.ports import free_port  # re-exported for the tests
from tests import forked

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


def recipe_env(tmp: Path) -> dict[str, str]:
    return {
        **os.environ,
        # one thread: the two pytest-xdist workers keep both cores busy, and a second thread
        # costs more CPU than it saves time (the quality learning run: 44.6 CPU-s on 2, 39.2 on 1)
        "OMP_NUM_THREADS": "1",
        # idle OpenMP threads sleep instead of spinning: beside another busy process (a test
        # running on the other pytest-xdist worker), spinning threads made a 2-thread run 2x
        # slower; passive, it ran as fast as alone
        "OMP_WAIT_POLICY": "PASSIVE",
        "PYTHONUNBUFFERED": "1",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "HF_HOME": str(tmp / "hf"),
        "HF_HUB_OFFLINE": "1",  # nothing may wait on the network
        # the tree under test, ahead of any installed copy of accel_common
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }


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
    logs = Path(tempfile.mkdtemp(prefix="killed-"))
    child = forked.start(script, args, cwd=cwd, env=recipe_env(cwd), logs=logs, new_session=True)
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert child.exitcode is None, "the run ended before the test could kill it"
        assert time.monotonic() < deadline, "no checkpoint appeared in time"
        time.sleep(0.002)
    os.killpg(child.pid, signal.SIGKILL)
    child.join()
    shutil.rmtree(logs)
    assert child.exitcode == -signal.SIGKILL


def run_processes(
    script: Path, args: list[str], nproc: int, *, cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    """`python script args` as one process, or as `nproc` ranks over gloo given the environment
    torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT); each process is
    forked from a server that has imported torch already, or, where CUDA is present, a fresh
    interpreter (tests/forked.py).

    No launcher process: `accelerate launch` is one more Python process importing torch and
    Accelerate per run, and the tests that compare N processes with one do not need it; the
    launchers are tested where they matter (test_launch, test_processes, test_multinode,
    test_recovery, test_nonfinite, test_sharded), with real `accelerate launch` processes. A rank
    that fails has the others stopped 15 s later (they would wait in a collective), and its exit
    code is the run's; stdout and stderr are the ranks' outputs one after the other.
    """
    port, logs = str(free_port()), Path(tempfile.mkdtemp(prefix="run-"))
    children = []
    for rank in range(nproc):
        where = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc)}
        where |= {"LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        (logs / str(rank)).mkdir()
        rank_env = {**env, **where} if nproc > 1 else env
        children.append(forked.start(script, args, cwd=cwd, env=rank_env, logs=logs / str(rank)))
    first_failure, stop_at = None, time.monotonic() + timeout
    while any(child.exitcode is None for child in children):
        if first_failure is None and any(child.exitcode for child in children):
            first_failure = next(child.exitcode for child in children if child.exitcode)
            stop_at = min(stop_at, time.monotonic() + 15)
        if time.monotonic() > stop_at:
            for child in children:
                child.kill()
                child.join()
            if first_failure is None:
                raise subprocess.TimeoutExpired([str(script), *args], timeout)
        time.sleep(0.05)
    if first_failure is None:  # they all ended between two looks
        first_failure = next((child.exitcode for child in children if child.exitcode), 0)
    stdout = "".join((logs / str(rank) / "out").read_text() for rank in range(nproc))
    stderr = "".join((logs / str(rank) / "err").read_text() for rank in range(nproc))
    shutil.rmtree(logs)
    return subprocess.CompletedProcess([str(script), *args], first_failure, stdout, stderr)


def run_recipe(
    args: list[str],
    *,
    cwd: Path,
    nproc: int = 1,
    script: Path = TEMPLATE,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run a recipe as real processes: one, or `nproc` ranks over gloo (see `run_processes`)."""
    env = recipe_env(cwd)
    result = run_processes(script, args, nproc, cwd=cwd, env=env, timeout=600)
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
    assert result.output.startswith("dry run: nothing is trained or written")
    return dict(line.strip().split(": ", 1) for line in result.output.splitlines()[1:])


def exported_params(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(output_dir / "model" / "model.safetensors"))


def metrics_log(output_dir: Path) -> list[dict]:
    lines = (output_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest ||a - b|| / ||a|| over the floating-point tensors. Integer and boolean tensors
    (BatchNorm's `num_batches_tracked`, index buffers) have no norm and no rounding: they must be
    equal, or the comparison fails naming the tensor."""
    assert a.keys() == b.keys()
    differences = [0.0]
    for name in a:
        if a[name].is_floating_point() or a[name].is_complex():
            differences.append(((a[name] - b[name]).norm() / a[name].norm()).item())
        else:
            assert torch.equal(a[name], b[name]), f"{name}: {a[name]} != {b[name]}"
    return max(differences)


def global_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||a|| over all parameters at once."""
    assert a.keys() == b.keys()
    diff = sum(((a[k] - b[k]) ** 2).sum() for k in a) ** 0.5
    return (diff / sum((a[k] ** 2).sum() for k in a) ** 0.5).item()


@pytest.fixture
def accelerator():
    """A single-process CPU Accelerator, with Accelerate's process-wide state reset around it."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield Accelerator(cpu=True, gradient_accumulation_steps=2)
    AcceleratorState._reset_state(reset_partial_state=True)


def shared_dataset(
    factory: pytest.TempPathFactory, name: str, write: Callable[[Path], object]
) -> Path:
    """A generated data set, written once per test run: the pytest-xdist workers of one run
    share it (generating the crystals alone takes ~15 s), under a file lock, written whole or
    not at all. The tests only read it."""
    root = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    target = root / f"data-{name}"
    with FileLock(f"{target}.lock"):
        if not target.is_dir():
            partial = target.with_name(f"{target.name}.partial")
            shutil.rmtree(partial, ignore_errors=True)
            write(partial)
            partial.rename(target)
    return target


@pytest.fixture(scope="session")
def template_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Template data whose test split (301 rows) is not divisible by 2 processes."""
    from recipes.train_template import write_dataset

    return shared_dataset(
        tmp_path_factory, "template", lambda out: write_dataset(out, test_size=301)
    )


@pytest.fixture(scope="session")
def pointcloud_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example skulls: 24 train + 6 test skulls, 5 defects each."""
    from recipes.pointcloud.example import write_dataset

    return shared_dataset(tmp_path_factory, "pointcloud", write_dataset)


@pytest.fixture(scope="session")
def captioning_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example captions (imagefolder layout): 800 training and 100 test images."""
    from recipes.captioning.example import write_dataset

    return shared_dataset(tmp_path_factory, "captioning", write_dataset)


@pytest.fixture(scope="session")
def crystal_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example crystals: 1000 EMT-labelled structures of 1 to 64 atoms."""
    from recipes.crystal.example import write_dataset

    return shared_dataset(tmp_path_factory, "crystal", write_dataset)


@pytest.fixture(scope="session")
def quality_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """320 rated surface patches and 6 annotators (3 experts, casual, spammer, adversarial)."""
    from recipes.quality.example import write_dataset

    return shared_dataset(tmp_path_factory, "quality", write_dataset)


@pytest.fixture(scope="session")
def cricket_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """100 simulated T20 matches in Cricsheet JSON (about 23,000 legal deliveries)."""
    from recipes.cricket.example import write_dataset

    return shared_dataset(tmp_path_factory, "cricket", lambda out: write_dataset(out, matches=100))


# The suite runs on 2 pytest-xdist workers (`make test`): each module goes to one worker whole
# (its module fixtures run once), and work is handed out in this order, heaviest modules first,
# so that no long module starts last while the other worker idles (longest-first scheduling).
# test_resume's cases, one independent run per recipe, are spread over both workers instead.
HEAVIEST_FIRST = [
    "test_crystal", "test_captioning", "test_quality", "test_pointcloud", "test_multinode",
    "test_sharded", "test_cricket", "test_recovery", "test_resume", "test_loop",
    "test_plan_measure", "test_bench", "test_distributed", "test_nonfinite", "test_launchers",
    "test_runtime_guards", "test_template", "test_launch", "test_cli_errors", "test_cli",
    "test_doctor", "test_prepare", "test_processes", "test_documented_commands", "test_settings",
]  # fmt: skip
SPREAD = {"test_resume"}


def module_of(nodeid: str) -> str:
    """tests/test_x.py::test_y[z]@group -> test_x"""
    return nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = module_of(item.nodeid)
        return HEAVIEST_FIRST.index(name) if name in HEAVIEST_FIRST else len(HEAVIEST_FIRST)

    items.sort(key=rank)  # stable: a module's tests keep their order
    for item in items:
        name = module_of(item.nodeid)
        if name not in SPREAD and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(name))


def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """Stop a run whose groups pytest-xdist silently dropped (pytest 9.2 ignores the renamed node
    ids that xdist 3.8's loadgroup relies on): modules would then split over workers and build
    their trained fixtures once per worker, which is how CI went from 12 to 14 minutes unseen."""
    grouped = [nodeid for nodeid in ids if module_of(nodeid) not in SPREAD]
    if node.config.getoption("dist") == "loadgroup" and grouped and "@" not in "".join(grouped):
        pytest.exit(
            f"pytest-xdist's loadgroup put no test in a group under pytest {pytest.__version__}: "
            "install the pytest range of pyproject.toml's dev extra",
            returncode=4,
        )
