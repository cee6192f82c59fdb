"""`accel-recipes`: the batch/LR plan table, checkpoint conversion, new recipes, example data."""

from __future__ import annotations

import functools
import importlib.metadata
import math
import re
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from accel_common.batch_lr.batching import BATCH_FLAG_HELP, BatchPlanError, BatchRequest
from accel_common.batch_lr.lr import LRScaling, scale_lr
from accel_common.checkpoints.checkpoint_files import ALLOW_UNVERIFIED_HELP
from accel_common.checkpoints.export import (
    UNNAMED_RECIPE,
    require_export_target,
    require_new_files,
    save_file_atomically,
    write_export,
)
from accel_common.conversion.convert import convert_checkpoint, parse_given, tell
from accel_common.errors import ConfigError, RecipeError, exit_on_error
from accel_common.hardware.launch_guard import require_new_file, require_writable_folder
from accel_common.run_folder.outputs import exclusive_outputs, new_file
from accel_common.tools.bench.report import run_benchmark
from accel_common.tools.doctor.base import Backend, DoctorOptions
from accel_common.tools.doctor.comm import parse_sizes
from accel_common.tools.doctor.report import run_doctor
from accel_common.tools.example_data import make_data, workloads
from accel_common.tools.launch import run as run_launch
from accel_common.tools.originals import converter, import_from
from accel_common.tools.recipe_settings import foreign_config, is_recipe, unrecorded_note

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Tools for the accel-recipes training recipes.",
)
console = Console()

REPO_ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = REPO_ROOT / "recipes" / "train_template.py"
GUIDE_REF_BS, GUIDE_REF_LR = 32, 1e-3  # `plan` without flags


def version() -> str:
    """This code's version: its checkout's pyproject.toml where it runs from one (an editable
    install's metadata keeps the version it was installed at, not the last `git pull`'s), else
    the installed distribution's."""
    pyproject = REPO_ROOT / "pyproject.toml"
    # a regular expression, not tomllib (Python 3.11+): the line is ours and kept this simple
    if pyproject.is_file() and (
        found := re.search(r'^version = "(.+)"$', pyproject.read_text(), re.M)
    ):
        return found.group(1)
    return importlib.metadata.version("accel-recipes")


def print_version(value: bool) -> None:
    """`--version`: eager, so it answers before Typer asks for a command."""
    if value:
        typer.echo(f"accel-recipes {version()}")
        raise typer.Exit()


@app.callback()
def main(
    _version: bool = typer.Option(
        False,
        "--version",
        callback=print_version,
        is_eager=True,
        help="Print the version (CHANGELOG.md says what changed in it) and exit.",
    ),
) -> None:
    """Tools for the accel-recipes training recipes."""


def batch_option(name: str, default: int | None = None) -> Any:
    """A batch flag as the recipes declare it (batching.BATCH_FLAG_HELP), for the plan and doctor
    commands: the same name, meaning and bound everywhere."""
    return typer.Option(default, f"--{name.replace('_', '-')}", help=BATCH_FLAG_HELP[name], min=1)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@exit_on_error
