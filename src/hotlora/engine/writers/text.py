"""The text encoders' part of a request: text-encoder LoRA applied unfused, pivotal-tuning
embeddings copied into reserved token rows, and the request's prompt mapped onto those rows.

Text-encoder LoRA (``text_lora.py`` beside this file): each touched Linear adds its request's
low-rank branch through a forward hook; the weights are never written, so a request without text
parts runs the base encoders bit for bit, whatever ran before. (It used to be merged into the
weights, restored from a pristine copy: that cost a copy of every encoder Linear, a merge each time
an adapter came back, and in bf16 the delta elements under half a step of their weight.)

Embeddings: diffusers' ``load_textual_inversion`` grows the tokenizer and the embedding table per
adapter and refuses a token name already loaded, so it cannot serve a different user per request.
Here each tokenizer gets ``rows`` reserved tokens per slot at start-up (``<hotlora-0-0>``, ...;
slot 0, row 0), the embedding table grows once to hold them, and a request's vectors are copied
into its slots' rows. Its prompt is rewritten per text encoder, each trainer token (``<s0>``)
replaced by its slot's reserved token, so each tokenizer splits the prompt exactly where diffusers'
would split the added tokens. Reserved ids keep the order in which diffusers would add the tokens
(slot order, then row order): CLIP's legacy pooling takes the position of the largest id, and
added tokens are the largest ids. Prompts naming a reserved token are refused (they would read
another request's rows).

Written by hand: no library hot-swaps text-encoder LoRA (diffusers raises on it under hotswap) or
serves per-request textual-inversion tokens without growing the tokenizer.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Mapping, Sequence

import torch

from hotlora.adapters.binding import Bindings
from hotlora.adapters.format.convert import Adapter
from hotlora.adapters.format.validate import SlotCeiling, problems_with
from hotlora.engine.writers.text_lora import UnfusedTextLora
from hotlora.errors import InvalidRequest
from hotlora.families import ModelFamily

RESERVED = re.compile(r"<hotlora-", re.IGNORECASE)  # CLIP's tokenizer lowercases before matching added tokens


def _reserved_name(slot_index: int, row: int) -> str:
    return f"<hotlora-{slot_index}-{row}>"


@dataclasses.dataclass(frozen=True)
class RowFacts:
    """What embeddings must fit in one text encoder's reserved rows: their width, how many per slot,
    and the tokenizer's own vocabulary (names a trainer token may not take). Plain data, so the
    checks travel to the process that validates requests (``TextChecks``)."""

    width: int
    rows: int
    vocabulary: frozenset

    def problems(self, encoder: str, adapter: Adapter) -> list[str]:
        tokens, vectors = adapter.embeddings.tokens, adapter.embeddings.vectors[encoder]
        problems = []
        if vectors.shape[1] != self.width:
            problems.append(f"{encoder} embeddings are {vectors.shape[1]} wide, the text encoder's are {self.width}")
        if len(tokens) > self.rows:
            problems.append(f"{len(tokens)} embedding tokens; the engine reserves {self.rows} per slot "
                            f"(embedding_rows)")
        taken = [t for t in tokens if t in self.vocabulary]
        if taken:  # diffusers' load_textual_inversion refuses these too
            problems.append(f"embedding tokens already in the {encoder} tokenizer's vocabulary: {', '.join(taken[:8])}")
        return problems


class ReservedRows:
    """``rows`` token rows per slot in one tokenizer and its text encoder's input embeddings."""

    def __init__(self, tokenizer, encoder: torch.nn.Module, slot_names: Sequence[str], rows: int):
        self.vocabulary = frozenset(tokenizer.get_vocab())  # before adding: names a trainer token may not take
        self.names = {slot: tuple(_reserved_name(k, i) for i in range(rows)) for k, slot in enumerate(slot_names)}
        flat = [name for slot in slot_names for name in self.names[slot]]
        tokenizer.add_tokens(flat)
        ids = tokenizer.convert_tokens_to_ids(flat)
        if max(ids) >= encoder.get_input_embeddings().num_embeddings:
            # Once, at start-up; new rows are written before any prompt can reach them.
            encoder.resize_token_embeddings(max(ids) + 1, mean_resizing=False)
        self.weight = encoder.get_input_embeddings().weight
        self.ids = {slot: ids[k * rows:(k + 1) * rows] for k, slot in enumerate(slot_names)}
        self.width = self.weight.shape[1]
        self.rows = rows
        # CLIP's tokenizer matches added tokens after lower-casing the prompt ("<S0>" is "<s0>"); T5's
        # does not. Asked of the tokenizer itself, so prompts are rewritten the way it splits them.
        self.ignore_case = tokenizer.tokenize(flat[0].upper()) == tokenizer.tokenize(flat[0])
        self.facts = RowFacts(self.width, rows, self.vocabulary)

    @torch.no_grad()
    def write(self, slot: str, vectors: torch.Tensor) -> None:
        ids = torch.tensor(self.ids[slot][:vectors.shape[0]], device=self.weight.device)
        self.weight.index_copy_(0, ids, vectors.to(device=self.weight.device, dtype=self.weight.dtype))


