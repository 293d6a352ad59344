"""`hotlora plan` on the meta device: full-size Flux counted exactly, no weights allocated."""

import json

import pytest
import torch

from hotlora.cli import main
from hotlora.settings import EngineConfig
from hotlora.engine.plan import ACCELERATORS, parse_bytes, plan_memory
from hotlora.engine.plan.models import build_parts, find_model

FLUX_DEV_TRANSFORMER_PARAMETERS = 11_901_408_320  # "12B" on the model card


def part(plan, name):
    return next(p for p in plan.parts if p.name == name)


@pytest.fixture(scope="module")
def flux_dev_linears():
    parts = build_parts(find_model("flux-dev"), torch.bfloat16)
    return {n: (m.in_features, m.out_features) for n, m in parts.transformer.named_modules()
            if isinstance(m, torch.nn.Linear)}


def test_flux_dev_transformer_has_the_published_parameter_count():
    parts = build_parts(find_model("flux-dev"), torch.bfloat16)
    assert parts.transformer.device.type == "meta"
    assert sum(p.numel() for p in parts.transformer.parameters()) == FLUX_DEV_TRANSFORMER_PARAMETERS
    assert f"{FLUX_DEV_TRANSFORMER_PARAMETERS / 1e9:.1f}B" == "11.9B"


def test_slots_are_the_engine_buffers_at_every_rank(flux_dev_linears):
    """The slot bytes come from the engine's SlotsWriter on meta tensors; checked here against the
    layout's arithmetic: every Linear, 2 slots x rank rows of (in + out) values, bf16."""
    for rank in (16, 128):
        plan = plan_memory("flux-dev", EngineConfig(target_rank=rank), device="cuda",
                           budget=ACCELERATORS["h100-80gb"], budget_name="h100-80gb")
        assert part(plan, "transformer").bytes == 2 * FLUX_DEV_TRANSFORMER_PARAMETERS
        expected = 2 * rank * sum(i + o for i, o in flux_dev_linears.values()) * 2
        assert part(plan, "slots (LoRA buffers)").bytes == expected
        assert plan.settings["ceiling_modules"] == len(flux_dev_linears) == 504


def test_adapters_in_use_are_one_float16_copy_and_one_packed_copy_per_slot_at_the_target_rank():
    """The estimate of what serving adds: per slot, an adapter at the target rank on every ceiling
    Linear in the store (float16, 2 bytes) and packed (the slots' dtype). Host memory beside a GPU
    (not counted against the card), the same memory on a CPU (counted)."""
    on_gpu = plan_memory("flux-dev", EngineConfig(target_rank=64), device="cuda", budget=ACCELERATORS["h100-80gb"])
    slots, estimate = part(on_gpu, "slots (LoRA buffers)"), part(on_gpu, "adapters in use (estimate)")
    assert estimate.bytes == 2 * slots.bytes and estimate.where == "host"  # bf16 slots: 2 + 2 bytes an element
    assert on_gpu.static_bytes == sum(p.bytes for p in on_gpu.parts if p is not estimate and p.where == "device")
    on_cpu = plan_memory("flux-dev", EngineConfig(target_rank=64, dtype="float32"), device="cpu", budget=2**40)
    slots, estimate = part(on_cpu, "slots (LoRA buffers)"), part(on_cpu, "adapters in use (estimate)")
    assert estimate.bytes * 2 == slots.bytes * 3 and estimate.where == "device"  # float32 slots: 2 + 4 bytes
    fused = plan_memory("flux-dev", EngineConfig(adapter_mode="fused"), device="cuda", budget=ACCELERATORS["h200-141gb"])
    assert not any(p.name == "adapters in use (estimate)" for p in fused.parts)


