"""Host overhead per streamed group (CPU): what each offloader's Python/dispatch work costs beyond the model.

A stack of tiny residual blocks (two 64x64 linears each, batch 1, one torch thread) runs so little compute that
the time an offloaded call takes beyond the plain model's is the offloader's host work: its hooks or graph ops,
its copies (device ``cpu``: a memcpy) and its allocations. Methods, all in this one process, interleaved round
by round and from several Python stack depths (`common.interleave`: where CPython's frame chunks end decides
whether per-group Python work pays an mmap/munmap per group):

  plain-eager / plain-inductor   the model itself (eager; torch.compile with inductor)
  ours-eager / ours-inductor     offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu"))
  diffusers-group-block          diffusers apply_group_offloading(block_level, 1 block per group, onload cpu)
  accelerate-cpu_offload         accelerate.cpu_offload(model, execution_device=cpu)
  vllm-functional_call           each block copies its state dict per forward and runs torch.func.functional_call

Per method: seconds per call, wall and this process's CPU time, host µs per streamed
group beyond the plain model on both clocks (ours-inductor against plain-inductor, everything else against
plain-eager), and minor page faults per call (``getrusage``).

    python benchmarks/host_overhead.py                      # writes benchmarks/results/host_overhead.json
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (RESULTS, against_baseline, environment, exact_command, interleave,  # noqa: E402
                    STACK_DEPTHS, moved_per_call, write_json)

METHODS = ("plain-eager", "plain-inductor", "ours-eager", "ours-inductor", "diffusers-group-block",
           "accelerate-cpu_offload", "vllm-functional_call")
BASELINE = {"ours-inductor": "plain-inductor"}  # every other method is measured against plain-eager


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, hidden)
        self.down = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, blocks: int, hidden: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def functional_call_offload(blocks) -> None:
    """vLLM's cpu_offload_gb mechanism per block: the host weights stay, each forward copies the block's state
    dict to the device and runs ``torch.func.functional_call``."""
    from torch.func import functional_call
    for block in blocks:
        forward = block.forward

        def offloaded(*args, block=block, forward=forward, **kwargs):
            block.forward = forward
            try:
                state = {k: v.to("cpu", non_blocking=True) for k, v in block.state_dict().items()}
                return functional_call(block, state, args, kwargs)
            finally:
                block.forward = offloaded
        block.forward = offloaded


def setup(name: str, model: Stack) -> tuple[object, dict]:
    """The callable a method runs, and what to record about how it was set up."""
    if name == "plain-eager":
        return model, {}
    if name == "plain-inductor":
        return torch.compile(model, backend="inductor", fullgraph=True), {}
    if name.startswith("ours-"):
        from offload_compiler import OffloadPolicy, offload_compile
        policy = OffloadPolicy(strategy="layerwise", device="cpu", compiler=name.split("-", 1)[1])
        return offload_compile(model, policy), {"policy": repr(policy)}
    if name == "diffusers-group-block":
        from diffusers.hooks import apply_group_offloading
        apply_group_offloading(model, onload_device=torch.device("cpu"), offload_device=torch.device("cpu"),
                               offload_type="block_level", num_blocks_per_group=1)
        return model, {"call": "apply_group_offloading(model, onload_device=cpu, offload_device=cpu, "
                               "offload_type='block_level', num_blocks_per_group=1)",
                       "cpu_onload": "accepted (cpu -> cpu)"}
    if name == "accelerate-cpu_offload":
        from accelerate import cpu_offload
        cpu_offload(model, execution_device=torch.device("cpu"))
        return model, {"call": "accelerate.cpu_offload(model, execution_device=cpu)"}
    if name == "vllm-functional_call":
        functional_call_offload(model.blocks)
        return model, {"call": "per block: state_dict().to(cpu) + torch.func.functional_call"}
    raise ValueError(f"unknown method {name!r}; choose from {METHODS}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds; the medians are over these")
    parser.add_argument("--calls", type=int, default=10, help="calls per method per round and stack depth")
    parser.add_argument("--depths", type=int, default=STACK_DEPTHS, help="Python stack places (common.interleave)")
    parser.add_argument("--step-bytes", type=int, default=None,
                        help="bytes between places (default: the places span one frame chunk); small steps sweep "
                             "one stretch finely, to find where a chunk boundary falls")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--out", type=Path, default=RESULTS / "host_overhead.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    reference = Stack(args.blocks, args.hidden).eval()
    x = torch.randn(1, args.hidden)
    with torch.no_grad():
        expected = reference(x)
    runs, info, errors = {}, {}, {}
    for name in args.methods:
        try:
            runs[name], info[name] = setup(name, copy.deepcopy(reference))
            with torch.no_grad():
                for _ in range(args.warmup):
                    out = runs[name](x)
            info[name]["max_abs_diff"] = float((out - expected).abs().max())
            if name.startswith("ours-"):
                info[name].update(moved_per_call(runs[name], lambda: runs[name](x)))
        except Exception as exc:  # a method that cannot run here is reported, not fatal
            errors[name] = f"{type(exc).__name__}: {exc}"
            runs.pop(name, None)
    with torch.no_grad():
        timed = interleave({name: (lambda fn=fn: lambda: fn(x)) for name, fn in runs.items()}, args.rounds,
                           args.calls, args.depths, args.step_bytes)
    results = {name: {**timed[name], **info[name]} for name in runs}
    for name, r, base in against_baseline(results, BASELINE):
        r["baseline"] = BASELINE.get(name, "plain-eager")
        r["host_us_per_group"] = (r["wall_s"] - base["wall_s"]) / args.blocks * 1e6
        r["host_cpu_us_per_group"] = (r["cpu_s"] - base["cpu_s"]) / args.blocks * 1e6
        by_place = [(a - b) / args.blocks * 1e6 for a, b in zip(r["wall_s_by_place"], base["wall_s_by_place"])]
        r["host_us_per_group_by_place"] = by_place
        r["host_us_per_group_median_place"] = statistics.median(by_place)
    for name, error in errors.items():
        results[name] = {"error": error}
    summary = _summary(results)
    data = {"command": exact_command(), "environment": environment(),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "methods": results, "summary": summary}
    write_json(args.out, data)
    for name, r in results.items():
        print(f"{name:24s} " + (r["error"] if "error" in r else
                                f"{r['wall_s'] * 1e3:8.3f} ms/call  "
                                f"{r.get('host_us_per_group', float('nan')):7.1f} us/group  "
                                f"{r.get('host_cpu_us_per_group', float('nan')):7.1f} CPU us/group  "
                                f"{r.get('host_us_per_group_median_place', float('nan')):7.1f} us/group at the "
                                f"median place  "
                                f"{r['minor_faults']:7.1f} faults/call"))
    print(summary)
    return data


def _summary(results: dict) -> dict:
    """Ours against the targets (≤ 15 µs per group, ≤ 0.5x diffusers'), on wall time and on this process's CPU
    time (what a shared machine's other load inflates least)."""
    out = {}
    for clock, key in (("wall", "host_us_per_group"), ("cpu", "host_cpu_us_per_group")):
        diffusers = results.get("diffusers-group-block", {}).get(key)
        for name in ("ours-eager", "ours-inductor"):
            value = results.get(name, {}).get(key)
            out.setdefault(name, {"faults_per_call": results.get(name, {}).get("minor_faults"),
                                  "target_us": 15})[clock] = {
                "us_per_group": value, "meets_us_target": value is not None and value <= 15,
                "over_diffusers": value / diffusers if value is not None and diffusers else None}
    return out


if __name__ == "__main__":
    main()
