"""Scale-out on Ray Serve: one deployment per base model, identity-adapter affinity through Serve's
model multiplexing, the same HTTP API as ``hotlora serve``. Needs the ``ray`` extra."""

from hotlora.scaleout.config import ModelDeployment, RayServeConfig

__all__ = ["ModelDeployment", "RayServeConfig", "build_app", "run"]


def __getattr__(name):
    # Importing Ray takes a while: only when the application is built.
    if name in ("build_app", "run"):
        from hotlora.scaleout import app

        return getattr(app, name)
    raise AttributeError(name)
