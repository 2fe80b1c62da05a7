"""Tiny real architectures built from configs with random weights (no downloads): transformers Llama,
GPT-2 (tied embeddings), Qwen2 (with a KV cache); diffusers DiT, Flux and UNet2DCondition. `ARCHITECTURES`
has many more (decoders, MoE, encoder-decoders, encoders, vision, video DiTs, VAE, ControlNet).

Each builder returns ``(model, kwargs)``. Used by the tests, the examples and the CLI."""

from __future__ import annotations

import torch
from torch import nn


def _seeded(seed: int) -> torch.Generator:
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def llama(layers: int = 3, hidden: int = 64, vocab: int = 128, seq: int = 12, seed: int = 0,
          intermediate: int | None = None, heads: int = 4, kv_heads: int = 2) -> tuple[nn.Module, dict]:
    from transformers import LlamaConfig, LlamaForCausalLM
    g = _seeded(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max(256, seq))
    return LlamaForCausalLM(config).eval(), {"input_ids": torch.randint(0, vocab, (1, seq), generator=g)}


def gpt2(layers: int = 3, hidden: int = 64, vocab: int = 128, seq: int = 12, seed: int = 0) -> tuple[nn.Module, dict]:
    from transformers import GPT2Config, GPT2LMHeadModel
    g = _seeded(seed)
    config = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=64,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval(), {"input_ids": torch.randint(0, vocab, (1, seq), generator=g)}


def qwen2(layers: int = 3, hidden: int = 64, vocab: int = 128, seq: int = 12, seed: int = 0) -> tuple[nn.Module, dict]:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    g = _seeded(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    return Qwen2ForCausalLM(config).eval(), {"input_ids": torch.randint(0, vocab, (1, seq), generator=g),
                                             "use_cache": True}


def dit(layers: int = 2, seed: int = 0) -> tuple[nn.Module, dict]:
    from diffusers import DiTTransformer2DModel
    g = _seeded(seed)
    model = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=layers,
                                  sample_size=8, patch_size=2, num_embeds_ada_norm=10, norm_num_groups=1)
    return model.eval(), {"hidden_states": torch.randn(1, 4, 8, 8, generator=g), "timestep": torch.tensor([3]),
                          "class_labels": torch.tensor([1])}


def flux(layers: int = 1, single_layers: int = 2, seed: int = 0) -> tuple[nn.Module, dict]:
    from diffusers import FluxTransformer2DModel
    g = _seeded(seed)
    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=layers, num_single_layers=single_layers,
                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                   pooled_projection_dim=16, axes_dims_rope=(2, 2, 4))
    return model.eval(), {"hidden_states": torch.randn(1, 16, 4, generator=g),
                          "encoder_hidden_states": torch.randn(1, 8, 16, generator=g),
                          "pooled_projections": torch.randn(1, 16, generator=g), "timestep": torch.tensor([1.0]),
                          "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(8, 3)}


def unet(seed: int = 0) -> tuple[nn.Module, dict]:
    from diffusers import UNet2DConditionModel
    g = _seeded(seed)
    model = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                 block_out_channels=(8, 16), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
                                 attention_head_dim=2, norm_num_groups=4)
    return model.eval(), {"sample": torch.randn(1, 4, 8, 8, generator=g), "timestep": torch.tensor([2]),
                          "encoder_hidden_states": torch.randn(1, 5, 16, generator=g)}


BUILDERS = {"llama": llama, "gpt2": gpt2, "qwen2": qwen2, "dit": dit, "flux": flux, "unet": unet}


class DiffusionContainer(nn.Module):
    """Text encoder → DiT (a few denoising steps) → VAE decode, as one module (model-level offload target)."""

    def __init__(self, text_encoder: nn.Module, transformer: nn.Module, vae: nn.Module, steps: int = 2) -> None:
        super().__init__()
        self.text_encoder, self.transformer, self.vae, self.steps = text_encoder, transformer, vae, steps

    def forward(self, input_ids: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return denoise_and_decode(self.text_encoder, self.transformer, self.vae, input_ids, latents, self.steps)


def denoise_and_decode(text_encoder, transformer, vae, input_ids, latents, steps: int) -> torch.Tensor:
    encoded = text_encoder(input_ids)
    text, pooled = encoded.last_hidden_state, encoded.pooler_output
    b, c, h, w = latents.shape
    img_ids = torch.zeros(h * w, 3)
    txt_ids = torch.zeros(text.shape[1], 3)
    for step in range(steps):
        tokens = latents.flatten(2).transpose(1, 2)
        velocity = transformer(hidden_states=tokens, encoder_hidden_states=text, pooled_projections=pooled,
                               timestep=torch.full((b,), 1.0 - step / steps), img_ids=img_ids,
                               txt_ids=txt_ids).sample
        latents = latents - velocity.transpose(1, 2).reshape(b, c, h, w) / steps
    return vae.decode(latents).sample


def _diffusion_parts(seed: int):
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel
    g = _seeded(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(vocab_size=100, hidden_size=16, intermediate_size=32,
                                                num_hidden_layers=2, num_attention_heads=2,
                                                max_position_embeddings=16, projection_dim=16)).eval()
    transformer, _ = flux(layers=1, single_layers=2, seed=seed)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                        up_block_types=("UpDecoderBlock2D",), block_out_channels=(8,), layers_per_block=1,
                        latent_channels=4, norm_num_groups=4, sample_size=8).eval()
    inputs = {"input_ids": torch.randint(0, 100, (1, 8), generator=g), "latents": torch.randn(1, 4, 4, 4, generator=g)}
    return text_encoder, transformer, vae, inputs


