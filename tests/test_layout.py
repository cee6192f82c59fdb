"""The library's layout: no import circle in accel_common, no module over 500 lines, no import of
a recipe, and conversion's torch.distributed.checkpoint out of every recipe's start-up; and the
recipes' shape: a recipe's folder never imports a recipe's script, and an original's file kept
as it is (recipes/X/original/) keeps its license beside it and is left alone by ruff and these
checks."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.processes import recipe_env

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = "accel_common"
MAX_LINES = 500
ORIGINAL = "original"  # recipes/X/original/: an original project's files, kept as they are
LICENSES = ("LICENSE*", "COPYING*")


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, module: str) -> set[str]:
    """Every module name an import anywhere in `path` may load, deferred imports inside functions
    included: a circle hidden by an import in a function is still a circle."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}  # `from pkg import mod`
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    """accel_common module -> the accel_common modules it imports."""
    paths = {module_name(root, p): p for p in sorted((root / LIBRARY).rglob("*.py"))}
    return {
        module: (imported_names(path, module) & paths.keys()) - {module}
        for module, path in paths.items()
    }


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The import circles: each group of modules that reach one another."""

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reach = {module: reachable(module) for module in graph}
    return {
        frozenset({module} | {other for other in reach[module] if module in reach[other]})
        for module in graph
        if module in reach[module]
    }


def recipe_importers(root: Path) -> set[str]:
    """The accel_common modules that import something of `recipes`."""
    modules = {module_name(root, p): p for p in (root / LIBRARY).rglob("*.py")}
    return {
        module
        for module, path in modules.items()
        if any(name.split(".")[0] == "recipes" for name in imported_names(path, module))
    }


def script_importers(root: Path) -> dict[str, list[str]]:
    """{recipes/X/ module: the recipe scripts it imports} for every recipe recipes/train_X.py: its
    folder holds the script's parts, so that an import of the script from there is a circle (or
    one a copier starts by copying)."""
    found = {}
    for script in sorted((root / "recipes").glob("train_*.py")):
        folder = root / "recipes" / script.stem.removeprefix("train_")
        for path in sorted(folder.rglob("*.py")):
            if path.relative_to(folder).parts[0] == ORIGINAL:  # not ours: any style, any import
                continue
            names = imported_names(path, module_name(root, path))
            if scripts := sorted(n for n in names if n.startswith("recipes.train_")):
                found[str(path.relative_to(root))] = scripts
    return found


def originals_without_license(root: Path) -> list[str]:
    """The recipes/X/original/ folders with no LICENSE (or COPYING) file of the original's."""
    return [
        str(folder.relative_to(root))
        for folder in sorted((root / "recipes").glob(f"*/{ORIGINAL}"))
        if folder.is_dir() and not any(any(folder.glob(name)) for name in LICENSES)
    ]


def ruff(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=cwd, capture_output=True, text=True
    )


def test_the_cycle_finder_sees_a_circle_through_a_deferred_import(tmp_path):
    package = tmp_path / LIBRARY
    package.mkdir()
    (package / "a.py").write_text("def f():\n    from accel_common import b\n")
    (package / "b.py").write_text("from accel_common.c import g\n")
    (package / "c.py").write_text("import accel_common.a\n\ndef g():\n    pass\n")
    (package / "d.py").write_text("from accel_common.a import f\n")
    graph = import_graph(tmp_path)
    assert graph["accel_common.d"] == {"accel_common.a"}
    assert cycles(graph) == {frozenset({"accel_common.a", "accel_common.b", "accel_common.c"})}


def test_no_import_circle_in_the_library():
    found = cycles(import_graph(ROOT))
    assert not found, "import circles: " + "; ".join(" <-> ".join(sorted(c)) for c in found)


def concern(module: str) -> str:
    """The part of the library a module belongs to: its subpackage, or itself at the top."""
    parts = module.split(".")
    return ".".join(parts[:2])


def concern_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between the library's parts (subpackages and top-level modules)."""
    found: dict[str, set[str]] = {}
    for module, imported in graph.items():
        edges = found.setdefault(concern(module), set())
        edges |= {concern(other) for other in imported} - {concern(module)}
    return found


def test_the_concern_graph_sees_a_circle_between_two_subpackages():
    graph = {
        "accel_common.a.x": {"accel_common.b.y"},
        "accel_common.b.y": {"accel_common.b.z"},
        "accel_common.b.z": {"accel_common.a.w"},
        "accel_common.a.w": set(),
    }
    assert cycles(graph) == set()  # no circle between modules
    assert cycles(concern_graph(graph)) == {frozenset({"accel_common.a", "accel_common.b"})}


