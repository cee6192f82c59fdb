"""The suite's fixtures (an Accelerator, the example data sets written once per run) and its
pytest-xdist schedule. Running recipes: tests/processes.py; reading their outputs:
tests/results.py."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock


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
def check_example(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Recipe name -> its example at the size it declares for `accel-recipes check`
    (CHECK_DATA), written once per test run: any recipe there is, with no list to edit."""
    from accel_common.tools.check.recipe import find_recipe

    def example(recipe: str) -> Path:
        return shared_dataset(
            tmp_path_factory, f"check-{recipe}", find_recipe(recipe).write_example
        )

    return example


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
# (its module fixtures run once), and so does each recipe's folder, tests/recipes/<workload>/
# (its package fixtures run once); work is handed out in this order, heaviest groups first, so
# that no long group starts last while the other worker idles (longest-first scheduling).
# test_resume's cases, one independent run per recipe, are spread over both workers instead.
HEAVIEST_FIRST = [
    "recipes/crystal", "recipes/captioning", "recipes/quality", "recipes/pointcloud",
    "test_multinode", "test_sharded", "test_dry_run_plans", "recipes/cricket", "test_recovery",
    "test_data_files", "test_resume", "test_loop", "test_plan_measure", "test_bench",
    "test_distributed", "test_nonfinite", "test_launchers", "test_runtime_guards",
    "recipes/template", "test_launch", "test_cli_errors", "test_cli", "test_doctor",
    "test_processes", "test_documented_commands", "test_settings",
]  # fmt: skip
SPREAD = {"test_resume"}


def module_of(nodeid: str) -> str:
    """The group a test runs in: tests/test_x.py::test_y[z]@group -> test_x; a recipe's folder,
    tests/recipes/<workload>/test_x.py::test_y -> recipes/<workload>."""
    parts = nodeid.split("::")[0].split("/")
    if parts[:2] == ["tests", "recipes"] and len(parts) > 3:
        return "/".join(parts[1:3])
    return parts[-1].removesuffix(".py")


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


@pytest.fixture
def read_only_folder(tmp_path: Path):
    """A folder in which no file can be created, even by root, who ignores permission bits:
    mode 0555 and, as root, the immutable attribute (chattr +i). Skipped where neither holds."""
    import subprocess

    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    immutable = (
        os.geteuid() == 0
        and subprocess.run(
            ["chattr", "+i", str(folder)], capture_output=True, check=False
        ).returncode
        == 0
    )
    try:
        (folder / "probe").touch()
    except OSError:
        yield folder
    else:
        (folder / "probe").unlink()
        pytest.skip("no folder can be made read-only here")
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        folder.chmod(0o755)
