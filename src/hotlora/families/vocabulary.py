"""The layer names each registered family's denoiser has, as templates (block indices written ``N``):
what tells another family's LoRA apart when its keys are plain diffusers module names, which the
key patterns (``ModelFamily.lora_key_pattern``) cannot always do. An attention-only LoRA, the
default of diffusers' training scripts, names ``transformer_blocks.N.attn.to_q`` in five families;
its full set of names still fits only some of them (Flux's ``single_transformer_blocks.N.attn.to_q``,
SD3.5's ``attn2``, Z-Image's ``layers.N.attention.to_q``).

Read off the families' tiny models (the published classes, fewer blocks) and kept in
``vocabulary.json`` beside this file: ``python -m hotlora.families.vocabulary`` writes it, and
tests/unit/test_unserved.py checks it against the tiny models. Reading it is torch-free (the Ray
ingress imports ``recognize``). Written here: no library lists which architectures a LoRA's module
names fit. Only ever used to word a refusal.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Iterable

PATH = Path(__file__).with_name("vocabulary.json")


def template(module: str) -> str:
    """``transformer_blocks.12.attn.to_q`` -> ``transformer_blocks.N.attn.to_q``."""
    return ".".join("N" if part.isdigit() else part for part in module.split("."))


@cache
def vocabularies() -> dict[str, frozenset[str]]:
    """Family name -> the templates of its denoiser's layers that take LoRA."""
    return {name: frozenset(templates) for name, templates in json.loads(PATH.read_text()).items()}


def families_of_modules(modules: Iterable[str]) -> list[str]:
    """The families whose denoisers have a layer of every one of ``modules``' names, in registry order."""
    wanted = {template(module) for module in modules}
    if not wanted:
        return []
    return [name for name, known in vocabularies().items() if wanted <= known]


def denoiser_templates(denoiser) -> list[str]:
    """The templates of a denoiser's Linear and conv layers (what LoRA files name)."""
    import torch

    kinds = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    return sorted({template(name) for name, layer in denoiser.named_modules() if isinstance(layer, kinds)})


def read_registered() -> dict[str, list[str]]:
    """Every registered family's templates, read off its tiny model."""
    from hotlora.families import REGISTERED

    return {family.name: denoiser_templates(getattr(family.build_tiny(), family.denoiser)) for family in REGISTERED}


def main() -> None:
    from hotlora.durable import write_atomic

    write_atomic(PATH, (json.dumps(read_registered(), indent=1) + "\n").encode())  # never left half-written
    PATH.chmod(0o644)  # write_atomic's temporary file is 0600; this is a source file
    print(f"wrote {PATH}")


if __name__ == "__main__":
    main()
