"""Dynamo's per-call cost (guards and call) of a model whose weights are host masters, against plain weights:
a backend that returns a constant, so only what dynamo does per call is timed. Interleaved, medians.

    PYTHONPATH=. python benchmarks/host_master_guards.py [--weights 64] [--calls 1000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch import nn

from offload_compiler.host_masters import HostMaster, keep_guards


def _model(layers: int, masters: bool) -> nn.Module:
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)]).eval()
    if masters:
        for module in model:
            for name, p in list(module._parameters.items()):
                module._parameters[name] = nn.Parameter(HostMaster(p.detach(), torch.device("cpu")),
                                                        requires_grad=False)
    return model


def _constant_backend():
    out = torch.zeros(1, 8)
    return lambda gm, example_inputs: (lambda *args: (out,))


def _drop_master_guards(entries: list) -> list[bool]:
    return [not (e.has_value and isinstance(e.value, HostMaster)) for e in entries]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--weights", type=int, default=64)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    layers = args.weights // 2
    x = torch.randn(1, 8)
    methods = {  # each its own backend object: dynamo shares compiled code between equal backends
        "plain": torch.compile(_model(layers, False), backend=_constant_backend()),
        "masters": torch.compile(_model(layers, True), backend=_constant_backend()),
        "masters, their guards dropped": torch.compile(_model(layers, True), backend=_constant_backend(),
                                                       options={"guard_filter_fn": _drop_master_guards}),
        # what offloaded calls compile with (`host_masters.GUARD_FILTER`): each master's TENSOR_MATCH alone
        "masters, TENSOR_MATCH alone (keep_guards)": torch.compile(
            _model(layers, True), backend=_constant_backend(),
            options={"guard_filter_fn": keep_guards}),
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    with torch.no_grad():
        for compiled in methods.values():
            compiled(x)
        for _ in range(args.rounds):
            for name, compiled in methods.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    compiled(x)
                times[name].append((time.perf_counter() - start) / args.calls * 1e6)
    result = {"command": "PYTHONPATH=. python benchmarks/host_master_guards.py " + " ".join(sys.argv[1:]),
              "torch": torch.__version__, "weights": args.weights, "us_per_call_median":
              {name: round(statistics.median(t), 1) for name, t in times.items()}}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
