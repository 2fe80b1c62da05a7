"""Regional compilation: how the first call's time grows with depth, with and without ``regional=True``.

Each measurement runs in a fresh Python process: libraries imported, dynamo warmed on a tiny unrelated function
and the model built (random weights) before the clock starts; then the method is set up and called once.

  plain-eager      torch.compile(model, backend="eager") and its first call (no offloading)
  plain-regional   the same with the block class's forward marked torch.compiler.nested_compile_region by
                   hand: what dynamo itself pays per reused block (its floor for ours-regional)
  ours-eager       offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu")) and its first call
  ours-regional    the same with regional=True (each block class traced once, reused for its other blocks)

Models: ``llama`` (a tiny transformers Llama, hidden 128; its call builds a KV cache, updated in every layer)
and ``dit`` (a tiny diffusers ``DiTTransformer2DModel``, `offload_compiler.testing.models.dit`), each at
``--depth`` blocks and twice that. Processes are interleaved (round
by round, model by model, depth by depth, method by method); medians over rounds. ``growth`` is the first
call at 2x depth over the first call at 1x depth (2.0: the capture is linear in depth; near 1: depth is free).
``full_gc_s``: the time the first call spent in full (generation 2) garbage collections; a capture makes enough
objects for one such collection of the whole heap (0.3 s here) to fall inside the first call or just after it,
depending on the collector's counts, which makes a step between depths.

    python benchmarks/regional_capture.py      # writes benchmarks/results/regional_capture.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (RESULTS, FullCollections, environment, exact_command, median, run_worker,  # noqa: E402
                    write_json)

METHODS = ("plain-eager", "plain-regional", "ours-eager", "ours-regional")
MODELS = ("llama", "dit")


def build(name: str, depth: int):
    from offload_compiler.testing.models import dit, llama
    if name == "llama":
        model, inputs = llama(layers=depth, hidden=128, seq=16)
    else:
        model, inputs = dit(layers=depth)
    return model.eval(), inputs


def block_class(name: str, model) -> type:
    return type(model.model.layers[0] if name == "llama" else model.transformer_blocks[0])


def worker(name: str, depth: int, method: str) -> dict:
    import gc
    import torch
    torch.set_num_threads(1)
    torch.compile(lambda t: t * 2 + 1, backend="eager")(torch.ones(4))  # dynamo warmed, untimed
    model, inputs = build(name, depth)
    from offload_compiler import OffloadPolicy, offload_compile, offload_stats
    full_gc = FullCollections()
    with torch.no_grad():
        gc.callbacks.append(full_gc)
        start = time.perf_counter()
        if method == "plain-eager":
            runs = torch.compile(model, backend="eager")
        elif method == "plain-regional":
            block = block_class(name, model)
            block.forward = torch.compiler.nested_compile_region(block.forward)
            runs = torch.compile(model, backend="eager")
        else:
            runs = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu",
                                                        regional=method == "ours-regional"))
        runs(**inputs)
        first = time.perf_counter() - start
        gc.callbacks.remove(full_gc)
        start = time.perf_counter()
        runs(**inputs)
        second = time.perf_counter() - start
    moved = offload_stats(runs).bytes_transferred if method.startswith("ours") else 0
    return {"first_call_s": first, "second_call_s": second, "full_gc_s": full_gc.seconds, "bytes_moved": moved}


def run_fresh(name: str, depth: int, method: str, timeout: int) -> dict:
    return run_worker(__file__, [name, str(depth), method], timeout)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--depth", type=int, default=8, help="blocks at 1x (2x doubles it)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--out", type=Path, default=RESULTS / "regional_capture.json")
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "DEPTH", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.worker[2])))
        return {}
    depths = (args.depth, 2 * args.depth)
    samples = []
    for round_ in range(args.rounds):
        for name in args.models:
            for depth in depths:
                for method in args.methods:
                    result = run_fresh(name, depth, method, args.timeout)
                    samples.append({"round": round_, "model": name, "depth": depth, "method": method, **result})
                    print(f"round {round_} {name:5s} depth {depth:3d} {method:14s} "
                          f"{result.get('first_call_s', float('nan')):6.2f} s {result.get('error', '')}", flush=True)
    summary: dict = {}
    for name in args.models:
        for method in args.methods:
            firsts = {depth: median([s["first_call_s"] for s in samples if s["model"] == name
                                     and s["depth"] == depth and s["method"] == method and "first_call_s" in s])
                      for depth in depths}
            gcs = {depth: median([s["full_gc_s"] for s in samples if s["model"] == name and s["depth"] == depth
                                  and s["method"] == method and "full_gc_s" in s]) for depth in depths}
            ok = all(v is not None for v in firsts.values())
            summary.setdefault(name, {})[method] = {
                f"first_call_s_depth_{d}": v for d, v in firsts.items()} | {
                "growth": firsts[depths[1]] / firsts[depths[0]] if ok else None} | {
                f"full_gc_s_depth_{d}": v for d, v in gcs.items()}
    data = {"command": exact_command(), "environment": environment(),
            "config": {"models": args.models, "depths": depths, "rounds": args.rounds, "methods": args.methods,
                       "torch_num_threads": 1},
            "summary": summary, "samples": samples}
    write_json(args.out, data)
    for name, methods in summary.items():
        for method, row in methods.items():
            print(f"{name:5s} {method:14s} " + "  ".join(f"{k} {v:.2f}" for k, v in row.items() if v is not None))
    return data


if __name__ == "__main__":
    main()
