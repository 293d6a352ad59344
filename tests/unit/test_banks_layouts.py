"""The banks writer on denoisers whose Linears do not all see one row per sample: a layer fed every
sample's tokens packed into one sequence (Z-Image's embedders: ``packed_linears``) and a layer with
a row every sample shares (Qwen-Image 2.1's t = 0 timestep row: ``mixed_batch_shared_rows``). On a
toy denoiser, each sample's output against the same layers with that sample's LoRA alone."""

import pytest
import torch
from torch import nn

from hotlora.adapters.binding import Binding
from hotlora.adapters.format.convert import Adapter, LoraWeights
from hotlora.adapters.format.validate import problems_with
from hotlora.engine.writers.banks import BanksWriter
from hotlora.errors import SlotStateCorrupt

RANK = 2


class Toy(nn.Module):
    """``embed`` sees the samples' tokens packed (their runs of unequal length), ``proj`` one row per
    sample, ``shared`` a row per sample plus one all samples share (added to every sample)."""

    def __init__(self):
        super().__init__()
        self.embed, self.proj, self.shared = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, tokens: list[torch.Tensor]) -> torch.Tensor:
        runs = self.embed(torch.cat(tokens)).split([len(t) for t in tokens])
        pooled = torch.stack([run.mean(dim=0) for run in runs])
        rows = self.shared(torch.cat([pooled, pooled.new_ones(1, 6)]))
        return self.proj(pooled) + rows[:-1] + rows[-1:]


def segments(args, kwargs):
    return {"embed": [len(t) for t in args[0]]}


def lora_of(model: Toy, seed: int, modules=("embed", "proj")) -> Adapter:
    generator = torch.Generator().manual_seed(seed)
    weights = {name: LoraWeights(down=torch.randn(RANK, getattr(model, name).in_features, generator=generator),
                                 up=torch.randn(getattr(model, name).out_features, RANK, generator=generator),
                                 scaling=0.5) for name in modules}
    return Adapter(name=f"a{seed}", family="toy", layout="diffusers", modules=weights, sha256=f"{seed:064d}")


def alone(model: Toy, adapter: Adapter | None, scale: float, tokens: torch.Tensor) -> torch.Tensor:
    """The sample by itself through layers with the adapter merged (plain arithmetic, no banks)."""
    merged = Toy()
    merged.load_state_dict(model.state_dict())
    if adapter is not None:
        with torch.no_grad():
            for name, w in adapter.modules.items():
                getattr(merged, name).weight += scale * w.scaling * (w.up @ w.down)
    return merged([tokens])[0]


def test_a_packed_layer_adds_each_samples_adapter_over_its_own_tokens():
    torch.manual_seed(0)
    model = Toy()
    reference = Toy()
    reference.load_state_dict(model.state_dict())
    writer = BanksWriter(model, "toy", ("identity",), RANK, entries=4, max_batch=3, packed_linears=("embed",),
                         packed_segments=segments, shared_rows=("shared",))
    assert sorted(writer.ceiling.modules) == ["embed", "proj"] and writer.ceiling.unbatched == {"shared"}
    first, second = lora_of(reference, 1), lora_of(reference, 2)
    tokens = [torch.randn(n, 4) for n in (3, 5, 2)]
    chosen = [(first, 1.0), (None, 0.0), (second, 0.7)]
    writer.bind([{"identity": Binding(a, s) if a is not None else None} for a, s in chosen])
    with torch.no_grad():
        together = model(tokens)
        for row, (adapter, scale) in enumerate(chosen):
            assert torch.allclose(together[row], alone(reference, adapter, scale, tokens[row]), atol=1e-5), row
    # Runs that do not add up to the layer's input are a fault, never a silent misassignment.
    writer.selector.segments = {"embed": [3, 5]}
    with pytest.raises(SlotStateCorrupt, match="packed layer 'embed' got 10 tokens"):
        model.embed(torch.cat(tokens))


def test_an_adapter_on_a_shared_row_is_refused_saying_which_engine_serves_it():
    model = Toy()
    writer = BanksWriter(model, "toy", ("identity",), RANK, entries=3, max_batch=2, shared_rows=("shared",))
    problems = problems_with(lora_of(model, 3, modules=("proj", "shared")), writer.ceiling)
    assert len(problems) == 1
    assert "outside the slot ceiling: shared" in problems[0]
    assert "every sample of a mixed batch shares" in problems[0] and "mixed=False" in problems[0]


def test_a_sequence_first_layer_finds_each_sample_on_its_second_axis():
    """ERNIE-Image's MLPs see [tokens, batch, width]: the banks index the batch there."""
    torch.manual_seed(1)
    model, reference = nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 4)
    reference.load_state_dict(model[0].state_dict())
    writer = BanksWriter(model, "toy", ("identity",), RANK, entries=3, max_batch=2, sequence_first=r"0")
    first = Adapter(name="f", family="toy", layout="diffusers", sha256="1" * 64, modules={"0": LoraWeights(
        down=torch.randn(RANK, 4), up=torch.randn(4, RANK), scaling=1.0)})
    writer.bind([{"identity": None}, {"identity": Binding(first, 0.5)}])
    x = torch.randn(5, 2, 4)  # five tokens of two samples
    with torch.no_grad():
        out = model(x)
        w = first.modules["0"]
        assert torch.allclose(out[:, 0], reference(x[:, 0]), atol=1e-6)
        assert torch.allclose(out[:, 1], reference(x[:, 1]) + 0.5 * x[:, 1] @ (w.up @ w.down).T, atol=1e-5)
