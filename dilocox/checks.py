"""Checks that config dataclasses run in their `validate()`: each raises a ValueError naming the field and the fix.

A component's config calls these once, in its own `validate()` (docs/design.md §7), with its section name, so
every message reads like the option the user typed. A choice is a `Literal[...]` field: its allowed values are the
type's, and `check_types` refuses any other value with the list. An option that follows from others is annotated
`int | Auto` (or `float | Auto`, `bool | Auto`): it holds "auto" until `Config.resolve()` sets it by its rule.

    check_types("compression", self)     # compression.kind = 'zip' is not one of: none, fp16, ...
    check_positive("compression", self, "rank", "group_size")      # compression.rank = 0 must be > 0
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any, Literal

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""Every int option must fit: steps, tokens and byte counters are int64 in tensors, checkpoints and metrics."""
AUTO = "auto"
Auto = Literal["auto"]
"""The value of an option that follows from others until it is resolved (its docstring states the rule)."""


@functools.cache
def auto_types(cls: type) -> dict[str, type]:
    """The options of a config dataclass that may be "auto" (annotated `T | Auto`), by field name: their type T."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        args = typing.get_args(hints[f.name])
        if typing.get_origin(hints[f.name]) in (typing.Union, types.UnionType) and Auto in args:
            out[f.name] = next(arg for arg in args if arg is not Auto)
    return out


def field_type(cls: type, name: str) -> type:
    """The type a value of option `name` has once resolved (an auto option's T; else the default's type)."""
    return auto_types(cls).get(name) or type(getattr(cls(), name))


@functools.cache
def field_choices(cls: type) -> dict[str, tuple[str, ...]]:
    """The allowed values of every choice field (annotated `Literal[...]`) of a config dataclass, by field name."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: typing.get_args(hints[f.name])
        for f in dataclasses.fields(cls)
        if typing.get_origin(hints[f.name]) is Literal
    }


def check_types(section: str, cfg: Any) -> None:
    """Every field holds the type of its default (an int is accepted for a float; bools are not ints here), and a
    choice field (`Literal[...]`) one of its values."""
    choices, autos = field_choices(type(cfg)), auto_types(type(cfg))
    for f in dataclasses.fields(cfg):
        value, expected = getattr(cfg, f.name), field_type(type(cfg), f.name)
        if f.name in autos and value == AUTO:
            continue
        if f.name in choices and isinstance(value, str):
            check_choice(f"{section}.{f.name}", value, choices[f.name])
        ok = isinstance(value, expected) and (expected is bool or not isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise ValueError(
                f"{section}.{f.name} = {value!r} must be a {expected.__name__}, got {type(value).__name__}"
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{section}.{f.name} = {value} must be a finite number")
        if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:  # counters and sizes end up in int64
            raise ValueError(f"{section}.{f.name} = {value} does not fit in a 64-bit integer; use a smaller value")


def check_positive(section: str, cfg: Any, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) <= 0:
            raise ValueError(f"{section}.{name} = {getattr(cfg, name)} must be > 0")


def check_non_negative(section: str, cfg: Any, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) < 0:
            raise ValueError(f"{section}.{name} = {getattr(cfg, name)} must be >= 0")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} = {value!r} is not one of: {', '.join(choices)}")


def check_fraction(name: str, value: float, *, low: float, high: float, fix: str = "") -> None:
    """low < value <= high."""
    if not low < value <= high:
        raise ValueError(f"{name} = {value!r} must be in ({low}, {high}]" + (f"; {fix}" if fix else ""))
