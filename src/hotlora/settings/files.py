"""The files settings come from: config files (TOML, or YAML of the same shape) and a model
directory's ``hotlora.json`` (serving defaults). Read here and nowhere else."""

from __future__ import annotations

import json
from pathlib import Path

from hotlora.errors import HotloraError


def read_config_file(path) -> dict:
    """A TOML file, or YAML of the same shape (``.yaml`` / ``.yml``)."""
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        import yaml

        return yaml.safe_load(text) or {}
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads(text)


# A model directory may carry this file to suggest serving defaults (the tiny models do: their
# pipelines' own defaults would be far too large an image for them), among them the ids it
# answers to (``model_id``, ``base_model_aliases``).
MODEL_DEFAULTS_FILE = "hotlora.json"


class ModelDefaultsError(HotloraError):
    """A model directory's hotlora.json cannot be read (a start-up fault)."""


def read_model_defaults(model) -> dict:
    """``hotlora.json`` of a model directory; {} for a hub id or a directory without one."""
    path = Path(str(model)) / MODEL_DEFAULTS_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ModelDefaultsError(f"{path}: unreadable serving defaults ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelDefaultsError(f"{path}: serving defaults must be a JSON object")
    return data
