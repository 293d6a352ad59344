"""The store wing: references parsed and made safe (``references``), sources (disk, HTTPS, S3, the
Hub: ``sources``, ``remote``, ``hub``) fetched fairly per client (``fetching``) under the egress
rules (``egress``), converted adapters kept in RAM and on disk (``adapter_store``, ``diskcache``),
a catalog of named adapters (``catalog``).

``AdapterStore`` is imported on first use (PEP 562): the store imports torch, and light parts of
this package (``references``, ``egress``) serve processes without it, such as the Ray ingress.
"""

from __future__ import annotations

import importlib

__all__ = ["AdapterStore"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("hotlora.adapters.store.adapter_store"), name)
    raise AttributeError(f"module 'hotlora.adapters.store.adapter_store' has no attribute {name!r}")
