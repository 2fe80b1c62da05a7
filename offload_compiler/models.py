"""Tiny real architectures built from configs with random weights (no downloads): transformers Llama,
GPT-2 (tied embeddings), Qwen2 (with a KV cache); diffusers DiT, Flux and UNet2DCondition.

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
