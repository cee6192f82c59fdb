"""Settings declared once: a dataclass field carries its default, help text, bounds and whether
a resumed run may change it.

    @dataclass
    class MLPSettings(Settings):
        hidden: int = setting(64, "Width of the hidden layers.", min=1)
        depth: int = setting(2, "Number of hidden layers.", min=1)

From that one declaration come the command-line flags and their `--help`
(accel_common.train_command), the keys a `--config FILE.yaml` may set, the checks a value
must pass (from the command line, a file or Python alike), the config the export records and the
single-device commands rebuild the model from (`from_config`), and the run identity that
`--resume` compares: every setting counts in it unless declared `adjustable` (it does not change
what is trained: cadence, workers, trackers, timeouts, paths).

A setting typed `tuple[int, ...]`, `tuple[float, ...]` or `tuple[str, ...]` is a list: one flag
of comma-separated items (`--widths 32,64`), a YAML list in a `--config` file, a JSON list where
the run records it; its bounds hold for each item (accel_common.setting_lists).
"""

from __future__ import annotations

import difflib
import math
import sys
import typing
from dataclasses import Field, dataclass, field, fields
from enum import Enum
from pathlib import Path
from types import UnionType
from typing import Any, TypeVar

import yaml

from accel_common.errors import CheckpointError, ConfigError
from accel_common.setting_lists import ItemError, item_kind, parse_items, shown

S = TypeVar("S", bound="Settings")


# the most blocks (layers) a network setting may ask for: the model is built block by block, so
# a mistyped depth (99999999999999999999) would build for hours, even for --dry-run's count
MAX_BLOCKS = 1000
# the largest whole number any setting may be: beyond 2^53 a number is no longer exact in JSON,
# where the run's identity and the export record it, and no size or count here comes near it
MAX_INTEGER = 2**53
# an export's `config_from` when its config is what `convert --set` gave a foreign checkpoint
CONFIG_FROM_SET = "convert --set"


def setting(
    default: Any,
    help: str,
    *,
    min: float | None = None,
    max: float | None = None,
    above: float | None = None,
    adjustable: bool = False,
    aliases: tuple[str, ...] = (),
    cli_type: Any = None,
    panel: str | None = None,
) -> Any:
    """A settings field. `min`/`max` are inclusive bounds, `above` an exclusive lower bound; a
    float must also be finite (for a list setting, `tuple[int, ...]`: each item). `adjustable`:
    may differ when a run is resumed. `aliases`: extra flag names (the original codebase's).
    `cli_type`: the flag's type where it differs from the field's (e.g. a number that may also
    be 'auto'). `panel`: the group `--help` shows the flag in (accel_common.recipe_cli.panels:
    a shared one's name joins it); default: the recipe's own panel, shown first."""
    return field(
        default=default,
        metadata={
            "help": help,
            "min": min,
            "max": max,
            "above": above,
            "adjustable": adjustable,
            "aliases": aliases,
            "cli_type": cli_type,
            "panel": panel,
        },
    )


def flag(name: str) -> str:
    """The command-line form of a setting's name: `ref_bs` -> `--ref-bs`."""
    return "--" + name.replace("_", "-")


def expected(f: Field) -> str:
    """What a valid value of `f` is, in words: 'a number above 0', '1 or more', ..."""
    low, high, above = f.metadata.get("min"), f.metadata.get("max"), f.metadata.get("above")
    if above is not None:
        low_text = "a positive number" if above == 0 else f"a number above {above:g}"
        return low_text + (f" at most {high:g}" if high is not None else "")
    if low is not None and high is not None:
        return f"a value from {low:g} to {high:g}"
    if low is not None:
        return f"{low:g} or more"
    if high is not None:
        return f"{high:g} or less"
    return "a finite number"


