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
