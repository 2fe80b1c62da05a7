"""A second process starts warm: the first call of a model compiled with inductor, in a fresh process whose
inductor cache directory is empty ("cold") and in the next fresh process sharing that directory ("warm").
torch's FX-graph and AOT-autograd caches key a graph by its content; an offloaded graph's transfer ops carry
only plain integers (runtime id, group and fetch keys, plan indices) that are the same in every process, so
the rewritten graph hits the cache as the plain one does. Methods:

  plain-inductor   torch.compile(model) (inductor) and its first call
  ours-inductor    offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu", compiler="inductor"))
                   and its first call

Each round makes a new cache directory per method, then runs cold and warm; methods interleaved round by round;
medians over the rounds. The cache hits and misses each process saw (torch's counters) are recorded.

    PYTHONPATH=. python benchmarks/compile_cache.py [--layers 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, environment, exact_command, write_json  # noqa: E402

METHODS = ("plain-inductor", "ours-inductor")


def worker(method: str, layers: int) -> dict:
    import torch
    from torch._dynamo.utils import counters
    from offload_compiler import OffloadPolicy, offload_compile
    from offload_compiler.testing.models import llama
    model, inputs = llama(layers=layers, hidden=64)
    model.eval()
    start = time.perf_counter()
    if method == "ours-inductor":
        run = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu", compiler="inductor"))
    else:
        run = torch.compile(model)
    with torch.no_grad():
        run(**inputs, use_cache=False)
    first = time.perf_counter() - start
    caches = {k: v for name in ("inductor", "aot_autograd") for k, v in counters[name].items() if "cache" in k}
    return {"first_call_s": first, "caches": caches}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", nargs=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS / "compile_cache.json")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.layers)))
        return
    runs: dict[str, dict[str, list]] = {m: {"cold": [], "warm": []} for m in METHODS}
    for _ in range(args.rounds):
        for method in METHODS:
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                for state in ("cold", "warm"):
                    out = subprocess.run([sys.executable, __file__, "--layers", str(args.layers), "--worker", method],
                                         check=True, capture_output=True, text=True, env=env)
                    runs[method][state].append(json.loads(out.stdout.strip().splitlines()[-1]))
    median = {m: {s: statistics.median(r["first_call_s"] for r in runs[m][s]) for s in ("cold", "warm")}
              for m in METHODS}
    result = {"command": exact_command(), "environment": environment(),
              "model": f"tiny Llama (offload_compiler.testing.models.llama), {args.layers} layers, hidden 64",
              "rounds": args.rounds, "median_first_call_s": median,
              "warm_over_cold": {m: median[m]["warm"] / median[m]["cold"] for m in METHODS},
              "target": "ours-inductor warm <= 0.5 x cold",
              "meets_target": median["ours-inductor"]["warm"] <= 0.5 * median["ours-inductor"]["cold"],
              "runs": runs}
    write_json(args.out, result)
    print(json.dumps({k: result[k] for k in ("median_first_call_s", "warm_over_cold", "meets_target")}, indent=1))


if __name__ == "__main__":
    main()
