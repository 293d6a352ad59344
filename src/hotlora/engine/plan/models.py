"""Where a plan's model comes from, and its parts built on the meta device (no weights, no memory).

A model is named as the server names it (a local folder laid out like a Hub snapshot, or a Hub id
whose snapshot is in the local Hugging Face cache) or by a built-in name whose published
configuration ships in ``hotlora.fullsize`` (each family's ``full_size_models``). Only
``model_index.json`` and each component's ``config.json`` are read: the parts are built from them
with diffusers' ``from_config`` / transformers' config classes under ``torch.device("meta")``, so a
12B transformer costs nothing to build and its parameter and buffer shapes are the real ones.
"""

from __future__ import annotations

import importlib
import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from hotlora.families import ModelFamily, family_of_model_index, full_size_model, full_size_names
from hotlora.engine.pipeline import ModelLoadError

log = logging.getLogger(__name__)

# Read beside the family's denoiser (an image-to-video checkpoint's image encoder too: Wan2.1-I2V's CLIP).
COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder", "vae")


@dataclass
class ModelSpec:
    """What the plan knows of a model: its family and each component's published config."""

    name: str
    family: ModelFamily
    configs: dict[str, dict]  # component -> its config.json, including the key naming its class
    classes: dict[str, tuple[str, str]]  # component -> (library, class), from model_index.json
    vocabulary: dict[str, int] = field(default_factory=dict)  # tokenizer -> tokens it holds
    folder: Path | None = None


def _family_of(index: dict, name: str) -> ModelFamily:
    try:
        return family_of_model_index(index)
    except ValueError as exc:
        raise ModelLoadError(f"{name}: {exc}") from None


# A published config names its class; the pipeline component each class is (denoisers: their family's).
COMPONENT_OF_CLASS = {
    "AutoencoderKL": ("diffusers", "vae"),
    "CLIPTextModel": ("transformers", "text_encoder"),
    "CLIPTextModelWithProjection": ("transformers", "text_encoder_2"),
    "T5EncoderModel": ("transformers", "text_encoder_2"),
}


def _built_in(name: str) -> ModelSpec:
    """A module of ``hotlora.fullsize``: ``COMPONENTS`` (component -> config) when it has them, each
    built as ``MODEL_INDEX`` names its class (else as its config does), else every module-level
    dict that names its class (``_class_name`` or ``architectures``, as a published config.json
    does), placed by its class."""
    family, module_name = full_size_model(name)
    try:
        module = importlib.import_module(f"hotlora.fullsize.{module_name}")
    except ImportError:
        raise ModelLoadError(f"the built-in model {name!r} has no published configuration in this "
                             f"installation (hotlora.fullsize.{module_name})") from None
    configs, classes = {}, {}
    index = getattr(module, "MODEL_INDEX", {})
    named = getattr(module, "COMPONENTS", {})
    if named:
        for component, config in named.items():
            # The other experts too (Wan 2.2 A14B's transformer_2), as _from_folder reads them: the
            # memory plan holds every expert the family names.
            if component not in (*COMPONENTS, family.denoiser, *family.other_denoisers):
                continue
            entry = index.get(component)
            if isinstance(entry, list) and entry[0] in ("diffusers", "transformers"):
                library, class_name = entry[0], entry[1]  # what the pipeline loads (Z-Image: Qwen3Model)
            elif "_class_name" in config:
                library, class_name = "diffusers", config["_class_name"]
            else:
                library, class_name = "transformers", config["architectures"][0]
            configs[component], classes[component] = dict(config), (library, class_name)
    else:
        for config in (v for v in vars(module).values()
                       if isinstance(v, dict) and ("_class_name" in v or "architectures" in v)):
            class_name = config.get("_class_name") or (config.get("architectures") or [None])[0]
            if class_name == family.denoiser_class:
                library, component = "diffusers", family.denoiser
            elif class_name in COMPONENT_OF_CLASS:
                library, component = COMPONENT_OF_CLASS[class_name]
            else:
                continue
            configs[component], classes[component] = dict(config), (library, class_name)
    if family.denoiser not in configs:
        raise ModelLoadError(f"hotlora.fullsize.{module_name} holds no denoiser configuration")
    return ModelSpec(name, family, configs, classes, dict(getattr(module, "TOKENIZER_VOCABULARY", {})))


def _from_folder(folder: Path, name: str) -> ModelSpec:
    if not (folder / "model_index.json").is_file():
        raise ModelLoadError(f"{name}: no model_index.json (a plan reads a diffusers pipeline folder, laid out "
                             "like a Hub snapshot)")
    index = json.loads((folder / "model_index.json").read_text())
    family = _family_of(index, name)
    configs, classes = {}, {}
    for component, entry in index.items():
        if component in (*COMPONENTS, family.denoiser, *family.other_denoisers) and isinstance(entry, list) and entry[0] is not None:
            path = folder / component / "config.json"
            if not path.is_file():
                raise ModelLoadError(f"{name}: {path} is missing (a plan reads every component's config.json)")
            configs[component] = json.loads(path.read_text())
            classes[component] = (entry[0], entry[1])
    # Tokenizers saved in the folder are loaded as they are (build_parts): they say where the reserved rows start.
    return ModelSpec(name, family, configs, classes, {}, folder)


