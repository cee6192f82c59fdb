"""The public API (accel_common and accel_common.data's `__all__`): what a recipe imports, every
name documented, its names and signatures held by a snapshot (tests/public_api.txt), so that an
API change is a deliberate edit of the snapshot and of CHANGELOG.md; and every recipe, and every
`accel-recipes new` copy, imports the library only through these faces.

After a deliberate change: `python -m tests.test_public_api --write`, then say in CHANGELOG.md
what changed for recipe authors and how to update.
"""

from __future__ import annotations

import ast
import difflib
import enum
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import REPO, recipe_env

FACES = ("accel_common", "accel_common.data")
SNAPSHOT = REPO / "tests" / "public_api.txt"
ORIGINAL = "original"  # recipes/X/original/: an original's files, kept as they are


def describe(name: str, value: object) -> str:
    """One line: a function's signature; a class's bases and the signature of its own __init__
    (an inherited one is its base's API: torch's or Python's, which change with their versions),
    an enum's members; a constant's value."""
    if inspect.isclass(value):
        bases = ", ".join(base.__qualname__ for base in value.__bases__)
        if issubclass(value, enum.Enum):
            return f"class {name}({bases}): {', '.join(repr(m.value) for m in value)}"
        if "__init__" in vars(value):
            return f"class {name}({bases}): {inspect.signature(value)}"
        return f"class {name}({bases})"
    if callable(value):
        return f"def {name}{inspect.signature(value)}"
    return f"{name} = {value!r}"


def public_api() -> str:
    """The snapshot's text: each face's names, in `__all__` order, one line each."""
    lines = []
    for face in FACES:
        module = importlib.import_module(face)
        lines.append(f"# {face}")
        lines += [describe(name, getattr(module, name)) for name in module.__all__]
    return "\n".join(lines) + "\n"


def library_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of each import of an accel_common module that is not a public face."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        found += [
            (node.lineno, name)
            for name in names
            if name.split(".")[0] == "accel_common" and name not in FACES
        ]
    return found


def recipe_files(root: Path) -> list[Path]:
    """Every Python file of recipes/, an original's files kept as they are aside."""
    return [
        path
        for path in sorted((root / "recipes").rglob("*.py"))
        if ORIGINAL not in path.relative_to(root / "recipes").parts
    ]


@pytest.mark.parametrize("face", FACES)
def test_every_public_name_loads_and_says_why(face):
    module = importlib.import_module(face)
    assert len(module.__all__) == len(set(module.__all__)), "a name listed twice"
    undocumented = [
        name
        for name in module.__all__
        if callable(value := getattr(module, name)) and not inspect.getdoc(value)
    ]
    assert not undocumented, f"{face}: public names without a docstring: {undocumented}"
    assert set(module.__all__) <= set(dir(module))


def test_a_name_that_is_not_public_is_an_attribute_error_and_a_submodule_still_imports():
    import accel_common

    with pytest.raises(AttributeError, match="has no attribute 'StepFlops'"):
        accel_common.StepFlops  # noqa: B018 (internal: accel_common.monitoring.throughput's)
    from accel_common import errors

    assert errors.ConfigError is accel_common.ConfigError


def test_importing_the_face_imports_no_module_until_a_name_is_used(tmp_path):
    """`import accel_common` costs nothing: the CLI's commands that need no torch stay fast."""
    probe = (
        "import sys, accel_common, accel_common.data\n"
        "print(sorted(m for m in sys.modules if m.startswith('accel_common.') and "
        "m not in ('accel_common.deprecation', 'accel_common.data')), 'torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=recipe_env(tmp_path)
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[] False"


def test_the_public_api_is_the_snapshot():
    now, kept = public_api(), SNAPSHOT.read_text()
    diff = "".join(difflib.unified_diff(kept.splitlines(True), now.splitlines(True), "kept", "now"))
    assert now == kept, (
        "the public API changed: if that is deliberate, run `python -m tests.test_public_api "
        "--write` and say in CHANGELOG.md what changed and how a recipe updates\n" + diff
    )


def test_the_snapshot_is_the_same_in_a_fresh_interpreter(tmp_path):
    """No address, no order that varies from run to run: the snapshot can only change when the
    API does."""
    result = subprocess.run(
        [sys.executable, "-c", "from tests.test_public_api import public_api\n"
         "print(public_api(), end='')"],
        capture_output=True, text=True, env=recipe_env(tmp_path), cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == public_api()


def test_the_import_finder_names_a_module_file_and_passes_the_faces(tmp_path):
    path = tmp_path / "train_x.py"
    path.write_text(
        "import accel_common\nfrom accel_common import say\nfrom accel_common.data import cached\n"
        "from accel_common.training.loop import TrainLoop\nimport accel_common.errors\n"
        "def f():\n    from accel_common.options import SharedSettings\n"
    )
    assert library_imports(path) == [
        (4, "accel_common.training.loop"),
        (5, "accel_common.errors"),
        (7, "accel_common.options"),
    ]


def test_every_recipe_imports_the_library_only_through_its_faces():
    """The recipes, and examples/ (a plain script built from the library's parts)."""
    found = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in [*recipe_files(REPO), *sorted((REPO / "examples").glob("*.py"))]
        for line, module in library_imports(path)
    ]
    assert not found, (
        "import these names from accel_common (or accel_common.data), not a module file; a "
        "name a recipe needs that is not public yet belongs in accel_common/__init__.py:\n"
        + "\n".join(found)
    )


def test_a_new_recipe_imports_the_library_only_through_its_faces(tmp_path):
    script = tmp_path / "recipes" / "train_mine.py"
    script.parent.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "accel_common.tools.cli", "new", "mine", "--dest", script.parent],
        capture_output=True, text=True, env=recipe_env(tmp_path), cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert script.is_file()
    assert library_imports(script) == []


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.test_public_api --write  (rewrites tests/public_api.txt)")
    SNAPSHOT.write_text(public_api())
    print(f"wrote {SNAPSHOT.relative_to(REPO)}")
