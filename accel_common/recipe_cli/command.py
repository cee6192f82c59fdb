"""A recipe's training command: `train_command` makes `train(args, settings)` a Typer command
with every shared flag (accel_common.SharedSettings, with the recipe's defaults), the
recipe's own settings and `--config` / `--dry-run` / `--processes`:

    @dataclass
    class MySettings(Settings):
        hidden: int = setting(64, "Width of the hidden layers.", min=1)

    @train_command(MySettings, build_model=build_model, default_bs=64, lr=3e-3, ref_bs=64)
    def train(args: SharedSettings, settings: MySettings) -> dict[str, float]: ...

`--help` lists both in panels: the recipe's own settings first ("Template settings"), then the
shared ones by concern (accel_common.recipe_cli.panels). Flag names follow the original
codebases (`--bs`, `--lr`, `--epochs`, `--workers`, `--wandb-project`, ...).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import typer

from accel_common.batch_lr.memory import memory_flags, parse_max_per_device_bs
from accel_common.errors import ConfigError
from accel_common.recipe_cli.command_line import (
    CLI_ONLY,
    CLI_PARAMETERS,
    from_config_file,
    settings_parameters,
)
from accel_common.recipe_cli.dry_run import print_dry_run
from accel_common.recipe_cli.options import SharedSettings
from accel_common.recipe_cli.panels import in_panel_order, recipe_panel
from accel_common.settings import Settings, flag


def model_option(recipe: str) -> Any:
    """`--model DIR` of a recipe's single-device commands (predict, score, ...): an exported
    model folder, by default the one training writes."""
    return typer.Option(
        Path(f"runs/{recipe}/model"), "--model", help="Exported model folder (train's output)."
    )


# the settings naming files or folders a run reads (outputs are made by it)
INPUTS = ("data", "init_from", "image_dir")


def absent_inputs(*settings: Settings) -> tuple[str, ...]:
    """`--flag PATH` for each input setting whose path this machine lacks."""
    found = [(name, getattr(s, name, None)) for s in settings for name in INPUTS]
    return tuple(f"{flag(n)} {p}" for n, p in found if p and not Path(p).exists())


def train_command(
    settings: type[Settings],
    *,
    default_bs: int | None = None,
    default_per_device_bs: int | None = None,
    aliases: dict[str, list[str]] | None = None,
    build_model: Callable[[SharedSettings, Any], torch.nn.Module] | None = None,
    build_optimizer: Callable[[SharedSettings, Any, torch.nn.Module], torch.optim.Optimizer]
    | None = None,
    replaces: tuple[str, ...] = (),
    **defaults: Any,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Make `train(args: SharedSettings, settings: S)` a Typer command with every shared flag (with
    this recipe's `defaults`) and every field of the recipe's `settings` class as flags, plus
    `--config`, `--dry-run` and `--processes`.

    The batch default is given apart (`default_bs` = global, or `default_per_device_bs`) because
    it applies only when the user passes neither --bs nor --per-device-bs. `aliases` adds the flag
    names an original codebase used, e.g. {"data": ["--path"], "epochs": ["--niter"]}.
    `build_model(args, settings)` builds the network (on the `meta` device) for `--dry-run`'s
    parameter count; `build_optimizer(args, settings, model)`, the one the recipe trains with,
    sizes the optimizer's state in its memory line (else Adam's is assumed). `replaces` names
    shared settings that a setting of the recipe's own, of the same name and another meaning,
    takes the place of (pointcloud's --eval-every counts epochs): the shared one keeps its
    default. The command's
    `resolve(**values)` gives the (SharedSettings, S) that the same values would give on the
    command line, for a recipe's Python API.
    """
    aliases = aliases or {}
    own_names = [f.name for f in fields(settings)]
    both = {f.name for f in fields(SharedSettings)} & set(own_names)
    if both != set(replaces):
        raise TypeError(
            f"train_command: {settings.__name__} declares shared settings {sorted(both)}, "
            f"replaces names {sorted(replaces)}: rename the recipe's own, or name each in "
            "replaces (its flag then has the recipe's meaning)"
        )
    shared_names = [f.name for f in fields(SharedSettings) if f.name not in replaces]
    unknown = (set(defaults) | set(aliases)) - set(shared_names) - set(own_names) | (
        {"bs", "per_device_bs"} & set(defaults)
    )
    if unknown:
        raise TypeError(f"train_command got unknown defaults: {sorted(unknown)}")
    if (default_bs is None) == (default_per_device_bs is None):
        raise TypeError("give train_command exactly one of default_bs, default_per_device_bs")
    default_note = (
        f" Default when neither is given: --bs {default_bs}."
        if default_bs is not None
        else f" Default when neither is given: --per-device-bs {default_per_device_bs}."
    )
    meta = {f.name: f.metadata for f in fields(SharedSettings)}
    helps = {name: meta[name]["help"] + default_note for name in ("bs", "per_device_bs")}

    def resolve(values: dict[str, Any], recipe: str) -> tuple[SharedSettings, Any]:
        values = dict(values)
        # None: this recipe's default (a Python API passes every argument, unset ones as None)
        shared = {name: values.pop(name, None) for name in shared_names}
        shared = {k: defaults.get(k) if v is None else v for k, v in shared.items()}
        shared = {k: v for k, v in shared.items() if v is not None}
        own_defaults = {k: v for k, v in defaults.items() if k not in shared_names}
        own = settings.from_config({**own_defaults, **values})
        own.validate()
        cap = shared.get("max_per_device_bs")
        if cap is not None:
            shared["max_per_device_bs"] = parse_max_per_device_bs(
                str(cap), recipe, memory_flags(own.as_config(), shared.get("mixed_precision"))
            )
        args = SharedSettings.from_config(shared)
        if args.bs is None and args.per_device_bs is None:
            args.bs, args.per_device_bs = default_bs, default_per_device_bs
        args.validate()
        return args, own

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        recipe = Path(inspect.getfile(fn)).stem.removeprefix("train_")
        own_panel = recipe_panel(recipe)
        own_params = settings_parameters(settings, defaults, aliases, {}, own_panel)
        shared_params = settings_parameters(SharedSettings, defaults, aliases, helps)
        shared_params = [p for p in shared_params if p.name not in replaces]
        params = in_panel_order(own_params + shared_params, own_panel) + CLI_PARAMETERS
        annotations = {p.name: p.annotation for p in params}

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            config_file, dry_run, processes, _, ctx = (kwargs.pop(n, None) for n in CLI_ONLY)
            from_file = from_config_file(config_file, ctx, annotations) if config_file else {}
            kwargs |= from_file
            if processes is not None and not dry_run:
                raise ConfigError(
                    f"--processes {processes} only goes with --dry-run; to train on "
                    f"{processes} processes, launch them: accelerate launch --num_processes "
                    f"{processes} ..."
                )
            try:
                args, own = resolve(kwargs, recipe)
            except ConfigError as error:  # a value the file gave: name the file too
                if any(str(error).startswith(flag(name) + " ") for name in from_file):
                    raise ConfigError(f"--config {config_file}: {error}") from None
                raise
            if dry_run:
                build = functools.partial(build_model, args, own) if build_model else None
                optimizer = (
                    functools.partial(build_optimizer, args, own) if build_optimizer else None
                )
                precision = args.mixed_precision.value if args.mixed_precision else None
                length = (args.epochs, args.max_steps)
                print_dry_run(
                    recipe, args.batch_request, args.lr_settings, length=length,
                    precision=precision, build_model=build, processes=processes,
                    compile=args.compile, absent=absent_inputs(args, own), cpu=args.cpu,
                    build_optimizer=optimizer, speed=args.as_config(),
                    ema=args.ema_decay > 0,
                )  # fmt: skip
                return None
            return fn(args, own)

        command.default_batch = (default_bs, default_per_device_bs)  # type: ignore[attr-defined]
        command.settings_class = settings  # type: ignore[attr-defined]
        command.resolve = lambda **values: resolve(values, recipe)  # type: ignore[attr-defined]
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = annotations
        del command.__wrapped__  # type: ignore[attr-defined]
        return command

    return decorate