def base_type(annotation: Any) -> Any:
    """`int | None` -> int; other annotations as they are."""
    if typing.get_origin(annotation) in (typing.Union, UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


@dataclass
class Settings:
    """Base of every settings dataclass; see the module docstring."""

    @classmethod
    def hints(cls) -> dict[str, Any]:
        return typing.get_type_hints(cls)

    @classmethod
    def adjustable(cls) -> frozenset[str]:
        """The settings a resumed run may change (not part of the run's identity)."""
        return frozenset(f.name for f in fields(cls) if f.metadata.get("adjustable"))

    def validate(self) -> None:
        """Refuse values that cannot work, naming the flag, before anything starts; a list
        setting's bounds hold for each item, named by its position."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple | list):
                for index, item in enumerate(value, 1):
                    if problem := out_of_bounds(f, item):
                        raise ConfigError(
                            f"{flag(f.name)} {shown(value)}: item {index} is {item}; {problem}"
                        )
            elif problem := out_of_bounds(f, value):
                raise ConfigError(f"{flag(f.name)} {value}: {problem}")

    def as_config(self) -> dict[str, Any]:
        """The settings as plain JSON values (enums by value, paths as strings)."""
        return {f.name: plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def default_config(cls) -> dict[str, Any]:
        """The declared defaults as `as_config` writes them: a checkpoint saved before a setting
        existed ran as its default, so a resume compares the missing value to this."""
        return {f.name: plain(f.default) for f in fields(cls)}

    @classmethod
    def from_config(cls: type[S], config: dict[str, Any], **overrides: Any) -> S:
        """These settings from a recorded config (an export's, a checkpoint's); keys of other
        settings are ignored, missing ones take their defaults."""
        hints = cls.hints()
        values = {f.name: config[f.name] for f in fields(cls) if f.name in config} | overrides
        if isinstance(config, RecordedConfig):  # a converted checkpoint's: name what it lacks
            config.tell_defaults(cls, set(values))
        converted = {}
        for name, value in values.items():
            try:
                converted[name] = convert(hints[name], value)
            except ItemError as err:  # a list setting's item: named by flag and position
                raise ConfigError(f"{flag(name)} {shown(value)}: {err}") from None
        return cls(**converted)


class RecordedConfig(dict):
    """The config of a foreign checkpoint converted for a recipe (`accel-recipes convert --recipe
    X --set NAME=VALUE`): only what --set gave. A key it lacks is one line naming the --set to
    give (not a KeyError); `from_config` takes the defaults of the settings it lacks, saying so
    in one line on stderr."""

    def __init__(self, values: dict[str, Any], where: str, recipe: str) -> None:
        super().__init__(values)
        self.where, self.recipe = where, recipe

    def __missing__(self, key: str) -> Any:
        raise CheckpointError(
            f"{self.where} records no {key}, which the {self.recipe} recipe's model needs: "
            f"convert it again adding --set {key}=VALUE (the value its training had)"
        )

    def tell_defaults(self, cls: type[Settings], given: set[str]) -> None:
        hints = typing.get_type_hints(cls)
        lacking = [
            f
            for f in fields(cls)
            if f.name not in given
            and not f.metadata.get("adjustable")
            and base_type(hints[f.name]) is not Path
        ]
        if lacking:
            used = ", ".join(f"{f.name} {plain(f.default)!r}" for f in lacking)
            flags = " ".join(f"--set {f.name}=..." for f in lacking)
            print(
                f"note: {self.where} records no {', '.join(f.name for f in lacking)}; used the "
                f"{self.recipe} defaults ({used}); if its model was trained with others, "
                f"convert it again with {flags}",
                file=sys.stderr,
            )


def out_of_bounds(f: Field, value: Any) -> str | None:
    """What is wrong with a number outside `f`'s bounds ('give 1 or more'); None if it fits (or
    is not a number)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    low, high, above = (f.metadata.get(k) for k in ("min", "max", "above"))
    ok = (
        (not isinstance(value, float) or math.isfinite(value))
        and (low is None or value >= low)
        and (high is None or value <= high)
        and (above is None or value > above)
    )
    if not ok:
        return f"give {expected(f)}"
    if abs(value) > MAX_INTEGER:
        return "absurdly large (the most any setting takes is 2^53)"
    return None


def plain(value: Any) -> Any:
    """A setting's value as JSON holds it: an enum by its value, a path as a string, a list
    setting's tuple as a list."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [plain(item) for item in value]
    return str(value) if isinstance(value, Path) else value


def convert(annotation: Any, value: Any) -> Any:
    """A JSON/YAML value as the field's Python type (enum, path, float from an int, a list
    setting's tuple from a list or comma text, ...); a list's bad item raises ItemError."""
    kind = base_type(annotation)
    if value is not None and (items := item_kind(kind)) is not None:
        return parse_items(value, items)
    if value is None or not isinstance(kind, type):
        return value
    if issubclass(kind, Enum):
        return kind(value)
    if issubclass(kind, Path):
        return Path(value)
    if kind is float and isinstance(value, int | str) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, str):
        return int(value)
    return value


def read_config_file(path: Path, names: list[str]) -> dict[str, Any]:
    """`--config FILE.yaml`: a mapping of flag names (`ref-bs` or `ref_bs`) to values as on the
    command line. Returns {setting name: raw value}; an unknown key is refused naming the file,
    the key and the valid names."""
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"--config {path} is not readable YAML: {single_line(err)}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(
            f"--config {path}: expected a mapping of flag names to values (lr: 3e-4), got a "
            f"{type(loaded).__name__}"
        )
    out = {}
    for key, value in loaded.items():
        name = str(key).removeprefix("--").replace("-", "_")
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean '{close[0].replace('_', '-')}'?)" if close else ""
            raise ConfigError(
                f"--config {path}: unknown key '{key}'{hint}; valid keys: "
                + ", ".join(n.replace("_", "-") for n in names)
            )
        out[name] = value
    return out


def single_line(err: BaseException | str) -> str:
    """An error's text on one line: a YAML or Click message spans several."""
    return " ".join(str(err).split())


DATA_KEY = "data_fingerprint"  # a run identity's entry for the data's contents
# what a run's identity holds besides its settings (the others are named as their flags)
NOT_FLAGS = frozenset({"recipe", "global_batch_size", DATA_KEY})


def describe_differences(
    saved: dict[str, Any], current: dict[str, Any], derived: frozenset[str] = frozenset()
) -> str:
    """'--draw-weight 0.1 in the checkpoint, 0.2 now; ...' for every setting that differs;
    `derived` values (computed from the data, not flags) are named as such."""
    keys = sorted(set(saved) | set(current), key=str)
    missing = object()
    parts = [
        f"{recorded_name(key, derived)} {shown(saved.get(key, 'unset'))} in the checkpoint, "
        f"{shown(current.get(key, 'unset'))} now"
        for key in keys
        if plain(saved.get(key, missing)) != plain(current.get(key, missing))  # a tuple as a list
    ]
    return "; ".join(parts)


def recorded_name(key: str, derived: frozenset[str] = frozenset()) -> str:
    """A recorded value as the user knows it: a setting as its flag (`--draw-weight`), a
    derived value as computed from the data, other recorded values as `key:`."""
    if key in derived:
        return f"{key} (computed from the data):"
    return f"{key}:" if key in NOT_FLAGS else "--" + str(key).replace("_", "-")
