"""Command-line flags generated from settings fields: ``--field-name`` for every field, its help
from the field's description, booleans as ``--x`` / ``--no-x``, tuples repeatable or comma-separated.
Every flag defaults to None (not given), so the layers below it (env, file, defaults) show through.

Written with argparse, not pydantic-settings' ``CliSettingsSource``: that source reads lists as JSON
or repeated flags and has no per-field parser, so the documented spellings (``--sizes 64x32,32x32``,
paths ``os.pathsep``-separated, ``--adapter-root`` repeated) would change; the parsed flags enter
the layering as the highest source (``Settings.layered``'s keyword arguments)."""

from __future__ import annotations

import argparse

from hotlora.settings.fields import (
    ENV_PREFIX,
    declared,
    default_of,
    is_bool,
    is_tuple,
    separator,
)

# Spellings kept from before the flags were generated.
ALIASES = {"local_roots": ("--adapter-root",)}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class _NoSecretFlag(argparse.Action):
    """A secret's would-be flag, hidden from ``--help``: it refuses with what to use instead. Without
    it argparse would take ``--api-keys`` as an abbreviation of ``--api-keys-file``."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: no such flag: a flag's value is readable by every local user (ps, "
                     f"/proc/<pid>/cmdline); set {ENV_PREFIX}{self.dest.upper()} or {self.dest} in the --config file")


def _default(info) -> str:
    value = default_of(info)
    if isinstance(value, tuple):
        value = ",".join(map(str, value)) or "none"
    return str(value)


def add_flags(parser: argparse.ArgumentParser, cls, title: str, only=None) -> list[str]:
    """One flag per field of ``cls`` (or of the names in ``only``) in an argument group, but for the
    fields declared without one (``setting(..., flag=False)``: secrets, whose flag only refuses);
    returns the dests, which are the field names."""
    group = parser.add_argument_group(title)
    names = []
    for name, info in cls.model_fields.items():
        if only is not None and name not in only:
            continue
        if not declared(info).flag:
            group.add_argument(flag(name), dest=name, default=None, action=_NoSecretFlag, help=argparse.SUPPRESS)
            continue
        kind, choices = info.annotation, declared(info).choices
        text = info.description or ""
        said = "default" in text  # the help says what the default means better than its value
        text += f" ({'' if said else f'default: {_default(info)}; '}env {ENV_PREFIX}{name.upper()})"
        options = {"dest": name, "default": None, "help": text.replace("%", "%%")}
        if is_bool(kind):
            options["action"] = argparse.BooleanOptionalAction
        elif is_tuple(kind):
            sep = "," if separator(kind) == "," else "os.pathsep"
            options.update(action="append", metavar=f"{name.upper()}[{sep}...]")
        if choices:
            options["choices"] = choices
        group.add_argument(flag(name), *ALIASES.get(name, ()), **options)
        names.append(name)
    return names


def given(args: argparse.Namespace, names) -> dict:
    """The flags among ``names`` that were given."""
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