def _lora_root(encoder: torch.nn.Module) -> torch.nn.Module:
    """The text encoder as canonical LoRA names see it. CLIPTextModelWithProjection (and older
    transformers' CLIPTextModel) nest their layers under ``text_model``, and formats strips that
    level as diffusers does for the flattened CLIPTextModel: a container holding ``text_model``'s
    children beside the encoder's own (``text_projection``), the same module objects."""
    inner = getattr(encoder, "text_model", None)
    if inner is None:
        return encoder
    root = torch.nn.Module()
    for name, child in [*inner.named_children(), *encoder.named_children()]:
        if child is not inner:
            root.add_module(name, child)
    return root


def _text_weights(encoder: str):
    return lambda adapter: adapter.text_modules.get(encoder, {})


def text_signature(bindings: Bindings) -> tuple:
    """What the text encoders hold for ``bindings``: equal signatures encode prompts alike.
    Each slot's ``Binding.key``, but embeddings ignore the scale: an adapter with embeddings and
    no text-encoder LoRA is the same state at any scale (its rows are copied unscaled)."""
    return tuple(sorted((slot, b.key if b.adapter.text_modules else (b.adapter.key, None))
                        for slot, b in bindings.items() if b.adapter.text_parts))


class TextChecks:
    """What a request's text parts must satisfy, as plain data (no encoder, no tokenizer): the
    LoRA ceiling of each text encoder whose LoRA is applied and each encoder's reserved rows. It
    pickles, so requests are validated in the server's process while the model lives in the
    engine's (``engine/process.py``)."""

    def __init__(self, lora: Mapping[str, SlotCeiling], rows: Mapping[str, RowFacts]):
        self.lora, self.rows = dict(lora), dict(rows)

    def problems(self, adapter: Adapter) -> list[str]:
        """What of ``adapter``'s text parts this engine cannot serve (validated with the rest)."""
        problems = []
        for encoder, modules in adapter.text_modules.items():
            ceiling = self.lora.get(encoder)
            if ceiling is None:
                continue  # text-encoder LoRA switched off: skipped, and the response says so
            view = dataclasses.replace(adapter, modules=modules, text_modules={}, embeddings=None, base_model=None)
            problems += [f"{encoder}: {p}" for p in problems_with(view, ceiling)]
        if adapter.embeddings is not None:
            if not self.rows:
                problems.append("the adapter carries pivotal-tuning embeddings; this engine reserves no token rows "
                                "for them (embedding_rows is 0)")
            for encoder in adapter.embeddings.vectors:
                if encoder not in self.rows:
                    if self.rows:
                        problems.append(f"embeddings for {encoder}, which this model does not have")
                    continue
                problems += self.rows[encoder].problems(encoder, adapter)
            reserved = [t for t in adapter.embeddings.tokens if RESERVED.search(t)]
            if reserved:
                problems.append(f"embedding token {reserved[0]!r:.80} uses the engine's reserved prefix <hotlora-")
        return problems

    def check(self, bindings: Bindings, *texts: str | None) -> None:
        """Per request: token names unique across its slots, and no reserved token in its prompts."""
        owner: dict[str, str] = {}
        for slot, (adapter, _) in bindings.items():
            for token in adapter.embeddings.tokens if adapter.embeddings is not None else ():
                if token in owner:
                    raise InvalidRequest(f"slots {owner[token]} and {slot} both define the embedding token {token}; "
                                         "a prompt could not tell them apart (diffusers refuses the second one too)")
                owner[token] = slot
        if any(isinstance(text, str) and RESERVED.search(text) for text in texts):
            raise InvalidRequest("the prompt names a token reserved by the engine (<hotlora-...>)")


