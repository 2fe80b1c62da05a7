"""The fixed host work around every offloaded call (CPU), piece by piece, on host_overhead.py's stack.

Each offloaded call, before and after its graph runs, does per-call work that does not depend on the model's
compute: it marks the thread as inside an offloaded call (`OffloadState.tracing_through`; the piece keeps its
earlier name, from when it lifted per-module routed parts), enters what dynamo's config needs for the call (`_torch_private.config_for_call`:
nothing on a steady call, since our compiles carry `_torch_private.capture_config` themselves; a library without it
entered that config patch around every call), snapshots dynamo's graph-break counters, and checks every hook
dict (`HookWatch.change`, twice); it also looks at every tensor among the call's arguments (moved to the device
if elsewhere, `_OffloadedForward._inputs_on_device`), timed on a decode step's arguments (``input_ids``, a KV
cache object, ``use_cache``). Each piece is timed alone (``timeit``, best of ``--repeats``), with the number
of modules it walks; a whole steady call of the model is timed too, for reference (not part of the sum).

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
from offload_compiler.offloaded import Outside, state_of  # noqa: E402


def _entered(context) -> None:
    with context:
        pass


class _Cache:
    """Stands for a KV cache object among a decode step's arguments (not a pytree node, as transformers')."""


def _call_config(state):
    """What a call enters for dynamo's config: ``config_for_call`` where the library has it, else the patch that
    every call entered before it (so that this script times either tree, before and after)."""
    try:
        from offload_compiler._torch_private import config_for_call
    except ImportError:
        return lambda: state.limits
    forward = state.forwards[(state.owner, "forward")]
    return lambda: config_for_call(forward._compiled, state.limits)


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
    call_config = _call_config(state)
    forward = state.forwards[(state.owner, "forward")]
    decode_step = {"input_ids": torch.zeros(1, 1, dtype=torch.long), "past_key_values": _Cache(), "use_cache": True}
    pieces = {
        "argument scan (a decode step's)": lambda: forward._inputs_on_device((), decode_step, state.runtime.device),
        "lift and restore the routed parts": lambda: _entered(state.tracing_through()),
        "dynamo config for the call": lambda: _entered(call_config()),
        "outside-the-graphs snapshot": lambda: Outside(state.runtime, state.owner, "forward"),
        "hook check (runs twice per call)": state.hooks.change,
    }
    us = {name: min(timeit.repeat(piece, number=args.number, repeat=args.repeats)) / args.number * 1e6
          for name, piece in pieces.items()}
    per_call = sum(us.values()) + us["hook check (runs twice per call)"]
    x = torch.randn(1, 64)
    with torch.no_grad():
        whole = min(timeit.repeat(lambda: m(x), number=max(args.number // 10, 1), repeat=args.repeats))
    whole_us = whole / max(args.number // 10, 1) * 1e6
    result = {
        "command": exact_command(),
        "environment": environment(),
        "config": {"blocks": args.blocks, "number": args.number, "repeats": args.repeats},
        "walked": {"routed parts": len(state.parts), "hook dicts": len(state.hooks.dicts),
                   "groups": len(state.runtime.groups)},
        "us_per_call": us,
        "summary": {"us_per_call": per_call, "us_per_group": per_call / len(state.runtime.groups)},
        "whole_call_us": whole_us,
    }
    write_json(args.out, result)
    for name, value in us.items():
        print(f"{name:36s} {value:8.2f} µs per call")
    print(f"in all, per call {per_call:.1f} µs, per group {result['summary']['us_per_group']:.2f} µs "
          f"({len(state.parts)} parts, {len(state.hooks.dicts)} hook dicts)")
    print(f"a whole steady call {whole_us:.1f} µs (for reference)")
    return result


if __name__ == "__main__":
    main()
