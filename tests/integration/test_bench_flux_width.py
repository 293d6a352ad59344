"""bench/flux_width.py's model directory (FLUX.1 at its width with fewer blocks: the edit task's real-width
rows): a pipeline diffusers loads, and two adapters that land on the layers they name. Built here narrow
(one head, 64-wide text states) so it takes seconds; the bench builds it at the published width."""

from bench.flux_width import ATTENTION, save


def test_the_saved_model_loads_with_both_adapters_on_their_layers(tmp_path):
    import torch
    from diffusers import FluxKontextPipeline, FluxPipeline
    from peft.tuners.lora import LoraLayer

    adapters = save(tmp_path / "flux-width", layers=1, single_layers=2, heads=1, text_width=64)
    pipeline = FluxPipeline.from_pretrained(tmp_path / "flux-width", local_files_only=True, dtype=torch.float32)
    assert (len(pipeline.transformer.transformer_blocks), len(pipeline.transformer.single_transformer_blocks)) == (1, 2)
    linears = {module_name for module_name, module in pipeline.transformer.named_modules()
               if isinstance(module, torch.nn.Linear) and module_name.startswith(("transformer_blocks.",
                                                                                 "single_transformer_blocks."))}
    for name, source in adapters.items():
        pipeline.load_lora_weights(source, adapter_name=name)
    on = {name: {module_name for module_name, module in pipeline.transformer.named_modules()
                 if isinstance(module, LoraLayer) and name in module.lora_A} for name in adapters}
    assert on["r32"] == linears  # every Linear of the blocks
    assert on["r128"] and on["r128"] == {name for name in linears if name.endswith(ATTENTION)}
    assert on["r128"] < on["r32"]
    edit = FluxKontextPipeline.from_pipe(pipeline)  # the edit task's pipeline, as bench/tasks.py makes it
    assert edit.transformer is pipeline.transformer
