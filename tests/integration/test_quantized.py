"""A quantized base (``base_quantization``): the denoiser's Linear weights quantized once at
start-up with torchao, the adapters unfused LoRA branches on top, swapped per request without
compiling. The reference is plain diffusers with the SAME torchao quantization applied to the same
base denoiser, then ``load_lora_weights`` (unfused) + ``set_adapters``.

The tolerance: int8 weight-only quantization alone moves the quantized reference away from the
float32 reference by 1.2e-2..1.9e-2 (tiny Flux) and 3.3e-2..5.3e-2 (tiny SDXL), max |latent
difference| over these adapters (measured here and printed: what quantization itself costs). The
engine must reproduce torchao's quantized product and PEFT's unfused LoRA on it, so it gets the
float32 contract's tolerance (test_contract.py, 1e-4: compiled kernels reorder sums; measured
1e-6..1e-5), over 100 times under the quantization's own distance, and it is also asserted to be
under a tenth of that distance: an engine whose slots ran on a float32 base (or quantized twice)
could not pass."""

import warnings

import pytest
import torch

from hotlora import Engine
from hotlora.settings import EngineConfig
from hotlora.engine.quantize import weight_bytes
from hotlora.testing import random_lora, save_diffusers_lora

from ..helpers import TARGET_RANK, PackRequest, bank_layouts, engine_reference, fresh_pipeline, generate_batch, recompiles_are_errors, family_params

pytest.importorskip("torchao")

PROMPT = "a portrait of an astronaut, watercolor"
STEPS = 2
N = 2
TOLERANCE = 1e-4  # absolute, float32 latents, as test_contract.py; see the module docstring


