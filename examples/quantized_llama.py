"""Quantized weights stream as their quantized bytes: a tiny Llama (random weights) offloaded layerwise in
fp32, bf16, and quantized with torchao from bf16 (int8 and float8 weight-only). Prints the bytes each call moves
and checks the outputs against the same plain (quantized) model.

    pip install torchao             # or: pip install -e '.[quant]'
    python examples/quantized_llama.py
    python examples/quantized_llama.py --layers 4 --hidden 256 --compiler inductor
"""

import argparse

import torch

from offload_compiler import OffloadPolicy, offload_compile, offload_stats, remove_offload, reset_offload_stats
from offload_compiler.subclasses import leaf_nbytes
from offload_compiler.testing import one_intra_op_thread
from offload_compiler.testing.models import llama


def build(kind: str, layers: int, hidden: int):
    model, inputs = llama(layers=layers, hidden=hidden)
    if kind == "fp32":
        return model, inputs
    model = model.to(torch.bfloat16)
    if kind in ("int8", "float8"):
        from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
        quantize_(model, Int8WeightOnlyConfig() if kind == "int8" else Float8WeightOnlyConfig())
    return model, inputs


def bytes_per_call(kind: str, args) -> tuple[int, int, bool]:
    """(bytes one steady call moves, the model's weight bytes, outputs equal the plain model's)."""
    model, inputs = build(kind, args.layers, args.hidden)
    weights = sum(leaf_nbytes(w) for w in {id(w): w for w in [*model.parameters(), *model.buffers()]}.values())
    with torch.no_grad():
        expected = model(**inputs).logits
        m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu", compiler=args.compiler))
        m(**inputs)  # captures the graphs
        reset_offload_stats(m)
        got = m(**inputs).logits
    moved = offload_stats(m).bytes_transferred
    exact = torch.equal(got, expected) if args.compiler == "eager" else torch.allclose(
        got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    remove_offload(m)
    return moved, weights, exact


@one_intra_op_thread()  # the outputs are compared bit for bit (why one thread: its docstring)
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--compiler", default="eager", choices=["eager", "inductor"])
    args = parser.parse_args()
    print(f"tiny Llama: {args.layers} layers, hidden {args.hidden}; layerwise offload, {args.compiler}")
    print(f"{'weights':<8} {'bytes per call':>15} {'of the model':>13}   outputs equal the plain model")
    results = {}
    for kind in ("fp32", "bf16", "int8", "float8"):
        try:
            results[kind] = bytes_per_call(kind, args)
        except ImportError as exc:
            print(f"{kind:<8} skipped: {exc}")
            continue
        moved, weights, exact = results[kind]
        print(f"{kind:<8} {moved:>15,d} {weights:>13,d}   {exact}")
    if "int8" in results:
        print(f"int8 moves {results['int8'][0] / results['bf16'][0]:.2f}x the bytes of bf16 and "
              f"{results['int8'][0] / results['fp32'][0]:.2f}x those of fp32")
    print(f"outputs equal: {all(exact for _, _, exact in results.values())}")


if __name__ == "__main__":
    main()
