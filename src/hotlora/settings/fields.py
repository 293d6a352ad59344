"""How a setting is declared, and how text becomes its value.

A setting is a dataclass field made with ``setting()``: its default, a one-line ``help`` (the
``hotlora serve --help`` text) and, where the value is one of a few words, its ``choices``. Every
layer that hands in text (a ``HOTLORA_*`` variable, a flag, a string in a config file or a keyword
argument) goes through ``coerce``, which asks pydantic's ``TypeAdapter`` for the field's own type
instead of guessing from the annotation's spelling. A tuple is one comma-separated string (paths:
``os.pathsep``-separated, as ``PATH`` is), or several of them (a repeated flag).
"""

from __future__ import annotations

import functools
import os
import types
import typing
from dataclasses import MISSING, field, fields
from pathlib import Path

from hotlora.errors import HotloraError

ENV_PREFIX = "HOTLORA_"


class SettingsError(HotloraError, ValueError):
    """A setting with a value its type or its rules refuse (a start-up fault). A ``ValueError`` too:
    callers that built settings before this tree existed catch that."""


def setting(default=MISSING, help: str = "", *, choices: tuple = (), factory=MISSING, parse=None):
    """A field with what the generated flags and the coercion need. ``parse``: a function that
    takes the comma-split text parts when pydantic cannot (``sizes``: ``"1024x832"`` strings)."""
    metadata = {"help": help, "choices": tuple(choices), "parse": parse}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@functools.cache
def hints(cls) -> dict:
    """The fields' real types (annotations are strings under ``from __future__ import annotations``)."""
    return typing.get_type_hints(cls)


def _args(kind) -> tuple:
    return typing.get_args(kind)


def optional(kind) -> bool:
    return type(None) in _args(kind) and typing.get_origin(kind) in (typing.Union, types.UnionType)


def bare(kind):
    """``X | None`` -> ``X`` (a union of several other types stays a union)."""
    if not optional(kind):
        return kind
    rest = [a for a in _args(kind) if a is not type(None)]
    return rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]


def is_tuple(kind) -> bool:
    return typing.get_origin(bare(kind)) is tuple


def is_bool(kind) -> bool:
    return bare(kind) is bool


def separator(kind) -> str:
    """Paths are listed like ``PATH`` (a path may hold a comma); anything else with commas."""
    item = _args(bare(kind))[:1]
    return os.pathsep if item and item[0] is Path else ","


@functools.cache
def _adapter(kind):
    from pydantic import TypeAdapter  # imported on first use: `import hotlora.config` stays light

    return TypeAdapter(kind)


def _texty(value) -> bool:
    return isinstance(value, str) or (isinstance(value, (list, tuple)) and any(isinstance(v, str) for v in value))


def coerce(cls, name: str, value):
    """``value`` as field ``name`` of ``cls`` holds it. Only text is converted (and lists holding
    text, for tuples): typed values pass untouched, so what a caller built keeps its exact type
    (the compile fingerprint is written from them)."""
    f = cls.__dataclass_fields__[name]
    kind = hints(cls)[name]
    if kind is typing.Any or not _texty(value):
        return value
    if is_tuple(kind):
        sep = separator(kind)
        items = [value] if isinstance(value, str) else list(value)
        # Text items split and stripped, empty parts dropped; typed items ((h, w) sizes) kept as given.
        parts = [part for item in items
                 for part in ([p.strip() for p in item.split(sep) if p.strip()] if isinstance(item, str) else [item])]
        if f.metadata.get("parse"):
            return f.metadata["parse"](parts)
        value = parts
    elif value.strip() == "" and optional(kind):
        return None
    elif bare(kind) is not str:
        value = value.strip()
    try:
        return _adapter(kind).validate_python(value)
    except ValueError as exc:  # pydantic's ValidationError is one; keep its first line of reasons
        reason = "; ".join(e["msg"] for e in getattr(exc, "errors", lambda: [])()) or str(exc)
        raise SettingsError(f"{name} must be {_spelled(kind)}, got {value!r} ({reason})") from None


_WORDS = {int: ("an integer", "integers"), float: ("a number", "numbers"), bool: ("true or false", "booleans"),
          str: ("text", "names"), Path: ("a path", "paths")}


def _spelled(kind) -> str:
    """``tuple[int, ...]`` -> "a comma-separated list of integers", for the operator who typed it."""
    kind = bare(kind)
    if is_tuple(kind):
        item = _args(kind)[0]
        return f"a {'os.pathsep' if item is Path else 'comma'}-separated list of {_WORDS.get(item, ('', 'values'))[1]}"
    return _WORDS.get(kind, (str(kind).replace("typing.", ""),))[0]


def normalize(instance) -> None:
    """Coerce every text value of a settings instance in place (frozen ones too): the one place
    keyword arguments, environment values, flags and config-file strings become typed."""
    cls = type(instance)
    for f in fields(cls):
        value = getattr(instance, f.name)
        typed = coerce(cls, f.name, value)
        if typed is not value:
            object.__setattr__(instance, f.name, typed)


def environment(cls) -> dict:
    """The ``HOTLORA_<FIELD>`` variables set for ``cls``'s fields, as text (coerced by the class)."""
    found = {}
    for f in fields(cls):
        raw = os.environ.get(ENV_PREFIX + f.name.upper())
        if raw is not None:
            found[f.name] = raw
    return found


def layered(cls, file_values: dict | None, overrides: dict) -> dict:
    """Keyword arguments for ``cls``: a config file's table < ``HOTLORA_*`` variables < ``overrides``
    (flags; a None flag was not given). Defaults are the dataclass's own."""
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(file_values or {}) - set(known))
    if unknown:
        raise SettingsError(f"unknown setting {unknown[0]!r} for {cls.__name__}; known: {', '.join(known)}")
    return {**(file_values or {}), **environment(cls), **{k: v for k, v in overrides.items() if v is not None}}
