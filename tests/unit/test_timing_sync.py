"""GPU timings are synchronised at the measurement boundary: diffusers returns device tensors
without a host sync, so a chunk's clock must be read only after the device's queue drained.
No GPU here: a pipeline that says it lives on ``cuda`` and a recording ``torch.cuda.synchronize``."""

import torch

from hotlora.engine import runner
from hotlora.engine.runner import Timings, run_pack, synchronize


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
    images = run_pack(CudaLookingPipeline(events), prompt="x", num_images=3, batch_size=2, seed=0,
                      output_type="pt", call_kwargs={"num_inference_steps": 1}, timings=timings)
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
