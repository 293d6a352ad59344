"""Adapters: the format wing (``format/``: read, convert, validate) and the store wing (``store/``:
references, sources, fetching, caches, egress); a request's adapter records (``binding``) and the
resolver that turns them into checked adapters for the engine (``resolver``). Knows nothing of
the running engine.

The converted types are imported on first use (PEP 562), not with the package: the converter
imports torch, and light parts of this package (``store.references``, ``store.egress``) serve
processes without it, such as the Ray ingress.
"""

from __future__ import annotations

import importlib

__all__ = ["Adapter", "LoraWeights", "load_adapter"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("hotlora.adapters.format.convert"), name)
    raise AttributeError(f"module 'hotlora.adapters' has no attribute {name!r}")
