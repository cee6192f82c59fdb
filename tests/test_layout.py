"""Rules of the library's layout (docs/DESIGN: one owner per concern), checked on its source."""

from __future__ import annotations

import ast

from tests.conftest import REPO

LIBRARY = REPO / "accel_common"
# being split by the other parts of issue 41; remove each name once its split is in
SPLIT_ELSEWHERE = {"loop.py", "checkpoint.py", "options.py"}


def imported_modules(path) -> set[str]:
    """Every module `path` imports by name (import x.y / from x.y import z)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_the_library_imports_no_recipe():
    """The library never depends on a recipe: a tool finds a workload's parts by name
    (tools/example_data.py, tools/originals.py), not by importing them."""
    offenders = {}
    for path in LIBRARY.rglob("*.py"):
        recipes = sorted(m for m in imported_modules(path) if m.split(".")[0] == "recipes")
        if recipes:
            offenders[str(path.relative_to(REPO))] = recipes
    assert offenders == {}


def test_no_library_module_is_over_500_lines():
    long = {
        str(path.relative_to(REPO)): lines
        for path in LIBRARY.rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > 500
        and str(path.relative_to(LIBRARY)) not in SPLIT_ELSEWHERE
    }
    assert long == {}
