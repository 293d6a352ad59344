"""Tasks beyond text-to-image on one warm denoiser: image-to-image, inpaint and edit, each made from
the warm pipeline with ``from_pipe``, equal to plain diffusers' variant pipeline with the same
adapters (float32, within 1e-4) and compiling nothing after warm-up (``error_on_recompile``)."""

import re

import numpy as np
import pytest
import torch
from PIL import Image

from hotlora import Engine
from hotlora.engine.inputs import fitted
from hotlora.engine.request import UnservedTask
from hotlora.errors import InvalidRequest
from hotlora.families import FAMILIES, ModelFamily, family_named

from ..helpers import CORE_FAMILIES, TARGET_RANK, allow_cfg_rounding, recompiles_are_errors, small_edit_references

TOLERANCE = 1e-4
PROMPT = "the same portrait, at dusk"
STEPS = 4
N = 3  # with batch_size 2: a full chunk and a last chunk of 1


def task_params():
    """The image families with tasks (a video family's image-to-video: test_image_to_video.py)."""
    return [pytest.param(name, id=name, marks=() if name in CORE_FAMILIES else pytest.mark.families)
            for name, family in FAMILIES.items() if family.task_pipelines and not family.video]


@pytest.fixture(scope="module", params=task_params())
def warm(request, tiny_task_models):
    family, model_dir = family_named(request.param), tiny_task_models[request.param]
    with small_edit_references():
        engine = Engine.from_pretrained(model_dir, target_rank=TARGET_RANK, batch_size=2, compile=True,
                                        rank_buckets=(), tasks=tuple(family.task_pipelines),
                                        max_reference_images=min(2, family.max_edit_references))
        with recompiles_are_errors():
            yield family, model_dir, engine
    assert engine.recompiles == 0


