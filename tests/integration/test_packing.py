"""Packed adapters (engine/writers/packing.py) and the slots' flat buffers (engine/writers/slots.py).

The packed layout must change nothing an adapter means, and a slot must hold exactly the
request's update after any sequence of packed and per-module swaps of any ranks and scales."""

import random

import pytest
import torch

from hotlora import Engine
from hotlora.adapters.binding import Binding
from hotlora.adapters.format.convert import Adapter, LoraWeights
from hotlora.engine.writers.packing import MAX_PADDING, PackLayout, pack
from hotlora.engine.writers.slots import SlotsWriter
from hotlora.testing import random_lora

from ..helpers import TARGET_RANK


@pytest.fixture(scope="module")
def engine(tiny_models):
    return Engine.from_pretrained(tiny_models["flux"], target_rank=TARGET_RANK, batch_size=1, compile=False)


def make_adapter(linears, rank, seed, modules=None, scalings=None, dtype=torch.float32) -> Adapter:
    modules = list(modules or linears)
    sd = random_lora(linears, rank, seed, modules=modules)
    rng = random.Random(seed)
    weights = {
        m: LoraWeights(sd[f"{m}.lora_A.weight"].to(dtype), sd[f"{m}.lora_B.weight"].to(dtype),
                       scalings[m] if scalings else 0.5)
        for m in modules
    }
    name = f"r{rank}-s{seed}-{rng.random():.6f}"
    return Adapter(name, "flux", "diffusers", weights, sha256=name)


def deltas(adapter: Adapter) -> dict[str, torch.Tensor]:
    return {m: w.scaling * (w.up.double() @ w.down.double()) for m, w in adapter.modules.items()}


def test_packing_keeps_every_weight_and_leaves_the_adapter_untouched(engine):
    linears = dict(engine.ceiling.modules)
    adapter = make_adapter(linears, 5, seed=1)
    before = {m: (w.down.clone(), w.up.clone(), w.scaling, w.down.data_ptr()) for m, w in adapter.modules.items()}
    packed = pack(adapter, engine.writer.layout)
    assert packed is not None and packed.rows == 5 and packed.scaling == 0.5 and not packed.folded
    for module, (down, up, scaling, pointer) in before.items():
        w = adapter.modules[module]
        assert torch.equal(w.down, down) and torch.equal(w.up, up) and w.scaling == scaling
        assert w.down.data_ptr() == pointer  # cached adapters are shared: packing never re-points them
        assert torch.equal(engine.writer.layout.down_view(packed.down, module, 5), down)
        assert torch.equal(engine.writer.layout.up_view(packed.up, module, 5), up)
    # The writer packs once per adapter, on the request's thread, into its side table.
    engine.writer.prepare({"identity": Binding(adapter, 1.0)})
    held = engine.writer.packs.get(adapter)
    engine.writer.prepare({"style": Binding(adapter, 0.5)})
    assert held is not None and engine.writer.packs.get(adapter) is held


def test_uneven_alphas_are_folded_and_the_update_is_unchanged(engine):
    linears = dict(engine.ceiling.modules)
    scalings = {m: 0.25 + (i % 5) / 4 for i, m in enumerate(linears)}
    adapter = make_adapter(linears, 4, seed=2, scalings=scalings)
    expected = deltas(adapter)
    packed = pack(adapter, engine.writer.layout)
    assert packed is not None and packed.folded and packed.scaling == 1.0
    for module, delta in deltas(adapter).items():
        torch.testing.assert_close(delta, expected[module], rtol=1e-6, atol=1e-7)


