"""List settings (issue 56 item 4): a field typed `tuple[int, ...]`, `tuple[float, ...]` or
`tuple[str, ...]` is one comma-separated flag, a YAML list (or comma text) in a --config file, a
JSON list in the export's config and the run's identity, compared as such on --resume; each item
is held to the declaration's bounds and a bad one is named by its position
(accel_common.setting_lists)."""

from __future__ import annotations

import functools
import importlib
import json
import re
from dataclasses import dataclass

import pytest

from accel_common import Settings, SharedSettings, setting, train_command
from accel_common.checkpoints.model_card import training_command
from accel_common.errors import ConfigError
from accel_common.settings import describe_differences
from tests.processes import REPO, dry_run_plan, invoke_train, run_recipe

LIST_WIDTHS = REPO / "tests" / "scripts" / "list_widths.py"
recipe = importlib.import_module("tests.scripts.list_widths")


@dataclass
class Lists(Settings):
    widths: tuple[int, ...] = setting((16, 8), "Widths.", min=1, max=4096)
    rates: tuple[float, ...] = setting((), "Rates.", above=0)
    names: tuple[str, ...] = setting(("a",), "Names.")


seen: list[Lists] = []


@train_command(Lists, default_bs=8)
def resolved(args: SharedSettings, settings: Lists) -> None:
    """Keeps the settings the command line and --config gave."""
    seen.append(settings)


invoke = functools.partial(invoke_train, resolved)


def settings_of(args: list[str]) -> Lists:
    result = invoke(args)
    assert result.exit_code == 0, result.output
    return seen.pop()


def test_a_list_setting_is_one_comma_separated_flag():
    assert settings_of([]) == Lists()
    given = settings_of(["--widths", "32,64", "--rates", "0.5, 1e-3", "--names", "x,y z"])
    assert given == Lists(widths=(32, 64), rates=(0.5, 0.001), names=("x", "y z"))
    assert settings_of(["--widths", "7"]).widths == (7,)
    assert settings_of(["--widths", "", "--names", ""]) == Lists(widths=(), names=())


def test_a_config_file_takes_a_yaml_list_or_comma_text_and_the_command_line_wins(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("widths: [32, 64]\nrates: 0.5,2\nnames: [x, 'no']\n")
    assert settings_of(["--config", str(config)]) == Lists((32, 64), (0.5, 2.0), ("x", "no"))
    assert settings_of(["--config", str(config), "--widths", "4"]).widths == (4,)
    config.write_text("widths: []\nrates: 3\n")
    assert settings_of(["--config", str(config)]) == Lists(widths=(), rates=(3.0,))


def test_a_list_setting_round_trips_through_a_recorded_config():
    settings = Lists(widths=(32, 64), rates=(0.5,), names=("x", "y"))
    recorded = json.loads(json.dumps(settings.as_config()))  # as model.json holds it
    assert recorded == {"widths": [32, 64], "rates": [0.5], "names": ["x", "y"]}
    assert Lists.from_config(recorded) == settings  # tuples again
    assert Lists.default_config() == {"widths": [16, 8], "rates": [], "names": ["a"]}
    assert Lists.from_config({"widths": "1,2"}).widths == (1, 2)  # the Python API's text too


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--widths", "32,x"], "--widths 32,x: item 2 'x' is not an integer"),
        (["--widths", "32,1.5"], "--widths 32,1.5: item 2 '1.5' is not an integer"),
        (["--widths", "32,0"], "--widths 32,0: item 2 is 0; give a value from 1 to 4096"),
        (["--widths", "32,,64"], "--widths 32,,64: item 2 is empty; separate the items by"),
        (["--rates", "1,-1"], "--rates 1.0,-1.0: item 2 is -1.0; give a positive number"),
        (["--rates", "nan"], "--rates nan: item 1 is nan; give a positive number"),
        (["--widths", "1," + "9" * 20], "--widths 1,99999999999999999999: item 2 is 9"),
    ],
)
def test_a_bad_item_is_one_line_naming_the_flag_and_its_position(args, message):
    result = invoke([*args, "--dry-run"])
    assert result.exit_code != 0
    assert isinstance(result.exception, ConfigError)
    assert str(result.exception).startswith(message), str(result.exception)
    assert "\n" not in str(result.exception)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("widths: [8, x]\n", "--widths 8,x: item 2 'x' is not an integer"),
        ("widths: [8, true]\n", "--widths 8,True: item 2 True is not an integer"),
        ("widths: [8, 0]\n", "--widths 8,0: item 2 is 0; give a value from 1 to 4096"),
        ("names: [a, no]\n", "--names a,False: item 2 False is not a string; quote it"),
        ("widths: {a: 1}\n", "--widths {'a': 1}: {'a': 1} is not a list; give the items"),
        ("widths: null\n", "widths: null, but --widths takes a value; .* \\(16,8\\)"),
    ],
)
def test_a_bad_list_in_a_config_file_is_refused_naming_the_file_and_item(tmp_path, text, message):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    result = invoke(["--config", str(config), "--dry-run"])
    assert isinstance(result.exception, ConfigError)
    assert str(result.exception).startswith(f"--config {config}: ")
    assert re.search(message, str(result.exception)), str(result.exception)


