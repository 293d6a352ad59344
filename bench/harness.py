"""What the benchmarks in bench/ share: where compile caches go, the machine line, Markdown
tables and results files (``bench/results/NAME.json`` + ``NAME.md``), adapters for any model. No
torch import at module level: the compile-cache location must be set before torch reads it.

Part of the source checkout, not of the installed package: a script imports it as
``bench.harness`` after putting the checkout's root on ``sys.path`` (run as a file, Python puts
``bench/`` there instead)."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Iterable, Sequence

REPO = Path(__file__).resolve().parents[1]  # the source checkout this file is in


def use_repo_compile_cache() -> None:
    """Benchmarks reuse the repository's inductor cache unless told otherwise."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".cache" / "inductor"))


def allow_many_compiled_engines() -> None:
    """Several compiled engines in one process share the blocks' code objects: let their graphs
    coexist (a server runs one engine and never comes near dynamo's default limit of 8)."""
    import torch

    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024


def machine() -> str:
    import torch

    line = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    return line + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server the bench starts)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(out: str | Path, name: str, data: dict, table: str, description: str) -> None:
    """``NAME.json`` (the machine plus ``data``) and ``NAME.md`` (description and table), each replaced
    whole (a run cut while writing leaves the previous file, which ``--update`` runs read); prints the table."""
    from hotlora.durable import write_atomic

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    where = machine()
    write_atomic(out / f"{name}.json", json.dumps({"machine": where, **data}, indent=2).encode())
    write_atomic(out / f"{name}.md", f"Machine: {where}. {description}\n\n{table}\n".encode())
    print(table)


# --------------------------------------------------------------------- adapters for any model


def denoiser_layers(model: str | os.PathLike) -> tuple[str, dict[str, tuple[int, int]]]:
    """The family and the Linear layers (name -> (in, out)) of a local diffusers model directory's
    denoiser, read from its config alone: the model is built on the meta device, so no weight is
    read and a full-size model costs no memory."""
    import diffusers
    import torch

    from hotlora.engine.writers.base import ceiling_modules
    from hotlora.families import family_of_model_index

    model = Path(model)
    index = json.loads((model / "model_index.json").read_text())
    family = family_of_model_index(index)
    cls = getattr(diffusers, index[family.denoiser][1])
    with torch.device("meta"):
        denoiser = cls.from_config(cls.load_config(str(model / family.denoiser)))
    return family.name, ceiling_modules(denoiser, None)


def bench_adapters(model: str | os.PathLike, target_rank: int, out: str | os.PathLike) -> dict[str, Path]:
    """Random adapters over every Linear of ``model``'s denoiser, in the diffusers layout, written to
    ``out``: ``identity`` (a quarter of ``target_rank``), ``style`` (``target_rank``) and ``style-low``
    (a quarter). Built for whatever model the bench is given, so no bench needs the tiny model's
    sample adapters (``adapters/identity-diffusers``)."""
    from hotlora.tiny import random_lora, save_diffusers_lora

    family, linears = denoiser_layers(model)
    out = Path(out)
    low = max(1, target_rank // 4)
    specs = {"identity": (low, 1), "style": (target_rank, 2), "style-low": (low, 3)}
    return {name: save_diffusers_lora(out / name, family, random_lora(linears, rank, seed), rank=rank, alpha=rank)
            for name, (rank, seed) in specs.items()}
