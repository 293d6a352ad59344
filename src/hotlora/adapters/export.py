"""Write a converted adapter back out in diffusers' layout, loadable by plain ``load_lora_weights``."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from hotlora.adapters.families import family_named, pipeline_class
from hotlora.adapters.formats import Adapter


def save_as_diffusers(adapter: Adapter, out_dir: str | Path) -> Path:
    """Each module's ``alpha / r`` is folded into B and saved with ``alpha == r``: every loader
    then applies a scaling of exactly 1.0 and gets the same update, whatever it assumes about alphas."""
    family = family_named(adapter.family)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    layers = {}
    ranks = {}
    for module, w in adapter.modules.items():
        # contiguous: converters may hand out strided views.
        layers[f"{module}.lora_A.weight"] = w.down.detach().cpu().clone().contiguous()
        layers[f"{module}.lora_B.weight"] = (w.up.detach().cpu().float() * w.scaling).to(w.up.dtype).contiguous()
        ranks[module] = w.rank
    common = Counter(ranks.values()).most_common(1)[0][0]
    pattern = {f"^{m}$": r for m, r in ranks.items() if r != common}
    metadata = {"r": common, "lora_alpha": common, "rank_pattern": pattern, "alpha_pattern": dict(pattern),
                "target_modules": sorted(ranks)}
    pipeline_class(family).save_lora_weights(
        str(out_dir), **{f"{family.denoiser}_lora_layers": layers, f"{family.denoiser}_lora_adapter_metadata": metadata}
    )
    return out_dir / "pytorch_lora_weights.safetensors"


def describe(adapter: Adapter) -> dict:
    ranks = Counter(w.rank for w in adapter.modules.values())
    scalings = sorted({round(w.scaling, 6) for w in adapter.modules.values()})
    return {
        "name": adapter.name, "family": adapter.family, "layout": adapter.layout, "rank": adapter.rank,
        "ranks": {str(r): n for r, n in sorted(ranks.items())}, "alpha_over_rank": scalings[:8],
        "modules": len(adapter.modules), "targets": sorted(adapter.modules)[:20], "base_model": adapter.base_model,
        "bytes": adapter.nbytes, "sha256": adapter.sha256, "skipped_keys": len(adapter.skipped_keys),
    }
