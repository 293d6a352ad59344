"""``hotlora_adapter_mode_total{mode}``: requests with adapters, by the path that served them
(``mode`` in each slot's response entry); fused mode's kept histogram sees only fused requests."""

from types import SimpleNamespace

from hotlora.server.metrics import Metrics


def test_each_request_with_adapters_is_counted_once_by_its_path():
    worker = SimpleNamespace(ready=True, depth=0, rebuilds=0, batches=0, engine=None, store=None)
    metrics = Metrics(worker)
    fused = {"identity": {"mode": "fused", "fused_kept": 0.999}, "style": {"mode": "fused", "fused_kept": 0.999}}
    slots = {"identity": {"mode": "slots", "fused_kept": 0.44}, "style": None}  # auto: not fused, and why
    for adapters in (fused, slots, slots, {}, {"identity": {"mode": "slots"}}):
        metrics.observe({"total_ms": 10.0}, adapters)

    def sample(name, **labels):
        return metrics.registry.get_sample_value(name, labels) or 0.0

    assert sample("hotlora_adapter_mode_total", mode="fused") == 1
    assert sample("hotlora_adapter_mode_total", mode="slots") == 3
    assert sample("hotlora_fused_kept_fraction_count") == 1  # 0.44 was never merged: not observed