def diffusion_container(seed: int = 0) -> tuple[nn.Module, dict]:
    text_encoder, transformer, vae, inputs = _diffusion_parts(seed)
    return DiffusionContainer(text_encoder, transformer, vae).eval(), inputs


class DiffusionPipeline:
    """A diffusers-style pipeline object (not an nn.Module) whose components are attributes."""

    def __init__(self, text_encoder: nn.Module, transformer: nn.Module, vae: nn.Module, steps: int = 2) -> None:
        self.text_encoder, self.transformer, self.vae, self.steps = text_encoder, transformer, vae, steps

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return denoise_and_decode(self.text_encoder, self.transformer, self.vae, input_ids, latents, self.steps)


def diffusion_pipeline(seed: int = 0) -> tuple[DiffusionPipeline, dict]:
    text_encoder, transformer, vae, inputs = _diffusion_parts(seed)
    return DiffusionPipeline(text_encoder, transformer, vae), inputs


BUILDERS["diffusion_container"] = diffusion_container


# -- the architecture matrix -----------------------------------------------------------------------------
# Tiny configs of many transformers / diffusers classes (hidden 64 or less, 2 blocks). A builder raises
# ImportError (library missing) or AttributeError (class missing from the installed version).

_VOCAB, _SEQ = 128, 10


def _ids(g: torch.Generator, seq: int = _SEQ) -> torch.Tensor:
    return torch.randint(3, _VOCAB, (1, seq), generator=g)


def _transformers_class(name: str):
    import transformers
    return getattr(transformers, name)


def _causal_lm(config: str, model: str, **fields):
    def build(seed: int = 0) -> tuple[nn.Module, dict]:
        g = _seeded(seed)
        m = _transformers_class(model)(_transformers_class(config)(**fields)).eval()
        return m, {"input_ids": _ids(g), "use_cache": False}
    build.__name__ = model
    return build


_LM = dict(vocab_size=_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=128)


def _seq2seq(config: str, model: str, extra_inputs, **fields):
    def build(seed: int = 0) -> tuple[nn.Module, dict]:
        g = _seeded(seed)
        m = _transformers_class(model)(_transformers_class(config)(**fields)).eval()
        return m, {**extra_inputs(g), "decoder_input_ids": _ids(g, 5), "use_cache": False}
    build.__name__ = model
    return build


def _encoder(config: str, model: str, inputs, **fields):
    def build(seed: int = 0) -> tuple[nn.Module, dict]:
        g = _seeded(seed)
        return _transformers_class(model)(_transformers_class(config)(**fields)).eval(), inputs(g)
    build.__name__ = model
    return build


def _pixels(size: int):
    return lambda g: {"pixel_values": torch.randn(1, 3, size, size, generator=g)}


def _diffusers(name: str, inputs, **fields):
    def build(seed: int = 0) -> tuple[nn.Module, dict]:
        import diffusers
        g = _seeded(seed)
        return getattr(diffusers, name)(**fields).eval(), {**inputs(g), "return_dict": False}
    build.__name__ = name
    return build


class VAERoundTrip(nn.Module):
    """AutoencoderKL encode → latent mode → decode, as one forward."""

    def __init__(self, vae: nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(self.vae.encode(x).latent_dist.mode()).sample


def vae_roundtrip(seed: int = 0) -> tuple[nn.Module, dict]:
    from diffusers import AutoencoderKL
    g = _seeded(seed)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                        latent_channels=4, norm_num_groups=4, sample_size=16)
    return VAERoundTrip(vae).eval(), {"x": torch.randn(1, 3, 16, 16, generator=g)}


_TEXT = lambda g: {"encoder_hidden_states": torch.randn(1, 6, 16, generator=g)}  # noqa: E731

