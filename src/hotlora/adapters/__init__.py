"""Adapters: reading, converting and checking LoRA files. Knows nothing of the running engine."""

from hotlora.adapters.formats import Adapter, LoraWeights, load_adapter

__all__ = ["Adapter", "LoraWeights", "load_adapter"]