def photo(height: int, width: int, seed: int) -> Image.Image:
    """A smooth random picture (a VAE's input should look like one), ``width`` x ``height``."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, size=(max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    return Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC)


def half_mask(height: int, width: int) -> Image.Image:
    mask = Image.new("L", (width, height), 0)
    mask.paste(255, (0, height // 2, width, height))
    return mask


def task_case(family, engine, task, references=None):
    """(request keywords, the variant pipeline's own image arguments) for one task; an edit with
    ``references`` images (default: as many as served)."""
    height, width = engine.height, engine.width
    if task == "edit":
        count = references or engine.rules.max_reference_images
        references = [photo(height + 8, width * 2, 1), photo(height * 2, width, 2)]  # fitted to the served size
        references = references[:count]
        given = [Image.fromarray(fitted(np.asarray(r), height, width)) for r in references]
        arguments = family.task_arguments("edit", given, None, None, len(given))
        return {"task": task, "images": tuple(references)}, arguments
    image = photo(height, width, 3)
    mask = half_mask(height, width) if task == "inpaint" else None
    strength = 0.6  # 4 steps: Flux's pipelines run 3 of them, SDXL's 2 (ModelFamily.denoising_steps)
    # One input image per output image: how the engine calls the pipeline (families/base.py says why).
    arguments = family.task_arguments(task, [image] * N, None if mask is None else [mask] * N, strength, 1)
    return {"task": task, "images": (image,), "mask": mask, "strength": strength}, arguments


def reference(family, engine, model_dir, task, adapters, arguments, seed=0):
    from hotlora.testing import plain_diffusers_reference

    return plain_diffusers_reference(
        model_dir, adapters, prompt=PROMPT, num_images=N, num_inference_steps=STEPS,
        guidance_scale=engine.defaults["guidance_scale"], height=engine.height, width=engine.width, seed=seed,
        pipeline_class=family.task_pipelines[task], task_arguments=arguments)


@pytest.mark.parametrize("task", ["image-to-image", "inpaint", "edit"])
def test_each_task_equals_plain_diffusers_variant(warm, task, record_property, request):
    family, model_dir, engine = warm
    allow_cfg_rounding(request, family.name)
    if task not in family.task_pipelines:
        pytest.skip(f"diffusers has no {task} pipeline hotlora declares for {family.name}")
    adapters = {"identity": (model_dir / "adapters" / "identity-diffusers", 0.9),
                "style": (model_dir / "adapters" / "style-diffusers", 0.6)}
    keywords, arguments = task_case(family, engine, task)
    result = engine.generate(PROMPT, adapters=adapters, num_images=N, num_inference_steps=STEPS, seed=0,
                             output_type="latent", **keywords)
    theirs = reference(family, engine, model_dir, task, adapters, arguments)
    diff = (result.images - theirs).abs().max().item()
    record_property("max_abs_diff", diff)  # the figure a family's report quotes (--junitxml)
    assert diff <= TOLERANCE, f"{family.name} {task}: max |engine - diffusers| = {diff}"
    # The step clock saw each chunk's last step: the family counts the steps a strength leaves as its
    # pipelines do (else no chunk's decode is timed apart).
    assert len(result.timings.decode_ms) == len(result.timings.chunks) == 2
    # The input image must matter: the same request with the images mirrored gives something else.
    mirrored = {**keywords, "images": tuple(image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) for image in keywords["images"])}
    other = engine.generate(PROMPT, adapters=adapters, num_images=N, num_inference_steps=STEPS, seed=0,
                            output_type="latent", **mirrored).images
    assert (other - result.images).abs().max().item() > 100 * TOLERANCE
    assert engine.recompiles == 0


def test_edit_at_fewer_references(warm):
    """Each reference count below the most served is warmed up too (another token count) and equals
    plain diffusers' edit pipeline."""
    family, model_dir, engine = warm
    counts = range(1, engine.rules.max_reference_images) if "edit" in family.task_pipelines else ()
    if not counts:
        pytest.skip(f"{family.name} serves edits with one reference only (or none)")
    adapters = {"identity": (model_dir / "adapters" / "identity-diffusers", 0.9),
                "style": (model_dir / "adapters" / "style-diffusers", 0.6)}
    for count in counts:
        keywords, arguments = task_case(family, engine, "edit", references=count)
        result = engine.generate(PROMPT, adapters=adapters, num_images=N, num_inference_steps=STEPS, seed=0,
                                 output_type="latent", **keywords)
        theirs = reference(family, engine, model_dir, "edit", adapters, arguments)
        diff = (result.images - theirs).abs().max().item()
        assert diff <= TOLERANCE, f"{family.name} edit, {count} reference(s): max |engine - diffusers| = {diff}"
    assert engine.recompiles == 0


def test_an_edit_checkpoint_serves_text_to_image(warm):
    """A family whose edit checkpoints are another pipeline (Qwen-Image-Edit-2509's
    QwenImageEditPlusPipeline) serves text-to-image from one through its text-to-image pipeline,
    equal to plain diffusers loading that directory as that pipeline."""
    from hotlora.testing import plain_diffusers_reference

    family, model_dir, engine = warm
    if type(family).build_tiny_edit is ModelFamily.build_tiny_edit:
        pytest.skip(f"{family.name}'s edit checkpoints are its text-to-image pipeline")
    assert type(engine.pipeline).__name__ == family.pipeline_class
    adapters = {"identity": (model_dir / "adapters" / "identity-diffusers", 0.9)}
    ours = engine.generate(PROMPT, adapters=adapters, num_images=2, num_inference_steps=STEPS, seed=0,
                           output_type="latent").images
    theirs = plain_diffusers_reference(
        model_dir, adapters, prompt=PROMPT, num_images=2, num_inference_steps=STEPS,
        guidance_scale=engine.defaults["guidance_scale"], height=engine.height, width=engine.width, seed=0,
        pipeline_class=family.pipeline_class)
    assert (ours - theirs).abs().max().item() <= TOLERANCE
    assert engine.recompiles == 0


@pytest.mark.families
def test_qwenimage_edit_on_a_text_to_image_checkpoint_is_refused(tiny_models):
    """Qwen-Image's text-to-image checkpoint has no processor (and no edit-trained transformer):
    edit is refused at start-up, naming the checkpoint that serves it."""
    from hotlora.families import UnservedModel

    with pytest.raises(UnservedModel, match="QwenImageEditPlusPipeline"):
        Engine.from_pretrained(tiny_models["qwenimage"], target_rank=TARGET_RANK, batch_size=1, compile=False,
                               rank_buckets=(), tasks=("edit",))


def test_task_pipelines_share_every_weight(warm):
    """``from_pipe``: each task's pipeline holds the warm pipeline's module objects, nothing copied."""
    family, _, engine = warm
    base = engine.pipeline
    tensors = {t.data_ptr() for _, m in base.components.items() if isinstance(m, torch.nn.Module)
               for t in (*m.parameters(), *m.buffers())}
    for task, pipeline in engine.warm.task_pipelines.items():
        assert type(pipeline).__name__ == (family.task_pipelines.get(task) or type(base).__name__)
        for name, module in pipeline.components.items():
            if isinstance(module, torch.nn.Module) and name in base.components:
                assert module is base.components[name], f"{task}: {name} is a copy"
        own = {t.data_ptr() for _, m in pipeline.components.items() if isinstance(m, torch.nn.Module)
               for t in (*m.parameters(), *m.buffers())}
        assert own <= tensors, f"{task}: {len(own - tensors)} tensors not shared with the warm pipeline"


def test_task_inputs_are_checked_before_the_engine(warm):
    family, _, engine = warm
    image = photo(engine.height, engine.width, 5)
    task = next(iter(family.task_pipelines))
    cases = [
        ({"task": "outpaint"}, UnservedTask, "not served"),
        ({"task": "image-to-image"} if "image-to-image" in family.task_pipelines else {"task": task},
         InvalidRequest, "exactly one input image|reference image"),
        ({"images": (image,)}, InvalidRequest, "text-to-image takes no input image"),
    ]
    if "image-to-image" in family.task_pipelines:
        cases += [({"task": "image-to-image", "images": (image,), "strength": 1.5}, InvalidRequest, "strength"),
                  ({"task": "image-to-image", "images": (image, image)}, InvalidRequest, "exactly one")]
        if family.denoising_steps(STEPS, 0.1) == 0:  # a pipeline that floors steps x strength runs none
            cases += [({"task": "image-to-image", "images": (image,), "strength": 0.1}, InvalidRequest, "no step")]
    if "inpaint" in family.task_pipelines:
        cases += [({"task": "inpaint", "images": (image,)}, InvalidRequest, "needs a mask"),
                  ({"task": "inpaint", "images": (image,), "mask": half_mask(8, 8)}, InvalidRequest, "same size")]
    if "edit" in family.task_pipelines:
        cases += [({"task": "edit", "images": (image,) * (engine.rules.max_reference_images + 1)}, UnservedTask,
                   "max_reference_images")]
    graphs = engine.recompiles
    for keywords, error, message in cases:
        with pytest.raises(error, match=message):
            engine.prepare(PROMPT, num_inference_steps=STEPS, **keywords)
    assert engine.recompiles == graphs


def test_an_engine_without_tasks_refuses_them(tiny_models):
    engine = Engine.from_pretrained(tiny_models["flux"], target_rank=TARGET_RANK, batch_size=1, compile=False,
                                    rank_buckets=())
    with pytest.raises(UnservedTask, match="served tasks: text-to-image"):
        engine.prepare(PROMPT, task="image-to-image", images=(photo(32, 32, 0),))
    assert engine.describe()["tasks"] == ["text-to-image"]
    assert (engine.describe()["output"], engine.describe()["fps"]) == ("images", None)


def test_input_image_bytes_are_decoded_under_the_request_limits(tiny_models):
    """The ``input_image_*`` limits (``RequestLimits``; the server's flattened settings of the same
    names) bound file bytes in prepare, before the engine: a PNG over the side limit is a 413."""
    import io

    from hotlora.errors import RequestTooLarge
    from hotlora.settings import RequestLimits

    engine = Engine.from_pretrained(tiny_models["flux"], target_rank=TARGET_RANK, batch_size=1, compile=False,
                                    rank_buckets=(), tasks=("image-to-image",),
                                    limits=RequestLimits(input_image_max_side=40))

    def png(side: int) -> bytes:
        out = io.BytesIO()
        photo(side, side, 0).save(out, "PNG")
        return out.getvalue()

    prepared = engine.prepare(PROMPT, task="image-to-image", images=(png(40),), num_inference_steps=STEPS)
    assert prepared.images[0].shape == (40, 40, 3) and prepared.images[0].dtype == np.uint8
    with pytest.raises(RequestTooLarge, match="input_image_max_side"):
        engine.prepare(PROMPT, task="image-to-image", images=(png(48),), num_inference_steps=STEPS)


@pytest.mark.parametrize("task", ["image-to-image", "inpaint"])
@pytest.mark.parametrize("mixed", CORE_FAMILIES, indirect=True)
def test_requests_with_different_input_images_share_one_forward_batch(mixed, task):
    """Requests of one task with different input images (masks, adapters, prompts, seeds) have equal
    batch keys, so the worker packs them into ONE forward pass of a mixed engine (conftest's
    ``mixed``, which serves the core families' image tasks); each request's images equal that
    request run alone, and plain diffusers' variant pipeline with its adapters; nothing compiles.
    An input image of another size packs too: the engine resizes every input to the served size with
    the task pipeline's own image processor (``runner.at_served_size``), so the denoiser's shapes
    match. Plain diffusers gets the image as it is where its pipeline takes a size (and resizes it
    itself), else (SDXL's image-to-image) the image resized by that processor: unresized it would
    denoise at the input's size."""
    import inspect

    from hotlora.testing import plain_diffusers_reference

    from .conftest import MIXED_BATCH

    name, model_dir, engine, pool = mixed
    family = family_named(name)
    height, width = engine.height, engine.width
    strength = 0.6
    cases = [  # (prompt, adapters, images, seed, input image); MIXED_BATCH images in all
        ("a cat", {"identity": (pool[0], 0.9), "style": (pool[1], 0.5)}, 1, 11, photo(height, width, 3)),
        ("a red house", {"style": (pool[2], 1.1)}, 1, 40, photo(2 * height, 2 * width, 4)),
        ("an astronaut", {"identity": (pool[3], 0.7)}, 1, 7, photo(height, width, 5)),
    ]
    assert sum(images for _, _, images, _, _ in cases) == MIXED_BATCH
    masks = [half_mask(*image.size[::-1]).rotate(90 * i) if task == "inpaint" else None
             for i, (*_, image) in enumerate(cases)]

    def prepared(i):
        prompt, adapters, images, seed, image = cases[i]
        return engine.prepare(prompt, adapters=adapters, num_images=images, seed=seed, num_inference_steps=STEPS,
                              output_type="latent", task=task, images=(image,), mask=masks[i], strength=strength)

    with recompiles_are_errors():
        requests = [prepared(i) for i in range(len(cases))]
        assert len({r.batch_key() for r in requests}) == 1, "the worker would not pack these requests"
        together = engine.run(requests)
        alone = [engine.run(prepared(i)).images for i in range(len(cases))]
    for i, (prompt, adapters, images, seed, image) in enumerate(cases):
        assert together[i].timings.chunks == [MIXED_BATCH], "not one forward pass"
        diff = (together[i].images - alone[i]).abs().max().item()
        assert diff <= TOLERANCE, f"{name} {task} request {i}: packed vs alone differ by {diff}"
        pipeline, mask = engine.warm.task_pipelines[task], masks[i]
        if "height" not in inspect.signature(type(pipeline).__call__).parameters:
            image = pipeline.image_processor.resize(image, height, width)
            mask = None if mask is None else pipeline.mask_processor.resize(mask, height, width)
        arguments = family.task_arguments(task, [image] * images, None if mask is None else [mask] * images,
                                          strength, 1)
        theirs = plain_diffusers_reference(
            model_dir, {slot: (str(path), scale) for slot, (path, scale) in adapters.items()}, prompt=prompt,
            num_images=images, num_inference_steps=STEPS, guidance_scale=engine.defaults["guidance_scale"],
            height=height, width=width, seed=seed, pipeline_class=family.task_pipelines[task],
            task_arguments=arguments)
        diff = (together[i].images - theirs).abs().max().item()
        assert diff <= TOLERANCE, f"{name} {task} request {i}: packed vs plain diffusers differ by {diff}"
    assert engine.recompiles == 0



@pytest.mark.parametrize("name", [name for name, family in FAMILIES.items() if family.refused_tasks])
def test_a_refused_task_is_refused_with_its_reason(tiny_models, name):
    """A task diffusers has a pipeline for but that cannot run on the family's models (the family's
    ``refused_tasks``) is refused at start-up, saying why, before anything is warmed up."""
    from hotlora.families import UnservedModel

    family = family_named(name)
    for task, reason in family.refused_tasks.items():
        with pytest.raises(UnservedModel, match=f"does not serve {task} .*{re.escape(reason)}"):
            Engine.from_pretrained(tiny_models[name], target_rank=TARGET_RANK, batch_size=1, compile=False,
                                   rank_buckets=(), tasks=(task,))


def test_task_pipelines_leave_every_dtype_as_loaded(tiny_models):
    """``from_pipe`` casts the pipeline it makes, shared modules included, to float32 unless told a
    dtype: a bfloat16 engine serving tasks keeps every tensor bfloat16, and the same storage."""
    engine = Engine.from_pretrained(tiny_models["flux"], target_rank=TARGET_RANK, batch_size=1, compile=False,
                                    rank_buckets=(), tasks=("image-to-image",), dtype=torch.bfloat16)
    for pipeline in engine.warm.task_pipelines.values():
        dtypes = {t.dtype for m in pipeline.components.values() if isinstance(m, torch.nn.Module)
                  for t in (*m.parameters(), *m.buffers()) if t.is_floating_point()}
        assert dtypes == {torch.bfloat16}, f"{type(pipeline).__name__}: {dtypes}"


def test_kontext_edits_with_different_references_share_one_forward_batch(tiny_task_models):
    """Kontext takes one reference per batch position (``edit_references_per_image``): edits of one
    reference each, with different photos (adapters, prompts, seeds), have equal batch keys, so a
    mixed engine packs them into ONE forward pass; each request's images equal that request alone and
    plain diffusers' Kontext pipeline given its photo. Eager: the packed batch has the shapes of one
    edit of as many images, which a compiled engine warms up anyway (``test_each_task_equals_plain_diffusers_variant``).
    Flux.2's edits (its references go to every prompt of a call) still run alone."""
    from hotlora.testing import plain_diffusers_reference, random_lora, save_diffusers_lora

    family, model_dir = family_named("flux"), tiny_task_models["flux"]
    engine = Engine.from_pretrained(model_dir, target_rank=TARGET_RANK, batch_size=4, compile=False, mixed=True,
                                    rank_buckets=(), tasks=("edit",))
    height, width = engine.height, engine.width
    linears = dict(engine.ceiling.modules)
    pool = [save_diffusers_lora(model_dir.parent / f"kontext-pool-{i}", "flux",
                                random_lora(linears, 4, seed=70 + i), rank=4, alpha=4) for i in range(2)]
    cases = [  # (prompt, adapters, images, seed, reference)
        ("the same cat, at dusk", {"identity": (pool[0], 0.9)}, 2, 11, photo(height, width, 3)),
        ("a red house instead", {"style": (pool[1], 1.1)}, 1, 40, photo(2 * height, width, 4)),
        ("an astronaut", {}, 1, 7, photo(height, width, 5)),
    ]

    def prepared(i):
        prompt, adapters, images, seed, image = cases[i]
        return engine.prepare(prompt, adapters=adapters, num_images=images, seed=seed, num_inference_steps=STEPS,
                              output_type="latent", task="edit", images=(image,))

    requests = [prepared(i) for i in range(len(cases))]
    assert all(r.params.reference_per_image for r in requests)
    assert len({r.batch_key() for r in requests}) == 1, "the worker would not pack these requests"
    together = engine.run(requests)
    for i, (prompt, adapters, images, seed, image) in enumerate(cases):
        assert together[i].timings.chunks == [4], "not one forward pass"
        alone = engine.run(prepared(i)).images
        assert (together[i].images - alone).abs().max().item() <= TOLERANCE
        given = Image.fromarray(fitted(np.asarray(image), height, width))
        theirs = plain_diffusers_reference(
            model_dir, {slot: (str(path), scale) for slot, (path, scale) in adapters.items()}, prompt=prompt,
            num_images=images, num_inference_steps=STEPS, guidance_scale=engine.defaults["guidance_scale"],
            height=height, width=width, seed=seed, pipeline_class=family.task_pipelines["edit"],
            task_arguments=family.task_arguments("edit", [given], None, None, 1))
        diff = (together[i].images - theirs).abs().max().item()
        assert diff <= TOLERANCE, f"kontext edit request {i}: packed vs plain diffusers differ by {diff}"
    # Each reference counted: the second request's photo given to the first gives other images.
    swapped = engine.run(engine.prepare(cases[0][0], adapters=cases[0][1], num_images=2, seed=11,
                                        num_inference_steps=STEPS, output_type="latent", task="edit",
                                        images=(cases[1][4],))).images
    assert (swapped - together[0].images).abs().max().item() > 1e-3
    flux2 = engine.rules.__class__(family_named("flux2"), engine.defaults, engine.limits, engine.rules.sizes, 16,
                                   sizes_only=False, tasks=("text-to-image", "edit"))
    assert not flux2.check_task(flux2.check("a cat"), "edit", 1, False, None).reference_per_image
