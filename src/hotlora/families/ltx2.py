"""LTX-2 (LTX2Pipeline): text-to-video with its audio. One transformer denoises a video stream and
an audio stream together (each block: the video's and the audio's self- and cross-attention, the
two streams' cross-attention both ways, their feed-forwards); a Gemma 3 text encoder whose hidden
states a ``connectors`` model turns into the video's and the audio's prompt tokens; a video VAE,
an audio VAE and a vocoder. diffusers loads LoRA into the transformer and the connectors
(``LTX2LoraLoaderMixin``; the trainers' ComfyUI layout puts the connectors' part under
``text_embedding_projection.``, converted there).

The connectors run inside ``__call__`` on the encoded prompt, so their LoRA is applied as the text
encoders' is (``engine/writers/text.py``: unfused, through forward hooks, pointed at the request's
adapters before its pipeline call); the transformer's gets the slots. A batch mixing requests would
run every request's prompt through one connectors state: LTX-2 serves one request per forward batch
(``mixed_batches``).

Guidance, read from ``LTX2Pipeline.__call__``: classifier-free guidance as ONE doubled batch
``[negative, positive]``, run whenever the video's ``guidance_scale`` or the audio's
``audio_guidance_scale`` (7.0 by default) is above 1, so always at the pipeline's defaults
(``doubles_batch``); then a spatio-temporal guidance pass (``stg_scale`` 1.0, the blocks named by
``spatio_temporal_guidance_blocks``, [28] by default) and a modality-isolation pass
(``modality_scale`` 3.0), each over the undoubled batch. hotlora's ``guidance_scale`` is the video's;
the audio's guidance, STG, modality isolation and guidance rescale stay at the pipeline's defaults
(the LTX-2 model card's), fixed for every request. Prompts are padded to ``max_sequence_length``
(1024) on the left: one text shape whatever the prompt.

Frames: 8k + 1 (the published VAE compresses time 8x keeping the first frame); the pipeline would
round another count silently, so a request is refused instead (``frame_problems``). The frame rate
(24, ``__call__``'s default ``frame_rate``) sets the audio's length and the rotary positions; hotlora
runs the default and encodes the video at it.

Image-to-video is not served (``refused_tasks``): ``LTX2ImageToVideoPipeline`` re-compresses its
image with H.264 (CRF 33 for Gemma 3 models, what the model was trained on) and takes one PIL image a
call for it, then indexes that one image per video of the batch: one video a call, which the chunked
runner does not yet know how to ask for.

What LTX-2 shares with LTX-Video (``LTXVideo``: the VAE's compression ratios as the size rule, the
prompt encoding with its attention mask) is inherited.

The audio: the pipeline makes it with every video (``LTX2PipelineOutput.audio``, a waveform at the
vocoder's rate, ``audio_rate``): the result carries it beside the frames, and the MP4 as AAC.
"""

from __future__ import annotations

from typing import Mapping

from hotlora.families.ltx import LTXVideo


