"""A steady eager call of an offloaded many-part model, timed on two (or more) library trees, A/B interleaved.

The model is host_overhead.py's stack (``--blocks`` blocks of two ``Linear``: 3 x blocks modules holding
weights, each a routed part), offloaded ``layerwise`` on the CPU, called in eager mode (the offloaded graph
compiled by dynamo with its default backend, as a user gets it) until it is steady; then ``--number`` calls are
timed, ``--repeats`` times, in a fresh subprocess per tree and round. The trees take turns (A B, then B A, ...)
for ``--rounds`` rounds, so that the load of a shared machine falls on both alike. Per tree: the median over
rounds of each round's best batch, wall and CPU time of the process (what other processes inflate least).
What differs between the trees at a steady call is host work: dynamo's guards on the call's frame (a Python
lambda guard per part costs about a microsecond; the C++ ones, tens of nanoseconds), and our own bookkeeping.
The guards' check alone is timed too (``guard_check_us``: far less noisy than the whole call).

    git archive main | tar -x -C /tmp/base      # a base tree
    python benchmarks/steady_call_ab.py --tree branch=. --tree main=/tmp/base  # writes results/steady_call_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(blocks: int, hidden: int, number: int, repeats: int) -> dict:
    """In a subprocess whose PYTHONPATH names the tree: build, offload, warm up, time."""
    import torch
    sys.path.insert(0, str(HERE))
    from host_overhead import Stack

    import offload_compiler
    from offload_compiler import OffloadPolicy, offload_compile
    from offload_compiler.offloaded import state_of

    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = offload_compile(Stack(blocks, hidden).eval(), OffloadPolicy(strategy="layerwise", device="cpu"))
    x = torch.randn(1, hidden)
    with torch.no_grad():
        for _ in range(20):
            m(x)
        walls, cpus = [], []
        for _ in range(repeats):
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(number):
                m(x)
            walls.append((time.perf_counter() - wall) / number * 1e6)
            cpus.append((time.process_time() - cpu) / number * 1e6)
        guard_us = _guard_check_us(m, x, number, repeats)
    return {"library": str(Path(offload_compiler.__file__).resolve().parent.parent),
            "routed_parts": len(state_of(m).parts), "wall_us": min(walls), "cpu_us": min(cpus),
            "guard_check_us": guard_us}


def _guard_check_us(m, x, number: int, repeats: int) -> float | None:
    """The check of the guards of the call's cached graph alone (dynamo's private cache-entry API; None where
    it differs): the part of a steady call that the routed parts' guards add to. A tree that lifts the parts
    during a call (the earlier design) is checked as during one."""
    import contextlib
    import timeit

    import torch
    from offload_compiler.offloaded import state_of
    try:
        state = state_of(m)
        function = state.forwards[(state.owner, "forward")]._compiled.__wrapped__
        entry, = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(function.__code__)
        f_locals = {"args": (x,), "kwargs": {}, "function": function.__closure__[0].cell_contents}
        check = entry.guard_manager.check
        with contextlib.nullcontext() if check(f_locals) else state.tracing_through():
            if not check(f_locals):
                return None
            return min(timeit.repeat(lambda: check(f_locals), number=number, repeat=repeats)) / number * 1e6
    except Exception:
        return None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                        help="a library tree to time (repeat; default: this checkout only)")
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--number", type=int, default=200, help="calls per timed batch")
    parser.add_argument("--repeats", type=int, default=5, help="batches per subprocess; the best is kept")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "steady_call_ab.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.blocks, args.hidden, args.number, args.repeats)))
        return {}

    sys.path.insert(0, str(HERE))
    from common import environment, exact_command, git_commit, write_json

    trees = dict(t.split("=", 1) for t in args.tree) or {"this": str(HERE.parent)}
    trees = {name: str(Path(path).resolve()) for name, path in trees.items()}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    order = list(trees)
    for round_ in range(args.rounds):
        for name in (order if round_ % 2 == 0 else order[::-1]):
            env = dict(os.environ, PYTHONPATH=trees[name])
            out = subprocess.run([sys.executable, __file__, "--worker", "--blocks", str(args.blocks), "--hidden",
                                  str(args.hidden), "--number", str(args.number), "--repeats", str(args.repeats)],
                                 env=env, capture_output=True, text=True, check=True, cwd=trees[name])
            run = json.loads(out.stdout.strip().splitlines()[-1])
            assert run["library"] == trees[name], (run["library"], trees[name])
            runs[name].append(run)
            print(f"round {round_ + 1} {name:10s} wall {run['wall_us']:8.1f} µs  cpu {run['cpu_us']:8.1f} µs  "
                  f"guard check {run['guard_check_us'] or float('nan'):6.1f} µs", flush=True)
    summary = {name: {"wall_us_median": statistics.median(r["wall_us"] for r in rs),
                      "cpu_us_median": statistics.median(r["cpu_us"] for r in rs),
                      "guard_check_us_median": statistics.median(r["guard_check_us"] or float("nan") for r in rs),
                      "routed_parts": rs[0]["routed_parts"], "tree": trees[name],
                      "git_commit": git_commit(Path(trees[name]))} for name, rs in runs.items()}
    result = {"command": exact_command(), "environment": environment(),
              "config": {k: getattr(args, k) for k in ("blocks", "hidden", "number", "repeats", "rounds")},
              "summary": summary, "runs": runs}
    write_json(args.out, result)
    for name, s in summary.items():
        print(f"{name:10s} median wall {s['wall_us_median']:8.1f} µs, cpu {s['cpu_us_median']:8.1f} µs per call, "
              f"guard check {s['guard_check_us_median']:6.1f} µs ({s['routed_parts']} routed parts)")
    return result


if __name__ == "__main__":
    main()
