"""How a family makes its task pipelines from a loaded one (``ModelFamily.text_to_image_pipeline``,
``task_pipeline``): components shared, the serving dtype kept, edit refused where the checkpoint
cannot serve it. Tiny pipelines built in memory, nothing compiled or run."""

import pytest
import torch

from hotlora.engine.warm import shared_pipeline
from hotlora.families import UnservedModel, family_named


def share(dtype=torch.float32):
    """What the warm model passes a family's ``task_pipeline``: its dtype-keeping ``from_pipe``."""
    return lambda cls, source: shared_pipeline(cls, source, dtype)


@pytest.fixture(scope="module")
def qwen_edit():
    return family_named("qwenimage").build_tiny_edit(seed=0)


def test_task_pipelines_keep_the_serving_dtype():
    """diffusers' ``from_pipe`` casts the shared modules to float32 in place unless given a dtype: a
    bfloat16 engine serving image-to-image would have lost its dtype."""
    family = family_named("qwenimage")
    pipeline = family.build_tiny(seed=0).to(torch.bfloat16)
    variant = family.task_pipeline("image-to-image", pipeline, share(torch.bfloat16))
    assert type(variant).__name__ == "QwenImageImg2ImgPipeline"
    assert variant.transformer is pipeline.transformer
    assert pipeline.transformer.dtype == pipeline.vae.dtype == torch.bfloat16


def test_an_edit_checkpoint_serves_text_to_image_through_the_text_to_image_pipeline(qwen_edit):
    family = family_named("qwenimage")
    text_to_image = family.text_to_image_pipeline(qwen_edit)
    assert type(text_to_image).__name__ == "QwenImagePipeline"
    for name in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert getattr(text_to_image, name) is getattr(qwen_edit, name)
    edit = family.task_pipeline("edit", qwen_edit, share())
    assert type(edit).__name__ == "QwenImageEditPlusPipeline"
    assert edit.processor is qwen_edit.processor and edit.transformer is qwen_edit.transformer
    assert family.text_to_image_pipeline(text_to_image) is text_to_image  # a text-to-image one is served as it is


def test_edit_is_refused_without_an_edit_checkpoint(qwen_edit):
    from diffusers import QwenImageEditPipeline

    family = family_named("qwenimage")
    with pytest.raises(UnservedModel, match="no processor"):
        family.task_pipeline("edit", family.build_tiny(seed=0), share())
    original = QwenImageEditPipeline.from_pipe(qwen_edit)  # the original Qwen-Image-Edit's pipeline
    with pytest.raises(UnservedModel, match="QwenImageEditPipeline"):
        family.task_pipeline("edit", original, share())


def test_the_tiny_processor_expands_each_reference_to_its_patches(qwen_edit):
    """The tiny edit model's processor gives the vision tower's patches and, in the text, one
    ``<|image_pad|>`` per merged patch: ids the text encoder's config names."""
    from PIL import Image

    processor, config = qwen_edit.processor, qwen_edit.text_encoder.config
    text = "Picture 1: <|vision_start|><|image_pad|><|vision_end|>Picture 2: <|vision_start|><|image_pad|><|vision_end|>"
    inputs = processor(text=[text], images=[Image.new("RGB", (384, 384)), Image.new("RGB", (384, 192))],
                       padding=True, return_tensors="pt")
    grids = inputs["image_grid_thw"]
    ids = inputs["input_ids"][0]
    assert int((ids == config.image_token_id).sum()) == int(grids.prod(dim=1).sum()) // 4
    assert int((ids == config.vision_start_token_id).sum()) == 2 == int((ids == config.vision_end_token_id).sum())
    assert inputs["pixel_values"].shape[0] == int(grids.prod(dim=1).sum())
