"""A benchmark's command line made from its options dataclass: each field is one click
option whose default is the field's own, so that a default lives in one place.

    @dataclass(slots=True)
    class FooOptions:
        prompt_len: tuple[int, int] = opt((20, 400), "min-max tokens")
        rates: list[float] = opt([1.0], "requests/s", flag="--rate", parse=parse_rates)
        quiet: bool = internal(False)  # not on the command line

    @bench.command("foo")
    @options_command(FooOptions)
    def foo(options: FooOptions) -> None: ...

Field types and their options: int, float, str and Path take one value (`X | None` too,
default None); bool is `--x/--no-x`; `tuple[int, int]` is a range "N" or "MIN-MAX";
`tuple[T, ...]` repeats the option; `list[str]` repeats it and splits each value on
whitespace (extra `serve` flags), replacing the default when given. The flag is the field's
name with dashes, without a trailing `_s` (seconds), unless `flag=` names it. A field with
`parse=` is a repeated option whose values (a tuple of strings) `parse` turns into the
field's value; its ValueError, and the options' own `validate()`'s, are usage errors
(exit 2).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

_KEY = "cli"


@dataclasses.dataclass(frozen=True, slots=True)
class CliSpec:
    help: str | None = None
    flag: str | None = None
    choices: tuple[str, ...] | None = None
    parse: Callable[[Any], Any] | None = None
    # The default as --help shows it, where the value itself would not say it.
    shown: str | None = None
    metavar: str | None = None
    path: dict[str, Any] | None = None  # click.Path settings of a Path field


def opt(default: Any, help: str | None = None, **spec: Any) -> Any:
    """A field that is a command-line option (a list or dict default is copied per
    instance)."""
    metadata = {_KEY: CliSpec(help, **spec)}
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=functools.partial(_copy, default),
                                 metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def internal(default: Any) -> Any:
    """A field that is not on the command line."""
    return dataclasses.field(default=default, metadata={_KEY: None})


def _copy(value: Any) -> Any:
    return type(value)(value)


def parse_length_range(value: str, option: str) -> tuple[int, int]:
    """"N" or "MIN-MAX" tokens."""
    low, _, high = value.partition("-")
    try:
        pair = int(low), int(high or low)
    except ValueError:
        raise ValueError(f"{option} takes N or MIN-MAX tokens, not {value!r}") from None
    if not 1 <= pair[0] <= pair[1]:
        raise ValueError(f"{option} needs 1 <= MIN <= MAX, not {value!r}")
    return pair


@dataclasses.dataclass(frozen=True, slots=True)
class _Option:
    name: str  # the field's
    decorator: Callable[[Callable[..., Any]], Callable[..., Any]]
    convert: Callable[[Any], Any]  # what click read -> the field's value
    given: Callable[[Any], bool]  # whether the command line gave it


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _flag(field: dataclasses.Field[Any], spec: CliSpec) -> str:
    if spec.flag is not None:
        return spec.flag
    name = field.name[:-2] if field.name.endswith("_s") else field.name
    return "--" + name.replace("_", "-")


def _shown_range(pair: tuple[int, int]) -> str:
    return str(pair[0]) if pair[0] == pair[1] else f"{pair[0]}-{pair[1]}"


def _scalar_type(kind: Any, spec: CliSpec) -> Any:
    if spec.choices is not None:
        return click.Choice(spec.choices)
    if kind is Path:
        return click.Path(path_type=Path, **(spec.path or {}))
    return kind


def _option(field: dataclasses.Field[Any], kind: Any, spec: CliSpec) -> _Option:
    flag, default = _flag(field, spec), _default(field)
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (types.UnionType, typing.Union):  # X | None
        kind = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(kind), typing.get_args(kind)
    settings: dict[str, Any] = {"help": spec.help, "metavar": spec.metavar}
    convert: Callable[[Any], Any] = lambda value: value  # noqa: E731
    given: Callable[[Any], bool] = lambda value: True  # noqa: E731
    if spec.parse is not None:  # repeated, parsed as a whole
        settings.update(multiple=True, default=None)
        given, convert = bool, spec.parse
    elif kind is bool:
        flag = f"{flag}/--no-{flag[2:]}"
        settings.update(default=default, show_default=True)
    elif origin is tuple and args == (int, int):  # a range of token counts
        settings.update(default=_shown_range(default), show_default=True)
        convert = functools.partial(_parse_range, flag)
    elif origin is tuple:  # repeated
        settings.update(multiple=True, default=default, show_default=True,
                        type=_scalar_type(args[0], spec))
        convert = tuple
    elif origin is list and args == (str,):  # extra flags, each value split
        settings.update(multiple=True, default=None)
        if default and spec.shown is None:
            settings["help"] = f"{spec.help} [default: {' '.join(default)}]"
        given = bool
        convert = lambda values: [a for value in values for a in value.split()]  # noqa: E731
    else:
        settings.update(default=default, type=_scalar_type(kind, spec),
                        show_default=default is not None)
    if spec.shown is not None:
        settings.update(show_default=False, help=f"{spec.help} [default: {spec.shown}]")
    if spec.parse is not None and spec.shown is None and default not in (None, [], {}):
        settings["show_default"] = False
    return _Option(field.name, click.option(flag, field.name, **settings), convert, given)


def _parse_range(flag: str, value: str) -> tuple[int, int]:
    return parse_length_range(value, flag)


@functools.cache
def _options(cls: type) -> tuple[_Option, ...]:
    hints = typing.get_type_hints(cls)
    options = []
    for field in dataclasses.fields(cls):
        spec = field.metadata.get(_KEY, CliSpec())
        if spec is not None:
            options.append(_option(field, hints[field.name], spec))
    return tuple(options)


def build(cls: type, given: dict[str, Any]) -> Any:
    """The options from what click read: fields the command line left out keep their
    defaults. ValueError names a bad value."""
    values = {}
    for option in _options(cls):
        if option.name in given and option.given(given[option.name]):
            values[option.name] = option.convert(given[option.name])
    options = cls(**values)
    validate = getattr(options, "validate", None)
    if validate is not None:
        validate()
    return options


def options_command(cls: type, *, exclude: tuple[str, ...] = ()
                    ) -> Callable[[Callable[[Any], None]], Callable[..., None]]:
    """The click options of `cls`'s fields (less `exclude`) on a command that takes the
    built options."""
    def decorate(func: Callable[[Any], None]) -> Callable[..., None]:
        @functools.wraps(func)
        def command(**given: Any) -> None:
            try:
                options = build(cls, given)
            except ValueError as exc:
                raise click.UsageError(str(exc)) from None
            func(options)

        decorated: Callable[..., None] = command
        for option in reversed(_options(cls)):
            if option.name not in exclude:
                decorated = option.decorator(decorated)
        return decorated

    return decorate
