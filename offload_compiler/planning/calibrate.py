"""Host overheads of an offloaded graph as it runs, measured once per device and compiler on a probe: a tiny
model of four transformer-like blocks, small enough that what its calls cost is almost all overhead.

* per op: the probe's captured graph run as the policy's compiler runs it (eager: the FX GraphModule's Python
  code, each node an aten dispatch; inductor: the compiled graph, fused), less its predicted work, per graph
  node that `node_seconds` charges;
* per call: the probe offloaded with every group resident (dynamo's guards, our wrapper, the graph runner,
  the resident ops), less its predicted compute and the weight views (one op each, resident or fetched);
* per fetch: the probe with every block streamed, against all resident, called in turn: the prefetch, wait
  and evict ops and the copy's fixed cost, less the copies' bytes.

The call and fetch terms are measured under the eager compiler only: the entry path and the transfer ops are
the same under inductor, and an offloaded inductor probe would add tens of seconds of compilation.

Medians of repeated calls, since a loaded machine is what the timed calls of a plan see too."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import torch
from torch import nn

from ..policy import OffloadPolicy

PROBE_WIDTH = 32
PROBE_SEQ = 8
PROBE_CALLS = 21
PROBE_SECONDS = 1.0  # fewer calls (at least 5) where they are slow: a loaded machine, a big device's launch
PROBE_BLOCKS = 4


class _ProbeBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        heads = lambda t: t.view(t.shape[0], t.shape[1], 2, -1).transpose(1, 2)  # noqa: E731
        attn = torch.nn.functional.scaled_dot_product_attention(heads(q), heads(k), heads(v))
        x = x + self.out(attn.transpose(1, 2).reshape(x.shape))
        return x + self.down(torch.nn.functional.silu(self.up(x)) * 0.5)


class _Probe(nn.Module):
    def __init__(self, width: int = PROBE_WIDTH) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_ProbeBlock(width) for _ in range(PROBE_BLOCKS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@dataclasses.dataclass(frozen=True)
class Overheads:
    op_s: float
    call_s: float
    fetch_s: float


def median_time(fn: Callable[[], Any], sync: Callable[[], None], calls: int = PROBE_CALLS) -> float:
    fn()
    sync()
    times: list[float] = []
    while _more(len(times), sum(times)):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _more(done: int, spent_s: float) -> bool:
    return done < PROBE_CALLS and (done < 5 or spent_s < PROBE_SECONDS)


def _probe(device: torch.device) -> tuple[nn.Module, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _Probe().eval(), torch.randn(1, PROBE_SEQ, PROBE_WIDTH, device=device)


def _graph_runner(gm, example_inputs: list, compiler: str) -> Callable:
    if compiler == "inductor":
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)
    return gm


def _offloaded_calls(policies: list[OffloadPolicy], device: torch.device, sync: Callable[[], None]
                     ) -> list[list[float]]:
    """Seconds of each call of the probe offloaded under each policy, the probes called in turn (a load on the
    machine falls on all of them alike)."""
    from ..api import offload_compile, remove_offload  # the api imports the planner
    x = _probe(device)[1]
    models = [offload_compile(_probe(device)[0], policy) for policy in policies]
    times: list[list[float]] = [[] for _ in models]
    try:
        with torch.no_grad():
            for m in models:
                m(x), m(x)  # compiles, warms up
            while _more(len(times[0]), sum(map(sum, times))):
                for m, out in zip(models, times):
                    start = time.perf_counter()
                    m(x)
                    sync()
                    out.append(time.perf_counter() - start)
    finally:
        for m in models:
            remove_offload(m)
    return times


def _probe_graph(device: torch.device, rates: Any) -> tuple:
    """The probe's captured graph, its example inputs, its groups, and ``rates`` with no overheads."""
    from .auto import capture_graph
    from ..grouping import plan_groups
    model, x = _probe(device)
    gm, example_inputs = capture_graph(model.forward, (x.cpu(),), {}, "the calibration probe")
    specs = plan_groups(model, OffloadPolicy(strategy="layerwise", device="cpu"))
    free = dataclasses.replace(rates, op_overhead_s=0.0, call_overhead_s=0.0, fetch_overhead_s=0.0, compute_scale=1.0)
    return gm, example_inputs, specs, free


def _sync(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def op_seconds(device: torch.device, compiler: str, rates: Any) -> float:
    """Per charged node: the probe's graph run as the compiler runs it (eager: the GraphModule itself;
    inductor: compiled), less its predicted work."""
    return _op_seconds(_probe_graph(device, rates), device, compiler)


def _op_seconds(probe: tuple, device: torch.device, compiler: str) -> float:
    from .costmodel import build_table, charged_nodes
    gm, example_inputs, specs, free = probe
    work_s = build_table(gm, example_inputs, specs, free).compute_s
    run = _graph_runner(gm, example_inputs, compiler)
    inputs = [t.to(device) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    with torch.no_grad():
        graph_s = median_time(lambda: run(*inputs), _sync(device))
    return max(graph_s - work_s, 0.0) / max(charged_nodes(gm), 1)


def measure_overheads(device: torch.device, rates: Any) -> Overheads:
    """Per op, per call and per fetch under the eager compiler. ``rates``: the device's `DeviceRates` with
    work rates and bandwidth measured. The call and fetch costs are the entry path and the transfer ops,
    the same under every compiler; `op_seconds` gives the per-op cost of another compiler."""
    from .costmodel import build_table
    probe = _probe_graph(device, rates)
    op_s = _op_seconds(probe, device, "eager")
    gm, example_inputs, specs, free = probe
    table = build_table(gm, example_inputs, specs, dataclasses.replace(free, op_overhead_s=op_s))
    streamed = OffloadPolicy(strategy="layerwise", device=str(device), prefetch=0)
    resident_s, streamed_s = _offloaded_calls([streamed.replace(strategy="budget", offload_gb=0.0), streamed],
                                              device, _sync(device))
    # table.call_overhead_s: the weight views, with no call overhead yet
    call_s = max(statistics.median(resident_s) - table.compute_s - table.call_overhead_s, 0.0)
    blocks = [i for i, s in enumerate(specs) if s.is_block]
    extra_s = statistics.median(b - a for a, b in zip(resident_s, streamed_s))
    fetch_s = max((extra_s - sum(table.transfer_s(g) for g in blocks)) / len(blocks), 0.0)
    return Overheads(op_s, call_s, fetch_s)