def test_no_import_circle_between_the_librarys_subpackages():
    """Laid out by concern (0.3.0): the batch/LR math, the run folder and the errors below, the
    recipe's command line on top; an arrow back up would make the folders lie about the layers."""
    graph = concern_graph(import_graph(ROOT))
    graph.pop(LIBRARY, None)  # the public API names every part, and no part imports it
    found = cycles(graph)
    assert not found, "circles between parts: " + "; ".join(" <-> ".join(sorted(c)) for c in found)


def test_the_library_is_laid_out_by_concern():
    """At most 12 modules at the top (the errors, the console, the faces), at least 5
    subpackages, each with a docstring saying its concern."""
    top = sorted(path.name for path in (ROOT / LIBRARY).glob("*.py"))
    packages = sorted(path.parent for path in (ROOT / LIBRARY).glob("*/__init__.py"))
    assert len(top) <= 12, f"{len(top)} modules at the top of {LIBRARY}: {top}"
    assert len(packages) >= 5, [p.name for p in packages]
    for package in packages:
        assert ast.get_docstring(ast.parse((package / "__init__.py").read_text())), package


def test_no_library_module_is_over_500_lines():
    found = {
        str(path.relative_to(ROOT)): n
        for path in (ROOT / LIBRARY).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not found, f"over {MAX_LINES} lines, split by concern: {found}"


def test_the_library_imports_no_recipe():
    found = recipe_importers(ROOT)
    assert not found, f"import a recipe: {sorted(found)}"


def test_the_script_finder_sees_a_deferred_and_a_relative_import(tmp_path):
    (tmp_path / "recipes" / "toy" / "inner").mkdir(parents=True)
    (tmp_path / "recipes" / "train_toy.py").write_text("from recipes.toy.model import Net\n")
    (tmp_path / "recipes" / "toy" / "model.py").write_text("import torch\n")
    (tmp_path / "recipes" / "toy" / "convert.py").write_text(
        "def f():\n    from recipes.train_toy import Net\n"
    )
    (tmp_path / "recipes" / "toy" / "inner" / "api.py").write_text("from ... import train_toy\n")
    assert script_importers(tmp_path) == {
        "recipes/toy/convert.py": ["recipes.train_toy", "recipes.train_toy.Net"],
        "recipes/toy/inner/api.py": ["recipes.train_toy"],
    }


def test_no_recipe_folder_imports_a_recipe_script():
    found = script_importers(ROOT)
    assert not found, (
        "a recipe's folder imports a script (move what both need into the folder, e.g. "
        f"recipes/X/settings.py): {found}"
    )


def test_an_originals_file_kept_as_it_is_is_left_alone(tmp_path):
    """recipes/X/original/ may hold a file that fails our lint and format and imports anything;
    `ruff check .`, `ruff format --check .` and the layout checks pass over it, and the same file
    anywhere else in the folder fails them."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "recipes" / "toy" / ORIGINAL).mkdir(parents=True)
    (tmp_path / "recipes" / "train_toy.py").write_text('"""Toy."""\n')
    theirs = "import os, sys\nfrom recipes.train_toy import *\ndef f( x ):\n  return x==None\n"
    kept = tmp_path / "recipes" / "toy" / ORIGINAL / "train.py"
    kept.write_text(theirs)
    (kept.parent / "LICENSE").write_text("MIT License\n")
    for args in (["check", "."], ["format", "--check", "."]):
        result = ruff(args, tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
    assert script_importers(tmp_path) == {}
    assert originals_without_license(tmp_path) == []
    (tmp_path / "recipes" / "toy" / "train.py").write_text(theirs)  # not kept aside: ours
    for args in (["check", "."], ["format", "--check", "."]):
        assert ruff(args, tmp_path).returncode == 1
    assert list(script_importers(tmp_path)) == ["recipes/toy/train.py"]


def test_an_originals_file_keeps_its_license_beside_it(tmp_path):
    (tmp_path / "recipes" / "toy" / ORIGINAL).mkdir(parents=True)
    (tmp_path / "recipes" / "toy" / ORIGINAL / "model.py").write_text("x = 1\n")
    assert originals_without_license(tmp_path) == ["recipes/toy/original"]
    (tmp_path / "recipes" / "toy" / ORIGINAL / "LICENSE.txt").write_text("BSD\n")
    assert originals_without_license(tmp_path) == []
    found = originals_without_license(ROOT)
    assert not found, f"an original's files without its LICENSE beside them: {found}"


def test_checkpoints_and_exports_do_not_import_torch_distributed_checkpoint(tmp_path):
    """It adds ~1.3 s to every process start; only reading an FSDP sharded folder needs it."""
    probe = (
        "import sys\n"
        "import accel_common.checkpoints.checkpoint, accel_common.checkpoints.dcp_reader\n"
        "import accel_common.conversion.convert, accel_common.checkpoints.export\n"
        "print('torch.distributed.checkpoint' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=recipe_env(tmp_path)
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
