"""The command that builds a full-size model offline for the full-size runs (``bench/full_size.py``)::

    python -m hotlora.fullsize.MODULE build DIR [--seed 0] [--dtype bfloat16] [--adapters DIR] [--no-adapters]

the pipeline from its published configuration with random seeded weights, saved once under DIR like a
Hub snapshot, then its adapters as its trainers write them (each module's ``save`` and ``write_adapters``).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Callable


def build_command(argv: list[str] | None, *, module: str, what: str, save: Callable,
                  write_adapters: Callable[[Path], dict[str, Path]]) -> None:
    import torch

    parser = argparse.ArgumentParser(prog=f"python -m hotlora.fullsize.{module}", description=f"the full-size {what}, random")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help=f"save the full-size {what} pipeline (and its adapters) under DIR")
    build.add_argument("directory", type=Path)
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--dtype", default="bfloat16", help="the saved weights' dtype")
    build.add_argument("--adapters", type=Path, default=None, help="where the adapters go (default: DIR/adapters)")
    build.add_argument("--no-adapters", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not (args.directory / "model_index.json").is_file():
        save(args.directory, args.seed, getattr(torch, args.dtype))
    if not args.no_adapters:
        paths = write_adapters(args.adapters or args.directory / "adapters")
        print(json.dumps({k: str(v) for k, v in paths.items()}, indent=2))
