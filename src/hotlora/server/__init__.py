"""The HTTP edge: schemas, routes, error mapping, metrics. Knows nothing of tensors."""

from hotlora.server.app import create_app

__all__ = ["create_app"]