def test_what_stays_per_module(engine):
    linears = dict(engine.ceiling.modules)
    names = sorted(linears)
    few = make_adapter(linears, 4, seed=3, modules=names[: max(1, len(names) // 4)])
    assert pack(few, engine.writer.layout) is None, \
        f"an adapter on a quarter of the modules would pack into more than {MAX_PADDING}x its size"
    mixed = make_adapter(linears, 4, seed=4)
    first = next(iter(mixed.modules))
    w = mixed.modules[first]
    mixed.modules[first] = LoraWeights(w.down.half(), w.up.half(), w.scaling)
    assert pack(mixed, engine.writer.layout) is None  # one buffer holds one dtype
    other_layout = PackLayout.of(dict(list(linears.items())[::-1]))
    elsewhere = make_adapter(linears, 4, seed=5)
    assert pack(elsewhere, other_layout).layout_key != pack(elsewhere, engine.writer.layout).layout_key


def slot_deltas(engine, slot) -> dict[str, torch.Tensor]:
    state = engine.writer._slots[slot]
    return {m: state.up[m].double() @ state.down[m].double() for m in state.down}


def test_the_pack_cache_holds_two_requests_at_the_target_rank(tiny_models, monkeypatch):
    """The request being swapped in and the next one stay packed however large the slots are: a
    fixed 2 GiB held one full-size Flux adapter of rank 128, and preparing a pair's second adapter
    evicted its first (an H200 run), whose slot then took the per-module path."""
    monkeypatch.setattr(SlotsWriter, "MIN_PACK_CACHE_BYTES", 0)  # the tiny slots' own size sets the bound
    writer = Engine.from_pretrained(tiny_models["flux"], target_rank=TARGET_RANK, batch_size=1, compile=False).writer
    assert writer.pack_cache_bytes == 2 * writer.nbytes
    linears = dict(writer.ceiling.modules)
    adapters = [make_adapter(linears, TARGET_RANK, seed=40 + k) for k in range(5)]
    for first, second in ((0, 1), (2, 3)):
        writer.prepare({"identity": Binding(adapters[first], 1.0), "style": Binding(adapters[second], 1.0)})
    assert all(writer.packs.get(a) is not None for a in adapters[:4])
    report = writer.swap({"identity": Binding(adapters[0], 0.9), "style": Binding(adapters[1], 0.7)})
    assert report.packed_writes == 2 and report.per_module_writes == 0
    writer.prepare({"identity": Binding(adapters[4], 1.0)})  # a fifth: something older goes, within the bound
    assert writer.packs.get(adapters[4]) is not None and writer.packs.bytes <= writer.pack_cache_bytes
    assert sum(writer.packs.get(a) is not None for a in adapters) == 4


def test_any_sequence_of_swaps_leaves_exactly_the_requested_update(engine):
    """Packed and per-module writes, ranks up and down, scales including 0 and empty slots: after
    every swap each module of each slot holds ``weight * alpha / r * B @ A`` of its adapter, or 0."""
    linears = dict(engine.ceiling.modules)
    names = sorted(linears)
    rng = random.Random(7)
    pool = []
    for k, rank in enumerate((1, 3, TARGET_RANK, 2, 6, TARGET_RANK)):
        if k % 3 == 1:  # sparse: stays per-module
            adapter = make_adapter(linears, rank, seed=10 + k, modules=rng.sample(names, len(names) // 3))
        elif k == 5:  # uneven alphas: folded when packed
            adapter = make_adapter(linears, rank, seed=10 + k, scalings={m: 0.1 * (1 + i % 7) for i, m in enumerate(names)})
        else:
            adapter = make_adapter(linears, rank, seed=10 + k)
        expected = deltas(adapter)
        engine.writer.prepare({"identity": Binding(adapter, 1.0)})
        assert (engine.writer.packs.get(adapter) is None) == (k % 3 == 1)
        pool.append((adapter, expected))
    kinds = {"packed": 0, "per module": 0}
    for step in range(40):
        request = {}
        for slot in engine.writer.slot_names:
            if rng.random() < 0.15:
                continue  # empty slot
            adapter, expected = rng.choice(pool)
            scale = rng.choice([0.0, 0.35, 1.0, 1.4])
            request[slot] = (adapter, scale, expected)
        report = engine.writer.swap({slot: Binding(a, s) for slot, (a, s, _) in request.items()})
        kinds["packed"] += report.packed_writes
        kinds["per module"] += report.per_module_writes
        for slot in engine.writer.slot_names:
            held = slot_deltas(engine, slot)
            adapter, scale, expected = request.get(slot, (None, 0.0, {}))
            # Nothing of an earlier occupant lingers beyond this one's rank, in A or in B.
            state, rank = engine.writer._slots[slot], adapter.rank if adapter is not None and scale else 0
            assert not state.flat_down[rank:].any() and not state.flat_up[rank:].any(), f"step {step}, slot {slot}"
            for module in names:
                want = scale * expected[module] if module in expected else torch.zeros_like(held[module])
                torch.testing.assert_close(held[module], want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"step {step}, slot {slot}, {module}: {m}")
    assert kinds["packed"] > 5 and kinds["per module"] > 5, kinds
    engine.writer.check_intact()


def test_a_weight_moved_away_from_the_slot_buffers_is_caught(tiny_models):
    from hotlora.engine.writers.slots import PEFT_ADAPTER
    from hotlora.errors import SlotStateCorrupt

    engine = Engine.from_pretrained(tiny_models["flux"], target_rank=TARGET_RANK, batch_size=1, compile=False)
    engine.writer.check_intact()
    layer = engine.denoiser.get_submodule(next(iter(engine.ceiling.modules)))
    weight = layer.lora_B[PEFT_ADAPTER].weight
    # What Module.to() or a careless load would do: the same values, no longer a view of the slots.
    layer.lora_B[PEFT_ADAPTER].weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)
    with pytest.raises(SlotStateCorrupt):
        engine.writer.check_intact()
    layer.lora_B[PEFT_ADAPTER].weight = weight
    engine.writer.check_intact()
    weight.data = weight.detach().clone()  # the same Parameter, other storage
    with pytest.raises(SlotStateCorrupt):
        engine.writer.check_intact()


def test_a_packed_adapter_still_serialises_and_exports(engine, tmp_path):
    """Packing for the slots changes nothing the disk cache and ``adapters convert`` see."""
    from hotlora.adapters.store.diskcache import deserialize, serialize
    from hotlora.adapters.format.export import save_as_diffusers
    from hotlora.adapters.format.convert import load_adapter
    from hotlora.families import family_named

    linears = dict(engine.ceiling.modules)
    # Uneven alphas: the packed B holds them folded in; the adapter keeps its own scalings.
    adapter = make_adapter(linears, 3, seed=21, scalings={m: 0.2 * (1 + i % 3) for i, m in enumerate(linears)})
    expected = deltas(adapter)
    engine.writer.prepare({"identity": Binding(adapter, 1.0)})
    assert engine.writer.packs.get(adapter) is not None
    for copy in (deserialize(serialize(adapter)),
                 load_adapter(save_as_diffusers(adapter, tmp_path / "exported"), family_named("flux"))):
        got = deltas(copy)
        assert set(got) == set(expected)
        for module, delta in expected.items():
            torch.testing.assert_close(got[module], delta, rtol=1e-5, atol=1e-6)


def test_the_engine_process_packs_a_new_adapter_when_prepared_not_when_sent(engine, tiny_models):
    """``EngineProcess.prepare`` (the server's pool thread) packs an adapter the child does not hold
    into shared memory; sending it (the worker's thread) takes that pack; once held, it crosses by
    key and is never packed again. The proxy's own state, without a child."""
    from types import SimpleNamespace

    from hotlora.engine.process import EngineProcess
    from hotlora.engine.wire import Held, Packed
    from hotlora.lru import LRU

    proxy = SimpleNamespace(front=engine.front, _held=set(), _packs=LRU(max_entries=8))
    source = tiny_models["flux"] / "adapters" / "identity-diffusers"
    prepared = EngineProcess.prepare(proxy, "a portrait", adapters={"identity": source})
    key = prepared.adapters["identity"].adapter.key
    pack = proxy._packs.get(key)
    assert isinstance(pack, Packed) and pack.buffer.is_shared()
    wire, _ = EngineProcess._wire(proxy, prepared)
    assert wire.adapters["identity"].adapter is pack and key in proxy._held and proxy._packs.get(key) is None
    again = EngineProcess.prepare(proxy, "another", adapters={"identity": source})
    assert proxy._packs.get(key) is None
    assert isinstance(EngineProcess._wire(proxy, again)[0].adapters["identity"].adapter, Held)
    unpacked = pack.unpack()
    assert all(torch.equal(unpacked.modules[m].down, w.down) for m, w in prepared.adapters["identity"].adapter.modules.items())
