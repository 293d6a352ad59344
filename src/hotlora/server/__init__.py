"""The HTTP edge: schemas, routes, error mapping, metrics. Knows nothing of tensors.

``create_app`` is imported on first use, so ``hotlora.server.errors`` and ``hotlora.server.schemas``
stay importable without FastAPI, prometheus-client or torch (the Ray ingress uses them).
"""

__all__ = ["create_app"]


def __getattr__(name):
    if name == "create_app":
        from hotlora.server.app import create_app

        return create_app
    raise AttributeError(name)
