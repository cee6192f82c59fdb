"""A dry run is a promise: every documented `--dry-run` command, and the cases where the plan was
once another run's, is held to the run it describes.

Each case runs the command twice in this process, with the recipe's tiny sizes, test data and
`--max-steps 1`: with `--dry-run`, and as a run. What the dry run printed (parameter counts, the
batch plan, the LR line with its warmup, the step limit) must be what the run's export records it
used: the same count of the trained network (`model.json`'s `parameters`), its `batch_plan`, and
its banner's LR line and optimizer steps (`schedule`).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState

from accel_common.recipe_cli.dry_run import parameter_lines, size
from accel_common.recipe_cli.entry import train_in_python
from accel_common.tools.check.compare import plan_differences
from accel_common.tools.check.recipe import discovered, find_recipe
from tests.processes import (
    CRICKET_TINY,
    REPO,
    dry_run_plan,
)
from tests.test_documented_commands import COMMANDS


@pytest.fixture(scope="module")
def cricket_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cricket-cache")


def documented_dry_runs() -> list[tuple[str, str, list[str]]]:
    """(where, recipe, flags) of each documented command that is a dry run, once per command:
    its own flags, less --dry-run and --processes (a one-process run is what this machine can
    hold it to; the plan for N processes is the same code at another world size)."""
    found: dict[tuple[str, ...], tuple[str, str, list[str]]] = {}
    for command in COMMANDS:
        if "--dry-run" not in command.args:
            continue
        args, words = [], iter(command.args)
        for word in words:
            if word == "--processes":
                next(words)
            elif word == "--config":
                args += [word, str(REPO / next(words))]
            elif word != "--dry-run":
                args.append(word)
        found.setdefault((command.recipe, *args), (command.where, command.recipe, args))
    return list(found.values())


DOCUMENTED = documented_dry_runs()


def plan_and_run(
    recipe: str, args: list[str], request: pytest.FixtureRequest, tmp_path: Path
) -> tuple[dict[str, str], dict]:
    """The dry run's plan lines and the run's export metadata for the same flags, at the size the
    recipe declares for `accel-recipes check` (CHECK_ARGS) on its example (CHECK_DATA), one
    optimizer step."""
    found = find_recipe(recipe)
    data = request.getfixturevalue("check_example")(recipe)
    flags = [*args, *found.args, "--data", str(data), "--max-steps", "1"]
    if recipe == "cricket":  # keyed by the files and settings: the cases share what they can
        flags += ["--graph-cache-dir", str(request.getfixturevalue("cricket_cache"))]
    module = importlib.import_module(f"recipes.train_{recipe}")
    plan = dry_run_plan(module.train, flags)
    out = tmp_path / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_in_python(
            module.train, [*flags, "--output-dir", str(out)], out, script=Path(module.__file__)
        )
    finally:
        torch.set_num_threads(threads)
        AcceleratorState._reset_state(reset_partial_state=True)
    return plan, json.loads((out / "model" / "model.json").read_text())


def assert_held_to_its_run(plan: dict[str, str], export: dict) -> None:
    """Every number the dry run printed is the run's."""
    assert plan_differences(plan, export, 1) == []
    assert export["step"] == 1


def test_every_documented_dry_run_is_found():
    """Not vacuous: the docs' dry runs of the presets are all here."""
    recipes = {recipe for _, recipe, _ in DOCUMENTED}
    assert recipes >= {"pointcloud", "template", "cricket", "crystal"}, DOCUMENTED


@pytest.mark.parametrize(
    ("recipe", "args"), [d[1:] for d in DOCUMENTED], ids=[d[0] for d in DOCUMENTED]
)
def test_a_documented_dry_run_prints_what_its_run_uses(recipe, args, request, tmp_path):
    assert_held_to_its_run(*plan_and_run(recipe, args, request, tmp_path))


@pytest.mark.parametrize(
    ("recipe", "args"),
    [
        ("captioning", []),  # --max-steps cuts the warmup: the dry run printed 20, the run used 1
        ("quality", ["--backbone", "mobilenetv3_small_100"]),  # the head's width: the run crashed
        ("quality", ["--backbone", "resnet18"]),
    ],
    ids=["captioning", "quality-mobilenetv3", "quality-resnet18"],
)
def test_a_dry_run_prints_what_its_run_uses(recipe, args, request, tmp_path):
    assert_held_to_its_run(*plan_and_run(recipe, args, request, tmp_path))


def test_a_fine_tuning_dry_run_counts_the_exports_vocabulary(request, tmp_path):
    """--init-from: the network is sized by the export's vocabulary (here a smaller one, from
    --min-matches 20), not by this data's (nor a guessed one)."""
    _, first = plan_and_run("cricket", ["--min-matches", "20"], request, tmp_path / "a")
    export = tmp_path / "a" / "run" / "model"
    plan, tuned = plan_and_run("cricket", ["--init-from", str(export)], request, tmp_path / "b")
    assert_held_to_its_run(plan, tuned)
    assert tuned["parameters"] == first["parameters"]


