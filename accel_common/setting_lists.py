"""List settings: a field typed `tuple[int, ...]`, `tuple[float, ...]` or `tuple[str, ...]`.

    widths: tuple[int, ...] = setting((32, 64), "Channels of each stage.", min=1)

It is one flag whose items are separated by commas (`--widths 32,64`; `--widths ''` for none), a
YAML list (`widths: [32, 64]`) or the same comma text in a `--config` file, and a JSON list in
the export's config and the run's identity. Here: which annotations are lists, their items read
from any of those forms (accel_common.settings.convert calls it, for the command line, a file and
a recorded config alike), and a list shown as it is typed. The bounds of the declaration hold for
each item (Settings.validate).
"""

from __future__ import annotations

import typing
from typing import Any

# the kinds of item a list setting may hold, and what an item that is not one is told
ITEM_KINDS: dict[type, str] = {int: "an integer", float: "a number", str: "a string"}


class ItemError(ValueError):
    """A list setting's value that is not a list of its kind; the message names the item by its
    position (1 = first): `item 2 'x' is not an integer`."""


def item_kind(annotation: Any) -> type | None:
    """int for `tuple[int, ...]` (float, str alike); None for any other annotation."""
    if typing.get_origin(annotation) is not tuple:
        return None
    args = typing.get_args(annotation)
    if len(args) == 2 and args[1] is Ellipsis and args[0] in ITEM_KINDS:
        return args[0]
    return None


def is_sequence_type(annotation: Any) -> bool:
    """A tuple or list annotation, supported (`item_kind`) or not."""
    return typing.get_origin(annotation) in (tuple, list)


def parse_items(value: Any, kind: type) -> tuple[Any, ...]:
    """The items of a list setting as a tuple of `kind`, from comma text (`'32, 64'`; `''`: none),
    a list or tuple (YAML, JSON, Python), or one number (YAML's `widths: 32`). Raises ItemError
    naming the first item that is not of `kind`."""
    if isinstance(value, str):
        if not value.strip():
            return ()
        items: list[Any] = [part.strip() for part in value.split(",")]
        for index, part in enumerate(items, 1):
            if not part:
                raise ItemError(f"item {index} is empty; separate the items by single commas")
    elif isinstance(value, list | tuple):
        items = list(value)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        items = [value]
    else:
        raise ItemError(
            f"{value!r} is not a list; give the items separated by commas (32,64) or, in a "
            "--config file, as a YAML list ([32, 64])"
        )
    return tuple(parse_item(kind, item, index) for index, item in enumerate(items, 1))


def parse_item(kind: type, value: Any, index: int) -> Any:
    """One item as `kind`: a string as the command line gives it, or a number as YAML reads it
    (a whole number for a float list too; never a boolean, which YAML makes of `no`)."""
    if kind is str and isinstance(value, str):
        return value
    if kind is not str and isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            pass
    elif kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    hint = "; quote it" if kind is str else ""  # YAML read a number or a boolean (no, on)
    raise ItemError(f"item {index} {value!r} is not {ITEM_KINDS[kind]}{hint}")


def shown(value: Any) -> str:
    """A list as it is typed on the command line (`32,64`; `''` when empty); other values as
    str() shows them."""
    if isinstance(value, list | tuple):
        return ",".join(str(item) for item in value) or "''"
    return str(value)
