"""Profile one offloaded forward with torch.profiler: do the host-to-device copies overlap compute, and where
does the GPU idle?

A Llama built from a config (random weights) runs under ``offload_compile(model, layerwise, prefetch=1)``;
after warm-up calls, one forward is profiled (CPU and, on CUDA, GPU activity). From the trace: the time the
copies (``Memcpy HtoD``) take, the share of it that runs while a kernel runs (overlap), the GPU's busy and idle
time over the forward's span, and the host ops that cost most. Writes a JSON summary and the chrome trace.

    python benchmarks/profile_forward.py --device cuda                # benchmarks/results/profile_forward.json
    python benchmarks/profile_forward.py --device cpu --layers 2      # the harness on CPU (no GPU figures)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, environment, exact_command, write_json  # noqa: E402


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def covered(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of ``intervals`` that lies inside the (merged, sorted) ``cover``."""
    total = 0.0
    for start, end in union(intervals):
        for a, b in cover:
            total += max(0.0, min(end, b) - max(start, a))
    return total


def overlap_summary(trace: dict) -> dict:
    """Copies, kernels, overlap and idle time (µs) from a chrome trace's GPU events."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    copies = [(e["ts"], e["ts"] + e["dur"]) for e in events
              if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"]
    if not copies and not kernels:
        return {"gpu_events": 0}
    busy = union(copies + kernels)
    span = busy[-1][1] - busy[0][0]
    copy_time = sum(b - a for a, b in union(copies))
    # CUDA names each copy by its source: "Memcpy HtoD (Pinned -> Device)" or "(Pageable -> Device)"
    kinds: dict[str, int] = {}
    for e in events:
        if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", ""):
            kinds[e["name"]] = kinds.get(e["name"], 0) + 1
    return {"gpu_events": len(copies) + len(kernels), "span_us": span, "h2d_copies_by_kind": kinds,
            "kernel_us": sum(b - a for a, b in union(kernels)), "h2d_copy_us": copy_time,
            "h2d_copy_overlapped_share": covered(copies, union(kernels)) / copy_time if copy_time else None,
            "gpu_idle_us": span - sum(b - a for a, b in busy)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--compiler", default="inductor", choices=("eager", "inductor"))
    parser.add_argument("--out", type=Path, default=RESULTS / "profile_forward.json")
    args = parser.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    from offload_compiler import OffloadPolicy, offload_compile, offload_stats, reset_offload_stats
    from offload_compiler.testing.models import llama
    cuda = args.device.startswith("cuda")
    model, inputs = llama(layers=args.layers, hidden=args.hidden, vocab=32000 if cuda else 256, seq=args.seq,
                          heads=max(4, args.hidden // 128), kv_heads=max(2, args.hidden // 512))
    if cuda:
        model = model.to(torch.bfloat16)
    inputs = {k: v.to(args.device) for k, v in inputs.items()}
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device=args.device, prefetch=1,
                                             compiler=args.compiler))
    for _ in range(3):
        m(**inputs)
    if cuda:
        torch.cuda.synchronize()
    reset_offload_stats(m)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        m(**inputs)
        if cuda:
            torch.cuda.synchronize()
    trace_path = args.out.with_suffix(".trace.json")
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace_path))
    trace = json.loads(trace_path.read_text())
    stats = offload_stats(m)
    top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    data = {"command": exact_command(), "environment": environment(), "config": {k: str(v) for k, v in vars(args).items()},
            "bytes_per_forward": stats.bytes_transferred, "fetches_per_forward": stats.fetch_count,
            "gpu": overlap_summary(trace),
            "host_ops_by_self_cpu_us": [{"op": e.key, "calls": e.count, "self_cpu_us": e.self_cpu_time_total}
                                        for e in top],
            "trace": trace_path.name}
    write_json(args.out, data)
    print(json.dumps({k: data[k] for k in ("bytes_per_forward", "fetches_per_forward", "gpu")}, indent=2))
    return data


if __name__ == "__main__":
    main()