class TextEncodersWriter:
    """Every text encoder's LoRA and reserved rows, applied per request before it is encoded (the
    ``TextWriter``)."""

    def __init__(self, pipeline, family: ModelFamily, slot_names: Sequence[str], *, lora: bool = True, rows: int = 4):
        self.family = family
        self.slot_names = tuple(slot_names)
        present = {te: getattr(pipeline, te, None) for te in family.text_encoders}
        present = {te: module for te, module in present.items() if module is not None}
        self.lora = {te: UnfusedTextLora(_lora_root(present[te]), family.name, weights_of=_text_weights(te))
                     for te in family.lora_text_encoders if lora and te in present}
        # Reserved rows where a tokenizer feeds the encoder (LTX-2's connectors take LoRA and no tokens).
        tokenizers = {te: getattr(pipeline, self.family.tokenizer_of.get(te, ""), None) for te in present}
        self.rows = {te: ReservedRows(tokenizers[te], module, slot_names, rows) for te, module in present.items()
                     if rows and self.slot_names and tokenizers[te] is not None}
        self.checks = TextChecks({te: w.ceiling for te, w in self.lora.items()},
                                 {te: rows.facts for te, rows in self.rows.items()})
        self._applied: tuple | None = ()

    # ------------------------------------------------------------------ before anything is touched

    def problems(self, adapter: Adapter) -> list[str]:
        return self.checks.problems(adapter)

    def check(self, bindings: Bindings, *texts: str | None) -> None:
        self.checks.check(bindings, *texts)

    def prepare(self, bindings: Bindings, *texts: str | None) -> None:
        """On the request's thread, once per request: its token names and prompts checked
        (``TextChecks.check``), then ``stage``."""
        self.check(bindings, *texts)
        self.stage(bindings)

    def stage(self, bindings: Bindings) -> None:
        """Each text encoder's LoRA factors stacked on its device, so that ``apply`` on the serving
        thread only re-points the hooks. Where the model lives: in an engine process, after the
        request was checked in the server's."""
        for encoder, writer in self.lora.items():
            writer.prepare(self._with_lora_for(encoder, bindings))

    # ------------------------------------------------------------------ applying and prompts

    @staticmethod
    def _with_lora_for(encoder: str, bindings: Bindings) -> dict:
        """The slots whose adapters carry LoRA for ``encoder``."""
        return {slot: b for slot, b in bindings.items() if b.adapter.text_modules.get(encoder)}

    def signature(self, bindings: Bindings) -> tuple:
        return text_signature(bindings)

    def apply(self, bindings: Bindings) -> float:
        """Point the text-encoder LoRA at the request's and copy its embeddings into its slots'
        rows; nothing is written when the text encoders already hold them. Milliseconds spent."""
        signature = self.signature(bindings)
        if signature == self._applied:
            return 0.0
        began = time.perf_counter()
        self._applied = None  # unknown until every write below has landed
        for encoder, writer in self.lora.items():
            writer.swap(self._with_lora_for(encoder, bindings))
        for encoder, rows in self.rows.items():
            for slot, (adapter, _) in bindings.items():
                if adapter.embeddings is not None and encoder in adapter.embeddings.vectors:
                    rows.write(slot, adapter.embeddings.vectors[encoder])
        self._applied = signature
        return (time.perf_counter() - began) * 1000

    def prompts(self, bindings: Bindings, prompt: str, negative: str | None = None) -> dict:
        """The pipeline's prompt arguments for this request: each text encoder's prompt with the
        request's trainer tokens replaced by its slots' reserved tokens (unchanged without embeddings)."""
        texts = {"prompt": prompt, **({"negative_prompt": negative} if negative is not None else {})}
        mappings = {encoder: self._mapping(encoder, bindings) for encoder in self.rows}
        if not any(mappings.values()):
            return texts
        out = {}
        for encoder in self.family.text_encoders:
            argument = self.family.prompt_argument_of[encoder]
            rows = self.rows.get(encoder)
            for name, text in texts.items():
                key = name + argument.removeprefix("prompt")  # prompt_2 -> negative_prompt_2, prompt_3 -> ...
                out[key] = _rewritten(text, mappings.get(encoder) or {}, rows is not None and rows.ignore_case)
        return out

    def _mapping(self, encoder: str, bindings: Bindings) -> dict[str, str]:
        rows, mapping = self.rows[encoder], {}
        for slot, (adapter, _) in bindings.items():
            if adapter.embeddings is not None and encoder in adapter.embeddings.vectors:
                mapping.update(zip(adapter.embeddings.tokens, rows.names[slot]))
        return mapping

    # ------------------------------------------------------------------ state

    @property
    def lora_encoders(self) -> tuple[str, ...]:
        """The text encoders whose LoRA is applied (an adapter's LoRA for others is skipped)."""
        return tuple(self.lora)

    def check_intact(self) -> None:
        for writer in self.lora.values():
            writer.check_intact()

    def describe(self) -> dict:
        return {
            "lora": {te: w.describe() for te, w in self.lora.items()},
            "embedding_rows_per_slot": {te: rows.rows for te, rows in self.rows.items()},
        }

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.lora.values())


def _rewritten(text: str, mapping: Mapping[str, str], ignore_case: bool = False) -> str:
    if not mapping:
        return text
    if ignore_case:
        mapping = {token.lower(): reserved for token, reserved in mapping.items()}
    # Longest names first, so "<s10>" is not read as "<s1>" + "0".
    pattern = re.compile("|".join(re.escape(t) for t in sorted(mapping, key=len, reverse=True)),
                         re.IGNORECASE if ignore_case else 0)
    return pattern.sub(lambda match: mapping[match.group(0).lower() if ignore_case else match.group(0)], text)
