"""Plain diffusers' answers for bench/full_size.py's requests, in one dtype, in its own process.
The pipeline class is the one the model's ``model_index.json`` names (SDXL's, SD1.5's or Sana's).

Usage (bench/full_size.py runs it): full_size_reference.py MODEL ADAPTERS_JSON DTYPE STEPS NUM_IMAGES WxH OUT.json
(ADAPTERS_JSON: {request label: [adapter file, slot]}, the two adapters in the order served).

Two phases so that float32 fits a 12 GB process (the whole float32 SDXL pipeline is 13.9 GB, Sana's
17.5 GB):
1. the text encoders alone (denoiser and VAE ``None``): the prompt embeddings with no adapter and,
   for the SD families, with the kohya adapter's text-encoder LoRA (loaded by diffusers' own
   ``lora_state_dict`` and ``load_lora_into_text_encoder``, the calls ``load_lora_weights`` makes,
   unfused; Sana's LoRA has no text-encoder part);
2. the denoiser and VAE (text encoders ``None``): ``load_lora_weights`` for the denoiser part,
   unfused, ``set_adapters`` with the request's scale, one pipeline call per request with those
   embeddings.
The arithmetic is exactly what one pipeline call does; only the order of
loading differs. Writes the PNG bytes (hex), each pack's seconds (the pipeline call from the
embeddings), each request's prompt-encoding seconds and the process's peak memory.
"""

from __future__ import annotations

import inspect
import io
import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from full_size import GUIDANCE, PROMPT, SEED  # one definition of the requests

# What each pipeline's encode_prompt returns, as the keyword arguments its __call__ takes them by;
# the text encoders it loads LoRA into (Sana: none); its denoiser.
EMBEDDINGS = {"StableDiffusionXLPipeline": ("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds",
                                            "negative_pooled_prompt_embeds"),
              "StableDiffusionPipeline": ("prompt_embeds", "negative_prompt_embeds"),
              "SanaPipeline": ("prompt_embeds", "prompt_attention_mask", "negative_prompt_embeds",
                               "negative_prompt_attention_mask")}
TEXT_ENCODERS = {"StableDiffusionXLPipeline": ("text_encoder", "text_encoder_2"),
                 "StableDiffusionPipeline": ("text_encoder",), "SanaPipeline": ("text_encoder",)}
TEXT_LORA = ("StableDiffusionXLPipeline", "StableDiffusionPipeline")
# Beside the embeddings: Sana's default negative prompt "" is in them already (phase 1), and its
# __call__ refuses both.
CALL_ARGUMENTS = {"SanaPipeline": {"negative_prompt": None}}


def family_of(model: Path):
    """hotlora's family of the model: its denoiser's name and the arguments every call passes
    (``call_arguments``: the guidance, and what the family fixes, e.g. Sana's resolution binning off),
    so plain diffusers runs the very request the server runs."""
    from hotlora.families import family_of_model_index

    return family_of_model_index(json.loads((model / "model_index.json").read_text()))


def encode_arguments(cls) -> dict:
    """What ``__call__`` passes encode_prompt beyond the prompt, where it differs from encode_prompt's
    own default: Sana's ``complex_human_instruction`` (the instructions it prepends to every prompt)."""
    if cls.__name__ != "SanaPipeline":
        return {}
    return {"complex_human_instruction": inspect.signature(cls.__call__).parameters["complex_human_instruction"].default}


def pipeline_class(model: Path):
    import diffusers

    name = json.loads((model / "model_index.json").read_text())["_class_name"]
    if name not in EMBEDDINGS:
        raise SystemExit(f"{model}: a {name}; this reference runs {', '.join(EMBEDDINGS)}")
    return getattr(diffusers, name)