def published_name(hub_id: str) -> str | None:
    """The built-in name whose published configuration is the Hub repository ``hub_id`` (its module's
    ``HUB_ID``; the Hub resolves ids case-insensitively, so this does too), or None."""
    for name in full_size_names():
        module = importlib.import_module(f"hotlora.fullsize.{full_size_model(name)[1]}")
        if getattr(module, "HUB_ID", "").lower() == hub_id.lower():
            return name
    return None


def find_model(model: str) -> ModelSpec:
    """A built-in name, a local folder, a Hub id whose snapshot is in the local cache, or the Hub id
    of a built-in model (planned from its published configuration, before anything is downloaded:
    a server checks its plan before it fetches the weights)."""
    if full_size_model(model) is not None:
        return _built_in(model)
    folder = Path(model)
    if folder.is_dir():
        return _from_folder(folder, model)
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(model, "model_index.json")
    except ValueError:  # not a repository id at all
        cached = None
    if isinstance(cached, str):
        return _from_folder(Path(cached).parent, model)
    name = published_name(model)
    if name is not None:
        log.info("%s is not in the local Hugging Face cache: planned from hotlora's copy of its published "
                 "configuration (%s)", model, name)
        return _built_in(name)
    raise ModelLoadError(f"{model!r} is neither a built-in model ({', '.join(full_size_names())}), a local folder, nor a "
                         "Hub id whose model_index.json is in the local Hugging Face cache")


@contextmanager
def on_meta(dtype: torch.dtype):
    """Every tensor made inside on the meta device, floating ones in ``dtype`` by default: PEFT
    creates its LoRA layers in the default dtype and casts them to the base layer's only when it
    moves them off another device (it leaves meta tensors where they are)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype.is_floating_point and dtype.itemsize >= 2 else before)
    try:
        with torch.device("meta"):
            yield
    finally:
        torch.set_default_dtype(before)


def _build(component: str, library: str, class_name: str, config: dict, dtype: torch.dtype) -> torch.nn.Module:
    config = {k: v for k, v in config.items() if k not in ("_diffusers_version", "transformers_version")}
    if library == "diffusers":
        import diffusers

        model = getattr(diffusers, class_name).from_config(config)
    elif library == "transformers":
        import transformers

        cls = getattr(transformers, class_name)
        model = cls(cls.config_class.from_dict(config))
    else:
        raise ModelLoadError(f"{component}: a {library} component ({class_name}) is not one a plan can build")
    return model.to(dtype).eval()


class VocabularyOnly:
    """Stands in for a tokenizer the plan has no files for: ``size`` tokens, new ones taking the
    next ids (what the engine's reserved embedding rows need of a tokenizer: engine/writers/text.py)."""

    def __init__(self, size: int):
        self.size = size
        self.added: list[str] = []

    def get_vocab(self) -> dict[str, int]:
        return {token: self.size + i for i, token in enumerate(self.added)}

    def add_tokens(self, tokens) -> int:
        self.added += [t for t in tokens if t not in self.added]
        return len(tokens)

    def convert_tokens_to_ids(self, tokens) -> list[int]:
        return [self.size + self.added.index(t) for t in tokens]

    def tokenize(self, text: str) -> list[str]:
        return [text]


def build_parts(spec: ModelSpec, dtype: torch.dtype) -> SimpleNamespace:
    """The model's denoiser, text encoders and VAE on the meta device, in ``dtype``, with a
    tokenizer (or a stand-in of the published vocabulary's size) per text encoder: what the
    engine's writers are installed into (``hotlora.engine.plan.memory``)."""
    parts = SimpleNamespace()
    with on_meta(dtype):
        for component, config in spec.configs.items():
            library, class_name = spec.classes[component]
            if component in (*COMPONENTS, spec.family.denoiser, *spec.family.other_denoisers):
                setattr(parts, component, _build(component, library, class_name, config, dtype))
    for encoder, tokenizer in spec.family.tokenizer_of.items():
        if hasattr(parts, encoder):
            size = spec.vocabulary.get(tokenizer) or spec.configs[encoder].get("vocab_size")
            if spec.folder is not None and (spec.folder / tokenizer).is_dir():
                from transformers import AutoTokenizer

                setattr(parts, tokenizer, AutoTokenizer.from_pretrained(spec.folder / tokenizer, local_files_only=True))
            else:
                setattr(parts, tokenizer, VocabularyOnly(size))
    return parts


__all__ = ["ModelSpec", "VocabularyOnly", "build_parts", "find_model", "on_meta"]