def test_help_shows_a_list_as_it_is_typed():
    help_text = " ".join(invoke(["--help"]).output.split())
    assert "--widths <int,...> Widths. [default: 16,8]" in help_text
    assert "--rates <float,...> Rates. [default: (none: '')]" in help_text


def test_only_tuples_of_int_float_or_str_are_list_settings():
    @dataclass
    class Pair(Settings):
        pair: tuple[int, int] = setting((1, 2), "A pair.")

    with pytest.raises(TypeError, match=r"Pair.pair: a list setting is typed tuple\[int, ...\]"):
        train_command(Pair, default_bs=8)(resolved)


def test_resume_and_the_model_card_show_a_list_as_its_flag():
    saved, now = {"widths": [16, 8], "hidden": 4}, {"widths": [16, 4], "hidden": 4}
    assert describe_differences(saved, now) == "--widths 16,8 in the checkpoint, 16,4 now"
    assert describe_differences(saved, {**saved, "widths": (16, 8)}) == ""  # not what differs
    assert describe_differences({"widths": []}, now) == (
        "--hidden unset in the checkpoint, 4 now; --widths '' in the checkpoint, 16,4 now"
    )
    meta = {"recipe": "x", "config": {"widths": [32, 64], "names": [], "pairs": [[1, 2]]}}
    assert training_command(meta) == "python recipes/train_x.py --widths 32,64 --names ''"


def test_a_list_sizes_the_model_in_the_dry_run():
    plan = dry_run_plan(recipe.train, ["--widths", "4,2"])
    assert plan["parameters"] == str((8 * 4 + 4) + (4 * 2 + 2) + (2 + 1))


def test_a_run_exports_its_list_and_a_resume_compares_it(tmp_path, template_data):
    out = tmp_path / "run"
    args = ["--data", str(template_data), "--output-dir", str(out), "--save-every", "1"]
    run_recipe([*args, "--widths", "12,6", "--max-steps", "2"], cwd=tmp_path, script=LIST_WIDTHS)
    meta = json.loads((out / "model" / "model.json").read_text())
    assert meta["config"]["widths"] == [12, 6]
    assert "--widths 12,6" in (out / "model" / "README.md").read_text()  # the card's command
    refused = run_recipe(
        [*args, "--widths", "12,7", "--resume", "latest"], cwd=tmp_path, script=LIST_WIDTHS,
        check=False,
    )  # fmt: skip
    assert refused.returncode == 2
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert "--widths 12,6 in the checkpoint, 12,7 now; resume with that" in errors[0]
    go = run_recipe(
        [*args, "--widths", "12, 6", "--resume", "latest", "--max-steps", "3"],
        cwd=tmp_path, script=LIST_WIDTHS,
    )  # fmt: skip
    assert "resumed from" in go.stdout
    assert json.loads((out / "model" / "model.json").read_text())["step"] == 3