def test_a_dry_run_without_the_data_says_its_count_is_unknown(tmp_path):
    """A --data (or --init-from) this machine lacks, a cluster's path planned on a laptop: the
    plan, and in place of a guessed count, one line saying which file the sizes come from."""
    import recipes.train_cricket as cricket

    plan = dry_run_plan(cricket.train, ["--data", str(tmp_path / "absent"), *CRICKET_TINY])
    assert plan["parameters"] == (
        f"not counted: the network's sizes are read from files (--data {tmp_path / 'absent'}: "
        "no such folder)"
    )
    assert plan["batch"].startswith("global batch 64 = 64 per device")
    assert "memory per device" not in plan
    plan = dry_run_plan(cricket.train, ["--init-from", str(tmp_path / "export"), *CRICKET_TINY])
    assert plan["parameters"].endswith(f"(--init-from {tmp_path / 'export'}: not on this machine)")


@pytest.mark.parametrize("recipe", discovered())
def test_a_dry_run_names_an_input_this_machine_lacks(recipe, tmp_path):
    """The run stops on an --init-from that is not there; its dry run said nothing (exit 0).
    Every recipe there is: each has --init-from (the template's, which a copy keeps)."""
    module = importlib.import_module(f"recipes.train_{recipe}")
    plan = dry_run_plan(module.train, ["--init-from", str(tmp_path / "nope")])
    assert plan["inputs"] == (
        f"not on this machine: --init-from {tmp_path / 'nope'} (the run stops unless there)"
    )
    assert "inputs" not in dry_run_plan(module.train, [])


@pytest.mark.parametrize(
    ("make", "bytes_per_parameter", "state"),
    [
        (lambda p: torch.optim.SGD(p, lr=0.1), 8, "SGD state (0 x the weights)"),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 12, "SGD state (1 x the weights)"),
        (lambda p: torch.optim.AdamW(p), 16, "AdamW state (2 x the weights)"),
        (None, 16, "Adam state (assumed: no build_optimizer)"),
    ],
)
def test_the_memory_line_sizes_the_recipes_own_optimizer(
    make, bytes_per_parameter, state, tmp_path, monkeypatch
):
    """Weights and gradients, plus the state of the optimizer the recipe builds (train_command's
    build_optimizer, built on the meta device): SGD with momentum keeps one tensor per
    parameter, plain SGD none, Adam two; a recipe that declares none is assumed Adam's, saying
    so."""
    monkeypatch.chdir(tmp_path)  # no runs/memory measurement here
    build_optimizer = None if make is None else (lambda model: make(model.parameters()))
    lines = parameter_lines("toy", lambda: torch.nn.Linear(1000, 999), 4, build_optimizer)
    memory = lines[-1].removeprefix("  memory per device: ")
    assert memory.startswith(f"{size(999_999 * bytes_per_parameter)} for weights, gradients")
    assert f"and {state} (fp32, unsharded)" in memory


def test_the_templates_dry_run_counts_its_adamw(tmp_path, monkeypatch):
    import recipes.train_template as template

    monkeypatch.chdir(tmp_path)
    plan = dry_run_plan(template.train, [])
    assert "weights, gradients and AdamW state (2 x the weights)" in plan["memory per device"]


def test_the_memory_line_counts_the_emas_copy_of_the_trainable_weights(tmp_path, monkeypatch):
    """--ema-decay keeps one more tensor per trainable parameter (frozen ones are not averaged):
    a dry run that left it out promised memory the run does not have."""
    import recipes.train_template as template

    monkeypatch.chdir(tmp_path)

    def half_frozen() -> torch.nn.Module:
        model = torch.nn.Sequential(torch.nn.Linear(1000, 999), torch.nn.Linear(999, 1000))
        model[0].requires_grad_(False)
        return model

    def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.1)

    memory = parameter_lines("toy", half_frozen, 4, sgd, ema=True)[-1]
    trainable, total = 999 * 1000 + 1000, 999_999 + 999 * 1000 + 1000
    assert memory.startswith(f"  memory per device: {size(total * 8 + trainable * 4)} for ")
    assert "gradients, SGD state (0 x the weights) and the EMA (0.5 x the weights)" in memory
    plain = dry_run_plan(template.train, [])["memory per device"]
    averaged = dry_run_plan(template.train, ["--ema-decay", "0.999"])["memory per device"]
    assert "EMA" not in plain
    assert "AdamW state (2 x the weights) and the EMA (1 x the weights)" in averaged
