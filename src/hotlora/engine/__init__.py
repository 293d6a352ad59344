"""The engine: the only package that holds a pipeline and mutates its weights."""

from hotlora.engine.core import Engine, GenerationResult

__all__ = ["Engine", "GenerationResult"]
