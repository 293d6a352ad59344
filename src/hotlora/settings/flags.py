"""Command-line flags generated from settings fields: ``--field-name`` for every field, its help
from the field's ``help``, booleans as ``--x`` / ``--no-x``, tuples repeatable or comma-separated.
Every flag defaults to None (not given), so the layers below it (env, file, defaults) show through."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

from hotlora.settings.fields import ENV_PREFIX, hints, is_bool, is_tuple, separator

# Spellings kept from before the flags were generated.
ALIASES = {"local_roots": ("--adapter-root",)}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _default(f) -> str:
    value = f.default if f.default is not MISSING else f.default_factory()
    if isinstance(value, tuple):
        value = ",".join(map(str, value)) or "none"
    return str(value)


def add_flags(parser: argparse.ArgumentParser, cls, title: str, only=None) -> list[str]:
    """One flag per field of ``cls`` (or of the names in ``only``) in an argument group; returns the
    dests, which are the field names."""
    group = parser.add_argument_group(title)
    names = []
    for f in fields(cls):
        if only is not None and f.name not in only:
            continue
        kind = hints(cls)[f.name]
        text = f.metadata.get("help", "")
        said = "default" in text  # the help says what the default means better than its value
        text += f" ({'' if said else f'default: {_default(f)}; '}env {ENV_PREFIX}{f.name.upper()})"
        options = {"dest": f.name, "default": None, "help": text.replace("%", "%%")}
        if is_bool(kind):
            options["action"] = argparse.BooleanOptionalAction
        elif is_tuple(kind):
            sep = "," if separator(kind) == "," else "os.pathsep"
            options.update(action="append", metavar=f"{f.name.upper()}[{sep}...]")
        if f.metadata.get("choices"):
            options["choices"] = f.metadata["choices"]
        group.add_argument(flag(f.name), *ALIASES.get(f.name, ()), **options)
        names.append(f.name)
    return names


def given(args: argparse.Namespace, names) -> dict:
    """The flags among ``names`` that were given."""
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
