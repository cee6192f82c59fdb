"""A recipe's entry point: its command line (`run_recipe`) and training from Python
(`train_in_python`, in this process or on N processes through Accelerate's launcher).
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import typer
from accelerate.state import AcceleratorState

from accel_common.errors import exit_on_error

# 2 CPU processes over gloo: what train_in_python launches on a machine without GPUs
CPU_CONFIG = Path(__file__).resolve().parents[2] / "accelerate_configs" / "cpu_2proc.yaml"


def run_recipe(train: Callable[..., Any], **subcommands: Callable[..., Any]) -> None:
    """`python recipe.py [flags]` trains; `python recipe.py NAME [flags]` runs a subcommand.

    Training stays the default command, so `accelerate launch recipe.py --bs 64` works unchanged.
    """
    argv = sys.argv[1:]
    name = argv[0] if argv and argv[0] in subcommands else None
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    chosen = subcommands[name] if name else train
    if name is None and subcommands:
        doc = inspect.cleandoc(train.__doc__ or "")  # dedented: the appended line has no indent
        train.__doc__ = (
            doc
            + "\n\nOther commands: "
            + ", ".join(f"`{sys.argv[0]} {sub} --help`" for sub in subcommands)
        )
    app.command()(exit_on_error(chosen))
    prog = Path(sys.argv[0]).name + (f" {name}" if name else "")
    app(args=argv[1:] if name else argv, prog_name=prog)


def train_in_python(
    train: Callable[..., Any],
    argv: list[str],
    output_dir: Path,
    num_processes: int = 1,
    *,
    script: Path,
) -> tuple[dict[str, float], Path]:
    """Run a recipe's training command from Python (a notebook, a script): in this process, or on
    N processes through Accelerate's launcher (one per GPU when there are GPUs, else CPU processes
    over gloo). `argv` are its command-line flags. Returns the final metrics and the exported
    model's folder."""
    model_dir = output_dir / "model"
    if num_processes == 1:
        AcceleratorState._reset_state(reset_partial_state=True)  # a notebook may train twice
        app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
        app.command()(train)
        metrics = typer.main.get_command(app).main(
            args=argv, prog_name=script.name, standalone_mode=False
        )
        return metrics, model_dir
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes"]
    launch += [str(num_processes), "--main_process_ip", "127.0.0.1"]
    if torch.cuda.is_available():
        launch += ["--multi_gpu"]
    else:
        launch += ["--config_file", str(CPU_CONFIG)]
    subprocess.run([*launch, str(script), *argv], check=True)
    return json.loads((model_dir / "model.json").read_text())["metrics"], model_dir