def test_a_plan_that_fits_only_without_the_estimate_fits_tight_and_is_not_refused():
    """On a CPU the estimate is counted in the totals, but the start-up check refuses only what the
    engine itself needs: servers whose adapters are below the target rank must still start."""
    config = EngineConfig(target_rank=64, sizes="512x512", batch_size=1)
    unbounded = plan_memory("flux-dev", config, device="cpu", budget=2**50)
    estimate = part(unbounded, "adapters in use (estimate)").bytes
    assert unbounded.required_bytes == unbounded.peak_bytes - estimate
    tight = plan_memory("flux-dev", config, device="cpu", budget=unbounded.peak_bytes - estimate // 2)
    assert tight.fits is True and tight.verdict.startswith("FITS, TIGHT") and "--target-rank" in tight.verdict
    refused = plan_memory("flux-dev", config, device="cpu", budget=unbounded.required_bytes - 1)
    assert refused.fits is False and "DOES NOT FIT" in refused.verdict
    roomy = plan_memory("flux-dev", config, device="cpu", budget=unbounded.peak_bytes)
    assert roomy.verdict.startswith("FITS: peak")


def test_a_server_keeps_its_spare_engine_process_only_where_it_fits_beside_the_engine():
    """``hotlora serve``'s spare engine process (no model, its imports done) is host memory: counted
    on a CPU, beside the card on a GPU. Where the engine fits only without it, the server (and
    ``hotlora plan``) goes without one, saying so; what does not fit alone is refused as before."""
    from hotlora.engine.plan.budget import SPARE_PROCESS_BYTES
    from hotlora.server.run import check_memory, plan_serving
    from hotlora.settings import ServerConfig

    config = EngineConfig(target_rank=64, sizes="512x512", batch_size=1)
    alone = plan_memory("flux-dev", config, device="cpu", budget=2**50)
    with_spare = plan_memory("flux-dev", config, device="cpu", budget=2**50, spare_process=True)
    assert with_spare.required_bytes - alone.required_bytes == SPARE_PROCESS_BYTES
    on_gpu = plan_memory("flux-dev", EngineConfig(target_rank=64), device="cuda", spare_process=True)
    assert part(on_gpu, "spare engine process").where == "host"

    def serving(budget):
        return plan_serving("flux-dev", config, True, budget=budget, budget_name="test", device="cpu")

    plan, spare = serving(with_spare.required_bytes)
    assert spare and plan.fits and part(plan, "spare engine process")
    plan, spare = serving(with_spare.required_bytes - 1)
    assert not spare and plan.fits and "no spare engine process" in plan.text()
    plan, spare = serving(alone.required_bytes - 1)
    assert plan.fits is False and "DOES NOT FIT" in plan.verdict
    server = dict(model="flux-dev", target_rank=64, sizes="512x512", batch_size=1, device="cpu")
    assert check_memory(ServerConfig(**server, memory=str(with_spare.required_bytes)))[1] is True
    assert check_memory(ServerConfig(**server, memory=str(with_spare.required_bytes - 1)))[1] is False
    assert check_memory(ServerConfig(**server, memory="off", engine_spare_process=False))[1] is False


def test_fused_pristine_copy_is_every_linear_weight_and_goes_to_the_host_when_it_does_not_fit(flux_dev_linears):
    transformer = build_parts(find_model("flux-dev"), torch.bfloat16).transformer
    bias_bytes = sum(m.bias.numel() for m in transformer.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None)
    # Every Linear's weight, and its bias (a LoRA bias merges into it: lightx2v's .diff_b), bf16.
    linear_bytes = (sum(i * o for i, o in flux_dev_linears.values()) + bias_bytes) * 2
    assert bias_bytes > 0
    on_h200 = plan_memory("flux-dev", EngineConfig(adapter_mode="fused"), device="cuda",
                          budget=ACCELERATORS["h200-141gb"], budget_name="h200")
    assert part(on_h200, "fused pristine copy").bytes == linear_bytes
    assert part(on_h200, "fused pristine copy").where == "device"
    # 24 GB of weights + 22 GB pristine do not leave a quarter of a 48 GB card free: pinned host memory.
    on_l40s = plan_memory("flux-dev", EngineConfig(adapter_mode="fused"), device="cuda",
                          budget=ACCELERATORS["l40s-48gb"], budget_name="l40s")
    assert part(on_l40s, "fused pristine copy").where == "host"
    assert on_l40s.static_bytes < on_h200.static_bytes


def test_int8_base_stores_about_half_the_transformer():
    plain = plan_memory("flux-dev", EngineConfig(), device="cuda", budget=ACCELERATORS["h100-80gb"])
    int8 = plan_memory("flux-dev", EngineConfig(base_quantization="int8_weight_only"), device="cuda",
                       budget=ACCELERATORS["h100-80gb"])
    ratio = part(int8, "transformer").bytes / part(plain, "transformer").bytes
    assert 0.5 <= ratio < 0.52  # int8 weights plus a scale per row; biases and norms stay bf16


def test_activations_grow_with_the_chunk_and_the_largest_fitting_chunk_is_the_boundary():
    plan = plan_memory("flux-dev", EngineConfig(sizes="1024x1024,1024x1536"), device="cuda",
                       budget=ACCELERATORS["h100-80gb"], budget_name="h100-80gb")
    square, tall = plan.sizes
    assert tall.activation_bytes > square.activation_bytes > 0
    assert tall.largest_chunk < square.largest_chunk
    # The boundary: one more image than the largest chunk is over the budget.
    one_more = plan_memory("flux-dev", EngineConfig(sizes="1024x1536", batch_size=tall.largest_chunk + 1),
                           device="cuda", budget=ACCELERATORS["h100-80gb"])
    assert one_more.fits is False and "DOES NOT FIT" in one_more.verdict
    just = plan_memory("flux-dev", EngineConfig(sizes="1024x1536", batch_size=tall.largest_chunk),
                       device="cuda", budget=ACCELERATORS["h100-80gb"])
    assert just.fits is True and just.verdict.startswith("FITS")


def test_cli_plan_json(capsys):
    status = main(["plan", "flux-dev", "--gpu", "h100-80gb", "--json", "--target-rank", "64",
                   "--sizes", "1024x1024", "--max-batch-size", "6"])
    out = json.loads(capsys.readouterr().out)
    assert status == (0 if out["fits"] else 1)
    assert out["device"] == "cuda" and out["dtype"] == "bfloat16" and out["budget_bytes"] == 80 * 10**9
    assert out["settings"]["denoiser_parameters"] == FLUX_DEV_TRANSFORMER_PARAMETERS
    assert {p["name"] for p in out["parts"]} >= {"transformer", "text_encoder", "text_encoder_2", "vae"}
    assert out["sizes"][0]["size"] == "1024x1024" and out["sizes"][0]["largest_chunk"] >= 1


def test_cli_plan_refuses_with_status_1_when_it_does_not_fit(capsys):
    assert main(["plan", "flux-dev", "--memory", "16GiB"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_memory_sizes_parse():
    assert parse_bytes("24GiB") == 24 * 2**30 and parse_bytes("80GB") == 80 * 10**9 and parse_bytes(512) == 512
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_a_published_models_hub_id_is_planned_before_it_is_downloaded(tmp_path, monkeypatch):
    """A Hub id not in the local cache is planned from hotlora's copy of the published configuration
    whose ``HUB_ID`` it is (the Hub resolves ids case-insensitively, so does this), as a server checks
    its plan before it fetches weights; any other id not in the cache is still refused."""
    import huggingface_hub.constants

    from hotlora.engine.pipeline import ModelLoadError

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache
    spec = find_model("black-forest-labs/FLUX.2-klein-4B")
    assert (spec.name, spec.family.name) == ("flux2-klein-4b", "flux2-klein")
    assert find_model("qwen/qwen-image").name == "qwen-image"
    with pytest.raises(ModelLoadError, match="nor a Hub id"):
        find_model("someone/not-a-published-model")
