"""Main job: a real Llama architecture (~84M parameters, random weights built from a config) run with
layerwise offload. Prints the plan, what moved, what it saved, and checks the outputs against the plain model.

    python examples/llama_layerwise.py                 # CUDA when available, else CPU
    python examples/llama_layerwise.py --compiler inductor --prefetch 2
"""

import argparse
import contextlib
import copy
import time

import torch

from offload_compiler import OffloadPolicy, describe_plan, offload_compile, offload_stats, reset_offload_stats
from offload_compiler.testing import one_intra_op_thread
from offload_compiler.testing.models import llama


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compiler", default="eager", choices=["eager", "inductor"])
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()

    t0 = time.perf_counter()
    model, inputs = llama(layers=args.layers, hidden=512, intermediate=1408, vocab=32000, heads=8, kv_heads=8,
                          seq=args.seq)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"built Llama ({args.layers} layers, {n_params / 1e6:.1f}M parameters, random weights) "
          f"in {time.perf_counter() - t0:.1f}s")

    # eager on the CPU is compared bit for bit, at one intra-op thread: torch's multi-threaded CPU kernels do not
    # promise the same bits from run to run, so with many threads the plain model can differ from itself
    exact = args.compiler == "eager" and args.device == "cpu"
    same_bits = one_intra_op_thread if exact else contextlib.nullcontext
    plain = copy.deepcopy(model).to(args.device)
    inputs = {k: v.to(args.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with torch.no_grad(), same_bits():
        expected = plain(**inputs).logits
    del plain

    policy = OffloadPolicy(strategy="layerwise", device=args.device, prefetch=args.prefetch, compiler=args.compiler)
    offloaded = offload_compile(model, policy)
    t0 = time.perf_counter()
    offloaded(**inputs)  # first call captures and compiles
    compile_s = time.perf_counter() - t0
    reset_offload_stats(offloaded)
    t0 = time.perf_counter()
    offloaded(**inputs)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    call_s = time.perf_counter() - t0

    print(describe_plan(offloaded))
    stats = offload_stats(offloaded)
    print(f"capture+compile {compile_s:.1f}s, one offloaded call {call_s * 1e3:.0f} ms")
    looked_up = (f", and {stats.routed_bytes / 2**10:.1f} KiB of rows looked up in {stats.routed_fetches} routed "
                 f"fetch{'es' if stats.routed_fetches != 1 else ''} (the token embedding's rows for the call's tokens, not its table)"
                 if stats.routed_fetches else "")
    print(f"moved {(stats.bytes_transferred - stats.routed_bytes) / 2**20:.1f} MiB in {stats.fetch_count} fetches per "
          f"call{looked_up}")
    # the device memory held for weights: the slots copies land in (allocated whole at the first call, kept
    # between calls) and whatever stays on the device; the copies in flight at once are at most that
    held, total = stats.peak_device_weight_bytes, stats.total_bytes + stats.unmanaged_bytes
    print(f"device weights held {held / 2**20:.1f} MiB instead of {total / 2**20:.1f} MiB without offload: saved "
          f"{(1 - held / total) * 100:.0f}% ({stats.pool_bytes / 2**20:.1f} MiB of device slots; copies in flight "
          f"at most {stats.peak_resident_bytes / 2**20:.1f} MiB; filled after the call: {stats.live_device_bytes} B)")
    with same_bits():
        got = offloaded(**inputs).logits
    diff = (got - expected).abs().max().item()
    if exact:
        same, how = torch.equal(got, expected), f"compared bit for bit; max abs diff {diff:.2e}"
    else:  # a device's or inductor's kernels may sum in another order
        same, how = diff < 1e-3, f"within the tolerance 1e-03: max abs diff {diff:.2e}"
    print(f"outputs equal the plain model: {same} ({how})")
    if not same:
        raise SystemExit("offloaded outputs differ from the plain model")


if __name__ == "__main__":
    main()
