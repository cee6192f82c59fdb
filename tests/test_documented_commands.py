"""Every command in README.md and docs/ that launches a recipe does what its text says.

Each one is run with `--dry-run` at its process count (nothing trains: an 8-GPU command is checked
on a laptop), so a flag that does not exist or a value a recipe refuses fails here. Where the text
states the plan, it does so on a `# plan:` line right after the command, inside the same code
block, and every number on it must be what the dry run prints:

    accelerate launch --config_file accelerate_configs/8gpu.yaml recipes/train_X.py --bs 64
    # plan: global 64, per device 8, accumulation 1, lr 0.024
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import typer
import yaml
from typer.testing import CliRunner

from tests.processes import REPO, recipe_env
from tests.test_layout import originals_without_license, script_importers

# the porting guide's commands create the recipe they launch: run in order, in a copy of the
# project, by test_the_porting_guide_runs_step_by_step
PORTING = REPO / "docs" / "porting.md"
DOCS = [REPO / "README.md", *sorted(p for p in (REPO / "docs").rglob("*.md") if p != PORTING)]


def subcommands() -> set[str]:
    """The single-device commands of every recipe there is, as its `run_recipe(...)` names them
    (`evaluate=...`, `**{"export-onnx": ...}`): not training launches."""
    found = set()
    for script in (REPO / "recipes").glob("train_*.py"):
        call = re.search(r"run_recipe\(train(.*)\)", script.read_text())
        if call:
            found |= {a or b for a, b in re.findall(r"(\w+)=|\"([\w-]+)\":", call.group(1))}
    return found


SUBCOMMANDS = subcommands()
GPUS_PER_NODE = 8  # the Makefile's and the cluster scripts' default
MAKE_PROCESSES = {"train": 1, "train-cpu": 2, "train-1gpu": 1, "train-2gpu": 2, "train-4gpu": 4}
MAKE_PROCESSES["train-8gpu"] = 8
MAKE_CONFIGS = {"train-cpu": "cpu_2proc.yaml", "train-multinode": "multinode_2x8.yaml"}
MAKE_CONFIGS |= {f"train-{n}gpu": f"{n}gpu.yaml" for n in (1, 2, 4, 8)}
LAUNCH = re.compile(
    r"recipes/train_\w+\.py|^(\S+=\S+ )*(make|sbatch) |scripts/torchrun_multinode\.sh"
)
PLAN_FIELDS = {
    "global": r"global (\d+)",
    "per_device": r"per device (\d+)",
    "accumulation": r"accumulation (\d+)",
    "lr": r"lr ([0-9.]+(?:e[-+]?\d+)?)",
}


@dataclass
class Command:
    where: str  # file:line
    text: str
    recipe: str
    args: list[str]
    processes: int
    mixed_precision: str | None = None
    stated: dict[str, float] = field(default_factory=dict)


def code_blocks(path: Path) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each fenced code block."""
    blocks, current, start = [], None, 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            if current is None:
                current, start = [], number + 1
            else:
                blocks.append((start, current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def launch_config(name: str) -> tuple[int, str | None]:
    """num_processes (over all machines) and mixed_precision of an accelerate config file."""
    config = yaml.safe_load((REPO / name).read_text())
    precision = config.get("mixed_precision")
    return int(config.get("num_processes", 1)), None if precision in (None, "no") else precision


def option(words: list[str], *names: str) -> str | None:
    """The value of the first of `names` in `words` (`--x v` or `--x=v`)."""
    for i, word in enumerate(words):
        for name in names:
            if word == name and i + 1 < len(words):
                return words[i + 1]
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
    return None


def parse(words: list[str], where: str, text: str) -> Command | None:
    """The recipe launch `words` make, or None when they launch no recipe training."""
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if words[:2] == ["accel-recipes", "launch"]:
        words = words[3:] if words[2:3] == ["--"] else words[2:]
    if words and words[0] == "make":
        targets = [w for w in words[1:] if not re.fullmatch(r"[A-Z_]+=.*", w)]
        env |= dict(w.split("=", 1) for w in words[1:] if re.fullmatch(r"[A-Z_]+=.*", w))
        if not targets or not targets[0].startswith("train") or "-n" in words:
            return None
        target = targets[0]
        processes = MAKE_PROCESSES.get(target, int(env.get("NNODES", 2)) * GPUS_PER_NODE)
        config = env.get("CONFIG") or (
            f"accelerate_configs/{MAKE_CONFIGS[target]}" if target in MAKE_CONFIGS else None
        )
        precision = launch_config(config)[1] if config else None
        recipe = env.get("RECIPE", "pointcloud")
        return Command(where, text, recipe, shlex.split(env.get("ARGS", "")), processes, precision)
    cluster = [w for w in words if w.startswith("scripts/")]
    if cluster:  # the SLURM and torchrun scripts: RECIPE, ARGS and the recipe flags after them
        recipe = env.get("RECIPE", "pointcloud")
        args = [*shlex.split(env.get("ARGS", "")), *words[words.index(cluster[0]) + 1 :]]
        if cluster[0].endswith("train_1node.sbatch"):
            return Command(where, text, recipe, args, GPUS_PER_NODE, "bf16")
        nodes = int(option(words, "--nodes") or env.get("NNODES", 2))
        precision = "bf16" if words[0] == "sbatch" else None  # multinode_2x8.yaml; torchrun: none
        return Command(where, text, recipe, args, nodes * GPUS_PER_NODE, precision)
    scripts = [i for i, w in enumerate(words) if re.fullmatch(r"recipes/train_\w+\.py", w)]
    if not scripts:
        return None
    script = scripts[0]
    launcher, args = words[:script], words[script + 1 :]
    if not launcher:  # the path named in prose (a layout listing), not a command
        return None
    if args and args[0] in SUBCOMMANDS:
        return None
    recipe = re.fullmatch(r"recipes/train_(\w+)\.py", words[script]).group(1)
    processes, precision = 1, None
    if launcher[:2] == ["accelerate", "launch"]:
        config = option(launcher, "--config_file", "--config-file")
        if config:
            processes, precision = launch_config(config)
        processes = int(option(launcher, "--num_processes", "--num-processes") or processes)
        precision = option(launcher, "--mixed_precision") or precision
    elif launcher[:1] == ["torchrun"]:
        nodes = int(option(launcher, "--nnodes") or 1)
        processes = nodes * int(option(launcher, "--nproc_per_node", "--nproc-per-node") or 1)
    elif launcher not in (["python"], ["python3"]):
        raise AssertionError(f"{where}: unrecognised launcher {' '.join(launcher)!r}")
    # a documented dry run names its own process count
    processes = int(option(args, "--processes") or processes)
    return Command(where, text, recipe, args, processes, precision)


def stated_plan(line: str) -> dict[str, float]:
    found = {}
    for name, pattern in PLAN_FIELDS.items():
        match = re.search(pattern, line)
        if match:
            found[name] = float(match.group(1))
    return found


def documented_commands() -> list[Command]:
    commands = []
    for path in DOCS:
        for start, lines in code_blocks(path):
            i = 0
            while i < len(lines):
                number, text = start + i, lines[i].strip()
                # continued with a backslash, or shown wrapped (indented flags, no backslash)
                while i + 1 < len(lines) and (
                    text.endswith("\\") or re.match(r"\s+--", lines[i + 1])
                ):
                    i += 1
                    text = text.removesuffix("\\") + " " + lines[i].strip()
                i += 1
                if text.startswith(("#", "$")) or "..." in text or not LAUNCH.search(text):
                    continue
                where = f"{path.relative_to(REPO)}:{number}"
                command = parse(shlex.split(text, comments=True), where, text)
                if command is None:
                    continue
                if i < len(lines) and lines[i].strip().startswith("# plan:"):
                    command.stated = stated_plan(lines[i])
                    assert command.stated, f"{where}: a '# plan:' line with no number on it"
                commands.append(command)
    return commands


COMMANDS = documented_commands()


def test_the_docs_state_plans_for_their_multi_process_commands():
    """Not vacuous: the commands are found, and every documented launch on more than one device in
    a recipe's page says what its plan is."""
    assert len(COMMANDS) >= 30
    unstated = [
        c.where
        for c in COMMANDS
        if c.where.startswith("docs/recipes/") and c.processes > 2 and not c.stated
    ]
    assert not unstated, f"multi-GPU commands without a '# plan:' line: {unstated}"


def dry_run(command: Command, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    monkeypatch.chdir(tmp_path)  # a dry run writes nothing; if one did, it would land here
    module = importlib.import_module(f"recipes.train_{command.recipe}")
    app = typer.Typer()
    app.command()(module.train)
    args = [*command.args, "--dry-run", "--processes", str(command.processes)]
    if "--config" in args:  # the docs' paths are relative to the repository
        at = args.index("--config") + 1
        args[at] = str(REPO / args[at])
    if command.mixed_precision and "--mixed-precision" not in command.args:
        args += ["--mixed-precision", command.mixed_precision]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, f"{command.where}: {command.text}\n{result.output}"
    assert list(tmp_path.iterdir()) == [], f"{command.where}: the dry run wrote files"
    return result.output


def require_stated_plan(command: Command, output: str) -> None:
    """The dry run's `output` is planned for the command's processes, and every number on its
    `# plan:` line is what it printed."""
    batch = re.search(
        r"global batch (\d+) = (\d+) per device x (\d+) processes x (\d+) accumulation", output
    )
    peak = float(re.search(r"learning rate: peak ([0-9.e+-]+)", output).group(1))
    printed = {
        "global": float(batch.group(1)),
        "per_device": float(batch.group(2)),
        "accumulation": float(batch.group(4)),
        "lr": peak,
    }
    assert int(batch.group(3)) == command.processes
    for name, value in command.stated.items():
        assert printed[name] == pytest.approx(value, rel=5e-3), (
            f"{command.where}: the text says {name} {value:g}, the command gives "
            f"{printed[name]:g}\n{command.text}\n{output}"
        )


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_a_documented_command_runs_and_prints_what_its_text_says(command, monkeypatch, tmp_path):
    require_stated_plan(command, dry_run(command, monkeypatch, tmp_path))


def guide_blocks(path: Path, language: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each code block fenced as `language`, in order."""
    blocks, current, start = [], None, 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = line.strip()
        if current is None and fence == f"```{language}":
            current, start = [], number + 1
        elif current is not None and fence == "```":
            blocks.append((start, current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def shell_commands(path: Path) -> list[tuple[str, str, dict[str, float]]]:
    """(file:line, command, its stated plan) of every command in `path`'s bash blocks, in order;
    a line ending in a backslash continues on the next."""
    commands = []
    for start, lines in guide_blocks(path, "bash"):
        i = 0
        while i < len(lines):
            number, text = start + i, lines[i].strip()
            while text.endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text.removesuffix("\\") + " " + lines[i].strip()
            i += 1
            if not text or text.startswith("#"):
                continue
            stated = {}
            if i < len(lines) and lines[i].strip().startswith("# plan:"):
                stated = stated_plan(lines[i])
            commands.append((f"{path.relative_to(REPO)}:{number}", text, stated))
    return commands


def porting_workspace(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A fresh copy of the project, the guide's train_ddp.py, the original's LICENSE and the
    checkpoint.pt its DDP run saved (every key under `module.`); and the environment that runs
    the guide's commands there (`python` and `accel-recipes` this interpreter's, this copy's
    code)."""
    work = tmp_path / "work"
    ignore = shutil.ignore_patterns("__pycache__")
    for package in ("accel_common", "recipes", "examples"):
        shutil.copytree(REPO / package, work / package, ignore=ignore)
    (work / "accelerate_configs").symlink_to(REPO / "accelerate_configs")
    (_, script), *_ = guide_blocks(PORTING, "python")
    (work / "train_ddp.py").write_text("\n".join(script) + "\n")
    (work / "LICENSE").write_text("MIT License (the original project's)\n")
    original = {"__name__": "train_ddp"}
    exec(compile("\n".join(script), str(work / "train_ddp.py"), "exec"), original)
    torch.manual_seed(0)
    state = original["MLP"]().state_dict()
    torch.save({f"module.{k}": v for k, v in state.items()}, work / "checkpoint.pt")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, run in (("python", ""), ("accel-recipes", " -m accel_common.tools.cli")):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {sys.executable}{run} "$@"\n')
        (bin_dir / name).chmod(0o755)
    env = recipe_env(tmp_path) | {"PYTHONPATH": str(work)}
    env["PATH"] = os.pathsep.join([str(bin_dir), os.environ["PATH"]])
    return work, env


@pytest.mark.slow
def test_the_porting_guide_runs_step_by_step(tmp_path):
    """docs/porting.md's commands, in order, in a fresh copy of the project: `accel-recipes new`,
    the original kept aside, make-data, a run, the dry runs (an `accelerate launch` runs as its
    dry run at its process count, as above), convert of the DDP script's checkpoint and a run
    started from it. Each exits 0 and prints the plan its text states."""
    work, env = porting_workspace(tmp_path)
    ran = []
    for where, text, stated in shell_commands(PORTING):
        words = shlex.split(text, comments=True)
        command = parse(list(words), where, text)
        run = text
        if command is not None and words[:2] == ["accelerate", "launch"]:
            argv = ["python", f"recipes/train_{command.recipe}.py", *command.args]
            argv += ["--dry-run", "--processes", str(command.processes)]
            if command.mixed_precision and "--mixed-precision" not in command.args:
                argv += ["--mixed-precision", command.mixed_precision]
            run = shlex.join(argv)
        result = subprocess.run(
            ["bash", "-c", run], cwd=work, env=env, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, f"{where}: {text}\n{result.stdout}\n{result.stderr}"
        if stated:
            command.stated = stated
            require_stated_plan(command, result.stdout)
        ran.append(text)
    steps = ["accel-recipes new mymodel", "accel-recipes convert", "--init-from", "accelerate"]
    steps += ["examples/train_graph.py --epochs", "accel-recipes check examples/train_graph.py"]
    assert all(any(step in text for text in ran) for step in steps), ran
    assert (work / "recipes" / "mymodel" / "original" / "train_ddp.py").is_file()
    assert script_importers(work) == {} and originals_without_license(work) == []
    assert (work / "runs" / "mymodel-finetuned" / "model" / "model.safetensors").is_file()
    graph = json.loads((work / "runs" / "graph" / "model" / "model.json").read_text())
    assert graph["ema"]["decay"] == 0.99  # the second shape: its EMA exported, and it learned
    assert graph["metrics"]["val_accuracy"] > graph["metrics"]["majority_accuracy"] + 0.3
