"""A Settings class as command-line flags: one Typer parameter per field, in the `--help` panel
its declaration names (accel_common.recipe_cli.panels), the options every training command adds
(--config, --dry-run, --processes, --help), and --config's values read through each flag's own
conversion (accel_common.train_command puts them together)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import typer

from accel_common.errors import ConfigError
from accel_common.recipe_cli.panels import COMMAND
from accel_common.setting_lists import is_sequence_type, item_kind, shown
from accel_common.settings import (
    Settings,
    base_type,
    convert,
    flag,
    read_config_file,
    single_line,
)

# what a training command takes besides its settings: they choose how the settings are read and
# what is done with them, and are not recorded with the run
CLI_ONLY = ("config", "dry_run", "processes", "help", "ctx")
# settings that give one value two ways: whichever the command line gives replaces the file's
ONE_OF = ({"bs", "per_device_bs"},)


def settings_parameters(
    cls: type[Settings],
    defaults: dict[str, Any],
    aliases: dict[str, list[str]],
    helps: dict,
    panel: str | None = None,
) -> list[inspect.Parameter]:
    """One keyword-only Typer parameter per field of `cls`, from its declaration; in the `--help`
    panel it declares, else in `panel` (a recipe's own). A list setting (`tuple[int, ...]`) is
    one flag of comma-separated text, read into its tuple with the other settings
    (accel_common.settings.convert), so that a bad item is one line naming it."""
    hints = cls.hints()
    parameters = []
    for f in fields(cls):
        meta = f.metadata
        numeric = base_type(hints[f.name]) in (int, float)
        switch = base_type(hints[f.name]) is bool  # on/off: --x and --no-x
        items = list_option(cls, f.name, hints[f.name])
        # a number that may be none (`int | None`): Click has no type that reads `none`
        nullable = numeric and base_type(hints[f.name]) is not hints[f.name]
        reader = number_or_none(hints[f.name]) if nullable else None
        default = defaults.get(f.name, f.default)
        option = typer.Option(
            shown(default) if items and default else default,  # [default: 32,64]
            f"{flag(f.name)}/--no-{flag(f.name)[2:]}" if switch else flag(f.name),
            *meta.get("aliases", ()),
            *aliases.get(f.name, []),
            help=helps.get(f.name, meta["help"]),
            min=meta.get("min") if numeric else None,
            max=meta.get("max") if numeric else None,
            rich_help_panel=meta.get("panel") or panel,
            # the text as given, or a --config file's list as it is
            parser=(lambda value: value) if items else reader,
            metavar=f"<{items.__name__},...>" if items else None,
            show_default="none: ''" if items and default == () else True,
        )
        annotation = meta.get("cli_type") or hints[f.name]
        if items:
            annotation = str if base_type(annotation) is annotation else str | None
        kind = inspect.Parameter.KEYWORD_ONLY
        parameters.append(inspect.Parameter(f.name, kind, default=option, annotation=annotation))
    return parameters


def number_or_none(annotation: Any) -> Callable[[Any], Any]:
    """The flag's reading of an `int | None` setting: `none` (or `null`, as a --config file
    writes it) is None, anything else its number (Click has no optional-number type; the range
    is checked with the other settings, Settings.validate)."""
    kind = base_type(annotation)
    words = "an integer" if kind is int else "a number"

    def parse(value: Any) -> Any:
        if value is None or isinstance(value, kind):
            return value
        if str(value).strip().lower() in ("none", "null"):
            return None
        try:
            return kind(value)
        except ValueError:
            raise typer.BadParameter(f"{value!r}: give {words} or none") from None

    return parse


def list_option(cls: type[Settings], name: str, annotation: Any) -> type | None:
    """The item type of a list setting (int for `tuple[int, ...]`), None for other settings; a
    sequence of another form is refused where the recipe declares it."""
    kind = item_kind(base_type(annotation))
    if kind is None and is_sequence_type(base_type(annotation)):
        raise TypeError(
            f"{cls.__name__}.{name}: a list setting is typed tuple[int, ...], tuple[float, ...] "
            f"or tuple[str, ...], with a tuple default; not {annotation}"
        )
    return kind


def show_help(ctx: typer.Context, value: bool) -> None:
    """--help: print the command's help and exit, as Click's own help option does."""
    if value and not ctx.resilient_parsing:
        typer.echo(ctx.get_help(), color=ctx.color)
        raise typer.Exit()


CLI_PARAMETERS = [
    inspect.Parameter(
        "config",
        inspect.Parameter.KEYWORD_ONLY,
        default=typer.Option(
            None,
            "--config",
            help="YAML file of settings: keys are the flag names (ref-bs: 64), values as on the "
            "command line; flags given on the command line win. recipes/NAME/configs/"
            "original.yaml holds the original project's sizes and hyper-parameters.",
            rich_help_panel=COMMAND,
        ),
        annotation=Path | None,
    ),
    inspect.Parameter(
        "dry_run",
        inspect.Parameter.KEYWORD_ONLY,
        default=typer.Option(
            False,
            "--dry-run",
            help="Resolve the settings, print the run's plan (batch, LR, precision, parameter "
            "count, memory per device) and exit without training or writing anything.",
            rich_help_panel=COMMAND,
        ),
        annotation=bool,
    ),
    inspect.Parameter(
        "processes",
        inspect.Parameter.KEYWORD_ONLY,
        default=typer.Option(
            None,
            "--processes",
            min=1,
            help="With --dry-run: plan for this many processes (e.g. 16 for 2 nodes of 8 GPUs) "
            "without launching them. Default: this launch's.",
            rich_help_panel=COMMAND,
        ),
        annotation=int | None,
    ),
    # Click's own --help, declared here so that it is shown in the command's panel, not alone in a
    # default panel above the recipe's settings (a declared --help replaces Click's)
    inspect.Parameter(
        "help",
        inspect.Parameter.KEYWORD_ONLY,
        default=typer.Option(
            False,
            "--help",
            is_eager=True,
            expose_value=False,
            callback=show_help,
            help="Show this message and exit.",
            rich_help_panel=COMMAND,
        ),
        annotation=bool,
    ),
    # Typer passes its context here: which values came from the command line (they win over
    # --config), and each flag's own conversion for the file's values
    inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context),
]


def from_config_file(path: Path, ctx: typer.Context, annotations: dict[str, Any]) -> dict[str, Any]:
    """The values `--config FILE` sets, as Python values, for the settings not given on the
    command line. Each value goes through its flag's own conversion and range check, so a wrong
    type or value is refused naming the key and the file."""
    names = [n for n in annotations if n not in CLI_ONLY]
    params = {p.name: p for p in ctx.command.params}
    given = {n for n in names if ctx.get_parameter_source(n).name in ("COMMANDLINE", "ENVIRONMENT")}
    for group in ONE_OF:  # --per-device-bs on the command line replaces the file's bs, and so on
        if given & group:
            given |= group
    out = {}
    for name, value in read_config_file(path, names).items():
        if name in given:
            continue
        if value is None and base_type(annotations[name]) is annotations[name]:
            raise ConfigError(
                f"--config {path}: {name.replace('_', '-')}: null, but {flag(name)} takes a "
                f"value; give one, or leave the key out for the default "
                f"({params[name].default})"
            )
        if value is not None:
            refuse_wrong_kind(path, name, base_type(annotations[name]), value)
            try:
                value = params[name].process_value(ctx, value)
            except typer.BadParameter as err:
                message = single_line(err.format_message())
                raise ConfigError(f"--config {path}: {name.replace('_', '-')}: {message}") from None
        out[name] = convert(annotations[name], value)
    return out


def refuse_wrong_kind(path: Path, name: str, kind: Any, value: Any) -> None:
    """Click's conversions take what the command line cannot give: `true` as the number 1, `1.5`
    cut to 1 for a whole number, `1` as on for a switch. A file's value is held to the flag's own
    rules: a switch takes true or false, no other setting takes a boolean and a whole number
    takes no fraction."""
    key = f"--config {path}: {name.replace('_', '-')}: {value!r}"
    if kind is bool and not isinstance(value, bool):
        raise ConfigError(f"{key} is not a boolean; give true or false as for {flag(name)}")
    if kind is not bool and isinstance(value, bool):
        what = "a number" if kind in (int, float) else "the value in quotes ('no')"
        raise ConfigError(
            f"{key} is a boolean (YAML reads true, false, yes, no, on and off as one); give "
            f"{what} as for {flag(name)}"
        )
    if kind is int and isinstance(value, float):
        raise ConfigError(f"{key} is not a whole number; give one as for {flag(name)}")
