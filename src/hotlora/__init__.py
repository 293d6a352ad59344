"""hotlora: a different LoRA pair on every request, from one warm, compiled diffusion model."""

import importlib.metadata

try:  # one version, pyproject's, read from the installed package's metadata
    __version__ = importlib.metadata.version("hotlora")
except importlib.metadata.PackageNotFoundError:  # run from a source tree without installing
    __version__ = "0+source"


def __getattr__(name):
    # Importing torch and diffusers takes seconds: only pay for it when the engine is used.
    if name in ("Engine", "GenerationResult"):
        from hotlora import engine

        return getattr(engine, name)
    raise AttributeError(name)
