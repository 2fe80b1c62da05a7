"""Tiny real diffusers pipelines with random weights, built from configs (no downloads): Stable Diffusion 3
(two CLIP text encoders, T5 optional), Flux (CLIP + T5) and a UNet Stable Diffusion. Their tokenizers are
word-level vocabularies made in memory. Each builder returns ``(pipe, call_kwargs)``: ``pipe(**call_kwargs)``
runs the whole pipeline (prompt → text encoders → 2 denoising steps → VAE decode) in well under a second.

Used by the tests and ``examples/diffusers_pipeline.py``."""

from __future__ import annotations

from typing import Any

import torch

WORDS = ("a", "photo", "of", "cat", "dog", "on", "the", "moon", "red", "blue", "painting", "in", "style", "sky")
_VOCAB = 100  # the text encoders' vocabulary: ids of WORDS and the special tokens are below it


def tokenizer(max_length: int = 16) -> Any:
    """A word-level fast tokenizer (``transformers.PreTrainedTokenizerFast``) over `WORDS`, padded and
    truncated to ``max_length`` as the pipelines ask."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"[PAD]": 0, "[UNK]": 1, "[BOS]": 2, "[EOS]": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", bos_token="[BOS]",
                                   eos_token="[EOS]", model_max_length=max_length)


def _clip(hidden: int, projection: int | None = None, seed: int = 0) -> torch.nn.Module:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
    torch.manual_seed(seed)
    config = CLIPTextConfig(vocab_size=_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                            num_attention_heads=2, max_position_embeddings=16, projection_dim=projection or hidden,
                            pad_token_id=0, bos_token_id=2, eos_token_id=3)
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def _t5(d_model: int, seed: int = 0) -> torch.nn.Module:
    from transformers import T5Config, T5EncoderModel
    torch.manual_seed(seed)
    return T5EncoderModel(T5Config(vocab_size=_VOCAB, d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2,
                                   num_heads=2, relative_attention_num_buckets=8, pad_token_id=0,
                                   eos_token_id=3, decoder_start_token_id=0)).eval()


def _vae(latent_channels: int, seed: int = 0, **fields: Any) -> torch.nn.Module:
    from diffusers import AutoencoderKL
    torch.manual_seed(seed)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                         up_block_types=("UpDecoderBlock2D",), block_out_channels=(8,), layers_per_block=1,
                         latent_channels=latent_channels, norm_num_groups=4, sample_size=8, **fields).eval()


def call_kwargs(**extra: Any) -> dict:
    """What each test passes to ``pipe(...)``: a prompt, 2 steps, 8×8 pixels, a seeded generator, a tensor out."""
    return {"prompt": "a photo of a cat on the moon", "num_inference_steps": 2, "height": 8, "width": 8,
            "output_type": "pt", "generator": torch.Generator().manual_seed(0), **extra}


def _quiet(pipe: Any) -> Any:
    pipe.set_progress_bar_config(disable=True)
    return pipe


def sd3_pipeline(seed: int = 0, t5: bool = False) -> tuple[Any, dict]:
    """StableDiffusion3Pipeline: a 2-block SD3 transformer, two CLIP encoders with projection, T5 or None."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(sample_size=8, patch_size=1, in_channels=4, num_layers=2, attention_head_dim=8,
                                        num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16,
                                        pooled_projection_dim=32, out_channels=4,
                                        pos_embed_max_size=8).eval()
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), vae=_vae(4, seed, shift_factor=0.06),
        text_encoder=_clip(16, 16, seed + 1), tokenizer=tokenizer(), text_encoder_2=_clip(16, 16, seed + 2),
        tokenizer_2=tokenizer(), text_encoder_3=_t5(32, seed + 3) if t5 else None,
        tokenizer_3=tokenizer() if t5 else None)
    return _quiet(pipe), call_kwargs(max_sequence_length=8)


def flux_pipeline(seed: int = 0) -> tuple[Any, dict]:
    """FluxPipeline: a Flux transformer (1 double, 2 single blocks), CLIP and T5 encoders."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=2,
                                         attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=16, axes_dims_rope=(2, 2, 4)).eval()
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=_vae(1, seed, shift_factor=0.06),
                        text_encoder=_clip(16, None, seed + 1), tokenizer=tokenizer(), text_encoder_2=_t5(32, seed + 2),
                        tokenizer_2=tokenizer(), transformer=transformer)
    return _quiet(pipe), call_kwargs(max_sequence_length=8)


def sd_pipeline(seed: int = 0) -> tuple[Any, dict]:
    """StableDiffusionPipeline: a UNet2DCondition (two down and up blocks), a CLIP text encoder, DDIM."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline
    from .models import unet
    pipe = StableDiffusionPipeline(vae=_vae(4, seed), text_encoder=_clip(16, None, seed + 1), tokenizer=tokenizer(),
                                   unet=unet(seed)[0], scheduler=DDIMScheduler(clip_sample=False, steps_offset=1), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    return _quiet(pipe), call_kwargs()


PIPELINES = {"sd3": sd3_pipeline, "flux": flux_pipeline, "sd": sd_pipeline}
