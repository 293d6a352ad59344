"""Write a converted adapter back out in diffusers' layout, loadable by plain ``load_lora_weights``."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from hotlora.adapters.format.embeddings import EMBEDDINGS_FILE
from hotlora.families import family_named
from hotlora.adapters.format.convert import Adapter


def save_as_diffusers(adapter: Adapter, out_dir: str | Path) -> Path:
    """Each module's ``alpha / r`` is folded into B and saved with ``alpha == r``: every loader
    then applies a scaling of exactly 1.0 and gets the same update, whatever it assumes about alphas.
    Text-encoder LoRA goes into the same file under its encoder's prefix, as diffusers' training
    scripts save it; pivotal-tuning embeddings into ``embeddings.safetensors`` beside it (the
    name the Hugging Face inference API reads), under the key names the trainers write."""
    family = family_named(adapter.family)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Another expert's modules (Wan 2.2's ``transformer_2.<module>``) are that expert's part, under its prefix.
    experts = {other: {m[len(other) + 1:]: w for m, w in adapter.modules.items() if m.startswith(f"{other}.")}
               for other in family.other_denoisers}
    experts = {other: modules for other, modules in experts.items() if modules}
    own = {m: w for m, w in adapter.modules.items() if not m.startswith(tuple(f"{o}." for o in experts))}
    parts = {family.denoiser: own, **experts, **adapter.text_modules}
    packed = {part: _layers(modules) for part, modules in parts.items() if modules}
    if experts:  # the mixin's save_lora_weights takes no second expert: its own packing, one prefix each
        family.pipeline_type._save_lora_weights(str(out_dir), lora_layers={p: lm[0] for p, lm in packed.items()},
                                                lora_metadata={p: lm[1] for p, lm in packed.items()})
    else:
        family.pipeline_type.save_lora_weights(str(out_dir), **{
            f"{part}_lora_{kind}": value for part, (layers, metadata) in packed.items()
            for kind, value in (("layers", layers), ("adapter_metadata", metadata))})
    if adapter.embeddings is not None:
        from safetensors.torch import save_file

        names = {}
        for key, encoder in family.embedding_keys:
            names.setdefault(encoder, key)  # the first name is the trainers' (clip_l, clip_g, t5)
        save_file({names[encoder]: v.detach().cpu().contiguous() for encoder, v in adapter.embeddings.vectors.items()},
                  str(out_dir / EMBEDDINGS_FILE), metadata={"tokens": json.dumps(list(adapter.embeddings.tokens))})
    return out_dir / "pytorch_lora_weights.safetensors"


def pair_experts(high: Adapter, low: Adapter) -> Adapter:
    """One adapter of a two-expert model (Wan 2.2 A14B) from the two files diffusers loads apart:
    ``high`` for the denoiser (``transformer``), ``low`` for the family's second expert (what
    ``load_lora_weights(low, load_into_transformer_2=True)`` loads), its modules renamed
    ``transformer_2.<module>``. Both converted already, so each may be in any layout diffusers reads."""
    import hashlib

    from hotlora.errors import AdapterFormatError

    family = family_named(high.family)
    if low.family != high.family or not family.other_denoisers:
        raise AdapterFormatError(f"{high.name} ({high.family}) and {low.name} ({low.family}): a pair is two LoRAs of one "
                                 "family whose pipeline has a second expert (wan)")
    other = family.other_denoisers[0]
    taken = [m for part in (high, low) for m in part.modules if m.startswith(f"{other}.")]
    if taken or low.text_modules or low.embeddings is not None:
        raise AdapterFormatError(f"{low.name}: not one expert's LoRA (it has {other} modules, text-encoder LoRA or "
                                 "embeddings)")
    digest = hashlib.sha256(f"{high.sha256}:{low.sha256}".encode()).hexdigest()
    return Adapter(name=f"{high.name} + {low.name}", family=high.family, layout=high.layout,
                   modules={**high.modules, **{f"{other}.{m}": w for m, w in low.modules.items()}}, sha256=digest,
                   base_model=high.base_model or low.base_model, text_modules=dict(high.text_modules),
                   embeddings=high.embeddings)


def _layers(modules) -> tuple[dict, dict]:
    layers, ranks = {}, {}
    for module, w in modules.items():
        # contiguous: converters may hand out strided views.
        layers[f"{module}.lora_A.weight"] = w.down.detach().cpu().clone().contiguous()
        layers[f"{module}.lora_B.weight"] = (w.up.detach().cpu().float() * w.scaling).to(w.up.dtype).contiguous()
        if w.bias is not None:  # scaled like B (PEFT's lora_B.bias): the same fold
            layers[f"{module}.lora_B.bias"] = (w.bias.detach().cpu().float() * w.scaling).to(w.bias.dtype).contiguous()
        ranks[module] = w.rank
    common = Counter(ranks.values()).most_common(1)[0][0]
    pattern = {f"^{m}$": r for m, r in ranks.items() if r != common}
    metadata = {"r": common, "lora_alpha": common, "rank_pattern": pattern, "alpha_pattern": dict(pattern),
                "target_modules": sorted(ranks)}
    if any(w.bias is not None for w in modules.values()):
        metadata["lora_bias"] = True  # what makes load_lora_weights give its LoRA layers a bias
    return layers, metadata


def describe(adapter: Adapter) -> dict:
    ranks = Counter(w.rank for w in adapter.modules.values())
    scalings = sorted({round(w.scaling, 6) for w in adapter.modules.values()})
    return {
        "name": adapter.name, "family": adapter.family, "layout": adapter.layout, "rank": adapter.rank,
        "ranks": {str(r): n for r, n in sorted(ranks.items())}, "alpha_over_rank": scalings[:8],
        "modules": len(adapter.modules), "targets": sorted(adapter.modules)[:20], "base_model": adapter.base_model,
        "biases": len(adapter.biased),  # modules whose update carries a LoRA bias (lightx2v's .diff_b)
        "bytes": adapter.nbytes, "sha256": adapter.sha256, "skipped_keys": len(adapter.skipped_keys),
        "text_encoders": {te: {"modules": len(mods), "rank": max(w.rank for w in mods.values())}
                          for te, mods in adapter.text_modules.items()},
        "embeddings": None if adapter.embeddings is None else {
            "tokens": list(adapter.embeddings.tokens),
            "text_encoders": {te: list(v.shape) for te, v in adapter.embeddings.vectors.items()}},
    }
