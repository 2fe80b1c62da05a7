"""Tiny random-weight Qwen2.5-Omni models (transformers ``qwen2_5_omni``) built from configs, no downloads.

* :func:`omni_moe_thinker` -> a Qwen3-Omni-MoE thinker (``qwen3_omni_moe``), its text model a mixture of experts.

* :func:`omni_thinker` -> ``(Qwen2_5OmniThinkerForConditionalGeneration, kwargs)`` for ONE forward that mixes
  text + image + audio (the vision and audio encoders both run).
* :func:`omni_full` -> ``Qwen2_5OmniForConditionalGeneration`` (thinker + talker + token2wav),
  :func:`omni_stage_inputs` -> the inputs of :func:`run_stages`, which drives the three stages one call each,
  without ``generate``, the way ``Qwen2_5OmniForConditionalGeneration.generate`` feeds them.

Module tree (what ``named_children`` gives; transformers >= 5.21: before, the thinker holds ``audio_tower`` and
``visual`` itself and its ``model`` is the text model)::

    Qwen2_5OmniThinkerForConditionalGeneration: model, lm_head
        model (Qwen2_5OmniThinkerModel): audio_tower, visual, language_model
    Qwen2_5OmniForConditionalGeneration: thinker, talker, token2wav
        thinker.model.{audio_tower, visual, language_model}, thinker.lm_head
        talker: thinker_to_talker_proj, model, codec_head
        token2wav: code2wav_dit_model, code2wav_bigvgan_model

Token-count rules taken from ``modeling_qwen2_5_omni.py``:

* image: ``pixel_values`` is ``(t*h*w, C*temporal_patch*patch*patch)`` for ``image_grid_thw=[[t, h, w]]``; the
  merger emits ``t*h*w // spatial_merge_size**2`` embeddings -> that many ``image_token_index`` tokens, placed as
  ``vision_start, IMG*n, vision_end`` (``get_rope_index`` looks at the token right after ``vision_start``).
* audio: ``L = feature_attention_mask.sum()`` mel frames -> ``((L - 1) // 2 + 1 - 2) // 2 + 1`` embeddings ->
  that many ``audio_token_index`` tokens, placed as ``audio_start, AUD*n, audio_end``.

Run ``python -m offload_compiler.testing.omni_models`` for a self-check (runs each builder twice, checks
determinism, prints parameter counts, module names and timings).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

# ----------------------------------------------------------------------------------------------------------------
# Tiny sizes and special token ids (all inside the small vocabularies)
# ----------------------------------------------------------------------------------------------------------------
TEXT_VOCAB = 256
TEXT_HIDDEN = 64
# Every special text id is < 128 (also below the talker's vocab size: the talker config carries the thinker-side
# ids and transformers' config validation warns about ids outside *its* vocab). Ordinary text tokens are drawn
# from [TEXT_LO, TEXT_HI), disjoint from the special ids.
TEXT_LO, TEXT_HI = 128, TEXT_VOCAB
USER_TOKEN = 100
# thinker / shared multimodal ids
VISION_START, VISION_END = 101, 102
IMAGE_TOKEN, VIDEO_TOKEN = 103, 104
AUDIO_TOKEN, AUDIO_START, AUDIO_END = 105, 106, 107
# talker "text side" ids (looked up in the THINKER embedding table by generate)
TTS_TEXT_PAD, TTS_TEXT_START, TTS_TEXT_END = 110, 111, 112
TTS_TEXT_BOS = 113  # stands in for speaker_params["bos_token"] (spk_dict.pt is not available offline)
# talker codec vocabulary; special codec ids at the top, real codes are [0, CODEC_NUM_CODES)
TALKER_VOCAB = 128
CODEC_PAD, CODEC_START, CODEC_END, CODEC_MASK = 124, 125, 126, 127
CODEC_NUM_CODES = 124  # == dit_config.num_embeds (codec_embed has num_embeds + 1 rows)

# vision: patch 4, temporal patch 2, merge 2, window 16 px -> 2x2 merged tokens per window
PATCH, TEMPORAL_PATCH, MERGE, IN_CHANNELS = 4, 2, 2, 3
# audio
MEL_BINS = 16
# token2wav
MEL_DIM, SPK_EMB_DIM = 16, 16


def _seeded(seed: int) -> torch.Generator:
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def _rope(head_dim: int) -> dict:
    half = head_dim // 2
    a = half // 4
    b = (half - a) // 2
    return {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [a, b, half - a - b]}


def _thinker_config_dict() -> dict:
    heads = 4
    return dict(
        text_config=dict(
            vocab_size=TEXT_VOCAB, hidden_size=TEXT_HIDDEN, intermediate_size=2 * TEXT_HIDDEN, num_hidden_layers=2,
            num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=1024,
            rope_parameters=_rope(TEXT_HIDDEN // heads), tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=IN_CHANNELS, patch_size=PATCH,
            spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL_PATCH, window_size=16,
            out_hidden_size=TEXT_HIDDEN, fullatt_block_indexes=[1],
        ),
        audio_config=dict(
            num_mel_bins=MEL_BINS, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
            max_source_positions=64, n_window=8, output_dim=TEXT_HIDDEN,
        ),
        audio_token_index=AUDIO_TOKEN, image_token_index=IMAGE_TOKEN, video_token_index=VIDEO_TOKEN,
        audio_start_token_id=AUDIO_START, audio_end_token_id=AUDIO_END, user_token_id=USER_TOKEN,
        # not a declared field of Qwen2_5OmniThinkerConfig, but get_rope_index reads config.vision_start_token_id
        # (the released checkpoints carry it in thinker_config too)
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
    )


def _talker_config_dict() -> dict:
    return dict(
        vocab_size=TALKER_VOCAB, embedding_size=TEXT_HIDDEN, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=1024, rope_parameters=_rope(16),
        audio_token_index=AUDIO_TOKEN, image_token_index=IMAGE_TOKEN, video_token_index=VIDEO_TOKEN,
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
        audio_start_token_id=AUDIO_START, audio_end_token_id=AUDIO_END,
        tts_text_start_token_id=TTS_TEXT_START, tts_text_end_token_id=TTS_TEXT_END,
        tts_text_pad_token_id=TTS_TEXT_PAD,
        tts_codec_start_token_id=CODEC_START, tts_codec_end_token_id=CODEC_END,
        tts_codec_pad_token_id=CODEC_PAD, tts_codec_mask_token_id=CODEC_MASK,
        spatial_merge_size=MERGE,
    )


def _token2wav_config_dict() -> dict:
    return dict(
        dit_config=dict(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=16, ff_mult=2, emb_dim=16,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=1024,
            block_size=4, look_ahead_layers=[1], look_backward_layers=[0], repeats=2,
            num_embeds=CODEC_NUM_CODES, mel_dim=MEL_DIM, dropout=0.0, enc_emb_dim=SPK_EMB_DIM, enc_dim=16,
            enc_channels=[16, 16, 16, 16, 48], enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1],
            enc_attention_channels=8, enc_res2net_scale=2, enc_se_channels=8,
        ),
        bigvgan_config=dict(
            mel_dim=MEL_DIM, upsample_initial_channel=32, resblock_kernel_sizes=[3],
            resblock_dilation_sizes=[[1, 3, 5]], upsample_rates=[2, 2], upsample_kernel_sizes=[4, 4],
        ),
    )


def audio_output_len(num_frames: int) -> int:
    """Number of audio-encoder embeddings (= audio placeholder tokens) for ``num_frames`` valid mel frames."""
    after_conv = (num_frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


# ----------------------------------------------------------------------------------------------------------------
# 1. Thinker alone, text + image + audio in one forward
# ----------------------------------------------------------------------------------------------------------------
def omni_thinker(seed: int = 0, grid_thw: tuple[int, int, int] = (1, 4, 8), audio_frames: int = 40,
                 audio_pad: int = 8) -> tuple[nn.Module, dict]:
    """Tiny ``Qwen2_5OmniThinkerForConditionalGeneration`` + kwargs for one text+image+audio forward.

    ``grid_thw`` is the image patch grid (h, w multiples of ``spatial_merge_size``); ``audio_frames`` valid mel
    frames followed by ``audio_pad`` masked-out frames in ``input_features``/``feature_attention_mask``.
    """
    from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    g = _seeded(seed)
    config = Qwen2_5OmniThinkerConfig(**_thinker_config_dict())
    model = Qwen2_5OmniThinkerForConditionalGeneration(config).eval()

    t, h, w = grid_thw
    n_patches = t * h * w
    n_image_tokens = n_patches // (MERGE * MERGE)
    n_audio_tokens = audio_output_len(audio_frames)
    pixel_values = torch.randn(n_patches, IN_CHANNELS * TEMPORAL_PATCH * PATCH * PATCH, generator=g)
    image_grid_thw = torch.tensor([[t, h, w]], dtype=torch.long)
    input_features = torch.randn(1, MEL_BINS, audio_frames + audio_pad, generator=g)
    feature_attention_mask = torch.zeros(1, audio_frames + audio_pad, dtype=torch.long)
    feature_attention_mask[:, :audio_frames] = 1

    def text(n):
        return torch.randint(TEXT_LO, TEXT_HI, (n,), generator=g).tolist()

    ids = ([USER_TOKEN] + text(3)
           + [VISION_START] + [IMAGE_TOKEN] * n_image_tokens + [VISION_END]
           + text(2)
           + [AUDIO_START] + [AUDIO_TOKEN] * n_audio_tokens + [AUDIO_END]
           + text(4))
    input_ids = torch.tensor([ids], dtype=torch.long)
    kwargs = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": pixel_values,
        "image_grid_thw": image_grid_thw,
        "input_features": input_features,
        "feature_attention_mask": feature_attention_mask,
        "use_cache": False,
    }
    return model, kwargs


def omni_moe_thinker(seed: int = 0, experts: int = 16, top_k: int = 2, layers: int = 2,
                     experts_implementation: str = "batched_mm") -> nn.Module:
    """Tiny ``Qwen3OmniMoeThinkerForConditionalGeneration`` (transformers ``qwen3_omni_moe``): audio and vision
    encoders and a mixture-of-experts text model of ``layers`` layers, each with ``experts`` fused experts
    (``gate_up_proj [E, 64, 64]``, ``down_proj [E, 64, 32]``) of which the router picks ``top_k``. The experts
    run ``experts_implementation`` (transformers' ``batched_mm`` gathers them by router indices)."""
    from transformers.models.qwen3_omni_moe import (Qwen3OmniMoeThinkerConfig,
                                                    Qwen3OmniMoeThinkerForConditionalGeneration)

    heads = 4
    head_dim = TEXT_HIDDEN // heads
    text = dict(vocab_size=TEXT_VOCAB, hidden_size=TEXT_HIDDEN, intermediate_size=2 * TEXT_HIDDEN,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2, head_dim=head_dim,
                max_position_embeddings=1024, moe_intermediate_size=TEXT_HIDDEN // 2, num_experts=experts,
                num_experts_per_tok=top_k, decoder_sparse_step=1,
                rope_parameters={**_rope(head_dim), "interleaved": True})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=IN_CHANNELS,
                  patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL_PATCH,
                  out_hidden_size=TEXT_HIDDEN, num_position_embeddings=64, deepstack_visual_indexes=[0])
    audio = dict(num_mel_bins=MEL_BINS, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 max_source_positions=64, n_window=8, output_dim=TEXT_HIDDEN, downsample_hidden_size=16,
                 n_window_infer=16, conv_chunksize=50)
    config = Qwen3OmniMoeThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio, audio_token_id=AUDIO_TOKEN,
        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, audio_start_token_id=AUDIO_START,
        vision_start_token_id=VISION_START, user_token_id=USER_TOKEN)
    config.text_config._experts_implementation = experts_implementation
    _seeded(seed)
    return Qwen3OmniMoeThinkerForConditionalGeneration(config).eval()


