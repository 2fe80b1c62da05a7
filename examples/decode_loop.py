"""Token-by-token decoding with transformers' generate() on an offloaded Llama (random weights), with prefetch
wrap-around: each decoding step's last layer prefetches the first group of the next step. Prints the bytes moved
per token, how many steps started from the copy their previous step carried, and checks the tokens against the
plain model's greedy decoding.

    python examples/decode_loop.py                     # CUDA when available, else CPU
    python examples/decode_loop.py --tokens 32 --compiler inductor
"""

import argparse
import copy
import time

import torch

from offload_compiler import OffloadPolicy, offload_compile, offload_stats, release_device_copies, reset_offload_stats
from offload_compiler.testing.models import llama


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compiler", default="eager", choices=["eager", "inductor"])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()

    model, inputs = llama(layers=args.layers, hidden=256, intermediate=704, vocab=8000, heads=8, kv_heads=4, seq=12)
    prompt = inputs["input_ids"].to(args.device)
    plain = copy.deepcopy(model).to(args.device)
    expected = plain.generate(prompt, max_new_tokens=args.tokens, do_sample=False)
    del plain

    policy = OffloadPolicy(strategy="layerwise", device=args.device, prefetch=1, compiler=args.compiler,
                           prefetch_next_call=True)
    m = offload_compile(model, policy)
    t0 = time.perf_counter()
    got = m.generate(prompt, max_new_tokens=args.tokens, do_sample=False)  # compiles prefill and decode graphs
    print(f"first generate (captures and compiles): {time.perf_counter() - t0:.1f}s")
    reset_offload_stats(m)
    t0 = time.perf_counter()
    got = m.generate(prompt, max_new_tokens=args.tokens, do_sample=False)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    stats = offload_stats(m)
    steps = args.tokens  # one prefill call and tokens - 1 decoding calls
    print(f"{args.tokens} tokens in {seconds:.2f}s: moved {stats.bytes_transferred / 2**20:.1f} MiB "
          f"({stats.bytes_transferred / steps / 2**20:.2f} MiB per call, {stats.fetch_count} fetches)")
    print(f"calls that started from the copy their previous call prefetched: {stats.carry_hits} of {steps}")
    print(f"peak device weights {stats.peak_device_weight_bytes / 2**20:.2f} MiB of "
          f"{(stats.total_bytes + stats.unmanaged_bytes) / 2**20:.2f} MiB; held between calls "
          f"{stats.carried_bytes / 2**20:.2f} MiB (released: {release_device_copies(m) / 2**20:.2f} MiB)")
    print(f"tokens equal the plain model's greedy decoding: {torch.equal(got, expected)}")


if __name__ == "__main__":
    main()