def int8_base(pipeline):
    """What a diffusers user does to quantize the base: torchao's quantize_ on the denoiser."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    denoiser = pipeline.transformer if hasattr(pipeline, "transformer") else pipeline.unet
    quantize_(denoiser, Int8WeightOnlyConfig())


def reference(engine, model_dir, adapters, *, quantized=True, num_images=N, seed=0):
    with warnings.catch_warnings():
        # PEFT's torchao LoRA layer says it cannot merge; the reference never merges.
        warnings.filterwarnings("ignore", "TorchaoLoraLinear was instantiated without", UserWarning)
        return engine_reference(engine, model_dir, adapters, prompt=PROMPT, steps=STEPS, num_images=num_images,
                                seed=seed, prepare=int8_base if quantized else None)


def adapters_for(engine, family, tmp_path, count=2):
    linears = dict(engine.ceiling.modules)
    names = sorted(linears)
    pairs = []
    for k in range(count):
        identity = random_lora(linears, TARGET_RANK, seed=10 + k)
        style = random_lora(linears, 3, seed=20 + k, modules=names[: len(names) // 2])
        pairs.append({
            "identity": (save_diffusers_lora(tmp_path / f"{family}-id{k}", family, identity, rank=TARGET_RANK,
                                             alpha=TARGET_RANK), 0.8 + 0.3 * k),
            "style": (save_diffusers_lora(tmp_path / f"{family}-st{k}", family, style, rank=3, alpha=6), 0.5),
        })
    return pairs


def distance(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("family", family_params())
def test_compiled_int8_base_serves_adapters_in_turn_without_recompiling(family, tiny_models, tmp_path):
    model_dir = tiny_models[family]
    # rank_buckets=(): every request here holds a full-rank adapter (the full bucket); the default's
    # other two buckets would only triple the warm-up (CI time). Buckets: test_rank_buckets.py.
    engine = Engine.from_pretrained(model_dir, target_rank=TARGET_RANK, batch_size=N, compile=True,
                                    base_quantization="int8_weight_only", rank_buckets=())
    assert engine.compile_mode is not None  # compiled: torchao's int8 tensors trace under dynamo
    pairs = adapters_for(engine, family, tmp_path)
    with recompiles_are_errors():
        for adapters in (*pairs, pairs[0]):  # in turn, and back to the first
            ours = engine.generate(PROMPT, adapters=adapters, num_images=N, num_inference_steps=STEPS,
                                   seed=0, output_type="latent").images
            theirs = reference(engine, model_dir, adapters)
            full = reference(engine, model_dir, adapters, quantized=False)
            gap, quant = distance(ours, theirs), distance(theirs, full)
            print(f"{family}: engine vs quantized reference {gap:.2e}; quantized vs float32 reference {quant:.2e}")
            assert gap <= TOLERANCE, (gap, quant)
            assert gap <= quant / 10, (gap, quant)  # much closer to the quantized reference than to float32
    assert engine.recompiles == 0


@pytest.mark.parametrize("family", bank_layouts())
def test_compiled_mixed_batch_on_an_int8_base(family, tiny_models, tmp_path):
    """The banks wrap the quantized Linear like any other: two requests, different adapters, one
    compiled forward batch, no recompile, each equal to its own quantized reference."""
    model_dir = tiny_models[family]
    engine = Engine.from_pretrained(model_dir, target_rank=TARGET_RANK, batch_size=2, compile=True, mixed=True,
                                    base_quantization="int8_weight_only")
    first, second = adapters_for(engine, family, tmp_path)
    with recompiles_are_errors():
        results = generate_batch(engine, [PackRequest(PROMPT, first, seed=3), PackRequest(PROMPT, second, seed=4)],
                                 num_inference_steps=STEPS, output_type="latent")
    assert engine.recompiles == 0
    for result, adapters, seed in zip(results, (first, second), (3, 4)):
        theirs = reference(engine, model_dir, adapters, num_images=1, seed=seed)
        assert distance(result.images, theirs) <= TOLERANCE


def test_describe_reports_the_quantization_and_the_weight_bytes(tiny_models):
    model_dir = tiny_models["flux"]
    engine = Engine.from_pretrained(model_dir, target_rank=TARGET_RANK, batch_size=1, compile=False,
                                    base_quantization="int8_weight_only")
    described = engine.describe()
    full = weight_bytes(fresh_pipeline(model_dir).transformer)
    assert described["base_quantization"] == "int8_weight_only"
    # int8 Linear weights (+ one scale per row) against float32: well under half, over a quarter.
    assert full / 4 < described["denoiser_bytes"] < full / 2, (described["denoiser_bytes"], full)
    plain = Engine.from_pretrained(model_dir, target_rank=TARGET_RANK, batch_size=1, compile=False).describe()
    assert plain["base_quantization"] == "none" and plain["denoiser_bytes"] == full


def test_fused_mode_on_a_quantized_base_is_refused_and_the_quantization_is_fingerprinted():
    with pytest.raises(ValueError, match="fused mode .* base_quantization"):
        EngineConfig(adapter_mode="fused", base_quantization="int8_weight_only")
    with pytest.raises(ValueError, match="base_quantization must be one of"):
        EngineConfig(base_quantization="int4")
    # It changes the compiled graphs: a quantized engine never loads a float engine's compile artifacts.
    assert (EngineConfig(base_quantization="int8_weight_only").fingerprint("m", "flux")
            != EngineConfig().fingerprint("m", "flux"))


def test_float8_is_refused_off_cuda(tiny_models):
    with pytest.raises(ValueError, match="float8.*CUDA"):
        Engine.from_pretrained(tiny_models["flux"], base_quantization="float8", device="cpu", compile=False)
    # Built from a pipeline already loaded: the same start-up error, before anything is quantized.
    pipeline = fresh_pipeline(tiny_models["flux"])
    from hotlora.families import family_of_pipeline

    with pytest.raises(ValueError, match="float8.*CUDA"):
        Engine(pipeline, family_of_pipeline(pipeline), base_quantization="float8", compile=False)
    assert type(pipeline.transformer.proj_out.weight) is torch.nn.Parameter  # untouched


def test_an_already_quantized_denoiser_is_not_quantized_again(tiny_models):
    from hotlora.families import family_of_pipeline

    pipeline = fresh_pipeline(tiny_models["flux"])
    int8_base(pipeline)
    with pytest.raises(ValueError, match="already quantized"):
        Engine(pipeline, family_of_pipeline(pipeline), base_quantization="int8_weight_only", compile=False)