# ----------------------------------------------------------------------------------------------------------------
# 2. Full model (thinker + talker + token2wav), driven stage by stage
# ----------------------------------------------------------------------------------------------------------------
def omni_full(seed: int = 0) -> nn.Module:
    """Tiny ``Qwen2_5OmniForConditionalGeneration`` with thinker, talker and token2wav (fp32, eval mode)."""
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    _seeded(seed)
    config = Qwen2_5OmniConfig(thinker_config=_thinker_config_dict(), talker_config=_talker_config_dict(),
                               token2wav_config=_token2wav_config_dict(), enable_audio_output=True)
    return Qwen2_5OmniForConditionalGeneration(config).eval()


def omni_stage_inputs(model: nn.Module | None = None, seed: int = 0, prompt_len: int = 8, reply_len: int = 4,
                      ref_mel_len: int = 24, num_steps: int = 3) -> dict:
    """Inputs for :func:`run_stages`: a text prompt, the thinker "reply" tokens (stand-in for what
    ``thinker.generate`` would have produced; fed teacher-forced in the same forward), speaker conditioning and a
    reference mel (stand-ins for ``spk_dict.pt``), and the token2wav ODE step count."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(TEXT_LO, TEXT_HI, (1, prompt_len), generator=g)
    prompt[:, 0] = USER_TOKEN
    return {
        "input_ids": prompt,
        "attention_mask": torch.ones_like(prompt),
        "reply_ids": torch.randint(TEXT_LO, TEXT_HI, (1, reply_len), generator=g),
        "speaker_bos_token": TTS_TEXT_BOS,
        "conditioning": torch.randn(1, SPK_EMB_DIM, generator=g),
        "reference_mel": torch.randn(1, ref_mel_len, MEL_DIM, generator=g),
        "num_steps": num_steps,
        "seed": seed,
    }


def omni_full_with_inputs(seed: int = 0) -> tuple[nn.Module, dict]:
    model = omni_full(seed)
    return model, omni_stage_inputs(model, seed)


def _default_call(module: nn.Module, **kw: Any) -> Any:
    return module(**kw)


@torch.no_grad()
def run_stages(model: nn.Module, inputs: dict,
               call: Callable[..., Any] = _default_call) -> dict[str, torch.Tensor]:
    """thinker forward -> talker forward -> token2wav, each invoked exactly once as
    ``call(model.thinker, ...)``, ``call(model.talker, ...)``, ``call(model.token2wav, ...)``.

    Follows ``Qwen2_5OmniForConditionalGeneration.generate`` (text-only prompt, batch 1) with the autoregressive
    loops replaced by single forwards:

    (a) thinker over ``prompt + reply`` (teacher forcing: with causal attention the per-position hidden states are
        exactly what ``thinker.generate(output_hidden_states=True)`` collects step by step);
    (b) talker prefill: ``inputs_embeds = [last_hidden + token_embeds](prompt) ++ embed(speaker_bos) ++
        reply_part[:1]``, ``input_text_ids = prompt ++ speaker_bos ++ reply[:1]``, attention mask + 2 ones,
        ``thinker_reply_part`` = the rest of the reply + text-eos/pad embeddings;
    (c) token2wav on codec codes = greedy argmax of the talker logits over the real-code range (one code per talker
        position, instead of sampling ``talker_max_new_tokens`` codes one by one).
    """
    seed = int(inputs.get("seed", 0))
    input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
    reply_ids = inputs["reply_ids"]
    batch, prompt_len = input_ids.shape

    # (a) thinker -------------------------------------------------------------------------------------------
    torch.manual_seed(seed)
    thinker_ids = torch.cat([input_ids, reply_ids], dim=1)
    thinker_mask = torch.cat([attention_mask, torch.ones_like(reply_ids)], dim=1)
    thinker_out = call(model.thinker, input_ids=thinker_ids, attention_mask=thinker_mask,
                       output_hidden_states=True, use_cache=False)
    hidden_states = thinker_out.hidden_states  # (embeddings, layer1, ..., final-norm output)
    token_embeds, last_hidden = hidden_states[0], hidden_states[-1]

    # (b) talker --------------------------------------------------------------------------------------------
    embed = model.thinker.get_input_embeddings()
    bos = torch.full((batch, 1), int(inputs["speaker_bos_token"]), dtype=torch.long, device=input_ids.device)
    reply_part = last_hidden[:, prompt_len:] + token_embeds[:, prompt_len:]
    talker_inputs_embeds = torch.cat(
        [last_hidden[:, :prompt_len] + token_embeds[:, :prompt_len], embed(bos), reply_part[:, :1]], dim=1)
    eos_embed = embed(bos.new_full((batch, 1), model.talker.text_eos_token))
    pad_embed = embed(bos.new_full((batch, 1), model.talker.text_pad_token))
    thinker_reply_part = torch.cat([reply_part[:, 1:], eos_embed, pad_embed], dim=1)
    talker_input_text_ids = torch.cat([input_ids, bos, reply_ids[:, :1]], dim=1)
    talker_mask = torch.cat([attention_mask, attention_mask.new_ones((batch, 2))], dim=1)

    talker_inputs_embeds_in = talker_inputs_embeds.clone()  # the talker adds codec pad/bos embeds in place
    torch.manual_seed(seed)
    talker_out = call(model.talker, inputs_embeds=talker_inputs_embeds, attention_mask=talker_mask,
                      input_text_ids=talker_input_text_ids, thinker_reply_part=thinker_reply_part,
                      use_cache=False)
    talker_logits = talker_out.logits  # (batch, prompt_len + 2, talker vocab)

    # (c) token2wav -----------------------------------------------------------------------------------------
    num_codes = model.config.token2wav_config.dit_config.num_embeds
    codes = talker_logits[..., :num_codes].argmax(-1)  # real codes only; specials (pad/bos/eos/mask) excluded
    torch.manual_seed(seed)  # the DiT sampler draws its initial noise with torch.randn
    waveform = call(model.token2wav, code=codes, conditioning=inputs["conditioning"].float(),
                    reference_mel=inputs["reference_mel"].float(), num_steps=int(inputs["num_steps"]),
                    guidance_scale=0.5, sway_coefficient=-1.0)

    return {
        "thinker_logits": thinker_out.logits,
        "thinker_last_hidden": last_hidden,
        "talker_inputs_embeds": talker_inputs_embeds_in,
        "talker_logits": talker_logits,
        "codes": codes,
        "waveform": waveform,
    }


# ----------------------------------------------------------------------------------------------------------------
def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _outputs_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


if __name__ == "__main__":
    import time

    torch.set_num_threads(max(1, torch.get_num_threads()))

    # ---- thinker: text + image + audio ----
    t0 = time.perf_counter()
    thinker, kw = omni_thinker(0)
    t1 = time.perf_counter()
    ran = []
    hooks = [m.register_forward_hook(lambda mod, a, o, n=n: ran.append(n))
             for n, m in [("visual", thinker.model.visual), ("audio_tower", thinker.model.audio_tower)]]
    with torch.no_grad():
        out1 = thinker(**kw)
    t2 = time.perf_counter()
    for hk in hooks:
        hk.remove()
    with torch.no_grad():
        out_again = thinker(**kw)
        rebuilt, kw_b = omni_thinker(0)
        out2 = rebuilt(**kw_b)
    print(f"[thinker] build {t1 - t0:.2f}s forward {t2 - t1:.2f}s  seq={kw['input_ids'].shape[1]} "
          f"image_tokens={(kw['input_ids'] == IMAGE_TOKEN).sum().item()} "
          f"audio_tokens={(kw['input_ids'] == AUDIO_TOKEN).sum().item()} logits={tuple(out1.logits.shape)}")
    print(f"[thinker] encoders executed: {ran}")
    assert set(ran) == {"visual", "audio_tower"}, ran
    same = torch.equal(out1.logits, out_again.logits) and torch.equal(out1.logits, out2.logits)
    print(f"[thinker] deterministic (same model twice, and rebuilt model): {same}")
    assert same
    print(f"[thinker] children: {[n for n, _ in thinker.named_children()]}; "
          f"model children: {[n for n, _ in thinker.model.named_children()]}")
    print("[thinker] params: " + ", ".join(
        f"{n}={_params(m):,}" for n, m in [("model.visual", thinker.model.visual),
                                          ("model.audio_tower", thinker.model.audio_tower),
                                          ("model.language_model", thinker.model.language_model),
                                          ("lm_head", thinker.lm_head), ("total", thinker)]))

    # ---- full model: thinker -> talker -> token2wav ----
    t0 = time.perf_counter()
    full = omni_full(0)
    inputs = omni_stage_inputs(full, 0)
    t1 = time.perf_counter()
    called = []

    def tracing_call(module, **kw):
        name = next(n for n, m in full.named_children() if m is module)
        ts = time.perf_counter()
        out = module(**kw)
        called.append(f"{name} {time.perf_counter() - ts:.3f}s")
        return out

    res1 = run_stages(full, inputs, call=tracing_call)
    t2 = time.perf_counter()
    res2 = run_stages(full, inputs)
    t3 = time.perf_counter()
    full_b = omni_full(0)
    res3 = run_stages(full_b, omni_stage_inputs(full_b, 0))
    print(f"[full] build {t1 - t0:.2f}s run_stages {t2 - t1:.2f}s (2nd run {t3 - t2:.2f}s); stages called (time each): {called}")
    print("[full] outputs: " + ", ".join(f"{k}={tuple(v.shape)}" for k, v in res1.items()))
    same = _outputs_equal(res1, res2) and _outputs_equal(res1, res3)
    print(f"[full] deterministic (same model twice, and rebuilt model): {same}")
    assert same
    print(f"[full] children: {[n for n, _ in full.named_children()]}; "
          f"thinker: {[n for n, _ in full.thinker.named_children()]}; "
          f"thinker.model: {[n for n, _ in full.thinker.model.named_children()]}; "
          f"talker: {[n for n, _ in full.talker.named_children()]}; "
          f"token2wav: {[n for n, _ in full.token2wav.named_children()]}")
    print("[full] params: " + ", ".join(
        f"{n}={_params(m):,}" for n, m in [("thinker", full.thinker), ("talker", full.talker),
                                          ("token2wav", full.token2wav),
                                          ("thinker.model.visual", full.thinker.model.visual),
                                          ("thinker.model.audio_tower", full.thinker.model.audio_tower),
                                          ("thinker.model.language_model", full.thinker.model.language_model),
                                          ("thinker.lm_head", full.thinker.lm_head), ("total", full)]))
    print("OK")
