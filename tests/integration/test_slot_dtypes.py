"""Modules a model keeps in another dtype than the rest (diffusers' ``_keep_in_fp32_modules``: Wan's
time embedder stays float32 in a bf16 model) get slots of their own dtype, as PEFT gives their LoRA
weights: held in bf16 with the rest, a small adapter on the tiny Wan kept 0.11 of its effect where
plain diffusers kept 0.61 (tests/integration/test_precision.py measures that per family). Such modules
stay out of the packed layout; a packed adapter that skips them clears what the previous one left."""

import torch

from hotlora import Engine
from hotlora.engine.writers.slots import PEFT_ADAPTER
from hotlora.testing import random_lora, save_diffusers_lora

from ..helpers import TARGET_RANK


def test_float32_modules_of_a_bf16_model_get_float32_slots(tiny_models, tmp_path):
    model = tiny_models["wan"]
    engine = Engine.from_pretrained(model, target_rank=TARGET_RANK, batch_size=1, compile=False,
                                    dtype=torch.bfloat16, rank_buckets=())
    writer = engine.writer
    assert writer.apart and all("time_embedder" in name for name in writer.apart), writer.apart
    for name, down, up in writer._peft:
        base = engine.denoiser.get_submodule(name).get_base_layer().weight.dtype
        assert down[PEFT_ADAPTER].weight.dtype == up[PEFT_ADAPTER].weight.dtype == base, name
    assert {m.get_base_layer().weight.dtype for m in writer._layers} == {torch.bfloat16, torch.float32}

    linears = dict(engine.ceiling.modules)
    everywhere = save_diffusers_lora(tmp_path / "everywhere", "wan", random_lora(linears, 4, seed=3), rank=4, alpha=4)
    blocks = save_diffusers_lora(tmp_path / "blocks", "wan",
                                 random_lora(linears, 4, seed=4, modules=[m for m in linears if m not in writer.apart]),
                                 rank=4, alpha=4)

    def latents(path):
        result = engine.generate("a cat", adapters={"identity": (path, 0.8)}, num_inference_steps=2, seed=0,
                                 output_type="latent")
        return result.images, result.swap

    alone, swap = latents(blocks)
    assert swap.packed_writes == 1  # the packed path, which writes the flat buffers only
    after_everywhere, swap = latents(everywhere)
    assert swap.per_module_writes == 1 and not after_everywhere.equal(alone)
    again, swap = latents(blocks)
    assert swap.packed_writes == 1
    assert again.equal(alone), "the time embedder's slot kept the previous adapter's rows"
