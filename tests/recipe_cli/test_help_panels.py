"""`--help` shows a recipe's flags in panels: the recipe's own settings first, then the shared
ones in the panel each declares (accel_common.recipe_cli.panels), the command's own last; none
is left in Typer's default "Options" panel, and the README's list of panels is theirs."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from accel_common.recipe_cli import panels
from accel_common.recipe_cli.command import train_command
from accel_common.recipe_cli.options import SharedSettings
from accel_common.settings import Settings, flag, setting
from tests.processes import REPO, TEMPLATE, recipe_env

DEFAULT_PANEL = "Options"  # Typer's panel for an option that names none
TITLE = re.compile(r"^╭─ (.+?) ─")
ROW = re.compile(r"^│ (--[\w-]+)")  # an option's row; its wrapped lines start with spaces


def parse_panels(text: str) -> dict[str, list[str]]:
    """{panel title: the flags in it, in order} from rich's `--help`, panels in order."""
    found: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if title := TITLE.match(line):
            current = found.setdefault(title.group(1), [])
        elif (row := ROW.match(line)) and current is not None:
            current.append(row.group(1))
    return found


def help_of(script: Path, *args: str, tmp: Path) -> str:
    """`python script [args] --help` as a user runs it: wide, no colours."""
    env = recipe_env(tmp) | {"COLUMNS": "200", "TERM": "dumb", "PYTHONIOENCODING": "utf-8"}
    done = subprocess.run(
        [sys.executable, str(script), *args, "--help"],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def template_help(tmp_path_factory) -> dict[str, list[str]]:
    return parse_panels(help_of(TEMPLATE, tmp=tmp_path_factory.mktemp("help")))


def test_the_template_shows_its_own_panel_first_then_the_shared_ones_in_order(template_help):
    assert list(template_help) == ["Template settings", *panels.ORDER]
    assert template_help["Template settings"][:2] == ["--hidden", "--depth"]
    assert template_help[panels.COMMAND] == ["--config", "--dry-run", "--processes", "--help"]
    for title, flags in template_help.items():
        assert flags, f"panel {title!r} is empty"


def test_every_shared_setting_is_in_exactly_the_panel_it_declares(template_help):
    shown = [(title, f) for title, flags in template_help.items() for f in flags]
    for field in fields(SharedSettings):
        where = [title for title, f in shown if f == flag(field.name)]
        declared = field.metadata["panel"]
        assert declared in panels.ORDER, f"{flag(field.name)}: panel {declared!r} is not one"
        assert where == [declared], f"{flag(field.name)} is shown in {where}, declared {declared}"
    assert DEFAULT_PANEL not in template_help
    # onecycle's shape and the step / multistep decay's options are the schedule's
    schedule = template_help[panels.SCHEDULE]
    for name in ("--pct-start", "--anneal", "--cycle-momentum", "--step-size", "--milestones"):
        assert name in schedule


def test_a_subcommand_keeps_its_help(tmp_path):
    text = help_of(TEMPLATE, "evaluate", tmp=tmp_path)
    assert "Usage: train_template.py evaluate" in text
    assert parse_panels(text) == {DEFAULT_PANEL: ["--model", "--data", "--split", "--help"]}


@dataclass
class Own(Settings):
    width: int = setting(8, "Width.", min=1)
    temperature: float = setting(1.0, "Sampling temperature.", above=0, panel="Sampling")
    restarts: int = setting(0, "LR restarts.", min=0, panel=panels.SCHEDULE)
    depth: int = setting(2, "Depth.", min=1)


def own_help() -> str:
    command = train_command(Own, default_bs=8)(lambda args, own: None)
    app = typer.Typer(add_completion=False)
    app.command()(command)
    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200", "TERM": "dumb"})
    assert result.exit_code == 0, result.output
    return result.output


def test_a_recipe_setting_may_name_a_panel_and_defaults_to_the_recipe_s_own():
    shown = parse_panels(own_help())
    own = panels.recipe_panel(Path(__file__).stem)
    assert list(shown) == [own, "Sampling", *panels.ORDER]
    assert shown[own] == ["--width", "--depth"]
    assert shown["Sampling"] == ["--temperature"]
    assert shown[panels.SCHEDULE][0] == "--restarts"  # the recipe's own before the shared


def test_help_is_eager_and_passed_to_no_command():
    command = train_command(Own, default_bs=8)(lambda args, own: pytest.fail("trained"))
    app = typer.Typer(add_completion=False)
    app.command()(command)
    result = CliRunner().invoke(app, ["--width", "0", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output  # as Click's --help: before any value's check
    assert "Config file, dry run and help" in result.output


def test_the_readme_lists_the_panels_in_their_order():
    readme = (REPO / "README.md").read_text()
    paragraph = readme.split("`--help` shows the flags in panels")[1].split("\n\n")[0]
    named = [n for n in re.findall(r"`([^`]+)`", paragraph) if n in panels.ORDER]
    assert named == list(panels.ORDER)
    assert "`Template settings`" in paragraph
