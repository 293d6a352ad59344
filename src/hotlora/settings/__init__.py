"""Typed settings. Environment variables use the prefix ``HOTLORA_``.

Each setting is declared once, as a field with its default and help text:

- ``settings/engine.py``: ``EngineConfig`` (with ``RequestLimits`` and ``StepCache``), every engine
  option; the compile-cache fingerprint is derived from it.
- ``settings/store.py``: ``StoreConfig``, the adapter store's.
- ``settings/server.py``: ``ServerConfig``, the server's own fields plus every engine option taken
  from ``EngineConfig``'s fields (flattened); ``engine_config()`` regroups them.
- ``settings/fields.py``: ``setting()`` (a pydantic ``Field`` with help text) and how operator
  text (comma-separated lists, empty for unset) is read before pydantic validates it.
- ``settings/base.py``: the pydantic-settings base classes and the layering, with
  pydantic-settings' sources: defaults < config file < ``HOTLORA_*`` environment < flags.
- ``settings/flags.py``: the ``hotlora serve`` flags, generated from the fields.
- ``settings/files.py``: config files (TOML or YAML) and a model directory's ``hotlora.json``.

This package is the public face: import settings from ``hotlora.settings``.
"""

from hotlora.settings.engine import (
    ADAPTER_MODES, BASE_QUANTIZATIONS, FUSED_RESTORE, SIZE_POLICIES, TASKS, EngineConfig, RequestLimits, StepCache,
    format_size, parse_size, parse_sizes,
)
from hotlora.settings.fields import ENV_PREFIX, SettingsError
from hotlora.settings.files import MODEL_DEFAULTS_FILE, ModelDefaultsError, read_config_file, read_model_defaults
from hotlora.settings.server import ServerConfig
from hotlora.settings.store import GiB, MiB, StoreConfig

__all__ = [
    "ADAPTER_MODES", "BASE_QUANTIZATIONS", "ENV_PREFIX", "FUSED_RESTORE", "GiB", "MODEL_DEFAULTS_FILE", "MiB", "ModelDefaultsError",
    "SIZE_POLICIES", "TASKS", "EngineConfig", "RequestLimits", "ServerConfig", "SettingsError", "StepCache", "StoreConfig",
    "format_size", "parse_size", "parse_sizes", "read_config_file", "read_model_defaults",
]
