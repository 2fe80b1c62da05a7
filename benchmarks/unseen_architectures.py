"""Architectures the test suite does not build, offloaded as a new user would: tiny random-weight configs,
``layerwise`` (prefetch 1), eager (or ``--compiler inductor`` on the CPU), on the simulated accelerator (a device that is not the host) or the CPU.
For each: max abs difference of the logits (transformers) or sample (diffusers) to the plain CPU model, whether
the traffic equals the verified plan, the ledger's peak of the device copies in flight as a share of the model (field `device_weight_peak_share`, named before the slots held were counted: `describe_plan` gives the memory held), bytes read on demand.

    python benchmarks/unseen_architectures.py --device sim --out benchmarks/results/unseen_architectures.json

A model whose tiny config torch itself cannot compile (``torch.compile(backend="eager")`` of the plain model
fails too) is reported as such, not as ours."""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
import warnings

import torch

from offload_compiler import OffloadPolicy, OffloadSavingWarning, offload_compile, plan_summary, reset_offload_stats
from offload_compiler.testing import assert_traffic_matches_plan, simulated_device

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=128, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ALTERNATING = ["sliding_attention", "full_attention"] * 2
MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16)
DECODERS = {  # transformers model_type -> fields beyond SMALL
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, layer_types=ALTERNATING, sliding_window=8),
    "cohere2": dict(layer_types=ALTERNATING, sliding_window=8),
    "smollm3": {}, "glm4": {}, "stablelm": {}, "starcoder2": {}, "hunyuan_v1_dense": {}, "seed_oss": {},
    "apertus": {}, "arcee": {},
    "exaone4": dict(layer_types=ALTERNATING, sliding_window=8),
    "olmo3": dict(layer_types=ALTERNATING, sliding_window=8),
    "ernie4_5_moe": dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=32, moe_layer_start_index=1),
    "qwen3_next": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, linear_num_value_heads=4, linear_num_key_heads=2,
                       linear_key_head_dim=16, linear_value_head_dim=16,
                       layer_types=["linear_attention"] * 3 + ["full_attention"]),
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128,
                        interleave_moe_layer_step=2),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "dots1": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                  n_shared_experts=1, n_group=1, topk_group=1),
    "minimax": dict(num_local_experts=4, num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"] * 2),
    "mamba2": dict(num_heads=8, n_groups=1, state_size=16, expand=2),
    "bamba": dict(**MAMBA, attn_layer_indices=[1, 3]),
    "falcon_h1": dict(**MAMBA, mamba_d_ssm=128, mamba_expand=2),
    "granitemoehybrid": dict(**MAMBA, num_local_experts=4, num_experts_per_tok=2, layer_types=["mamba", "attention"] * 2),
    "jamba": dict(num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
                  expert_layer_period=2, expert_layer_offset=1, mamba_d_state=16),
    "deepseek_v2": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, kv_lora_rank=16,
                        q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        first_k_dense_replace=1, n_shared_experts=1),
}


def _random(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator)


def _diffusers_cases():
    g = torch.Generator().manual_seed(0)
    text = lambda n=16: _random(1, 5, n, generator=g)  # noqa: E731
    return {
        "SanaTransformer2DModel": (
            dict(patch_size=1, in_channels=4, out_channels=4, num_layers=2, num_attention_heads=2, attention_head_dim=8,
                 num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=8,
                 mlp_ratio=2.5, sample_size=8),
            lambda: dict(hidden_states=_random(1, 4, 8, 8, generator=g), encoder_hidden_states=text(8),
                         timestep=torch.tensor([3]))),
        "AuraFlowTransformer2DModel": (
            dict(sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=2,
                 attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                 out_channels=4, pos_embed_max_size=64),
            lambda: dict(hidden_states=_random(1, 4, 8, 8, generator=g), encoder_hidden_states=text(),
                         timestep=torch.tensor([3]))),
        "Lumina2Transformer2DModel": (
            dict(sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=2, num_refiner_layers=1,
                 num_attention_heads=2, num_kv_heads=1, multiple_of=16, norm_eps=1e-5, axes_dim_rope=(4, 6, 6),
                 axes_lens=(128, 128, 128), cap_feat_dim=16),
            lambda: dict(hidden_states=_random(1, 4, 8, 8, generator=g), timestep=torch.tensor([0.5]),
                         encoder_hidden_states=text(), encoder_attention_mask=torch.ones(1, 5, dtype=torch.bool))),
        "ChromaTransformer2DModel": (
            dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(4, 4, 8), approximator_num_channels=8,
                 approximator_hidden_dim=16, approximator_layers=1),
            lambda: dict(hidden_states=_random(1, 16, 4, generator=g), encoder_hidden_states=text(),
                         timestep=torch.tensor([0.5]), img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(5, 3))),
        "MochiTransformer3DModel": (
            dict(patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2, pooled_projection_dim=16,
                 in_channels=4, text_embed_dim=16, time_embed_dim=4, activation_fn="swiglu", max_sequence_length=16),
            lambda: dict(hidden_states=_random(1, 4, 2, 8, 8, generator=g), encoder_hidden_states=text(),
                         timestep=torch.tensor([3]), encoder_attention_mask=torch.ones(1, 5, dtype=torch.bool))),
        "CogView4Transformer2DModel": (
            dict(patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
                 out_channels=4, text_embed_dim=16, time_embed_dim=8, condition_dim=4),
            lambda: dict(hidden_states=_random(1, 4, 8, 8, generator=g), encoder_hidden_states=text(),
                         timestep=torch.tensor([3]), original_size=torch.tensor([[8, 8]]),
                         target_size=torch.tensor([[8, 8]]), crop_coords=torch.tensor([[0, 0]]))),
    }