def plan(
    ctx: typer.Context,
    ref_bs: int = typer.Option(None, help="Global batch the reference LR was tuned at."),
    ref_lr: float = typer.Option(None, help="LR tuned at --ref-bs."),
    per_device_bs: int = batch_option("per_device_bs"),
    bs: int = batch_option("bs"),
    grad_accum: int = batch_option("grad_accum", 1),
    max_per_device_bs: int = batch_option("max_per_device_bs"),
    gpus: str = typer.Option("1,2,4,8,16", help="Comma-separated GPU (process) counts."),
    measure: str = typer.Option(
        None,
        help="RECIPE (a name such as template, or a path): measure its memory at --measure-bs "
        "on this device and plan the per-device batch from it; the recipe's own flags follow.",
    ),
    measure_bs: str = typer.Option(
        "8,16,32", help="Per-device batches to measure (2 or 3, each in a fresh process)."
    ),
) -> None:
    """Print global batch, per-GPU batch, accumulation and linear/sqrt-scaled LR per GPU count:
    --bs keeps the global batch fixed as GPUs are added, --per-device-bs (the default, at --ref-bs,
    when neither is given) the per-GPU batch.

    Without flags it shows a guide for --ref-bs 32 --ref-lr 1e-3 (a common Adam setting).

    With --measure RECIPE [recipe flags] it runs a few training steps of the recipe at each
    --measure-bs batch, fits memory = fixed + per-sample x batch, and prints for each device count
    and memory size (this device, 24/40/80/141 GB) the largest per-device batch that fits, the
    accumulation that reaches --bs and the LR; `--max-per-device-bs auto` then uses it."""
    if ref_lr is not None and not (ref_lr > 0 and math.isfinite(ref_lr)):
        raise ConfigError(f"--ref-lr must be a positive number, got {ref_lr}")
    if measure is not None:
        recipe_argv = [*ctx.args]
        for flag, value in (
            ("--bs", bs), ("--per-device-bs", per_device_bs), ("--grad-accum", grad_accum),
            ("--ref-bs", ref_bs), ("--lr", ref_lr),
        ):  # fmt: skip
            if value is not None and not (flag == "--grad-accum" and value == 1):
                recipe_argv += [flag, str(value)]
        measured_plan(measure, recipe_argv, measure_bs, gpus)
        return
    if ctx.args:
        raise RecipeError(
            f"unknown arguments {' '.join(ctx.args)} (recipe flags go with --measure)"
        )
    if ref_bs is None and ref_lr is None:
        console.print(
            f"No reference given: showing --ref-bs {GUIDE_REF_BS} --ref-lr {GUIDE_REF_LR:g}; pass "
            "the batch and LR your model was tuned at for your own numbers."
        )
    ref_bs = GUIDE_REF_BS if ref_bs is None else ref_bs
    ref_lr = GUIDE_REF_LR if ref_lr is None else ref_lr
    if per_device_bs is None and bs is None:
        per_device_bs = ref_bs
    request = BatchRequest(bs, per_device_bs, grad_accum, max_per_device_bs)
    counts = parse_counts(gpus, "--gpus")
    scale_lr(ref_lr, ref_bs, ref_bs, LRScaling.none)  # validates --ref-bs (--ref-lr: above)
    keep = "per-GPU batch" if bs is None else "global batch"
    table = Table(title=f"Batch and LR plan (reference: lr {ref_lr:g} at global batch {ref_bs})")
    for column in ("GPUs", "global batch", "per-GPU batch", "accum", "linear LR", "sqrt LR"):
        table.add_column(column, justify="right")
    notes = []
    for count in counts:
        try:
            row = request.plan(count, warn_small=False)
        except BatchPlanError as err:
            if bs is None or "cannot be split" not in str(err):
                raise
            table.add_row(str(count), str(bs), "-", "-", "-", "-")
            notes.append(f"{count} GPUs: {err}")
            continue
        table.add_row(
            str(count),
            str(row.global_batch_size),
            str(row.per_device_batch_size),
            str(row.grad_accum_steps),
            f"{scale_lr(ref_lr, ref_bs, row.global_batch_size, LRScaling.linear):.3g}",
            f"{scale_lr(ref_lr, ref_bs, row.global_batch_size, LRScaling.sqrt):.3g}",
        )
    console.print(table)
    console.print(
        f"Keeping the {keep} fixed. Pass the numbers to a recipe as --bs GLOBAL "
        f"--lr {ref_lr:g} --ref-bs {ref_bs} --lr-scaling linear|sqrt."
    )
    for note in notes:
        console.print(f"[yellow]{note}[/yellow]")


def measured_plan(recipe: str, argv: list[str], batches: str, gpus: str) -> None:
    """plan --measure: measure, save the fit for --max-per-device-bs auto, print the table."""
    from accel_common.batch_lr.memory import (
        MEMORY_DIR,  # imported here: they load torch and accelerate
    )
    from accel_common.tools.measure import describe, measure, plan_rows

    fit, params = measure(recipe, argv, parse_counts(batches, "--measure-bs"))
    path = fit.save(MEMORY_DIR / f"{fit.recipe}.json")
    target = f"global batch {params['bs']}" if params["bs"] else "per-device batch"
    table = Table(title=f"{fit.recipe}: per-device batch from measured memory ({target})")
    columns = ("memory", "devices", "fits", "per-device batch", "accum", "global")
    for column in (*columns, "LR", "basis"):
        table.add_column(column, justify="right")
    for row in plan_rows(fit, params, parse_counts(gpus, "--gpus")):
        cells = (row.devices, row.fits, row.per_device, row.accum, row.global_batch)
        lr = "-" if row.lr is None else f"{row.lr:.3g}"
        table.add_row(row.memory, *("-" if c is None else str(c) for c in cells), lr, row.basis)
    console.print(table)
    for line in describe(fit):
        console.print(line)
    console.print(f"wrote {path}")


