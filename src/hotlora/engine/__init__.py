"""The engine: the only package that holds a pipeline and mutates its weights.

``Engine`` and ``GenerationResult`` are imported on first use (PEP 562), not with the package:
the request's records (``engine.request``) serve processes without torch, such as the HTTP
edge's schemas and the Ray ingress.
"""

from __future__ import annotations

import importlib

__all__ = ["Engine", "GenerationResult"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("hotlora.engine.core"), name)
    raise AttributeError(f"module 'hotlora.engine' has no attribute {name!r}")
