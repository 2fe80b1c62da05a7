"""Mixture-of-experts decode at batch 1: what a token moves and costs when only the routed experts are fetched.

A Qwen3-MoE decoder (transformers, built from a config with random weights, ``batched_mm`` experts) prefills a
prompt once; each timed call then decodes one token from that cache (cropped back to the prompt before each call,
so every call does the same work). Methods in this one process, interleaved round by round, medians:

  plain   the model on the device (the compute-only reference; needs the device to hold the whole model)
  ours    offload_compile(model, OffloadPolicy(strategy="layerwise", device=...)): each block's experts are a
          group of their own, fetched routed (the distinct experts the router named) at decode

Per method: ms per token. For ours, from the ledger of one token: bytes moved, whole fetches, routed fetches and
expert bytes; against them the bound the routed fetch must meet (non-expert bytes + top_k/E x expert bytes), the
bytes a whole-layer fetch would move (the model), and on an accelerator the lower bound bytes / pinned host-to-device
bandwidth (measured here, one exact-size pinned copy of the token's bytes). Tokens of ours equal plain's (checked).

    python benchmarks/moe_decode.py --device cpu --out benchmarks/results/moe_decode_cpu.json
    python benchmarks/moe_decode.py --device sim          # the simulated accelerator: bytes only, times meaningless
    python benchmarks/moe_decode.py --device cuda --dtype bfloat16 --hidden 1024 --experts 64 --top-k 8 \\
        --out benchmarks/results/moe_decode_gpu.json     # when a GPU is lent (gpu_campaign.sh runs it)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, exact_command, write_json  # noqa: E402
from offload_compiler import OffloadPolicy, offload_compile, offload_stats, reset_offload_stats  # noqa: E402
from offload_compiler.testing import assert_traffic_matches_plan, simulated_device  # noqa: E402


def build(args, device: str):
    from transformers import DynamicCache, Qwen3MoeConfig, Qwen3MoeForCausalLM
    config = Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                            moe_intermediate_size=args.hidden // 2, num_hidden_layers=args.layers,
                            num_attention_heads=max(args.hidden // 64, 2), num_key_value_heads=2,
                            head_dim=64 if args.hidden >= 128 else 16, num_experts=args.experts,
                            num_experts_per_tok=args.top_k, decoder_sparse_step=1, max_position_embeddings=256)
    config._experts_implementation = "batched_mm"  # experts gathered by router indices: fetched routed
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(getattr(torch, args.dtype)).eval().requires_grad_(False)
    return model, DynamicCache


def sync(device: str) -> None:
    if torch.device(device).type != "cpu":
        torch.get_device_module(device).synchronize()


def pinned_bandwidth(nbytes: int, device: str, repeats: int = 10) -> float | None:
    """GB/s (1e9 B/s) of one host-to-device copy of ``nbytes`` from a pinned buffer, median; CUDA only."""
    if torch.device(device).type != "cuda":
        return None
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dest = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        dest.copy_(host, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu, cuda, or sim (the simulated accelerator)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=5, help="timed decode calls per method and round")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)  # past_key_values: the floor's transformers needs it
    device = simulated_device() if args.device == "sim" else args.device

    model, Cache = build(args, device)
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    other_bytes = total_bytes - expert_bytes
    bound = other_bytes + args.top_k / args.experts * expert_bytes
    plain = copy.deepcopy(model).to(device)
    ours = offload_compile(model, OffloadPolicy(strategy="layerwise", device=device))
    ids = torch.randint(3, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1)).to(device)

    def prefilled(m):
        cache = Cache()
        with torch.no_grad():
            out = m(input_ids=ids, past_key_values=cache, use_cache=True)
        return cache, out.logits[:, -1:].argmax(-1)

    states = {"plain": (plain, *prefilled(plain)), "ours": (ours, *prefilled(ours))}

    def decode(name: str) -> torch.Tensor:
        m, cache, token = states[name]
        extra = cache.get_seq_length() - args.prompt
        if extra:
            cache.crop(-extra)  # back to the prompt: every call decodes the same token
        with torch.no_grad():
            return m(input_ids=token, past_key_values=cache, use_cache=True).logits

    tokens_equal = torch.equal(decode("plain").argmax(-1).cpu(), decode("ours").argmax(-1).cpu())
    reset_offload_stats(ours)
    decode("ours")
    one = assert_traffic_matches_plan(ours)  # the token's traffic equals the verified plans (routed within bound)
    times: dict[str, list[float]] = {name: [] for name in states}
    for _ in range(args.rounds):
        for name in states:
            sync(device)
            start = time.perf_counter()
            for _ in range(args.calls):
                decode(name)
            sync(device)
            times[name].append((time.perf_counter() - start) / args.calls)
    bandwidth = pinned_bandwidth(one.bytes_transferred, device)
    results = {
        "command": exact_command(), "environment": environment(), "device": str(device),
        "model": {"class": "Qwen3MoeForCausalLM", "dtype": args.dtype, "hidden": args.hidden, "layers": args.layers,
                  "experts": args.experts, "top_k": args.top_k, "total_bytes": total_bytes,
                  "expert_bytes": expert_bytes},
        "ms_per_token": {name: statistics.median(ts) * 1e3 for name, ts in times.items()},
        "ours_per_token": {"bytes_moved": one.bytes_transferred, "whole_fetches": one.fetch_count,
                           "routed_fetches": one.routed_fetches, "expert_bytes_moved": one.expert_bytes,
                           "bound_bytes": int(bound), "bytes_over_bound": one.bytes_transferred / bound,
                           "whole_layer_bytes": total_bytes,
                           "saving_vs_whole_layers": 1 - one.bytes_transferred / total_bytes},
        "tokens_equal_plain": tokens_equal,
        "pinned_h2d_gb_s": bandwidth,
        "transfer_lower_bound_ms": one.bytes_transferred / bandwidth / 1e6 if bandwidth else None,
    }
    results["ms_per_token"]["ours_over_plain"] = results["ms_per_token"]["ours"] / results["ms_per_token"]["plain"]
    print(f"per token: ours moved {one.bytes_transferred} B (bound {bound:.0f} B, whole layers {total_bytes} B: "
          f"{results['ours_per_token']['saving_vs_whole_layers']:.0%} saved); "
          f"plain {results['ms_per_token']['plain']:.2f} ms, ours {results['ms_per_token']['ours']:.2f} ms; "
          f"tokens equal: {tokens_equal}")
    assert offload_stats(ours).routed_fetches > 0
    if args.out:
        write_json(Path(args.out), results)
    return results


if __name__ == "__main__":
    main()