def parse_counts(text: str, flag: str) -> list[int]:
    try:
        return [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise RecipeError(f"{flag} {text!r}: give comma-separated integers, e.g. 1,2,4,8") from None


@app.command()
@exit_on_error
def convert(
    source: Path = typer.Argument(
        ...,
        help="A .safetensors/.pt/.pth/.bin file, an accelerator.save_state folder (also from "
        "FSDP, sharded or not), or a torch.distributed.checkpoint folder.",
    ),
    output: Path = typer.Argument(
        ...,
        help="Folder to write model.safetensors + model.json into, or a NAME.safetensors file "
        "to write, with its metadata as NAME.json beside it.",
    ),
    recipe: str = typer.Option(UNNAMED_RECIPE, help="Recipe name recorded in the JSON."),
    model_index: int = typer.Option(0, help="Which model of a multi-model save_state folder."),
    force: bool = typer.Option(
        False,
        help="Overwrite existing files: the export (OUTPUT/model.safetensors or NAME.safetensors), "
        "and what is written beside it (its JSON, a vocabulary, an original's config.json).",
    ),
    from_original: str | None = typer.Option(
        None,
        "--from",
        help="SOURCE is a checkpoint saved by this original project's code (e.g. pcdiff): import "
        "it, strictly, as the export of the recipe that trains its network.",
    ),
    to_original: str | None = typer.Option(
        None,
        "--to",
        help="SOURCE is this project's export folder: write OUTPUT as a checkpoint the original "
        "project's code loads.",
    ),
    given: list[str] = typer.Option(
        [],
        "--set",
        help="NAME=VALUE, a setting the checkpoint does not record, for the recipe's commands "
        "(evaluate, predict) to rebuild its model: with --recipe, one of its settings or a value "
        "its training derives (e.g. --set hidden=32 --set target_mean=0.4); with --from, what "
        "the original's checkpoint lacks (its note names them), e.g. --set dropout=0.159. "
        "Repeat for several.",
    ),
    allow_unverified: bool = typer.Option(False, help=ALLOW_UNVERIFIED_HELP),
    component: str | None = typer.Option(
        None,
        help="Which model of a diffusers pipeline folder (model_index.json), or of a save_state "
        "folder whose save hook wrote models into subfolders, e.g. --component unet.",
    ),
) -> None:
    """Convert a DDP / torch.compile / Accelerate / FSDP checkpoint into a clean single-file export.

    OUTPUT is a folder (it gets model.safetensors + model.json) or a file NAME.safetensors (written
    as named, with NAME.json beside it); no existing file is replaced, the one named nor any written
    beside it (a vocabulary, an original's config.json), unless --force is given.

    Strips `module.`, `model.module.` and `_orig_mod.` prefixes in any nesting, unwraps
    `model_state` / `state_dict` / `model` wrappers, merges FSDP's per-rank shards
    (`pytorch_model_fsdp_0/`) into full tensors, and never unpickles arbitrary objects. DeepSpeed
    ZeRO checkpoints are merged first with DeepSpeed's zero_to_fp32.py (see docs/sharded.md).
    """
    if from_original and to_original:
        raise RecipeError("give --from or --to, not both")
    if given and to_original:
        raise RecipeError("--set gives a setting the checkpoint does not record: not with --to")
    with exclusive_outputs(not force):  # checked before the work, and again at each move
        convert_to(
            source, output, recipe, model_index, force, (from_original, to_original),
            parse_given(given), allow_unverified, component,
        )  # fmt: skip


def convert_to(
    source: Path,
    output: Path,
    recipe: str,
    model_index: int,
    force: bool,
    originals: tuple[str | None, str | None],
    given: dict[str, str] | None = None,
    allow_unverified: bool = False,
    component: str | None = None,
) -> None:
    """`convert`'s work, once its flags are known to go together."""
    from_original, to_original = originals
    if to_original:
        _, module = converter(to_original)
        if output.is_dir():
            raise RecipeError(f"{output} is a folder; --to writes a file, e.g. {output}/model.pt")
        require_writable_folder(output.parent, "OUTPUT", output)
        side_files = getattr(module, "side_files", None)
        require_new_files([output, *(side_files(source, output) if side_files else [])], force)
        console.print(f"wrote {module.export_checkpoint(source, output)}")
        return
    if from_original:
        recipe, module = converter(from_original)
        model_path = require_export_target(output, force)
        # what the recipe's commands read beside the weights (a vocabulary), read before anything
        # is written, and before the import's note on what the checkpoint lacks (an error is
        # then the only line)
        extras = getattr(module, "export_files", None)
        files = extras(source) if extras else {}
        require_new_files([model_path.parent / name for name in files], force)
        state, config = import_from(module, source, given or {})
        metadata = {
            "recipe": recipe,
            "config": config,
            "converted_from": f"{from_original}: {source}",
        }
        path = write_export(state, output, metadata)
        for name, text in files.items():
            write = functools.partial(Path.write_text, data=text)
            save_file_atomically(path.parent / name, write, "convert again")
            console.print(f"wrote {path.parent / name}")
    else:
        config = foreign_config(recipe, given or {}) if is_recipe(recipe) or given else None
        path = convert_checkpoint(
            source, output, recipe=recipe, model_index=model_index, force=force,
            allow_unverified=allow_unverified, component=component, config=config,
        )  # fmt: skip
        tell(unrecorded_note(recipe, config or {}, output))
    console.print(f"wrote {path} and {path.with_suffix('.json')}")


# the template's lines that name it, and what `new` writes in their place
NEW_DOCSTRINGS = (
    (
        '"""Template recipe: the smallest complete training recipe.',
        '"""The {name} recipe, started from the template (WORKLOAD: say what it trains, on what).',
    ),
    (
        '"""Train the template MLP regressor on CSV data (or a generated example)."""',
        '"""Train the {name} model (WORKLOAD: say on what data; --help shows this line)."""',
    ),
)


@app.command()
@exit_on_error
def new(
    name: str = typer.Argument(..., help="Workload name: recipes/train_NAME.py is created."),
    dest: Path = typer.Option(Path("recipes"), help="Folder to create the recipe in."),
) -> None:
    """Start a new recipe as a copy of the template (never overwrites)."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise RecipeError(f"recipe name {name!r}: use lower-case letters, digits and _")
    target = dest / f"train_{name}.py"
    if target.exists():
        raise RecipeError(f"{target} already exists; choose another name or delete it first")
    if not TEMPLATE.is_file():
        raise RecipeError(f"template not found at {TEMPLATE}; install the repo with pip -e")
    text = TEMPLATE.read_text()
    text = text.replace('RECIPE = "template"', f'RECIPE = "{name}"')
    for old, new_text in NEW_DOCSTRINGS:  # its own name in --help, not the template's
        text = text.replace(old, new_text.format(name=name))
    for old, new_text in (
        ("runs/template", f"runs/{name}"),
        ("data/example/template", f"data/example/{name}"),
        ("train_template.py", target.name),
    ):
        text = text.replace(old, new_text)
    require_new_file(target, "--dest")  # a --dest that is a file, or under one: one line
    try:
        with new_file(target, "--dest") as partial:  # never over a recipe written meanwhile
            partial.write_text(text)
    except OSError as err:
        raise RecipeError(f"--dest {dest}: cannot write {target.name} ({err.strerror})") from None
    console.print(f"created {target}: replace the parts marked WORKLOAD, keep the loop's shape")


@app.command()
@exit_on_error
def check(
    name: str = typer.Argument(
        ..., help="Recipe: a name (recipes/train_NAME.py) or a script's path."
    ),
    only: str | None = typer.Option(None, help="Promises to check, e.g. a,d (default: all)."),
) -> None:
    """Prove on the CPU what the library promises the recipe: 2 processes = 1 (a), kill and
    resume exact (b), --dry-run = the run (c), files opened = data_files (d), the export (e) and
    a converted checkpoint (f) load in its own command, FSDP = plain (g), --compile keeps plain
    keys and bf16 trains (h). Runs its example at the size it declares (CHECK_ARGS, CHECK_DATA,
    CHECK_COMMAND); a row the recipe waives (CHECK_WAIVE = {"a": "why"}) is shown with its reason
    and not run. Prints a table whose failing rows name their worst tensors, and a summary line;
    exit 1 if a promise does not hold."""
    from accel_common.tools.check.runner import run_check  # imported here: it loads torch

    raise typer.Exit(run_check(name, only, console))


@app.command("make-data")
@exit_on_error
def make_data_command(
    workload: str = typer.Argument(..., help=f"One of: {', '.join(workloads())}."),
    out_dir: Path = typer.Argument(..., help="Folder to write the data set into."),
    seed: int = typer.Option(0, help="Random seed of the generator."),
    force: bool = typer.Option(False, help="Write into a non-empty folder."),
) -> None:
    """Write a small synthetic data set in the workload's original on-disk format."""
    path = make_data(workload, out_dir, force=force, seed=seed)
    console.print(f"wrote {workload} data to {path}")


@app.command()
@exit_on_error
def bench(
    out: Path = typer.Option(
        REPO_ROOT / "docs" / "BENCHMARKS.md", help="Markdown file whose scaling section is written."
    ),
    plot: Path = typer.Option(REPO_ROOT / "docs" / "scaling.png", help="Where the plot goes."),
    repeats: int = typer.Option(
        4, min=1, help="Interleaved repeats (even: each order of runs equally often)."
    ),
    cpu: bool = typer.Option(False, help="1 and 2 CPU processes even where there are GPUs."),
) -> None:
    """Samples/s of every recipe on 1 and 2 CPU processes (1..N GPUs where there are), next to
    a hand-written DDP loop, all in one interleaved run (about 6 minutes per repeat on 2 cores)."""
    typer.echo(run_benchmark(out, plot, repeats, cpu))
    console.print(f"wrote {out} and {plot}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@exit_on_error
def launch(ctx: typer.Context) -> None:
    """Run a launcher so that a failed run reads as one line and exits with the worker's code.

    accel-recipes launch -- accelerate launch --config_file CONFIG recipes/train_X.py [flags]

    Output passes through; a failed launch ends in one line: the rank that failed first and its
    exit code (2: bad input, 3: a collective failed, 4: launcher gone; 128+N: killed by signal N)
    with its `error: ...` or last line, instead of the launcher's 40-line report and its exit
    code 1 (a worker's own traceback is shown). Under a config with `use_cpu: true` it sets
    ACCELERATE_USE_CPU=true, so that any Accelerate script, not only a recipe, runs as one
    multi-process job on the CPU (a bare `accelerate launch` does not tell its workers). SIGTERM and
    SIGUSR1 reach the workers, which save the step in progress: exit code 75 (preempted, requeue
    me). The Makefile's launch targets and the SLURM scripts use it; ACCEL_RECIPES_FULL_REPORT=1
    shows everything (with the same exit code). Before anything starts, a missing or malformed
    accelerate config, a DeepSpeed launch without DeepSpeed and a launcher that does not exist are
    refused in one line.
    """
    if not ctx.args:
        raise RecipeError(
            "give the launch command after --, e.g. accel-recipes launch -- accelerate launch "
            "--config_file accelerate_configs/cpu_2proc.yaml recipes/train_template.py"
        )
    raise typer.Exit(run_launch(ctx.args))


@app.command()
@exit_on_error
def doctor(
    port: int | None = typer.Option(
        None, min=1, max=65535, help="Master port (default: the config's, MASTER_PORT, else 29500)."
    ),
    addr: str | None = typer.Option(
        None, help="Master address (default: the config's, MASTER_ADDR, else 127.0.0.1)."
    ),
    config_file: Path | None = typer.Option(None, help="Accelerate config to check against."),
    bs: int | None = batch_option("bs"),
    per_device_bs: int | None = batch_option("per_device_bs"),
    check_comm: bool = typer.Option(False, help="Time a real all-reduce across local processes."),
    backend: Backend = typer.Option(Backend.auto, help="auto: nccl with GPUs, else gloo."),
    nproc: int | None = typer.Option(None, min=1, help="Processes (default: 1 per GPU, or 2)."),
    sizes_mb: str = typer.Option("1,16,64", help="All-reduce sizes in MiB."),
    iters: int = typer.Option(10, min=1, help="Timed all-reduces per size."),
    dist_timeout: float = typer.Option(60.0, min=1, help="Process-group timeout, seconds."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Check this machine before a distributed launch: versions, devices, master port, network
    interfaces, launch variables, config fit; recommends a config, with the batch plan for --bs
    or --per-device-bs (default: 32 per device). Exit 1 on a blocker."""
    options = DoctorOptions(
        port=port,
        addr=addr,
        config_file=config_file,
        batch=BatchRequest(bs, per_device_bs),
        check_comm=check_comm,
        backend=backend,
        nproc=nproc,
        sizes_mb=parse_sizes(sizes_mb),
        iters=iters,
        dist_timeout=dist_timeout,
    )
    raise typer.Exit(run_doctor(options, console, as_json=as_json))


if __name__ == "__main__":
    app()
