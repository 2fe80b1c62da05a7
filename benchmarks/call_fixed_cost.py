"""The fixed host work around every offloaded call (CPU), piece by piece, on host_overhead.py's stack.

Each offloaded call, before and after its graph runs, does per-call work that does not depend on the model's
compute: it lifts the routed parts (`_RoutedPart`, one per module holding weights) and puts them back
(`OffloadState.tracing_through`), enters dynamo's config patch (`_dynamo.capture_config`), snapshots dynamo's
graph-break counters, and checks every hook dict (`HookWatch.change`, twice). Each piece is timed alone
(``timeit``, best of ``--repeats``), with the number of modules it walks.

    python benchmarks/call_fixed_cost.py                 # writes benchmarks/results/call_fixed_cost.json
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, environment, exact_command, write_json  # noqa: E402
from host_overhead import Stack  # noqa: E402

from offload_compiler import OffloadPolicy, offload_compile  # noqa: E402
from offload_compiler._dynamo import graph_breaks  # noqa: E402
from offload_compiler.offloaded import state_of  # noqa: E402


def _entered(context) -> None:
    with context:
        pass


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--number", type=int, default=2000, help="calls per timing")
    parser.add_argument("--repeats", type=int, default=7, help="timings per piece; the best is kept")
    parser.add_argument("--out", type=Path, default=RESULTS / "call_fixed_cost.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    m = offload_compile(Stack(args.blocks, 64).eval(), OffloadPolicy(strategy="layerwise", device="cpu"))
    with torch.no_grad():
        m(torch.randn(1, 64))
    state = state_of(m)
    pieces = {
        "lift and restore the routed parts": lambda: _entered(state.tracing_through()),
        "dynamo config patch": lambda: _entered(state.limits),
        "graph-break snapshot": graph_breaks,
        "hook check (runs twice per call)": state.hooks.change,
    }
    us = {name: min(timeit.repeat(piece, number=args.number, repeat=args.repeats)) / args.number * 1e6
          for name, piece in pieces.items()}
    per_call = sum(us.values()) + us["hook check (runs twice per call)"]
    result = {
        "command": exact_command(),
        "environment": environment(),
        "config": {"blocks": args.blocks, "number": args.number, "repeats": args.repeats},
        "walked": {"routed parts": len(state.parts), "hook dicts": len(state.hooks.dicts),
                   "groups": len(state.runtime.groups)},
        "us_per_call": us,
        "summary": {"us_per_call": per_call, "us_per_group": per_call / len(state.runtime.groups)},
    }
    write_json(args.out, result)
    for name, value in us.items():
        print(f"{name:36s} {value:8.2f} µs per call")
    print(f"in all, per call {per_call:.1f} µs, per group {result['summary']['us_per_group']:.2f} µs "
          f"({len(state.parts)} parts, {len(state.hooks.dicts)} hook dicts)")
    return result


if __name__ == "__main__":
    main()