def split_kohya(path: Path, out: Path) -> tuple[Path, Path]:
    """The kohya file's text-encoder keys and U-Net keys as two kohya files (header kept)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    parts = {}
    for name, keep in (("te", lambda k: k.startswith("lora_te")), ("unet", lambda k: k.startswith("lora_unet"))):
        parts[name] = out / f"kohya-{name}.safetensors"
        save_file({k: v for k, v in tensors.items() if keep(k)}, str(parts[name]), metadata=meta)
    return parts["te"], parts["unet"]


def prompt_embeddings(model: Path, kohya_te: Path | None, scale: float,
                      dtype: torch.dtype) -> tuple[dict[str, tuple], dict[str, float]]:
    """Phase 1: {"none": embeds, "kohya": embeds (the SD families)}, each encode_prompt's tensors, and
    the seconds each encoding takes (the second call of two: the server's pipeline call encodes too, warm)."""
    from diffusers import UNet2DConditionModel
    from diffusers.configuration_utils import FrozenDict

    cls = pipeline_class(model)
    pipe = cls.from_pretrained(str(model), **{family_of(model).denoiser: None}, vae=None, torch_dtype=dtype,
                               local_files_only=True)
    seconds = {}

    def encode(label: str):
        for _ in range(2):
            began = time.perf_counter()
            embeds = pipe.encode_prompt(PROMPT, device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=True,
                                        **encode_arguments(cls))
            seconds[label] = time.perf_counter() - began
        return embeds

    with torch.no_grad():
        out = {"none": encode("none")}
        if kohya_te is None:
            return out, seconds
        unet_config = FrozenDict(UNet2DConditionModel.load_config(str(model / "unet")))
        sd, alphas, meta = pipe.lora_state_dict(str(kohya_te), unet_config=unet_config, return_lora_metadata=True)
        for prefix in TEXT_ENCODERS[cls.__name__]:
            pipe.load_lora_into_text_encoder(sd, network_alphas=alphas, text_encoder=getattr(pipe, prefix), prefix=prefix,
                                             adapter_name="kohya", metadata=meta, _pipeline=pipe)
        pipe.set_adapters(["kohya"], [scale])
        out["kohya"] = encode("kohya")
    return out, seconds


def main() -> None:
    from full_size import SCALES

    model, adapters, dtype_name, steps, num_images, size, out = sys.argv[1:8]
    model, dtype = Path(model), getattr(torch, dtype_name)
    requests = {"none": None, **{label: (Path(path), slot) for label, (path, slot) in json.loads(adapters).items()}}
    width, height = (int(x) for x in size.split("x"))
    cls = pipeline_class(model)
    began = time.perf_counter()
    files = {label: adapter[0] for label, adapter in requests.items() if adapter is not None}
    kohya_te, kohya_scale = None, 1.0
    if cls.__name__ in TEXT_LORA:  # the kohya file's text-encoder half goes in with phase 1
        kohya_scale = SCALES[requests["kohya"][1]]
        kohya_te, files["kohya"] = split_kohya(files["kohya"], Path(out).parent)
    embeddings, encode_s = prompt_embeddings(model, kohya_te, kohya_scale, dtype)
    text_s = time.perf_counter() - began
    began = time.perf_counter()
    pipe = cls.from_pretrained(str(model), **dict.fromkeys(TEXT_ENCODERS[cls.__name__]), torch_dtype=dtype,
                               local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    load_s = time.perf_counter() - began
    rows = []
    for label, adapter in requests.items():
        if adapter is not None:
            if pipe.get_list_adapters():
                pipe.delete_adapters(pipe.get_active_adapters())
            began = time.perf_counter()
            pipe.load_lora_weights(str(files[label]), adapter_name=label)
            pipe.set_adapters([label], [SCALES[adapter[1]]])
            adapter_load_s = time.perf_counter() - began
        embeds = embeddings.get(label, embeddings["none"])
        generators = [torch.Generator().manual_seed(SEED + i) for i in range(int(num_images))]
        began = time.perf_counter()
        with torch.no_grad():
            images = pipe(**dict(zip(EMBEDDINGS[cls.__name__], embeds, strict=True)),
                          num_images_per_prompt=int(num_images), generator=generators,
                          num_inference_steps=int(steps), height=height, width=width,
                          **family_of(model).call_arguments(GUIDANCE), **CALL_ARGUMENTS.get(cls.__name__, {})).images
        pack_s = time.perf_counter() - began
        pngs = []
        for image in images:
            buffer = io.BytesIO()
            image.save(buffer, format="png")
            pngs.append(buffer.getvalue().hex())
        rows.append({"label": label, "pack_s": round(pack_s, 2), "pngs_hex": pngs,
                     "encode_s": round(encode_s.get(label, encode_s["none"]), 2),
                     "adapter_load_s": round(adapter_load_s, 2) if adapter else 0.0})
        print(f"reference {dtype_name} {label}: pack {pack_s:.1f}s", flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    Path(out).write_text(json.dumps({"dtype": dtype_name, "text_phase_s": round(text_s, 1), "load_s": round(load_s, 1),
                                     "peak_rss_gib": round(peak, 2), "requests": rows}))


if __name__ == "__main__":
    main()
