"""The engine's front: everything a request is checked and validated against, without the model.

    EngineFront.check(r)     parameters, slots and scales, no I/O -> CheckedRequest
    EngineFront.prepare(r)   adapters validated (fetched ones, or loaded through the resolver),
                             token names and prompts checked -> PreparedRequest, not yet staged

What it holds is plain data taken from a warm engine (its request rules, its resolver with the
slot ceiling, its text encoders' checks), so it pickles: the engine process (``engine/process.py``)
sends its front to the server once it is warm, and requests are refused there, before anything
crosses to the model. ``Engine`` holds one too and adds ``stage`` (the writers' device-side layout
of a validated request) in its own ``prepare``.
"""

from __future__ import annotations

import time
from dataclasses import replace
from functools import cached_property
from typing import Callable, Mapping

from hotlora.adapters.defaults import PARAMETERS as DECLARABLE, merge as merge_declared
from hotlora.adapters.format.convert import Adapter
from hotlora.adapters.resolver import AdapterResolver
from hotlora.engine.inputs import fitted, pixels_of
from hotlora.engine.request import CallParams, CheckedRequest, GenerationRequest, PreparedRequest, RequestRules, Timings
from hotlora.engine.writers.text import TextChecks, text_signature
from hotlora.errors import InvalidRequest
from hotlora.families import ModelFamily
from hotlora.families.recognize import base_model_compatible


class EngineFront:
    def __init__(self, family: ModelFamily, rules: RequestRules, resolver: AdapterResolver, text: TextChecks):
        self.family, self.rules, self.resolver, self.text = family, rules, resolver, text

    @cached_property
    def image_budget(self):
        """What an input image given as file bytes may be (``hotlora.images.ImageBudget``), from the
        request limits. Made on first use: a front of a text-to-image engine never imports Pillow."""
        from hotlora.images import ImageBudget

        return ImageBudget.of(self.rules.limits)

    @property
    def denoiser_config(self) -> Mapping | None:
        """What the family's converters need of the served denoiser (the store converts with it)."""
        return self.resolver.denoiser_config

    def answers_to(self, model_id: str) -> bool:
        """Whether ``model_id`` names the served model: its path, folder name, ``model_id`` or a
        ``base_model_aliases`` entry (full id or its last part, as an adapter's declared base model
        is matched)."""
        return base_model_compatible(model_id, self.resolver.ceiling.served_models)

    def check(self, request: GenerationRequest, *,
              default_scale: Callable[[str], float | None] | None = None) -> CheckedRequest:
        """Parameters, then slots, scales and token names, each checked once; no I/O (the server
        runs this before it fetches, so bad requests never wait for a download). ``default_scale``:
        a reference's default scale when its spec gives none (the serving store's catalog; None:
        the resolver's store, if it has one)."""
        return CheckedRequest(request=request, params=self.rules.check_request(request),
                              specs=self.resolver.specs(request.adapters, default_scale))

    def prepare(self, request: str | GenerationRequest | CheckedRequest, *,
                fetched: Mapping[str, Adapter] | None = None, **options) -> PreparedRequest:
        """Everything that can fail because of the request; nothing here touches the model (see
        ``Engine.prepare`` for the arguments)."""
        began = time.perf_counter()
        if isinstance(request, str):
            request = GenerationRequest(prompt=request, **{**options, "adapters": options.get("adapters") or {}})
        elif options:
            raise TypeError(f"options {', '.join(options)} go with a prompt, not with a request")
        checked = request if isinstance(request, CheckedRequest) else self.check(request)
        r = checked.request
        with r.trace.span("validate", adapters=len(checked.specs)):
            bindings = self.resolver.validate(checked.specs, fetched)
            params, applied = self.adapter_defaults(checked, bindings)
            negative = r.negative_prompt
            if negative is None:
                negative = self.family.default_negative_prompt(params.guidance_scale)
            self.text.check(bindings, r.prompt, negative)
        images, mask = self.inputs(r, params)
        timings = Timings(resolve_ms=(time.perf_counter() - began) * 1000)
        return PreparedRequest(prompt=r.prompt, params=params, adapters=bindings, num_images=r.num_images,
                               seed=r.seed, output_type=r.output_type, negative_prompt=negative, images=images,
                               mask=mask, progress=r.progress, timings=timings, trace=r.trace,
                               adapter_defaults=applied,
                               shared_texts=self.shared_texts(r.prompt, negative, bindings))

    def shared_texts(self, prompt: str, negative: str | None, bindings) -> tuple:
        """What of its texts a request's mixed batch must share (``ModelFamily.mixed_batch_texts``;
        the text encoders' state: embeddings, text-encoder LoRA)."""
        return self.family.mixed_batch_texts(prompt, negative, text_signature(bindings))

    def adapter_defaults(self, checked: CheckedRequest, bindings) -> tuple[CallParams, dict]:
        """The request's parameters once the inference defaults its adapters declare are applied
        (``adapters.defaults.merge``: the request's own values win, disagreeing adapters are
        refused), and what was applied: ``{parameter: {"value", "slots"}}``. Only known once the
        adapters are read, so here rather than in ``check``; the new values go through the same
        ``RequestRules`` check as a request's own (max_steps, max_work, strength), so a declared
        value the warm engine cannot serve is a 4xx naming the adapter, never a compile.
        Guidance a family does not take is not applied (klein distilled ignores it), nor a shift
        where the model's scheduler has none to set (it shifts by image size: Flux, Qwen-Image)."""
        r = checked.request
        untaken = {*(() if self.family.takes_guidance else ("guidance_scale",)),
                   *(() if self.rules.shift_key else ("shift",))}
        declared = {slot: {k: v for k, v in b.adapter.declared.items() if k not in untaken}
                    for slot, b in bindings.items() if b is not None and b.writes and b.adapter.declared}
        applied = merge_declared(declared, {name: getattr(r, name) for name in DECLARABLE})
        if not applied:
            return checked.params, {}
        with_defaults = replace(r, **{name: entry["value"] for name, entry in applied.items()})
        try:
            params = self.rules.check_request(with_defaults)
        except InvalidRequest as exc:  # RequestTooLarge and UnservedShape keep their class (and status)
            named = ", ".join(f"{name} {entry['value']:g} from [{', '.join(entry['slots'])}]"
                              for name, entry in applied.items())
            exc.args = (f"{exc.args[0] if exc.args else exc} (with the adapters' declared defaults: {named}; "
                        "set the value in the request to override it)", *exc.args[1:])
            raise
        return params, applied

    def inputs(self, request: GenerationRequest, params) -> tuple[tuple, object]:
        """The request's input images and mask as uint8 arrays (``engine.inputs``); an edit's
        references fitted to the served size."""
        if not request.images and request.mask is None:
            return (), None
        with request.trace.span("decode", images=len(request.images)):
            images = tuple(pixels_of(image, label=f"image {i + 1}" if len(request.images) > 1 else "image",
                                     budget=self.image_budget)
                           for i, image in enumerate(request.images))
            if params.task == "edit":
                images = tuple(fitted(image, params.height, params.width) for image in images)
            mask = None if request.mask is None else pixels_of(request.mask, label="mask", budget=self.image_budget,
                                                               mode="L")
        if mask is not None and mask.shape[:2] != images[0].shape[:2]:
            raise InvalidRequest(f"the mask is {mask.shape[1]}x{mask.shape[0]} pixels, the image "
                                 f"{images[0].shape[1]}x{images[0].shape[0]}: they must be the same size")
        return images, mask
