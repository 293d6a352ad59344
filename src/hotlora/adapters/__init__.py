"""Adapters: reading, converting and checking LoRA files. Knows nothing of the running engine.

The converted types are imported on first use (PEP 562), not with the package: ``formats`` imports
torch, and light parts of this package (``references``, ``egress``) serve processes without it,
such as the Ray ingress.
"""

from __future__ import annotations

import importlib

__all__ = ["Adapter", "LoraWeights", "load_adapter"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("hotlora.adapters.formats"), name)
    raise AttributeError(f"module 'hotlora.adapters' has no attribute {name!r}")
