r"""Read a LoRA in any layout diffusers understands and turn it into one canonical form.

The canonical form is what the engine copies into its slots: per denoiser module a down matrix
``A [r, in]``, an up matrix ``B [out, r]`` and the scaling PEFT would apply (``alpha / r``); the
same per text-encoder module for the text encoders diffusers loads LoRA into, and the
pivotal-tuning embeddings found beside the weights (``embeddings``).

Conversion is diffusers' own: the pipeline class's ``lora_state_dict`` converts kohya, XLabs and
the other community layouts, and ``_create_lora_config`` derives the exact ``LoraConfig`` (ranks,
alphas, patterns) that ``load_lora_weights`` would build. Mirroring those calls, instead of
re-deriving alphas, is what makes a hot-swapped slot equal to a fresh ``load_lora_weights``.

Not trusted: the config's ``rank_pattern`` / ``alpha_pattern`` keys come from the file, and PEFT
runs them as regexes (``get_pattern_key``), where ``((\w+)+)+Q`` blocks the process with the GIL
held. Only keys that are module names are accepted, and they are matched by plain string
comparison that gives what PEFT's regex gives for such keys (``lora_config.Patterns``). Each module's rank is
its tensors' rank; a config that declares another one is refused, as ``load_lora_weights`` fails
on it. ``target_modules`` is never used: the modules are the ones the weights name.

Written here by hand, because no library does it: the PEFT on-disk layout
(``base_model.model.*`` + ``adapter_config.json``), which Flux's ``lora_state_dict`` mistakes for
another format and fails on with a ``KeyError``.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Mapping

import torch

from hotlora.adapters.format.embeddings import Embeddings, parse_embeddings
from hotlora.families import ModelFamily
from hotlora.families.base import PEFT_PREFIX
from hotlora.families.recognize import foreign_note
from hotlora.adapters.format.loha import LAYOUT as LOHA_LAYOUT, is_loha, loha_as_lora
from hotlora.adapters.format.lokr import LAYOUT as LOKR_LAYOUT, is_lokr, lokr_modules
from hotlora.adapters.format.lora_config import MAX_NAME_CHARS, LoraWeights, module_weights  # LoraWeights: re-exported
from hotlora.adapters.format.files import ReadLimits, declared_base_model, hash_state_dict, read_files
from hotlora.errors import AdapterFormatError

log = logging.getLogger(__name__)

# Bumped whenever conversion changes what an adapter file turns into: the store keys converted
# entries by it (and by hotlora's version), so a fixed converter never serves old conversions.
# 4: text-encoder LoRA and pivotal-tuning embeddings kept (they were skipped)
# 5: another expert's keys (Wan 2.2's transformer_2.*) kept as its modules (they were skipped)
# 6: the inference defaults a file declares kept (``Adapter.declared``)
# 7: Wan's musubi-tuner files read through diffusers' ComfyUI-name converter (subsets of the blocks'
#    Linears and alpha-less files load), lightx2v's non-zero ``.diff*`` patches refused (``Wan.prepare_raw_lora``)
# 8: LyCORIS LoHa files read (as their exact low-rank form; they were refused)
# 9: LoRA biases kept (``lora_B.bias``, lightx2v's ``.diff_b``; they were refused)
# 10: Krea 2's ai-toolkit files (original names under PEFT's prefix) handed to diffusers' converter
CONVERTER_VERSION = 10

# Module names as diffusers models spell them; LoRA keys naming anything else are refused.
# "-" too: Z-Image names its patch embedder and final layer by patch sizes ("all_x_embedder.2-1").
MODULE_NAME = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")
# T5 LoRA keys (sd-scripts' ``lora_te3_``, ComfyUI's ``text_encoders.t5xxl.``) that diffusers' Flux
# converters drop without a trace; listed with the skipped keys so the caller learns they are not served.
DROPPED_T5 = ("lora_te3_", "text_encoders.t5xxl.")


@dataclass
class Adapter:
    """A LoRA for one denoiser, converted once, ready to be validated and copied into a slot."""

    name: str
    family: str
    layout: str  # diffusers | peft | kohya | xlabs | lycoris-lokr | lycoris-loha
    modules: dict[str, LoraWeights]  # the denoiser's
    sha256: str
    base_model: str | None = None
    skipped_keys: list[str] = field(default_factory=list)  # keys no served model part takes (Flux's T5 LoRA)
    # Text-encoder LoRA: text encoder (pipeline attribute, e.g. "text_encoder_2") -> module -> weights,
    # module names as in the text encoder (transformers' CLIP without its old "text_model." level).
    text_modules: dict[str, dict[str, LoraWeights]] = field(default_factory=dict)
    embeddings: Embeddings | None = None  # pivotal-tuning token vectors trained with the LoRA
    # Inference defaults the file declares (``adapters.defaults``: num_inference_steps,
    # guidance_scale); a request that leaves them open runs at them. Not in ``key``: they change
    # what a request asks for, never what the slot holds.
    declared: dict = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return max((w.rank for w in self.modules.values()), default=0)

    @property
    def biased(self) -> list[str]:
        """The denoiser modules whose update carries a bias (lightx2v's ``.diff_b``)."""
        return [m for m, w in self.modules.items() if w.bias is not None]

    @property
    def text_parts(self) -> bool:
        """Whether the adapter changes a text encoder (LoRA there, or embeddings)."""
        return bool(self.text_modules) or self.embeddings is not None

    @cached_property
    def key(self) -> tuple:
        """What the adapter is, for memos and side tables: the weights' hash plus what sits beside
        them (alphas, declared base model, embeddings and their token names). Computed once:
        adapters are not changed once made."""
        text = tuple(sorted((te, m, w.scaling) for te, mods in self.text_modules.items() for m, w in mods.items()))
        embeddings = (self.embeddings.sha256, self.embeddings.tokens) if self.embeddings is not None else None
        return (self.sha256, self.family, self.base_model,
                hash(tuple(sorted((m, w.scaling) for m, w in self.modules.items()))), hash(text), embeddings)

    @property
    def nbytes(self) -> int:
        text = sum(w.down.nbytes + w.up.nbytes for mods in self.text_modules.values() for w in mods.values())
        return (sum(w.down.nbytes + w.up.nbytes + (w.bias.nbytes if w.bias is not None else 0)
                    for w in self.modules.values()) + text
                + (self.embeddings.nbytes if self.embeddings is not None else 0))


def load_adapter(
    source: str | os.PathLike | Mapping[str, torch.Tensor],
    family: ModelFamily,
    *,
    name: str | None = None,
    denoiser_config: Mapping | None = None,
    limits: ReadLimits = ReadLimits(),
) -> Adapter:
    """Read ``source`` (a weights file, a directory, or a state dict) into an :class:`Adapter`.

    ``denoiser_config``: what the family's converter needs of the served denoiser
    (``ModelFamily.converter_config``; SDXL's kohya files map SGM block numbers with the U-Net's config).
    """
    if isinstance(source, Mapping):
        raw, file_metadata, extra, digest = dict(source), None, {}, hash_state_dict(source)
        label = name or "<state dict>"
    else:
        path = Path(source)
        label = name or str(path)
        raw, file_metadata, extra, digest = read_files(path, limits, label)
    adapter = _canonicalize(raw, file_metadata, extra, family, label, digest, denoiser_config)
    if "embeddings" in extra:
        tensors, tokens = extra["embeddings"]
        adapter.embeddings = parse_embeddings(tensors, family, label, tokens)
    return adapter


def detect_layout(keys, family: ModelFamily | None = None) -> str:
    keys = list(keys)
    if any(k.startswith(PEFT_PREFIX) for k in keys):
        # A trainer's own names under PEFT's prefix (ai-toolkit's Krea 2 files) are diffusers' converter's to read.
        return "diffusers" if family is not None and family.converter_reads_peft_prefix(keys) else "peft"
    if any(k.startswith(("lora_unet_", "lora_te")) or ".lora_down." in k for k in keys):
        return "kohya"
    if any(".processor." in k for k in keys):
        return "xlabs"
    return "diffusers"


def _canonicalize(raw, file_metadata, extra, family: ModelFamily, label, digest, denoiser_config) -> Adapter:
    bad = [k for k, v in raw.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise AdapterFormatError(f"{label}: entries that are not tensors: {', '.join(sorted(bad)[:5])}")
    peft_config = extra.get("peft_config")
    loha = is_loha(raw)
    if loha:  # LoHa -> the same modules as exact LoRA factors, scales folded in: read as a LoRA from here on
        raw, declared_config, peft_config = loha_as_lora(raw, label, peft_config), peft_config, None
    layout = detect_layout(raw, family)
    prefix = family.denoiser
    metadata = file_metadata
    if layout == "peft":
        # PEFT saves keys relative to the wrapped model and the LoraConfig beside them.
        raw = {f"{prefix}.{k.removeprefix(PEFT_PREFIX)}": v for k, v in raw.items()}
        if peft_config is not None:
            metadata = {f"{prefix}.{k}": v for k, v in _lora_config_fields(peft_config).items()}

    raw, experts = _split_experts(raw, metadata, family, label, denoiser_config)
    if raw or not experts:
        state_dict, network_alphas, metadata = _diffusers_state_dict(raw, metadata, family, label, denoiser_config)
    else:  # only another expert's keys (a low-noise-only Wan 2.2 LoRA)
        state_dict, network_alphas, metadata = {}, None, None
    if network_alphas and metadata:
        # load_lora_adapter raises on this pair too ("Both `network_alphas` and `metadata` ...").
        raise AdapterFormatError(
            f"{label}: carries both kohya-style alphas and lora_adapter_metadata; diffusers refuses that too"
        )

    layout = LOKR_LAYOUT if is_lokr(state_dict) else LOHA_LAYOUT if loha else layout
    ours = {k.removeprefix(f"{prefix}."): v for k, v in state_dict.items() if k.startswith(f"{prefix}.")}
    parts = (prefix, *family.lora_text_encoders)
    skipped = sorted([k for k in state_dict if not k.startswith(tuple(f"{part}." for part in parts))]
                     + [k for k in raw if k.startswith(DROPPED_T5)])
    text_modules = {}
    for encoder in family.lora_text_encoders:
        weights = _text_part_weights(family, state_dict, network_alphas, metadata, encoder, label)
        if weights:
            text_modules[encoder] = weights
    if not ours and not text_modules and not experts:
        raise AdapterFormatError(
            f"{label}: no LoRA weights for the {family.name} {prefix} or its text encoders found "
            f"({len(state_dict)} keys, e.g. {', '.join(sorted(state_dict)[:3]) or 'none'})"
            + foreign_note(family, sorted(raw), file_metadata, extra.get("header_base_model") or extra.get("model_card"))
        )
    if skipped:
        log.warning("%s: skipping %d keys no served model part takes (%s)", label, len(skipped), skipped[0][:80])
    modules = {**_denoiser_modules(ours, network_alphas, metadata, prefix, label), **experts}
    return Adapter(
        name=label,
        family=family.name,
        layout=layout,
        modules=modules,
        sha256=digest,
        base_model=declared_base_model(file_metadata, declared_config if loha else peft_config,
                                       extra.get("header_base_model") or extra.get("model_card")),
        skipped_keys=skipped,
        text_modules=text_modules,
        declared=dict(extra.get("declared") or {}),
    )


def _split_experts(raw, metadata, family: ModelFamily, label, denoiser_config) -> tuple[dict, dict]:
    """``raw`` less the keys of the family's other denoisers (Wan 2.2's low-noise expert: keys
    ``transformer_2.<what a transformer file would have after "transformer.">``), and those experts'
    module weights, named ``transformer_2.<module>`` (the engine's ceiling names them so).

    diffusers has no single-file layout for both experts: it loads the low-noise LoRA as a second
    file of ``transformer.`` keys with ``load_lora_weights(..., load_into_transformer_2=True)``.
    hotlora's adapter carries a pair in one state dict under the mixin's own module names
    (``transformer.`` / ``transformer_2.``); each part is converted exactly as that second call
    converts its file: re-prefixed ``transformer.``, through the mixin's ``lora_state_dict`` and the
    same LoraConfig construction (its metadata fields ``transformer_2.*`` read as ``transformer.*``)."""
    experts: dict[str, LoraWeights] = {}
    prefix = family.denoiser
    for other in family.other_denoisers:
        mark = f"{other}."
        part = {f"{prefix}.{k[len(mark):]}": v for k, v in raw.items() if k.startswith(mark)}
        if not part:
            continue
        raw = {k: v for k, v in raw.items() if not k.startswith(mark)}
        part_metadata = None if metadata is None else {
            f"{prefix}.{k[len(mark):]}": v for k, v in metadata.items() if k.startswith(mark)} or None
        state_dict, alphas, part_metadata = _diffusers_state_dict(part, part_metadata, family, f"{label} ({other})",
                                                                  denoiser_config)
        ours = {k.removeprefix(f"{prefix}."): v for k, v in state_dict.items() if k.startswith(f"{prefix}.")}
        weights = _denoiser_modules(ours, alphas, part_metadata, prefix, f"{label} ({other})")
        experts.update({f"{other}.{module}": w for module, w in weights.items()})
    return raw, experts


def _denoiser_modules(ours: dict, network_alphas, metadata, prefix: str, label: str) -> dict:
    """The denoiser's share of a converted state dict (``ours``, keys without ``prefix``) as module
    weights, with its alphas and LoRA config taken from the whole file's."""
    from diffusers.utils.state_dict_utils import convert_unet_state_dict_to_peft

    if not ours:
        return {}
    if metadata is not None:
        metadata = {k.removeprefix(f"{prefix}."): v for k, v in metadata.items() if k.startswith(f"{prefix}.")}
    if network_alphas:
        network_alphas = {
            k.removeprefix(f"{prefix}."): v for k, v in network_alphas.items() if k.startswith(f"{prefix}.")
        }
    if is_lokr(ours):
        return lokr_modules(ours, metadata, label)
    if "lora_A" not in next(iter(ours)):
        ours = convert_unet_state_dict_to_peft(ours)
    # The same rank dict and config construction as diffusers' load_lora_adapter.
    rank = {f"^{k}": v.shape[1] for k, v in ours.items() if "lora_B" in k and v.ndim > 1}
    return _weights_by_config(ours, network_alphas, metadata, rank, label, is_unet=True)


def _weights_by_config(ours: dict, network_alphas, metadata, rank: dict, label: str, *,
                       is_unet: bool) -> dict[str, LoraWeights]:
    """PEFT-form keys -> each module's weights and scaling, through the ``LoraConfig`` diffusers
    would build. Building the config runs no pattern; the patterns are checked before anything
    matches them."""
    from diffusers.utils.peft_utils import _create_lora_config

    if any("lora_magnitude_vector" in k for k in ours):  # how get_peft_kwargs recognises DoRA
        raise AdapterFormatError(f"{label}: DoRA adapters cannot be hot-swapped")
    pairs = _lora_pairs(ours, label)
    try:
        config = _create_lora_config(ours, network_alphas, metadata, rank, is_unet=is_unet)
    except Exception as exc:
        raise AdapterFormatError(f"{label}: cannot derive a LoRA config ({type(exc).__name__}: {exc})") from exc
    if config.use_dora:
        raise AdapterFormatError(f"{label}: DoRA adapters cannot be hot-swapped")
    return module_weights(pairs, config, declared_ranks=metadata is not None, label=label)


# The text-encoder layers diffusers reads LoRA ranks for (``_load_lora_into_text_encoder``).
TEXT_ENCODER_RANKED = (".q_proj", ".k_proj", ".v_proj", ".out_proj", ".fc1", ".fc2")


def _text_part_weights(family: ModelFamily, state_dict, network_alphas, metadata, encoder: str, label: str) -> dict:
    """A text-side part's LoRA: a text encoder's, or a module the mixin loads as it loads a denoiser
    (``model_lora_parts``: LTX-2's connectors, through ``load_lora_adapter(..., prefix="connectors")``)."""
    if encoder not in family.model_lora_parts:
        return _text_encoder_weights(state_dict, network_alphas, metadata, encoder, label)
    part = {k.removeprefix(f"{encoder}."): v for k, v in state_dict.items() if k.startswith(f"{encoder}.")}
    return _denoiser_modules(part, network_alphas, metadata, encoder, f"{label} ({encoder})")


def _text_encoder_weights(state_dict, network_alphas, metadata, encoder: str, label: str) -> dict[str, LoraWeights]:
    """One text encoder's LoRA, converted the way diffusers' ``_load_lora_into_text_encoder`` does:
    the same key conversions, rank dict, alphas and config."""
    from diffusers.utils.state_dict_utils import convert_state_dict_to_diffusers, convert_state_dict_to_peft

    part = {k.removeprefix(f"{encoder}."): v for k, v in state_dict.items() if k.startswith(f"{encoder}.")}
    if not part:
        return {}
    if metadata is not None:
        metadata = {k.removeprefix(f"{encoder}."): v for k, v in metadata.items() if k.startswith(f"{encoder}.")}
    try:
        part = convert_state_dict_to_peft(convert_state_dict_to_diffusers(part))
    except Exception as exc:
        raise AdapterFormatError(f"{label}: diffusers cannot convert the {encoder} LoRA ({type(exc).__name__}: {exc})") from exc
    # Module names relative to CLIP's "text_model." level, which transformers' CLIPTextModel lost
    # and CLIPTextModelWithProjection keeps (the engine resolves them against the model it has).
    part = {k.removeprefix("text_model."): v for k, v in part.items()}
    rank = {k: v.shape[1] for k, v in part.items()
            if k.endswith(".lora_B.weight") and k.split(".lora_B.")[0].endswith(TEXT_ENCODER_RANKED) and v.ndim > 1}
    if network_alphas:
        network_alphas = {k.removeprefix(f"{encoder}."): v for k, v in network_alphas.items()
                          if k.split(".")[0] == encoder}
    weights = _weights_by_config(part, network_alphas or None, metadata or None, rank, f"{label} ({encoder})",
                                 is_unet=False)
    biased = sorted(m for m, w in weights.items() if w.bias is not None)
    if biased:  # the text encoders' LoRA layers hold none (engine/writers/text_lora.py)
        raise AdapterFormatError(f"{label}: LoRA biases on the {encoder} ({', '.join(biased[:4])}) are not served")
    return weights


def _lora_pairs(ours: dict, label: str) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """module -> (A, B, B's bias or None) from PEFT-form keys; anything else (DoRA magnitudes, lone
    halves, a bias without its factors, names no diffusers module has) is refused with the keys that
    are wrong. A ``lora_B.bias`` is what diffusers makes of lightx2v's ``.diff_b`` (PEFT's ``lora_bias``)."""
    pairs, unpaired, bad_names = {}, [], []
    for key in ours:
        if ".lora_A." not in key:
            continue
        module = key.split(".lora_A.")[0]
        up = ours.get(f"{module}.lora_B.weight")
        if up is None or not key.endswith(".weight"):
            unpaired.append(module)
        elif len(module) > MAX_NAME_CHARS or not MODULE_NAME.fullmatch(module):
            bad_names.append(module[:80])
        else:
            pairs[module] = (ours[key], up, ours.get(f"{module}.lora_B.bias"))
    understood = (".lora_B.weight", ".lora_B.bias")
    unsupported = sorted(k for k in ours if ".lora_A." not in k and not k.endswith(understood))
    orphans = sorted(k.split(".lora_B.")[0] for k in ours
                     if k.endswith(understood) and f"{k.split('.lora_B.')[0]}.lora_A.weight" not in ours)
    if unpaired or unsupported or orphans:
        shown = sorted(set(unpaired + orphans)) + unsupported
        raise AdapterFormatError(f"{label}: unsupported or unpaired LoRA keys: {', '.join(shown[:8])}")
    if bad_names:
        shown = ", ".join(repr(n) for n in sorted(bad_names)[:8])
        raise AdapterFormatError(f"{label}: LoRA keys that name no module: {shown}")
    scalars = sorted(m for m, (down, up, _) in pairs.items() if down.ndim == 0 or up.ndim == 0 or down.shape[0] == 0)
    if scalars:
        raise AdapterFormatError(f"{label}: LoRA weights of rank 0 or without a rank dimension in {', '.join(scalars[:8])}")
    return pairs


def _diffusers_state_dict(raw, metadata, family: ModelFamily, label, denoiser_config):
    """Run diffusers' own detection and conversion for this family."""
    family.check_raw_lora(raw, label)  # on the file's own keys: a refusal names what the file holds
    raw = family.prepare_raw_lora(raw, label)
    kwargs = {"return_lora_metadata": True, **family.lora_state_dict_kwargs(denoiser_config)}
    try:
        out = family.pipeline_type.lora_state_dict(raw, **kwargs)
    except Exception as exc:  # converters raise ValueError, KeyError, AssertionError, ...
        message = str(exc).strip()
        if len(message) > 600:  # converters list every incompatible key: the first ones say enough
            message = message[:600] + " ..."
        raise AdapterFormatError(f"{label}: diffusers cannot convert this LoRA for the {family.name} family "
                                 f"({type(exc).__name__}: {message})" + foreign_note(family, sorted(raw), metadata)) from exc
    # Mixins that read no kohya alphas (SD3's, Flux.2's, the transformer-only ones) return
    # (state_dict, metadata), the others (state_dict, alphas, metadata).
    state_dict, network_alphas, file_meta = out if len(out) == 3 else (out[0], None, out[1])
    return state_dict, network_alphas, metadata if metadata is not None else file_meta


def _lora_config_fields(peft_config: dict) -> dict:
    from peft import LoraConfig

    known = set(LoraConfig.__dataclass_fields__)
    return {k: v for k, v in peft_config.items() if k in known and k not in {"base_model_name_or_path", "revision"}}

