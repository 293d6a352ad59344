"""The text encoders' side of a request (#18, #27): what binding a request's text-encoder LoRA
(unfused: forward hooks re-pointed to its factors) and copying its embeddings costs, what the
unfused branch adds to one prompt encode, against merging the same LoRA into the weights (how it
was done before, a FusedWriter per text encoder); and the memory each keeps.

Usage: .venv/bin/python bench/text_encoders.py [--runs 20] [--rank 16] [--full-size]

Rows: the tiny models' CLIP (32 wide) and, with ``--full-size``, a CLIP-L at its real size (768
wide, 12 layers; random weights: only shapes matter here). The LoRA covers q, k, v, out_proj, fc1
and fc2 of every layer in both slots (what diffusers' training scripts target), plus two embedding
tokens per slot. A bind (or merge) alternates between two such requests, so every one writes. The
encode is one 77-token prompt, the text encoder's forward, eager. Writes bench/results/text_encoders.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

# Run as a file, Python puts bench/ first on sys.path: bench.harness needs the checkout's root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import markdown_table, use_repo_compile_cache, write_results

use_repo_compile_cache()

CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, vocab_size=49408, projection_dim=768, eos_token_id=2)
TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")


def encoders(full_size: bool):
    from transformers import CLIPTextConfig, CLIPTextModel

    from hotlora.families._tiny import clip_config, clip_tokenizer

    config = CLIPTextConfig(**CLIP_L) if full_size else clip_config()
    return SimpleNamespace(text_encoder=CLIPTextModel(config).eval(), tokenizer=clip_tokenizer())


def request(text_encoder, rank: int, seed: int):
    """Both slots: LoRA on every targeted layer and two embedding tokens each."""
    import torch

    from hotlora.adapters.binding import Binding
    from hotlora.adapters.format.embeddings import Embeddings
    from hotlora.adapters.format.convert import Adapter, LoraWeights

    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, slot in enumerate(("identity", "style")):
        modules = {name: LoraWeights(torch.randn(rank, m.in_features, generator=g) * 0.01,
                                     torch.randn(m.out_features, rank, generator=g) * 0.01, 1.0)
                   for name, m in text_encoder.named_modules() if name.endswith(TARGETS)}
        width = text_encoder.get_input_embeddings().embedding_dim
        embeddings = Embeddings((f"<{slot}0>", f"<{slot}1>"), {"text_encoder": torch.randn(2, width, generator=g)},
                                f"{seed}-{k}")
        adapter = Adapter(f"{slot}-{seed}", "flux", "diffusers", {}, f"{seed}{k}".ljust(64, "0"),
                          text_modules={"text_encoder": modules}, embeddings=embeddings)
        out[slot] = Binding(adapter, 0.8)
    return out


def median_ms(run, runs: int) -> float:
    samples = []
    for _ in range(runs):
        began = time.perf_counter()
        run()
        samples.append((time.perf_counter() - began) * 1000)
    return statistics.median(samples)


def measure(label: str, full_size: bool, rank: int, runs: int) -> dict:
    import torch

    from hotlora.families import family_named
    from hotlora.engine.writers.fused import FusedWriter
    from hotlora.engine.writers.text import TextEncodersWriter, _lora_root, _text_weights

    parts = encoders(full_size)
    text = TextEncodersWriter(parts, family_named("flux"), ("identity", "style"), rows=4)
    requests = [request(parts.text_encoder, rank, seed) for seed in (1, 2)]
    prepare_ms = statistics.median(median_ms(lambda r=r: text.prepare(r), 1) for r in requests)  # first: not cached
    turn = iter(range(10**9))
    apply_ms = median_ms(lambda: text.apply(requests[next(turn) % 2]), runs)
    ids = parts.tokenizer("a photo of a cat", padding="max_length", max_length=77, return_tensors="pt").input_ids
    with torch.no_grad():
        text.apply(requests[0])
        lora_ms = median_ms(lambda: parts.text_encoder(ids), runs)
        text.apply({})
        base_ms = median_ms(lambda: parts.text_encoder(ids), runs)
    factor_bytes = text.nbytes
    # Before: the same LoRA merged into the weights (a FusedWriter per text encoder, as it was).
    merged = FusedWriter(_lora_root(parts.text_encoder), "flux", ("identity", "style"), 0,
                         weights_of=_text_weights("text_encoder"), min_kept=None)
    assignments = [{slot: b for slot, b in r.items()} for r in requests]
    for assignment in assignments:
        merged.prepare(assignment)
    merge_ms = median_ms(lambda: merged.swap(assignments[next(turn) % 2]), runs)
    merged.swap({})
    return {"text encoder": label, "rank": rank, "prepare ms (request thread)": round(prepare_ms, 3),
            "bind ms (unfused)": round(apply_ms, 3), "merge ms (before)": round(merge_ms, 3),
            "encode base ms": round(base_ms, 3), "encode with LoRA ms (unfused)": round(lora_ms, 3),
            "LoRA per encode": f"{(lora_ms / base_ms - 1) * 100:+.1f}%", "factor bytes (now)": factor_bytes,
            "pristine bytes (before)": merged.pristine_bytes}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--full-size", action="store_true", help="also a CLIP-L at its real size")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    rows = [measure("tiny CLIP (32 wide, 2 layers)", False, args.rank, args.runs)]
    if args.full_size:
        rows.append(measure("CLIP-L full size (768 wide, 12 layers)", True, args.rank, args.runs))
    headers = list(rows[0])
    write_results(args.out, "text_encoders", {"rows": rows}, markdown_table(headers, [r.values() for r in rows]),
                  "Text-encoder side of a request: bind (LoRA on q/k/v/out/fc1/fc2 of every layer in both slots, "
                  "unfused; 2 embedding tokens per slot) vs merging the same LoRA (before), and one 77-token encode "
                  "with and without the unfused branch. `.venv/bin/python bench/text_encoders.py --full-size`")


if __name__ == "__main__":
    main()