def _decoder(kind: str):
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **SMALL, **DECODERS[kind]))
    ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(1))
    return model.eval().requires_grad_(False), dict(input_ids=ids, use_cache=False), lambda out: out.logits


def _denoiser(name: str, cases: dict):
    import diffusers
    config, inputs = cases[name]
    torch.manual_seed(0)
    model = getattr(diffusers, name)(**config).eval().requires_grad_(False)
    return model, dict(inputs(), return_dict=False), lambda out: out[0]


def _torch_compiles_it(model, kwargs) -> bool:
    try:
        with torch.no_grad():
            torch.compile(copy.deepcopy(model), backend="eager")(**kwargs)
        return True
    except Exception:  # noqa: BLE001 - any failure of torch's own compile of the plain model
        return False
    finally:
        torch.compiler.reset()


def trial(model, kwargs, output, device: str, compiler: str) -> dict:
    with torch.no_grad():
        expected = output(model(**kwargs))
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:  # whether a small saving is said before it runs
            warnings.simplefilter("always", OffloadSavingWarning)
            m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="layerwise", device=device,
                                                                     compiler=compiler, prefetch=1))
        warned = any(issubclass(w.category, OffloadSavingWarning) for w in caught)
        reset_offload_stats(m)
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        with torch.no_grad():
            got = output(m(**moved)).cpu()
        stats = assert_traffic_matches_plan(m)
    except Exception as error:  # noqa: BLE001 - a trial reports every failure
        ours = _torch_compiles_it(model, kwargs)
        return {"ok": False, "error": f"{type(error).__name__}: {str(error)[:300]}",
                "plain_torch_compile_fails_too": not ours}
    largest = max(plan_summary(m)["groups"], key=lambda g: g["bytes"])
    return {"ok": True, "max_abs_diff": float((got - expected).abs().max()), "traffic_equals_plan": True,
            "device_weight_peak_share": round(stats.peak_resident_bytes / stats.total_bytes, 3),
            "largest_group": largest["name"], "largest_group_share": round(largest["bytes"] / stats.total_bytes, 3),
            "saving_warning": warned,
            "on_demand_bytes": stats.on_demand_bytes, "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="sim", help="'sim' (the simulated accelerator) or 'cpu'")
    parser.add_argument("--compiler", default="eager", choices=["eager", "inductor"],
                        help="inductor: on the cpu only (the simulated device has no inductor backend)")
    parser.add_argument("--only", nargs="*", default=None, help="these names only (e.g. transformers:gpt_oss)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    device = simulated_device() if args.device == "sim" else args.device
    import diffusers
    import transformers
    results = {}
    cases = _diffusers_cases()
    builds = [(f"transformers:{k}", lambda k=k: _decoder(k)) for k in DECODERS]
    builds += [(f"diffusers:{n}", lambda n=n: _denoiser(n, cases)) for n in cases]
    builds = [(name, build) for name, build in builds if args.only is None or name in args.only]
    for name, build in builds:
        results[name] = trial(*build(), device, args.compiler)
        print(name, results[name], flush=True)
    passed = sum(r["ok"] for r in results.values())
    report = {"command": f"python benchmarks/unseen_architectures.py --device {args.device} --compiler {args.compiler}"
                         + (f" --only {' '.join(args.only)}" if args.only else "")
                         + (f" --out {args.out}" if args.out else ""),
              "device": device, "torch": torch.__version__, "transformers": transformers.__version__,
              "diffusers": diffusers.__version__, "python": platform.python_version(),
              "passed": passed, "failed_plain_torch_compile_too": sum(
                  not r["ok"] and r["plain_torch_compile_fails_too"] for r in results.values()),
              "total": len(results), "results": results}
    print(f"{passed} of {len(results)} equal the plain model with traffic equal to the plan")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
