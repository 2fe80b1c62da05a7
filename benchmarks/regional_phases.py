"""Where the first call of a regionally compiled model spends its time, by phase, at several depths.

A tiny DiT (`offload_compiler.testing.models.dit`) at 8, 16 and 32 blocks, each in a fresh process (dynamo warmed
on an unrelated function, the model built, then timed): ``offload_compile(model, OffloadPolicy(strategy=
"layerwise", device="cpu", regional=True))`` and its first call (``ours-regional``), and plain ``torch.compile(
model, backend="eager")`` with the block class's forward marked ``torch.compiler.nested_compile_region`` by hand
(``plain-regional``: dynamo's own cost per reused block). The phases are wall-clock spans around dynamo's
functions and ours (each counted once where it nests in itself):

  dynamo            torch._dynamo.convert_frame._compile: the whole capture of the frame
  trace             convert_frame.trace_frame: bytecode to FX graph, within it
    fingerprint       invoke_subgraph.build_input_fingerprint: a region call's inputs (pytree traced by dynamo)
    reuse_check       invoke_subgraph.find_reuse_match: the region's guards under the block's sources
    stamp_out         invoke_subgraph.stamp_out_subgraph: the reused call emitted, the block's weights lifted
  backend           OutputGraph.call_user_compiler (ours: the passes and lowering)
  guards            guards.CheckFunctionManager: the frame's guards built
  graph_run         our graph's first run (ours only)
  setup             offload_compile itself (ours only)
  full_gc           full (generation 2) garbage collections anywhere in the first call

``per_block_ms`` is each phase's growth from the smallest depth to the largest, per block added. Depths run
interleaved over rounds; medians.

    PYTHONPATH=. python benchmarks/regional_phases.py    # writes benchmarks/results/regional_phases.json
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

METHODS = ("ours-regional", "plain-regional")


def worker(depth: int, method: str) -> dict:
    import gc

    import torch
    import torch._dynamo.convert_frame as convert_frame
    import torch._dynamo.guards as guards
    import torch._dynamo.output_graph as output_graph
    import torch._dynamo.variables.invoke_subgraph as invoke_subgraph

    import offload_compiler.backend as backend
    from offload_compiler import OffloadPolicy, offload_compile
    from offload_compiler.testing.models import dit

    torch.set_num_threads(1)
    torch.compile(lambda t: t * 2 + 1, backend="eager")(torch.ones(4))  # dynamo warmed, untimed
    model, inputs = dit(layers=depth)
    model.eval()
    spans: dict[str, float] = {}
    inside: set[str] = set()

    def timed(owner, name: str, phase: str) -> None:
        function = getattr(owner, name)

        def span(*args, **kwargs):
            if phase in inside:  # nested in itself: counted once
                return function(*args, **kwargs)
            inside.add(phase)
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spans[phase] = spans.get(phase, 0.0) + time.perf_counter() - start
                inside.discard(phase)
        setattr(owner, name, span)
    timed(convert_frame, "_compile", "dynamo")
    timed(convert_frame, "trace_frame", "trace")
    timed(invoke_subgraph, "build_input_fingerprint", "fingerprint")
    timed(invoke_subgraph, "find_reuse_match", "reuse_check")
    timed(invoke_subgraph, "stamp_out_subgraph", "stamp_out")
    timed(output_graph.OutputGraph, "call_user_compiler", "backend")
    timed(guards.CheckFunctionManager, "__init__", "guards")
    timed(backend.GraphRunner, "__call__", "graph_run")
    full_gc = FullCollections()
    with torch.no_grad():
        gc.callbacks.append(full_gc)
        start = time.perf_counter()
        if method == "plain-regional":
            block = type(model.transformer_blocks[0])
            block.forward = torch.compiler.nested_compile_region(block.forward)
            runs = torch.compile(model, backend="eager")
        else:
            runs = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu", regional=True))
        spans["setup"] = time.perf_counter() - start
        runs(**inputs)
        spans["first_call"] = time.perf_counter() - start
        gc.callbacks.remove(full_gc)
    spans["full_gc"] = full_gc.seconds
    return spans


def run_fresh(depth: int, method: str, timeout: int) -> dict:
    return run_worker(__file__, [str(depth), method], timeout)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", nargs="+", type=int, default=[8, 16, 32])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--out", type=Path, default=RESULTS / "regional_phases.json")
    parser.add_argument("--worker", nargs=2, metavar=("DEPTH", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(int(args.worker[0]), args.worker[1])))
        return {}
    samples = []
    for round_ in range(args.rounds):
        for method in args.methods:
            for depth in args.depths:
                result = run_fresh(depth, method, args.timeout)
                samples.append({"round": round_, "depth": depth, "method": method, **result})
                print(f"round {round_} {method:14s} depth {depth:3d} "
                      f"{result.get('first_call', float('nan')):6.2f} s {result.get('error', '')}", flush=True)
    summary: dict = {}
    low, high = min(args.depths), max(args.depths)
    for method in args.methods:
        ok = [s for s in samples if s["method"] == method and "error" not in s]
        phases = sorted({k for s in ok for k in s if k not in ("round", "depth", "method")})
        seconds = {phase: {depth: median([s.get(phase, 0.0) for s in ok if s["depth"] == depth])
                           for depth in args.depths} for phase in phases}
        summary[method] = {
            "seconds": {phase: {str(d): v for d, v in by_depth.items()} for phase, by_depth in seconds.items()},
            "per_block_ms": {phase: None if None in (by_depth[low], by_depth[high]) else
                             1000 * (by_depth[high] - by_depth[low]) / (high - low)
                             for phase, by_depth in seconds.items()}}
    data = {"command": exact_command(), "environment": environment(),
            "config": {"depths": args.depths, "rounds": args.rounds, "methods": args.methods,
                       "torch_num_threads": 1},
            "summary": summary, "samples": samples}
    write_json(args.out, data)
    for method, row in summary.items():
        print(method, "  ".join(f"{k} {v:.1f}" for k, v in row["per_block_ms"].items() if v is not None), "ms/block")
    return data


if __name__ == "__main__":
    main()
