"""A recipe's entry point: a launched worker whose command succeeded leaves without the
interpreter's teardown (torch's gloo teardown at exit aborts now and then, after everything was
written); a failed command, or a process that was not launched, exits as usual."""

from __future__ import annotations

import sys

import pytest

from accel_common import entry
from accel_common.errors import ConfigError


class Left(Exception):
    """os._exit, recorded instead of ending the test process."""


def run(monkeypatch, command, world_size: str | None) -> list[int]:
    """Run `command` as a recipe's training command; the codes os._exit was called with."""
    calls: list[int] = []

    def fake_exit(code: int) -> None:
        calls.append(code)
        raise Left

    monkeypatch.setattr(entry.os, "_exit", fake_exit)
    monkeypatch.setattr(sys, "argv", ["recipe.py"])
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    with pytest.raises((Left, SystemExit)):
        entry.run_recipe(command)
    return calls


def succeeds() -> None:
    print("trained")


def fails() -> None:
    raise ConfigError("--bs 0: no batch")


def test_a_launched_worker_that_succeeded_leaves_with_its_output_flushed(monkeypatch, capsys):
    assert run(monkeypatch, succeeds, "2") == [0]
    assert capsys.readouterr().out == "trained\n"


@pytest.mark.parametrize(
    ("command", "world_size"), [(succeeds, None), (succeeds, "1"), (fails, "2")]
)
def test_any_other_end_exits_as_usual(monkeypatch, command, world_size):
    assert run(monkeypatch, command, world_size) == []
