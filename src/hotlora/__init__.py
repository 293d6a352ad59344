"""hotlora: a different LoRA pair on every request, from one warm, compiled diffusion model."""

__version__ = "0.1.0"


def __getattr__(name):
    # Importing torch and diffusers takes seconds: only pay for it when the engine is used.
    if name in ("Engine", "GenerationResult"):
        from hotlora import engine

        return getattr(engine, name)
    raise AttributeError(name)
