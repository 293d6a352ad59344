"""Typed settings. Environment variables use the prefix ``HOTLORA_``.

Each setting is declared once, as a field with its default and help text:

- ``settings/engine.py``: ``EngineConfig`` (with ``RequestLimits`` and ``StepCache``), every engine
  option; the compile-cache fingerprint is derived from it.
- ``settings/store.py``: ``StoreConfig``, the adapter store's.
- ``settings/server.py``: ``ServerConfig``, the server's own fields plus every engine option taken
  from ``EngineConfig``'s fields (flattened); ``engine_config()`` regroups them.
- ``settings/fields.py``: how text (env, flags, config files, keyword strings) becomes a typed
  value (pydantic's ``TypeAdapter``), and the layering: defaults < config file < ``HOTLORA_*``
  environment < flags.
- ``settings/flags.py``: the ``hotlora serve`` flags, generated from the fields.
- ``settings/files.py``: config files (TOML or YAML) and a model directory's ``hotlora.json``.

This module is the public face: import settings from here.
"""

from hotlora.settings.engine import (
    ADAPTER_MODES, BASE_QUANTIZATIONS, FUSED_RESTORE, SIZE_POLICIES, EngineConfig, RequestLimits, StepCache,
    format_size, parse_size, parse_sizes,
)
from hotlora.settings.fields import ENV_PREFIX, SettingsError, layered
from hotlora.settings.files import MODEL_DEFAULTS_FILE, ModelDefaultsError, read_config_file, read_model_defaults
from hotlora.settings.server import ServerConfig
from hotlora.settings.store import GiB, MiB, StoreConfig

_layered = layered  # the name it had

__all__ = [
    "ADAPTER_MODES", "BASE_QUANTIZATIONS", "ENV_PREFIX", "FUSED_RESTORE", "GiB", "MODEL_DEFAULTS_FILE", "MiB", "ModelDefaultsError",
    "SIZE_POLICIES", "EngineConfig", "RequestLimits", "ServerConfig", "SettingsError", "StepCache", "StoreConfig",
    "format_size", "parse_size", "parse_sizes", "read_config_file", "read_model_defaults",
]
