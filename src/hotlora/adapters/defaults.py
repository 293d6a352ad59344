"""Inference defaults an adapter declares: the steps and guidance a step-distilled LoRA (Lightning,
Turbo, Hyper, lightx2v) was trained for, which the model's own 30-50 steps would waste or ruin.

Declared in the safetensors header's ``__metadata__`` (values are strings there, as safetensors
requires), under hotlora's namespace::

    hotlora.num_inference_steps = "4"      an integer >= 1
    hotlora.guidance_scale      = "1.0"    a finite number >= 0
    hotlora.shift               = "5.0"    a finite number > 0: the scheduler's timestep shift

No trainer writes an equivalent key that could be cited (kohya's ``ss_*`` keys and diffusers'
``lora_adapter_metadata`` describe training, not inference; the Lightning / Hyper / lightx2v
releases give their steps in model cards and code), so only these keys are read. A declared shift
is applied where the model's scheduler has a fixed one (``engine.shift``: Wan, SD3, Z-Image), with
a scheduler of its own for the run; it is ignored on a model that shifts by image size (Flux).

Rules (``merge``): a value the request sets always wins; otherwise the adapters' declarations
apply, and adapters that disagree on a value the request leaves open are refused (InvalidRequest)
rather than one picked: slots are named, not ordered, and neither value is what the pair was trained
for. A slot at scale 0 writes nothing and declares nothing.
"""

from __future__ import annotations

import math
from typing import Mapping

from hotlora.errors import AdapterFormatError, InvalidRequest

PREFIX = "hotlora."
PARAMETERS = ("num_inference_steps", "guidance_scale", "shift")
RULES = {"num_inference_steps": "an integer >= 1", "guidance_scale": "a finite number >= 0",
         "shift": "a finite number > 0"}
MAX_DECLARED_CHARS = 32  # "4", "1.0": anything longer is not a number a trainer meant


def read_declared(header_metadata: Mapping | None, label: str) -> dict[str, int | float]:
    """The parameters a file's ``__metadata__`` declares, parsed; a declared value that is not one
    (``"four"``, ``"-1"``, ``"nan"``) is the file's error, refused with its key rather than ignored:
    the adapter would otherwise run at the model's defaults with no word of why."""
    if not isinstance(header_metadata, Mapping):
        return {}
    declared: dict[str, int | float] = {}
    for name in PARAMETERS:
        raw = header_metadata.get(PREFIX + name)
        if raw is None:
            continue
        value = _parse(name, raw)
        if value is None:
            shown = raw[:MAX_DECLARED_CHARS] if isinstance(raw, str) else type(raw).__name__
            rule = RULES[name]
            raise AdapterFormatError(f"{label}: {PREFIX}{name} in the header is {shown!r}, not {rule}")
        declared[name] = value
    return declared


def _parse(name: str, raw) -> int | float | None:
    if not isinstance(raw, str) or len(raw) > MAX_DECLARED_CHARS:
        return None
    try:
        value = int(raw.strip()) if name == "num_inference_steps" else float(raw.strip())
    except ValueError:
        return None
    return valid_value(name, value)


def valid_value(name: str, value) -> int | float | None:
    """``value`` as parameter ``name`` takes it (``RULES``), or None where it is not one."""
    if isinstance(value, bool):
        return None
    if name == "num_inference_steps":
        return value if isinstance(value, int) and value >= 1 else None
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value) if (value > 0 if name == "shift" else value >= 0) else None


def merge(declared: Mapping[str, Mapping[str, int | float]], given: Mapping[str, object]) -> dict[str, dict]:
    """The defaults a request gets from its adapters: ``{parameter: {"value": v, "slots": [...]}}``
    for each parameter the request leaves open (``given[parameter] is None``) and at least one slot
    declares. ``declared``: slot -> that slot's declarations (writing slots only). Disagreement on an
    open parameter is an InvalidRequest naming each slot's value and how to settle it."""
    applied: dict[str, dict] = {}
    problems = []
    for name in PARAMETERS:
        if given.get(name) is not None:
            continue  # the request's own value wins
        by_slot = {slot: values[name] for slot, values in sorted(declared.items()) if name in values}
        if not by_slot:
            continue
        if len({float(v) for v in by_slot.values()}) > 1:
            listed = ", ".join(f"[{slot}] {value:g}" for slot, value in by_slot.items())
            problems.append(f"the adapters declare different {name} ({listed}); set {name} in the request")
            continue
        applied[name] = {"value": next(iter(by_slot.values())), "slots": list(by_slot)}
    if problems:
        raise InvalidRequest("; ".join(problems))
    return applied


def applied_text(applied: Mapping[str, Mapping]) -> str:
    """``merge``'s answer in one line: ``num_inference_steps=4 (distill); guidance_scale=1 (distill)``."""
    return "; ".join(f"{name}={entry['value']:g} ({', '.join(entry['slots'])})" for name, entry in applied.items())