class LTX2Video(LTXVideo):
    name = "ltx2"
    pipeline_class = "LTX2Pipeline"
    denoiser_class = "LTX2VideoTransformer3DModel"
    # The audio stream's layers, which LTX-Video's blocks lack, as diffusers and ComfyUI name them.
    lora_key_pattern = (r"(?:^|transformer\.|diffusion_model\.)transformer_blocks[._]\d+[._]"
                        r"(?:audio_attn[12]|audio_ff|audio_to_video_attn|video_to_audio_attn)[._]")
    base_model_markers = ("ltx-2", "ltx2", "ltx_2", "ltx 2")
    # The LTX-2 model card's text-to-video example: 40 steps, guidance 4.0, 512 x 768, 121 frames at 24 fps.
    default_steps, default_guidance = 40, 4.0
    default_size = (512, 768)
    default_frames = 121
    fps = 24
    # LTX-Video's: frames 8k + 1 (the published VAE compresses time 8x too), CFG as a doubled batch,
    # negative prompts, the tiny model's size and frames.
    mixed_batches = False
    mixed_batches_refused = ("its connectors (which take LoRA) run inside the pipeline call on the whole batch's "
                             "prompts: one connectors state per forward batch")
    task_pipelines: Mapping[str, str] = {}
    refused_tasks = {"image-to-video": "LTX2ImageToVideoPipeline re-compresses one PIL image a call (H.264, the "
                                       "model's training CRF) and makes one video of it a call; not served yet"}
    # The condition, in-context, HDR and other LTX-2 pipelines are not served (``serves_variants``, LTX's).
    full_size_models: Mapping[str, str] = {}
    min_steps, min_steps_reason = 1, ""  # the loaded scheduler's shift_terminal still asks two (``fewest_steps``)
    text_tokens = 1024  # LTX2Pipeline.__call__'s max_sequence_length: every prompt is padded to it
    model_lora_parts = ("connectors",)  # LTX2LoraLoaderMixin.load_lora_into_transformer(..., prefix="connectors")

    def audio_rate(self, pipeline) -> int | None:
        """The vocoder's output rate: ``LTX2PipelineOutput.audio`` is its waveform per video."""
        return pipeline.vocoder.config.output_sampling_rate

    def doubles_batch(self, guidance_scale: float) -> bool:
        """Always: the audio's guidance (7.0, fixed) keeps CFG's doubled batch on at any video guidance."""
        return True

    def warmup_guidance_scales(self, default: float) -> list[float]:
        """One batch shape at every guidance (``doubles_batch``)."""
        return [default]

    # long: seven components, each configured as diffusers' own test configures it
    def build_tiny(self, seed: int = 0):
        """As diffusers' own tests/pipelines/ltx2/test_ltx2.py builds it (its transformer, connectors,
        audio VAE and vocoder configs), except: a Gemma 3 encoder and a character tokenizer made here
        instead of downloaded, and a video VAE of three levels that compresses time 8x as the
        published one does (the frame rule is the family's; 8x in space too)."""
        import torch
        from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                               LTX2Pipeline, LTX2VideoTransformer3DModel)
        from diffusers.pipelines.ltx2 import LTX2TextConnectors
        from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
        from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

        from hotlora.families.generic import char_tokenizer

        tokenizer = char_tokenizer(add_bos_token=True)
        text = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                max_position_embeddings=self.text_tokens, sliding_window=64,
                                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                eos_token_id=tokenizer.eos_token_id)
        # The vision tower is never called on text; Gemma3ForConditionalGeneration needs one.
        vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=16, patch_size=8)
        torch.manual_seed(seed)
        text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
            text_config=text, vision_config=vision, mm_tokens_per_image=4,
            image_token_index=tokenizer.unk_token_id)).eval()
        torch.manual_seed(seed)
        transformer = LTX2VideoTransformer3DModel(
            in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
            cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
            audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads",
            caption_channels=text.hidden_size, rope_double_precision=False, rope_type="split")
        torch.manual_seed(seed)
        connectors = LTX2TextConnectors(
            caption_channels=text.hidden_size, text_proj_in_factor=text.num_hidden_layers + 1,
            video_connector_num_attention_heads=4, video_connector_attention_head_dim=8, video_connector_num_layers=1,
            video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=4,
            audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
            audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_theta=10000.0,
            rope_double_precision=False, causal_temporal_positioning=False, rope_type="split")
        torch.manual_seed(seed)
        vae = AutoencoderKLLTX2Video(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8),
            decoder_block_out_channels=(8, 8, 8), layers_per_block=(1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1), spatio_temporal_scaling=(True, True, True),
            decoder_spatio_temporal_scaling=(True, True, True), decoder_inject_noise=(False, False, False, False),
            downsample_type=("spatiotemporal", "spatiotemporal", "spatiotemporal"),
            upsample_residual=(False, False, False), upsample_factor=(1, 1, 1), timestep_conditioning=False,
            patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False)
        vae.use_framewise_encoding = False
        vae.use_framewise_decoding = False
        torch.manual_seed(seed)
        audio_vae = AutoencoderKLLTX2Audio(
            base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
            resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
            mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8)
        torch.manual_seed(seed)
        vocoder = LTX2Vocoder(
            in_channels=audio_vae.config.output_channels * audio_vae.config.mel_bins, hidden_channels=32,
            out_channels=2, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2], resnet_kernel_sizes=[3],
            resnet_dilations=[[1, 3, 5]], leaky_relu_negative_slope=0.1, output_sampling_rate=16000)
        return LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, audio_vae=audio_vae,
                            text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors,
                            transformer=transformer, vocoder=vocoder)

    def write_trainer_samples(self, pipeline, linears, out, rank: int, attention_only) -> dict:
        """Two files with a connectors part. ``identity-connectors``: diffusers' names, the transformer's
        under ``transformer.`` and every connectors Linear under ``connectors.`` (what
        ``load_lora_weights`` splits between the two). ``style-comfy``: the trainers' (ComfyUI) layout
        that diffusers' ``_convert_non_diffusers_ltx2_lora_to_diffusers`` reads: the blocks' attention
        under ``diffusion_model.`` and the connectors' input projection as the original checkpoint
        names it, ``text_embedding_projection.aggregate_embed``; no alpha."""
        import torch
        from safetensors.torch import save_file

        from hotlora.families._tiny import random_lora

        connectors = {name: (m.in_features, m.out_features) for name, m in pipeline.connectors.named_modules()
                      if isinstance(m, torch.nn.Linear)}
        both = {**{f"transformer.{k}": v for k, v in random_lora(linears, rank, seed=6).items()},
                **{f"connectors.{k}": v for k, v in random_lora(connectors, rank, seed=7).items()}}
        (out / "identity-connectors").mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in both.items()}, str(out / "identity-connectors" / "lora.safetensors"))
        comfy = {**{f"diffusion_model.{k}": v for k, v in random_lora(linears, rank, seed=8, modules=attention_only).items()},
                 **{f"text_embedding_projection.{k.replace('text_proj_in', 'aggregate_embed')}": v
                    for k, v in random_lora(connectors, rank, seed=9, modules=["text_proj_in"]).items()}}
        save_file({k: v.contiguous() for k, v in comfy.items()}, str(out / "style-comfy.safetensors"))
        return {"identity-connectors": out / "identity-connectors" / "lora.safetensors",
                "style-comfy": out / "style-comfy.safetensors"}
