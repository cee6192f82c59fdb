"""Fixtures shared by this folder's test files."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.processes import run_recipe


@pytest.fixture(scope="package")
def finished_run(tmp_path_factory, template_data) -> Path:
    tmp = tmp_path_factory.mktemp("template")
    out = tmp / "run"
    run_recipe(["--data", str(template_data), "--output-dir", str(out)], cwd=tmp)  # defaults
    return out
