"""Qwen-Image-Edit-Plus beyond the shared task contract (``test_tasks.py``): an edit served by a
mixed-batch engine (adapter banks) equals plain diffusers' edit pipeline. Its batch is the one
request, whose prompt goes to the pipeline once (QwenImageEditPlusPipeline refuses a list)."""

import numpy as np
import pytest

from hotlora import Engine
from hotlora.engine.inputs import fitted
from hotlora.families import family_named

from ..helpers import TARGET_RANK, small_edit_references

pytestmark = pytest.mark.families

PROMPT = "the same portrait, at dusk"
STEPS = 3


def test_an_edit_in_a_mixed_batch_equals_plain_diffusers(tiny_task_models):
    from PIL import Image

    from hotlora.testing import plain_diffusers_reference

    family, model_dir = family_named("qwenimage"), tiny_task_models["qwenimage"]
    rng = np.random.default_rng(0)
    photo = Image.fromarray(rng.integers(0, 256, size=(6, 5, 3), dtype=np.uint8)).resize((40, 48))
    adapters = {"identity": (model_dir / "adapters" / "identity-diffusers", 0.9),
                "style": (model_dir / "adapters" / "style-diffusers", 0.6)}
    with small_edit_references():
        engine = Engine.from_pretrained(model_dir, target_rank=TARGET_RANK, batch_size=2, compile=False, mixed=True,
                                        rank_buckets=(), tasks=("edit",), max_reference_images=1)
        prepared = engine.prepare(PROMPT, task="edit", images=(photo,), adapters=adapters, num_images=2,
                                  num_inference_steps=STEPS, seed=0, output_type="latent")
        (result,) = engine.run([prepared])  # a list: one forward batch, the mixed path
        given = Image.fromarray(fitted(np.asarray(photo), engine.height, engine.width))
        theirs = plain_diffusers_reference(
            model_dir, adapters, prompt=PROMPT, num_images=2, num_inference_steps=STEPS,
            guidance_scale=engine.defaults["guidance_scale"], height=engine.height, width=engine.width, seed=0,
            pipeline_class=family.task_pipelines["edit"],
            task_arguments=family.task_arguments("edit", [given], None, None, 1))
    assert result.images.shape == theirs.shape
    assert (result.images - theirs).abs().max().item() <= 1e-4
