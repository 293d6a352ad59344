"""GPU timings are synchronised at the measurement boundary: diffusers returns device tensors
without a host sync, so a chunk's clock must be read only after the device's queue drained.
No GPU here: a pipeline that says it lives on ``cuda`` and a recording ``torch.cuda.synchronize``."""

import torch

from hotlora.engine import runner
from hotlora.engine.device import synchronize
from hotlora.engine.request import Timings
from hotlora.engine.runner import plan_chunks, run_chunks


class CudaLookingPipeline:
    device = torch.device("cuda")

    def __init__(self, events):
        self.events = events

    def __call__(self, *, num_images_per_prompt, **kwargs):
        self.events.append("denoise")

        class Output:
            images = torch.zeros(num_images_per_prompt, 1, 2, 2)

        return Output()


def test_each_chunk_is_timed_after_the_device_synchronises(monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(f"sync:{torch.device(device)}"))
    clock = iter(range(100))
    monkeypatch.setattr(runner.time, "perf_counter", lambda: events.append("clock") or next(clock))
    timings = Timings()
    (images,) = run_chunks(CudaLookingPipeline(events), plan_chunks([3], 2), seeds=[0], output_type="pt",
                           call_kwargs={"prompt": "x", "num_inference_steps": 1}, timings=[timings])
    assert images.shape[0] == 3
    assert events == ["clock", "denoise", "sync:cuda", "clock"] * 2
    assert len(timings.generate_ms) == 2


def test_synchronize_is_a_no_op_on_the_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    synchronize("cpu")
    synchronize(torch.device("cpu"))
    assert calls == []
    synchronize("cuda:1")
    assert calls == [torch.device("cuda:1")]


class SteppingPipeline(CudaLookingPipeline):
    """Calls diffusers' ``callback_on_step_end`` after each of its steps, then "decodes"."""

    def __call__(self, *, num_images_per_prompt, num_inference_steps, callback_on_step_end=None, **kwargs):
        for step in range(num_inference_steps):
            self.events.append(f"step{step}")
            callback_on_step_end(self, step, 0, {})
        self.events.append("decode")

        class Output:
            images = torch.zeros(num_images_per_prompt, 1, 2, 2)

        return Output()


def test_the_decode_starts_where_the_last_step_ended_synchronised_and_is_traced(monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from hotlora.server.tracing import Tracing

    events, progress = [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    clock = iter([0.0, 3.0, 4.0, 10.0, 12.0, 13.0])  # chunk 1 (2 images): 0 -> 3 -> 4; chunk 2: 10 -> 12 -> 13
    monkeypatch.setattr(runner.time, "perf_counter", lambda: events.append("clock") or next(clock))
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing, timings = Tracing(provider), Timings()
    try:
        with tracing.request({}, "POST", "/v1/generate") as trace:
            run_chunks(SteppingPipeline(events), plan_chunks([3], 2), seeds=[0], output_type="pt",
                       call_kwargs={"prompt": "x", "num_inference_steps": 2}, timings=[timings], trace=trace,
                       progress=lambda done, total: progress.append((done, total)))
    finally:
        tracing.shutdown()
    chunk = ["clock", "step0", "step1", "sync", "clock", "decode", "sync", "clock"]
    assert events == chunk * 2  # the boundary is read once per chunk, after the device drained
    assert timings.generate_ms == [4000.0, 3000.0] and timings.decode_ms == [1000.0, 1000.0]
    assert timings.chunks == [2, 1]
    assert progress == [(1, 4), (2, 4), (3, 4), (4, 4)]  # the listener still hears every step
    spans = [s for s in memory.get_finished_spans() if s.name in ("denoise", "decode")]  # in the order recorded
    assert [(s.name, s.attributes["images"]) for s in spans] == [("denoise", 2), ("decode", 2), ("denoise", 1),
                                                                  ("decode", 1)]
    durations = [(s.end_time - s.start_time) / 1e9 for s in spans]
    assert [round(d, 3) for d in durations] == [3.0, 1.0, 2.0, 1.0]
