"""How a setting is declared, and how text becomes its value.

A setting is a pydantic field made with ``setting()``: its default, a one-line ``help`` (the field's
``description``: the ``hotlora serve --help`` text) and, where the value is one of a few words, its
``choices``. Pydantic validates every value against the field's type; the one thing it does not do
is read the spellings an operator types: a tuple as one comma-separated string (paths:
``os.pathsep``-separated, as ``PATH`` is) or several of them (a repeated flag), and an empty string
for "unset". ``from_text`` does that, by hand, before pydantic sees the value (``settings/base.py``
calls it for every source: a ``HOTLORA_*`` variable, a flag, a config-file string, a keyword).
"""

from __future__ import annotations

import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from hotlora.errors import HotloraError

ENV_PREFIX = "HOTLORA_"
_UNSET = object()


class SettingsError(HotloraError, ValueError):
    """A setting with a value its type or its rules refuse (a start-up fault). A ``ValueError`` too:
    callers that built settings before this tree existed catch that."""


@dataclass(frozen=True)
class Declared:
    """What a field carries besides its type and default (kept in the pydantic field's ``metadata``,
    which a forwarded copy of the field keeps too): ``choices`` for the flags and ``parse``, a
    function applied to every given value (text first split into parts for a tuple) when the type
    alone cannot read it (``sizes``: ``"1024x832"`` strings); ``flag``: whether ``hotlora serve`` has a
    flag for it (not for a secret)."""

    choices: tuple = ()
    parse: typing.Callable | None = None
    flag: bool = True


def setting(default=_UNSET, help: str = "", *, choices: tuple = (), factory=_UNSET, parse=None, flag: bool = True):
    """A pydantic ``Field`` with its help text (``description``) and what the flags and the text
    coercion need. The call reads as the dataclass field it replaced. ``flag=False``: no command-line
    flag (a secret: argv is readable by every local user, in ``ps`` and ``/proc/<pid>/cmdline``)."""
    if factory is not _UNSET:
        info = Field(default_factory=factory, description=help)
    else:
        info = Field(default=... if default is _UNSET else default, description=help)  # no default: required
    info.metadata.append(Declared(tuple(choices), parse, flag))
    return info


def declared(info) -> Declared:
    """The ``Declared`` of a pydantic ``FieldInfo`` (an empty one for a field not made by ``setting``)."""
    return next((m for m in info.metadata if isinstance(m, Declared)), Declared())


def default_of(info):
    return info.default_factory() if info.default_factory is not None else info.default


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


def _texty(value) -> bool:
    return isinstance(value, str) or (isinstance(value, (list, tuple)) and any(isinstance(v, str) for v in value))


def from_text(info, value):
    """``value`` as pydantic can validate it for the field ``info``. Only text is read (and lists
    holding text, for tuples): typed values pass untouched. ``parse`` then sees every value."""
    kind, parse = info.annotation, declared(info).parse
    if value is not None and kind is not typing.Any and _texty(value):
        if is_tuple(kind):
            sep = separator(kind)
            items = [value] if isinstance(value, str) else list(value)
            # Text items split and stripped, empty parts dropped; typed items ((h, w) sizes) kept as given.
            value = [part for item in items for part in
                     ([p.strip() for p in item.split(sep) if p.strip()] if isinstance(item, str) else [item])]
        elif isinstance(value, str) and value.strip() == "" and optional(kind):
            return None
        elif isinstance(value, str) and bare(kind) is not str:
            value = value.strip()
    return parse(value) if parse is not None and value is not None else value


_WORDS = {int: ("an integer", "integers"), float: ("a number", "numbers"), bool: ("true or false", "booleans"),
          str: ("text", "names"), Path: ("a path", "paths")}


def spelled(kind) -> str:
    """``tuple[int, ...]`` -> "a comma-separated list of integers", for the operator who typed it."""
    kind = bare(kind)
    if is_tuple(kind):
        item = _args(kind)[0]
        return f"a {'os.pathsep' if item is Path else 'comma'}-separated list of {_WORDS.get(item, ('', 'values'))[1]}"
    return _WORDS.get(kind, (str(kind).replace("typing.", ""),))[0]