ARCHITECTURES = {
    # decoder-only LMs
    "mistral": _causal_lm("MistralConfig", "MistralForCausalLM", **_LM),
    "mixtral": _causal_lm("MixtralConfig", "MixtralForCausalLM", **_LM, num_local_experts=4, num_experts_per_tok=2),
    "qwen3": _causal_lm("Qwen3Config", "Qwen3ForCausalLM", **_LM, head_dim=16),
    "qwen3_moe": _causal_lm("Qwen3MoeConfig", "Qwen3MoeForCausalLM", **_LM, head_dim=16, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
    "gemma2": _causal_lm("Gemma2Config", "Gemma2ForCausalLM", **_LM, head_dim=16, sliding_window=4),
    "gemma3": _causal_lm("Gemma3TextConfig", "Gemma3ForCausalLM", **_LM, head_dim=16, sliding_window=4),
    "phi3": _causal_lm("Phi3Config", "Phi3ForCausalLM", **_LM, pad_token_id=0, eos_token_id=1, bos_token_id=1),
    "olmo2": _causal_lm("Olmo2Config", "Olmo2ForCausalLM", **_LM),
    "falcon": _causal_lm("FalconConfig", "FalconForCausalLM", vocab_size=_VOCAB, hidden_size=64,
                         num_hidden_layers=2, num_attention_heads=4),
    "gpt_neox": _causal_lm("GPTNeoXConfig", "GPTNeoXForCausalLM", vocab_size=_VOCAB, hidden_size=64,
                           intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           max_position_embeddings=128),
    "opt": _causal_lm("OPTConfig", "OPTForCausalLM", vocab_size=_VOCAB, hidden_size=64, ffn_dim=128,
                      num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=64),
    "bloom": _causal_lm("BloomConfig", "BloomForCausalLM", vocab_size=_VOCAB, hidden_size=64, n_layer=2, n_head=4),
    "deepseek_v3": _causal_lm("DeepseekV3Config", "DeepseekV3ForCausalLM", vocab_size=_VOCAB, hidden_size=64,
                              intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                              num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                              first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                              qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=128),
    "mamba": _causal_lm("MambaConfig", "MambaForCausalLM", vocab_size=_VOCAB, hidden_size=32, state_size=8,
                        num_hidden_layers=2, expand=2, conv_kernel=4),
    # encoder-decoders
    "t5": _seq2seq("T5Config", "T5ForConditionalGeneration", lambda g: {"input_ids": _ids(g)}, vocab_size=_VOCAB,
                   d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                   decoder_start_token_id=0),
    "bart": _seq2seq("BartConfig", "BartForConditionalGeneration", lambda g: {"input_ids": _ids(g)},
                     vocab_size=_VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                     max_position_embeddings=64),
    "whisper": _seq2seq("WhisperConfig", "WhisperForConditionalGeneration",
                        lambda g: {"input_features": torch.randn(1, 8, 32, generator=g)}, vocab_size=_VOCAB,
                        num_mel_bins=8, encoder_layers=2, decoder_layers=2, d_model=64, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                        max_source_positions=16, max_target_positions=32, decoder_start_token_id=1,
                        pad_token_id=0, bos_token_id=1, eos_token_id=1),
    # encoders and vision
    "bert": _encoder("BertConfig", "BertModel", lambda g: {"input_ids": _ids(g),
                                                           "attention_mask": torch.ones(1, _SEQ, dtype=torch.long)},
                     vocab_size=_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=64),
    # relative attention: every layer reads the shared relative embeddings through pos_dropout (in eval mode the
    # weight itself, though its traced value is a new tensor)
    "deberta_v2": _encoder("DebertaV2Config", "DebertaV2Model", lambda g: {"input_ids": _ids(g)}, vocab_size=_VOCAB,
                           hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                           max_position_embeddings=64, relative_attention=True, position_buckets=8,
                           pos_att_type=["p2c", "c2p"], max_relative_positions=16),
    "albert": _encoder("AlbertConfig", "AlbertModel", lambda g: {"input_ids": _ids(g)}, vocab_size=_VOCAB,
                       embedding_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=128),
    "vit": _encoder("ViTConfig", "ViTModel", _pixels(16), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=128, image_size=16, patch_size=4),
    "dinov2": _encoder("Dinov2Config", "Dinov2Model", _pixels(16), hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, mlp_ratio=2, image_size=16, patch_size=4),
    "clip_vision": _encoder("CLIPVisionConfig", "CLIPVisionModel", _pixels(16), hidden_size=64,
                            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=16,
                            patch_size=4),
    "clip_text": _encoder("CLIPTextConfig", "CLIPTextModel", lambda g: {"input_ids": _ids(g)}, vocab_size=_VOCAB,
                          hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          max_position_embeddings=32, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "swin": _encoder("SwinConfig", "SwinModel", _pixels(32), image_size=32, patch_size=4, embed_dim=16,
                     depths=[1, 1], num_heads=[2, 2], window_size=4),
    "convnext": _encoder("ConvNextConfig", "ConvNextModel", _pixels(32), hidden_sizes=[8, 16], depths=[1, 1],
                         num_stages=2),
    # a segmentation head that calls its encoder with output_hidden_states=True (transformers' output capture)
    "segformer": _encoder("SegformerConfig", "SegformerForSemanticSegmentation", _pixels(32), num_encoder_blocks=2,
                          depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16], num_attention_heads=[1, 2],
                          patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2], decoder_hidden_size=16, num_labels=3),
    # speech: a convolutional feature encoder on raw audio, a convolutional position embedding, then blocks; 3 of
    # the 19 frames masked, which writes the masked_spec_embed weight into the activations (h[mask] = weight)
    "wav2vec2": _encoder("Wav2Vec2Config", "Wav2Vec2Model",
                         lambda g: {"input_values": torch.randn(1, 400, generator=g),
                                    "mask_time_indices": torch.arange(19).remainder(6).eq(0)[None]},
                         hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
                         conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=16,
                         num_conv_pos_embedding_groups=2, do_stable_layer_norm=True),
    # diffusers
    "sd3": _diffusers("SD3Transformer2DModel", lambda g: {
        "hidden_states": torch.randn(1, 4, 8, 8, generator=g), **_TEXT(g),
        "pooled_projections": torch.randn(1, 16, generator=g), "timestep": torch.tensor([3])},
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
        pos_embed_max_size=16),
    "wan": _diffusers("WanTransformer3DModel", lambda g: {
        "hidden_states": torch.randn(1, 4, 2, 8, 8, generator=g), "timestep": torch.tensor([3]), **_TEXT(g)},
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32),
    "ltx_video": _diffusers("LTXVideoTransformer3DModel", lambda g: {
        "hidden_states": torch.randn(1, 2 * 4 * 4, 8, generator=g), **_TEXT(g), "timestep": torch.tensor([3]),
        "encoder_attention_mask": torch.ones(1, 6), "num_frames": 2, "height": 4, "width": 4},
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, num_layers=2, caption_channels=16),
    "cogvideox": _diffusers("CogVideoXTransformer3DModel", lambda g: {
        "hidden_states": torch.randn(1, 2, 4, 8, 8, generator=g), **_TEXT(g), "timestep": torch.tensor([3])},
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=8,
        text_embed_dim=16, num_layers=2, sample_width=8, sample_height=8, sample_frames=5, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=6),
    "hunyuan_video": _diffusers("HunyuanVideoTransformer3DModel", lambda g: {
        "hidden_states": torch.randn(1, 4, 1, 4, 4, generator=g), "timestep": torch.tensor([3]), **_TEXT(g),
        "encoder_attention_mask": torch.ones(1, 6), "pooled_projections": torch.randn(1, 8, generator=g),
        "guidance": torch.tensor([3.0])},
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_single_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16,
        pooled_projection_dim=8, rope_axes_dim=(2, 2, 4)),
    "qwen_image": _diffusers("QwenImageTransformer2DModel", lambda g: {
        "hidden_states": torch.randn(1, 16, 16, generator=g), **_TEXT(g),
        "encoder_hidden_states_mask": torch.ones(1, 6), "timestep": torch.tensor([0.5]), "img_shapes": [(1, 4, 4)]},
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=16, axes_dims_rope=(4, 6, 6)),
    "controlnet": _diffusers("ControlNetModel", lambda g: {
        "sample": torch.randn(1, 4, 8, 8, generator=g), "timestep": torch.tensor([2]),
        "encoder_hidden_states": torch.randn(1, 5, 16, generator=g),
        "controlnet_cond": torch.randn(1, 3, 16, 16, generator=g)},
        in_channels=4, conditioning_channels=3, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), cross_attention_dim=16, attention_head_dim=2,
        norm_num_groups=4, conditioning_embedding_out_channels=(4, 8)),
    "sd3_controlnet": _diffusers("SD3ControlNetModel", lambda g: {
        "hidden_states": torch.randn(1, 4, 8, 8, generator=g), "controlnet_cond": torch.randn(1, 4, 8, 8, generator=g),
        **_TEXT(g), "pooled_projections": torch.randn(1, 16, generator=g), "timestep": torch.tensor([3])},
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
        pos_embed_max_size=16),
    "pixart": _diffusers("PixArtTransformer2DModel", lambda g: {
        "hidden_states": torch.randn(1, 4, 8, 8, generator=g), **_TEXT(g), "timestep": torch.tensor([3])},
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=16, sample_size=8, patch_size=2, caption_channels=16, norm_num_groups=1,
        use_additional_conditions=False),
    "vae_roundtrip": vae_roundtrip,
    # decoder MoE with granite's scaled residuals and logits
    "granitemoe": _causal_lm("GraniteMoeConfig", "GraniteMoeForCausalLM", **_LM, num_local_experts=4,
                             num_experts_per_tok=2),
}
