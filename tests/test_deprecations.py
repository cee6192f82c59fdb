"""Stable across versions: a name that moved keeps its old path for at least one minor version,
with a DeprecationWarning naming the new one at the user's line (a recipe copied from an earlier
version still trains after `git pull`); `accel-recipes --version` names the CHANGELOG's newest
version."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import subprocess
import sys
import warnings

import pytest
import torch
from typer.testing import CliRunner

import accel_common
import accel_common.tools.cli as cli
from accel_common import SharedSettings
from accel_common.deprecation import OLD_MODULES
from tests.processes import REPO, recipe_env

# the template as a user copied it before 0.2.0: model_option and train_command from
# accel_common.options, args.compile_model, and 9 module paths that moved in 0.3.0
OLD_TEMPLATE = REPO / "tests" / "fixtures" / "train_template_0_1.py"


def only_warning(record: pytest.WarningsRecorder) -> warnings.WarningMessage:
    """The one DeprecationWarning recorded: a second would be a shim warning twice."""
    deprecations = [w for w in record if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1, [str(w.message) for w in deprecations]
    return deprecations[0]


@pytest.mark.parametrize("name", ["model_option", "train_command"])
def test_a_name_that_left_options_imports_from_there_with_a_warning(name):
    with pytest.warns(DeprecationWarning, match=rf"use accel_common\.{name}\b") as record:
        found = getattr(importlib.import_module("accel_common.options"), name)
    assert found is getattr(accel_common, name)
    assert only_warning(record).filename == __file__  # the user's line, not the shim's


def test_the_old_from_import_of_options_works_and_points_at_the_importing_line():
    with pytest.warns(DeprecationWarning) as record:
        from accel_common.options import model_option, train_command
    assert model_option is accel_common.model_option
    assert train_command is accel_common.train_command
    messages = sorted(str(w.message) for w in record)
    assert [m.split(" is deprecated")[0] for m in messages] == [
        "accel_common.options.model_option",
        "accel_common.options.train_command",
    ]
    assert {w.filename for w in record} == {__file__}


def test_a_name_that_never_was_in_options_is_still_an_import_error():
    with pytest.raises(ImportError, match="cannot import name 'nothing_here'"):
        from accel_common.options import nothing_here  # noqa: F401
    with pytest.raises(ImportError, match="cannot import name 'model_option'"):
        from accel_common.loop import model_option  # noqa: F401 (it left options, not loop)


def defined_names(module: object) -> list[str]:
    """The functions and classes `module` defines itself (not those it imports)."""
    return [
        name
        for name, value in vars(module).items()
        if callable(value) and getattr(value, "__module__", None) == module.__name__
    ]


@pytest.mark.parametrize("old", sorted(OLD_MODULES))
def test_every_module_path_of_0_2_hands_out_its_new_modules_names(old):
    """`from accel_common.loop import TrainLoop` (0.2's layout) is accel_common.training.loop's
    TrainLoop, with one warning at the importing line naming where to import it from now."""
    new = importlib.import_module(OLD_MODULES[old])
    names = defined_names(new)
    assert names, f"{new.__name__} defines no function or class to look up"
    old_module = importlib.import_module(old)
    for name in names:
        with pytest.warns(DeprecationWarning) as record:
            found = getattr(old_module, name)
        assert found is getattr(new, name)
        warning = only_warning(record)
        assert warning.filename == __file__  # the user's line, not the shim's
        where = "accel_common" if name in accel_common.__all__ else new.__name__
        assert f"{old}.{name} is deprecated: use {where}.{name} " in str(warning.message)


def test_an_old_module_path_is_not_a_second_copy_of_the_module():
    """The old path forwards reads to the one module: state kept there is the same state."""
    import accel_common.stop_signals as old_stop_signals
    from accel_common.training import stop_signals

    assert old_stop_signals is not stop_signals  # a forwarding module, not an alias
    with pytest.warns(DeprecationWarning):
        assert old_stop_signals.StopSignals is stop_signals.StopSignals


def test_compile_model_is_adapt_model_with_a_warning(monkeypatch):
    adapted = []
    monkeypatch.setattr(SharedSettings, "adapt_model", lambda self, model: adapted.append(model))
    model = torch.nn.Linear(2, 1)
    with pytest.warns(DeprecationWarning, match=r"use SharedSettings\.adapt_model") as record:
        SharedSettings().compile_model(model)
    assert adapted == [model]
    assert only_warning(record).filename == __file__


def test_the_crystal_api_at_its_old_path_is_the_one_beside_the_script():
    import recipes.crystal.api as old
    from recipes import crystal_api

    with pytest.warns(DeprecationWarning, match=r"use recipes\.crystal_api\.train_from_extxyz"):
        from recipes.crystal.api import train_from_extxyz
    assert train_from_extxyz is crystal_api.train_from_extxyz
    for name in old.MOVED:
        with pytest.warns(DeprecationWarning, match=rf"use recipes\.crystal_api\.{name}\b"):
            assert getattr(old, name) is getattr(crystal_api, name)
    with pytest.raises(AttributeError, match="has no attribute 'torch'"):
        old.torch  # noqa: B018 (only what the old module defined, not crystal_api's imports)


@pytest.mark.slow
def test_a_recipe_written_against_the_previous_layout_trains_with_warnings(tmp_path):
    """The template as a user copied it before 0.2.0 (OLD_TEMPLATE): it trains on its example
    data and says what moved, at the recipe's own lines."""
    script = tmp_path / "train_mine.py"
    script.write_text(OLD_TEMPLATE.read_text())
    env = {**recipe_env(tmp_path), "PYTHONWARNINGS": "default::DeprecationWarning"}
    result = subprocess.run(
        [sys.executable, str(script), "--epochs", "1", "--max-steps", "2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "runs" / "template" / "model" / "model.safetensors").is_file()
    for old_path, new_path in [
        ("accel_common.options.model_option", "accel_common.model_option"),
        ("accel_common.options.train_command", "accel_common.train_command"),
        ("accel_common.entry.run_recipe", "accel_common.run_recipe"),
        ("accel_common.export.load_exported", "accel_common.load_exported"),
        ("SharedSettings.compile_model", "SharedSettings.adapt_model"),
    ]:
        assert f"DeprecationWarning: {old_path} is deprecated: use {new_path}" in result.stderr
    assert f"{script}:" in result.stderr  # each warning points at the recipe's own line


def newest_changelog_version() -> str:
    text = (REPO / "CHANGELOG.md").read_text()
    found = re.search(r"^## (\d+\.\d+\.\d+)\b", text, re.M)
    assert found, "CHANGELOG.md has no `## X.Y.Z` heading"
    return found.group(1)


def test_version_is_the_changelogs_newest(monkeypatch):
    # an editable install's metadata keeps the version it was installed at: the checkout wins
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0.0")
    result = CliRunner().invoke(cli.app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output == f"accel-recipes {newest_changelog_version()}\n"


def test_version_outside_a_checkout_is_the_installed_distributions(monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "REPO_ROOT", tmp_path)  # no pyproject.toml: installed from a wheel
    monkeypatch.setattr(importlib.metadata, "version", {"accel-recipes": "9.9.9"}.__getitem__)
    result = CliRunner().invoke(cli.app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output == "accel-recipes 9.9.9\n"
