"""A request's ``{slot: spec}`` turned into checked adapters, before any engine state is touched.

Two steps, each run once per request: ``specs`` (slots, scales, token names: no I/O, so bad ones
never wait for a download; ``Engine.check``) and ``validate`` (the fetched adapters renamed,
validated and paired with their scales; ``Engine.prepare``). Between them the server fetches on its
event loop, through the adapter store it owns; the resolver loads an adapter itself only where
nothing was fetched for its slot (the Python API: through the store it was given, or from a path,
a state dict or an Adapter). Holds no tensors of the model and knows no layout: each engine owns one, and the server runs
it on request threads, so cold adapters are fetched and validated while the engine generates for
others.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from hotlora.adapters.binding import AdapterSpec, Binding
from hotlora.adapters.format.embeddings import checked_tokens
from hotlora.adapters.format.convert import Adapter, load_adapter
from hotlora.adapters.format.export import pair_experts
from hotlora.adapters.format.validate import SlotCeiling, problems_with, served_experts
from hotlora.errors import AdapterFormatError, AdapterRejected, InvalidRequest
from hotlora.families import ModelFamily
from hotlora.lru import LRU

_MEMO = 1024  # validation results remembered by content hash (checking finiteness costs a pass over the weights)


class AdapterResolver:
    def __init__(self, slot_names, ceiling: SlotCeiling, family: ModelFamily, store=None, denoiser_config=None,
                 max_scale: float = 8.0, serving_dtype: torch.dtype = torch.float32, text_problems=None):
        self.slot_names = tuple(slot_names)
        self.ceiling = ceiling
        self.family = family
        self.store = store
        self.denoiser_config = denoiser_config
        self.max_scale = max_scale
        # The engine's check of an adapter's text-encoder parts (LoRA and embeddings), or None.
        self.text_problems = text_problems
        # What the folded update may reach: its square keeps activations (x @ delta^T, summed over
        # thousands of features) clear of the dtype's overflow. 1.8e19 for float32/bf16, 256 for fp16.
        self.max_update = torch.finfo(serving_dtype).max ** 0.5
        # The second expert the slots reach into (Wan 2.2 A14B's transformer_2), or None: a
        # request's ``low_noise`` LoRA has somewhere to go only where it is served.
        self.second_expert = next(iter(served_experts(ceiling)), None)
        self._memos()

    def _memos(self) -> None:
        self._peaks: LRU[tuple, float] = LRU(max_entries=_MEMO)
        self._checked: LRU[tuple, list[str]] = LRU(max_entries=_MEMO)

    def __getstate__(self) -> dict:
        """Pickled (to validate in another process than the model's) without its store or memos:
        the process that unpickles it is handed every adapter, and its memos are its own."""
        return {k: v for k, v in self.__dict__.items() if k not in ("store", "_peaks", "_checked")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, store=None)
        self._memos()

    def load(self, source, name: str | None = None) -> Adapter:
        """An adapter from a reference (through the store, when the resolver has one), a path, a
        state dict or an Adapter."""
        if isinstance(source, Adapter):
            return source
        if isinstance(source, str) and self.store is not None:
            return self.store.get(source)
        return load_adapter(source, self.family, name=name, denoiser_config=self.denoiser_config)

    def resolve(self, adapters: Mapping[str, Any] | None) -> dict[str, Binding]:
        """``specs`` then ``validate``: a request's ``{slot: spec}`` as checked bindings."""
        return self.validate(self.specs(adapters))

    def specs(self, adapters: Mapping[str, Any] | None,
              default_scale: Callable[[str], float | None] | None = None) -> dict[str, AdapterSpec]:
        """``{slot: AdapterSpec}`` with slots, scales and token names checked, before anything is
        fetched: the one place a request's adapter specs are checked. A spec is an AdapterSpec, a
        source, ``(source, scale)`` or ``{"ref": source, "scale": s, "tokens": [...], "low_noise": source}``; a missing
        scale becomes the catalog entry's default (``default_scale(ref)``: the serving store's
        catalog; None: the resolver's own store's, if it has one), else 1.0; ``tokens`` renames the
        adapter's pivotal-tuning embeddings for this request (its prompt then uses these names);
        ``low_noise`` is refused unless the served model has a second expert."""
        adapters = dict(adapters or {})
        check_slots(adapters, self.slot_names)
        if default_scale is None and self.store is not None:
            default_scale = self.store.default_scale
        out = {}
        for slot, spec in adapters.items():
            if spec is None:
                continue
            spec = spec_of(spec, slot)
            if spec.low_noise is not None and self.second_expert is None:
                raise InvalidRequest(f"[{slot}] low_noise names a LoRA for a low-noise expert, but the served model "
                                     "has one denoiser (a two-expert model is Wan 2.2 A14B): give ref alone")
            scale = spec.scale
            if scale is None:
                default = default_scale(spec.ref) if default_scale and isinstance(spec.ref, str) else None
                scale = 1.0 if default is None else default
            # A finite scale can still overflow the pack (1e30 does); bounded like any other input.
            if abs(scale) > self.max_scale:
                raise InvalidRequest(f"[{slot}] scale {scale:g} is outside the allowed range "
                                     f"-{self.max_scale:g}..{self.max_scale:g}")
            out[slot] = dataclasses.replace(spec, scale=scale)
        return out

    def validate(self, specs: Mapping[str, AdapterSpec], fetched: Mapping[str, Adapter] | None = None
                 ) -> dict[str, Binding]:
        """``specs`` (from ``specs``: not checked again) as validated bindings; ``fetched``: slot ->
        the adapter the server already fetched for it, else it is loaded here. Every problem of
        every adapter is collected, then raised once; nothing is half-done."""
        fetched = fetched or {}
        bindings: dict[str, Binding] = {}
        problems: list[str] = []
        names = []
        for slot, spec in specs.items():
            source = spec.ref
            if slot in fetched:
                adapter = fetched[slot]
            else:
                adapter = self.load(source, name=source if isinstance(source, str) else None)
                if spec.low_noise is not None:
                    low = spec.low_noise
                    adapter = paired(adapter, self.load(low, name=low if isinstance(low, str) else None), slot)
            if spec.tokens is not None:
                adapter = renamed_tokens(adapter, spec.tokens, slot)
            problems += [f"[{slot}] {p}" for p in self._problems(adapter)]
            if not problems:
                problems += [f"[{slot}] {p}" for p in self._magnitude_problems(adapter, spec.scale)]
            names.append(f"{slot}={adapter.name}")
            bindings[slot] = Binding(adapter=adapter, scale=spec.scale)
        if problems:
            raise AdapterRejected(", ".join(names), problems)
        return bindings

    def _magnitude_problems(self, adapter: Adapter, scale: float) -> list[str]:
        """Huge but finite weights overflow like a huge scale. ``peak`` bounds every entry of every
        module's update (|scaling| * rank * max|A| * max|B|); scaled, it must stay under the bound."""
        peak = self._peak(adapter)
        if abs(scale) * peak > self.max_update:
            return [f"weights too large for the serving dtype: the scaled update may reach {abs(scale) * peak:.3g} "
                    f"(limit {self.max_update:.3g})"]
        return []

    def _peak(self, adapter: Adapter) -> float:
        key = adapter.key
        peak = self._peaks.get(key)
        if peak is None:
            weights = [*adapter.modules.values(), *(w for mods in adapter.text_modules.values() for w in mods.values())]
            peak = max((abs(w.scaling) * w.rank * float(w.down.abs().amax()) * float(w.up.abs().amax())
                        for w in weights if w.down.numel() and w.up.numel()), default=0.0)
            self._peaks.put(key, peak)
        return peak

    def _problems(self, adapter: Adapter) -> list[str]:
        key = adapter.key
        found = self._checked.get(key)
        if found is None:
            found = problems_with(adapter, self.ceiling)
            if self.text_problems is not None and adapter.text_parts:
                found = found + self.text_problems(adapter)
            self._checked.put(key, found)
        return found


def check_slots(adapters: Mapping[str, Any], slot_names) -> None:
    """Unknown slots are one InvalidRequest, raised by ``specs`` (``Engine.check``), once per
    request: writers are only ever given bindings made from checked specs."""
    unknown = [s for s in adapters if s not in slot_names]
    if unknown:
        shown = ", ".join(repr(str(s)[:64]) for s in unknown[:8])
        raise InvalidRequest(f"unknown slot(s) {shown}; this engine has {', '.join(slot_names)}")


def spec_of(spec, slot: str) -> AdapterSpec:
    """Any spec form the engine reads, as a checked AdapterSpec (its scale may still be None)."""
    tokens = low_noise = None
    if isinstance(spec, AdapterSpec):
        source, scale, tokens, low_noise = spec.ref, spec.scale, spec.tokens, spec.low_noise
    elif isinstance(spec, Mapping) and "ref" in spec:
        source, scale, tokens, low_noise = spec["ref"], spec.get("scale"), spec.get("tokens"), spec.get("low_noise")
    elif isinstance(spec, tuple):
        if len(spec) != 2:
            raise InvalidRequest(f"[{slot}] an adapter spec tuple is (source, scale)")
        source, scale = spec
    else:
        source, scale = spec, None
    if isinstance(source, Path):
        source = str(source)
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale)):
        raise InvalidRequest(f"[{slot}] scale must be a finite number, got {scale!r}")
    if source is None or (isinstance(source, str) and not source.strip()):
        raise InvalidRequest(f"[{slot}] adapter reference is empty")
    if isinstance(low_noise, Path):
        low_noise = str(low_noise)
    if isinstance(low_noise, str) and not low_noise.strip():
        raise InvalidRequest(f"[{slot}] low_noise reference is empty")
    if tokens is not None:
        try:
            tokens = checked_tokens(tokens, len(tokens) if isinstance(tokens, (list, tuple)) else -1, f"[{slot}]")
        except AdapterFormatError as exc:
            raise InvalidRequest(str(exc)) from None
    return AdapterSpec(ref=source, scale=None if scale is None else float(scale), tokens=tokens, low_noise=low_noise)


def paired(high: Adapter, low: Adapter, slot: str) -> Adapter:
    """A slot's high-noise and low-noise LoRAs as one pair adapter; a part that is no one expert's
    LoRA (a pair already, or text-encoder LoRA in the low-noise file) is a 422 naming the slot."""
    try:
        return pair_experts(high, low)
    except AdapterFormatError as exc:
        raise InvalidRequest(f"[{slot}] {exc}") from None


def renamed_tokens(adapter: Adapter, tokens: tuple[str, ...], slot: str) -> Adapter:
    """``adapter`` with its embeddings under the request's token names (a new Adapter: its key,
    and so every memo and text-encoder state, tells the names apart)."""
    if adapter.embeddings is None:
        raise InvalidRequest(f"[{slot}] tokens were given, but the adapter carries no pivotal-tuning embeddings")
    if len(tokens) != len(adapter.embeddings.tokens):
        raise InvalidRequest(f"[{slot}] {len(tokens)} token names for the adapter's {len(adapter.embeddings.tokens)} "
                             f"embedding rows")
    return dataclasses.replace(adapter, embeddings=adapter.embeddings.named(tokens))
