"""The recipe a check runs: found by name (recipes/train_NAME.py) or path, its declarations, its
example data.

A recipe declares, at module level, what makes its run small and deterministic for the checks
(`CHECK_ARGS`: tiny sizes, dropout off, the global batch), how small its example is
(`CHECK_DATA`: its generator's options), the single-device command that loads its export
(`CHECK_COMMAND`: {model}, {data} and {out} are filled in) and what its kill-and-resume test adds
to CHECK_ARGS (`CHECK_RESUME`: the randomness and state one process must restore exactly), the
tensors whose N-vs-1 difference is rounding noise the check cannot find itself (`CHECK_NOISE`)
and the promises that cannot hold for the workload, each with why (`CHECK_WAIVE`). The tests
read the same declarations, so a new recipe joins them by existing.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from accel_common.errors import RecipeError
from accel_common.tools.example_data import RECIPES, generator, make_data, workloads


def load_script(recipe: str, what: str) -> tuple[Path, ModuleType]:
    """The recipe's script (a name like `template`, or a path) and its module. A path that is not
    a recipe script (missing, a folder, not Python, not importable) is one line naming it, with
    `what` (the flag or argument that gave it)."""
    names = ", ".join(workloads())
    script = Path(recipe)
    if not script.exists() and re.fullmatch(r"[a-z][a-z0-9_]*", recipe):
        script = RECIPES / f"train_{recipe}.py"
    if not script.exists():
        raise RecipeError(f"{what}: no such recipe or file; give a recipe ({names}) or its script")
    if not script.is_file():
        raise RecipeError(f"{what} is a folder; give a recipe script such as recipes/train_X.py")
    if script.suffix != ".py":
        raise RecipeError(f"{what} is not a Python file; give a recipe ({names}) or its script")
    if script.resolve().parent == RECIPES:  # one of the project's recipes: import it as one
        return script, importlib.import_module(f"recipes.{script.stem}")
    # a script elsewhere, run as a module of its own (its dataclasses look it up by name)
    name = f"accel_recipes_{script.stem}"
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # a syntax error, a missing package: the user's file, not ours
        del sys.modules[name]
        text = str(err).splitlines()[0] if str(err) else ""
        if isinstance(err, SyntaxError):
            text = f"{err.msg} at line {err.lineno}"
        raise RecipeError(f"{what}: cannot import it ({type(err).__name__}: {text})") from None
    return script, module


@dataclass
class Recipe:
    name: str
    script: Path
    module: ModuleType

    @property
    def args(self) -> list[str]:
        return list(getattr(self.module, "CHECK_ARGS", []))

    @property
    def resume_args(self) -> list[str]:
        """CHECK_ARGS and then CHECK_RESUME: what the kill-and-resume test runs (one process,
        so what CHECK_ARGS turns off for N-vs-1 equality, dropout, may be on again)."""
        return [*self.args, *getattr(self.module, "CHECK_RESUME", [])]

    def __post_init__(self) -> None:
        """A malformed CHECK_NOISE is refused when the recipe is found, before any run: a bare
        string would match by its characters, an empty ending every tensor."""
        noise = getattr(self.module, "CHECK_NOISE", ())
        if isinstance(noise, str) or not all(isinstance(end, str) and end for end in noise):
            raise RecipeError(
                f"CHECK_NOISE in {self.script}: give a tuple of name endings, e.g. "
                'CHECK_NOISE = ("to_k.bias",)'
            )

    @property
    def noise(self) -> tuple[str, ...]:
        """Name endings of the tensors whose N-vs-1 difference is rounding noise amplified on
        purpose-free gradients (CHECK_NOISE, each with its reason in the recipe): a tensor is
        left out when its exported name ends with one (`str.endswith`: "to_k.bias" matches
        "down.0.attn.to_k.bias")."""
        return tuple(getattr(self.module, "CHECK_NOISE", ()))

    def waivers(self, rows: list[str]) -> dict[str, str]:
        """CHECK_WAIVE: the promises (row letters among `rows`) that cannot hold for this
        workload, each with the reason the table shows; one without a reason, or for a row
        that does not exist, is refused."""
        waive = getattr(self.module, "CHECK_WAIVE", {})
        where = f"CHECK_WAIVE in {self.script}"
        if not isinstance(waive, dict):
            raise RecipeError(f'{where}: give a dict of row to reason, e.g. {{"a": "why"}}')
        for row, reason in waive.items():
            if row not in rows:
                raise RecipeError(
                    f"{where}: {row!r} is no row; give letters among {','.join(rows)}"
                )
            if not isinstance(reason, str) or not reason.strip():
                raise RecipeError(f"{where}: row {row!r} has no reason; say why it cannot hold")
        return dict(waive)

    @property
    def data_options(self) -> dict:
        return dict(getattr(self.module, "CHECK_DATA", {}))

    @property
    def command(self) -> list[str] | None:
        command = getattr(self.module, "CHECK_COMMAND", None)
        return None if command is None else list(command)

    def write_example(self, out_dir: Path) -> Path:
        """Its example data, at the size CHECK_DATA asks for, into the new folder `out_dir`."""
        if self.script.resolve().parent == RECIPES:
            return make_data(self.name, out_dir, **self.data_options)
        write_dataset = getattr(self.module, "write_dataset", None)
        if write_dataset is None:  # a copied recipe with a folder of its own
            write_dataset = generator(self.name)
        return write_dataset(out_dir, **self.data_options)


def find_recipe(recipe: str, what: str = "NAME") -> Recipe:
    script, module = load_script(recipe, f"{what} {recipe}")
    name = getattr(module, "RECIPE", script.stem.removeprefix("train_"))
    if not hasattr(getattr(module, "train", None), "default_batch"):
        raise RecipeError(
            f"{what} {recipe} defines no recipe command `train` (a function decorated by "
            "accel_common.recipe_cli.options.train_command, as in recipes/train_template.py)"
        )
    return Recipe(name, script.resolve(), module)  # the runs start in a folder of their own


def discovered() -> list[str]:
    """Every recipe there is: recipes/train_*.py, by name."""
    return workloads()
