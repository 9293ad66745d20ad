"""One source of configuration: each component's config dataclass declares its fields with :func:`setting` (default,
help, and how it looks on the command line); the ``dllm-serve`` commands generate their click options from those
fields (:func:`options`), build the config from what click parsed (:func:`build`), and ``serve`` passes settings on to
the workers it starts as a command line generated the same way (:func:`to_args`). No torch."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import click

MISSING = dataclasses.MISSING
PORT = click.IntRange(1, 65535)      # every listening port setting


class FiniteFloatRange(click.FloatRange):
    """click's FloatRange, finite: it takes nan (every comparison with nan is false) and inf, and a timeout of nan
    never expires. Every FloatRange setting gets this (:func:`options`)."""

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return rv


def finite(t: click.FloatRange) -> FiniteFloatRange:
    return t if isinstance(t, FiniteFloatRange) else FiniteFloatRange(t.min, t.max, t.min_open, t.max_open, t.clamp)


def setting(default: Any = MISSING, help: str = "", *, flag: str | None = None, type: Any = None,
            show_default: bool = True, envvar: str | None = None, multiple: bool = False, metavar: str | None = None,
            convert: Callable[[Any], Any] | None = None, unparse: Callable[[Any], str] | None = None,
            default_factory: Callable[[], Any] | None = None, cli: bool = True, cli_default: Any = MISSING):
    """A config field that is also a command-line option: ``flag`` (default ``--field-name``), click ``type``
    (default from the default's type; ``bool`` fields are ``--flag`` switches), ``convert`` (the option's value ->
    the field's, e.g. a comma list -> list, applied while parsing) and ``unparse`` (the field's value -> the option's text, for
    :func:`to_args`). ``cli_default``: the option's default when it is not the field's (e.g. None for a list).
    ``cli=False``: a field set by code only."""
    meta = {"cli_default": cli_default, "help": help, "flag": flag, "type": type, "show_default": show_default, "envvar": envvar,
            "multiple": multiple, "metavar": metavar, "convert": convert, "unparse": unparse, "cli": cli}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _settings(cls, only=None, exclude=()) -> list[dataclasses.Field]:
    fields = [f for f in dataclasses.fields(cls) if f.metadata.get("cli")]
    if only is not None:
        by_name = {f.name: f for f in fields}
        fields = [by_name[n] for n in only]
    return [f for f in fields if f.name not in exclude]


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def _default(f: dataclasses.Field):
    if f.metadata.get("cli_default", MISSING) is not MISSING:
        return f.metadata["cli_default"]
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


def options(cls, *, only=None, exclude=(), prefix: str = "", overrides: dict | None = None):
    """A decorator adding one click option per setting of ``cls`` (``only``/``exclude`` pick fields; the parameter
    names are ``prefix + field name``; ``overrides`` maps a field name to option keyword overrides, e.g. another
    help in a command that uses the field differently, or ``flags``: the option's names there)."""
    overrides = overrides or {}

    def decorate(func):
        for f in reversed(_settings(cls, only, exclude)):
            m = f.metadata
            default = _default(f)
            kw = dict(default=default, show_default=m["show_default"] and default is not None, help=m["help"],
                      envvar=m["envvar"], metavar=m["metavar"], multiple=m["multiple"])
            required = f.default is MISSING and f.default_factory is MISSING
            on_off = default is True and not m["multiple"]     # a switch that is on by default: --x/--no-x
            if isinstance(default, bool) and not m["multiple"]:
                kw.update(is_flag=True, show_default=on_off)
            elif m["type"] is not None:
                kw["type"] = finite(m["type"]) if isinstance(m["type"], click.FloatRange) else m["type"]
            if m["multiple"]:
                kw["default"] = ()
            if required:       # no default at all: click >= 8.3 takes an explicit default=None as a given value
                kw["required"] = True
                kw.pop("default")
            if m["convert"] is not None:      # converted while parsing, so a bad value is a usage error naming it
                kw["callback"] = lambda ctx, param, v, convert=m["convert"]: convert(v)
            over = dict(overrides.get(f.name, {}))
            flags = over.pop("flags", (flag_of(f) + "/--no-" + flag_of(f)[2:] if on_off else flag_of(f),))
            kw.update(over)
            func = click.option(*flags, prefix + f.name, **kw)(func)
        return func
    return decorate


def build(cls, values: dict, *, prefix: str = "", only=None, exclude=(), **fixed):
    """``cls`` from the parsed options (``values``: click's keyword arguments) plus ``fixed`` fields."""
    kw = {f.name: values[prefix + f.name] for f in _settings(cls, only, exclude) if prefix + f.name in values}
    return cls(**kw, **fixed)


def to_args(cls, values: dict, only=None) -> list[str]:
    """The command line that gives ``cls``'s settings these ``values`` (field name -> value; None, and a switch at
    its default, are left out)."""
    args = []
    for f in _settings(cls, only):
        if f.name not in values:
            continue
        v = values[f.name]
        if isinstance(v, bool):
            if v != bool(_default(f)):
                args.append(flag_of(f) if v else "--no-" + flag_of(f)[2:])
            continue
        if v is None or (f.metadata["multiple"] and not v):
            continue
        unparse = f.metadata["unparse"]
        args += [flag_of(f), unparse(v) if unparse else str(v)]
    return args
