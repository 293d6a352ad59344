"""What crosses the engine process's pipe besides requests and results: adapters (held by key, or
packed into one shared-memory buffer the first time), the child's spans as records replayed into
the request's trace, and errors as records rebuilt on the server's side (engine/process.py)."""

from __future__ import annotations

import dataclasses
import importlib
import io
import pickle
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from hotlora.errors import EngineError, HotloraError
from hotlora.tracing import Trace


@dataclasses.dataclass(frozen=True)
class Held:
    """An adapter the engine process already holds, by its key."""

    key: tuple


@dataclasses.dataclass(frozen=True)
class Packed:
    """An adapter crossing for the first time: its record pickled with every tensor replaced by a
    place in ONE shared-memory buffer. Why: torch's own reductions share each tensor's storage
    separately, with a file descriptor (and a socket handshake) apiece; an adapter of 700 tensors
    then took seconds to cross where one buffer takes one copy."""

    key: tuple
    record: bytes
    buffer: Any  # a uint8 tensor in shared memory
    places: tuple  # per tensor: (offset, bytes, dtype, shape)

    @classmethod
    def of(cls, adapter) -> "Packed":
        import torch

        tensors: dict[int, int] = {}  # id -> index: a tensor named twice (q, k, v's shared down) crosses once
        ordered: list = []

        class Pickler(pickle.Pickler):
            def persistent_id(self, obj):
                if isinstance(obj, torch.Tensor):
                    if id(obj) not in tensors:
                        tensors[id(obj)] = len(ordered)
                        ordered.append(obj)
                    return tensors[id(obj)]
                return None

        record = io.BytesIO()
        Pickler(record, protocol=pickle.HIGHEST_PROTOCOL).dump(adapter)
        buffer = torch.empty(sum(t.nbytes for t in ordered), dtype=torch.uint8).share_memory_()
        places, offset = [], 0
        for tensor in ordered:
            flat = tensor.detach().contiguous()
            buffer[offset:offset + flat.nbytes].view(flat.dtype).view(flat.shape).copy_(flat)
            places.append((offset, flat.nbytes, flat.dtype, tuple(flat.shape)))
            offset += flat.nbytes
        return cls(adapter.key, record.getvalue(), buffer, tuple(places))

    def unpack(self):
        """The adapter, its tensors views into the buffer (kept alive while the adapter is)."""
        buffer, places = self.buffer, self.places

        class Unpickler(pickle.Unpickler):
            def persistent_load(self, index):
                offset, size, dtype, shape = places[index]
                return buffer[offset:offset + size].view(dtype).view(shape)

        adapter = Unpickler(io.BytesIO(self.record)).load()
        adapter.__dict__["key"] = self.key  # the server's key (``hash`` of text differs between processes)
        return adapter


class RecordedTrace(Trace):
    """In the child: spans and events kept as records, replayed into the request's own trace by
    the server (OpenTelemetry spans do not cross processes; their timestamps do)."""

    recording = True

    def __init__(self):
        self.records: list[tuple] = []

    @contextmanager
    def span(self, name: str, **attributes) -> Iterator[None]:
        began = time.time_ns()
        try:
            yield None
        finally:
            self.records.append(("span", name, began, time.time_ns(), attributes))

    def record(self, name: str, start_ns: int, end_ns: int, **attributes) -> None:
        self.records.append(("span", name, start_ns, end_ns, attributes))

    def event(self, name: str, **attributes) -> None:
        self.records.append(("event", name, attributes))


def replay(trace: Trace, records: Sequence[tuple]) -> None:
    for record in records:
        if record[0] == "span":
            _, name, start, end, attributes = record
            trace.record(name, start, end, **attributes)
        else:
            trace.event(record[1], **record[2])


def error_record(exc: BaseException) -> tuple:
    """An exception as (module, class, message, attributes): hotlora's errors take their own
    arguments, which pickling an exception does not carry."""
    attributes = {k: v for k, v in vars(exc).items() if _plain(v)}
    return type(exc).__module__, type(exc).__qualname__, str(exc), attributes


def error_of(record: tuple) -> BaseException:
    module, name, message, attributes = record
    try:
        cls = getattr(importlib.import_module(module), name)
        if not (isinstance(cls, type) and issubclass(cls, HotloraError)):
            raise TypeError(name)
        exc = cls.__new__(cls)
        Exception.__init__(exc, message)
        exc.__dict__.update(attributes)
        return exc
    except Exception:  # anything but one of ours is an engine fault, named by its class
        return EngineError(f"{name}: {message}")


def _plain(value) -> bool:
    return isinstance(value, (str, int, float, bool, type(None), list, tuple, dict))
