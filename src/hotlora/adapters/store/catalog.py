"""The adapter catalog: adapters to fetch and convert at start-up ("pre-cache what you can enumerate").

TOML (or YAML with the same shape)::

    [adapters.watercolor]
    ref = "hf://someone/watercolor-lora"
    scale = 0.8        # default scale when a request names the entry without one
    # relative paths are relative to the catalog file
    pin = true         # keep in the RAM tier, never evicted
    # the inference defaults it was trained for (a step-distilled LoRA), over any its file declares
    num_inference_steps = 4
    guidance_scale = 1.0
    shift = 5.0        # the scheduler's timestep shift (a model with a fixed one: Wan, SD3, Z-Image)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from hotlora.adapters.defaults import PARAMETERS as DECLARABLE, RULES, valid_value
from hotlora.adapters.store.references import parse_reference
from hotlora.settings import read_config_file
from hotlora.errors import HotloraError


class CatalogError(HotloraError):
    """The catalog file itself is wrong: a start-up fault, reported with the entry at fault."""


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    ref: str
    scale: float = 1.0
    pin: bool = False
    # num_inference_steps / guidance_scale / shift the entry declares (``adapters.defaults``); they override
    # what the file's header declares: the operator's catalog is the word about how it is served.
    declared: tuple[tuple[str, int | float], ...] = ()


def load_catalog(path: str | Path) -> dict[str, CatalogEntry]:
    path = Path(path)
    data = read_config_file(path)
    entries = data.get("adapters") if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        raise CatalogError(f"{path}: expected an 'adapters' table of named entries")
    catalog = {}
    for name, entry in entries.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("ref"), str):
            raise CatalogError(f"{path}: entry {name!r} needs a string 'ref'")
        unknown = set(entry) - {"ref", "scale", "pin", *DECLARABLE}
        if unknown:
            raise CatalogError(f"{path}: entry {name!r} has unknown fields {sorted(unknown)}")
        scale = entry.get("scale", 1.0)
        if not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise CatalogError(f"{path}: entry {name!r} has a non-numeric scale")
        ref = entry["ref"]
        if parse_reference(ref).kind == "file" and not Path(ref.removeprefix("file://")).is_absolute():
            ref = str(path.parent.resolve() / ref.removeprefix("file://"))  # relative to the catalog file
        catalog[name] = CatalogEntry(name, ref, float(scale), bool(entry.get("pin", False)),
                                     _declared(path, name, entry))
    return catalog


def _declared(path: Path, name: str, entry: dict) -> tuple[tuple[str, int | float], ...]:
    declared = []
    for parameter in DECLARABLE:
        given = entry.get(parameter)
        if given is None:
            continue
        value = valid_value(parameter, given)
        if value is None:
            raise CatalogError(f"{path}: entry {name!r} has {parameter} {given!r}, not {RULES[parameter]}")
        declared.append((parameter, value))
    return tuple(declared)
