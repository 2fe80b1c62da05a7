"""Host overheads of an offloaded graph as it runs, measured once per device and compiler on a probe: a tiny
model of four transformer-like blocks, small enough that what its calls cost is almost all overhead.

* per op: the probe's captured graph run as the policy's compiler runs it (eager: the FX GraphModule's Python
  code, each node an aten dispatch; inductor: the compiled graph, fused), less its predicted work, per graph
  node that `node_seconds` charges;
* per call: the probe offloaded with every group resident (dynamo's guards, our wrapper, the graph runner,
  the resident ops), less its graph's own time and the weight views (one op each, resident or fetched);
* per fetch: the probe with every block streamed, against all resident, called in turn: the prefetch, wait
  and evict ops and the copy's fixed cost, less the copies' bytes.

The call and fetch terms are measured under the eager compiler only: the entry path and the transfer ops are
the same under inductor, and an offloaded inductor probe would add tens of seconds of compilation.

The graph and the two offloaded probes are called in turn and the differences taken call by call, then the
median: a load on the machine that comes and goes falls on all three alike."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import statistics
import time
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .._torch_private import inductor_compile
from ..backend import RuntimeBackend, build_runtime
from ..grouping import plan_groups
from ..policy import OffloadPolicy
from ..runtime import synchronize
from .capture import capture_graph
from .costmodel import DeviceRates, build_table, charged_nodes, measure_rates

_RATES: dict[tuple, DeviceRates] = {}
_BOUNDS: dict[tuple, int | None] = {}  # per key: the device bytes its probes were bounded by

PROBE_WIDTH = 32
PROBE_SEQ = 8
PROBE_CALLS = 21
PROBE_SECONDS = 1.5  # fewer rounds (at least 5) where calls are slow: a loaded machine, a slow device
PROBE_BLOCKS = 4
PROBE_COPIES = 3  # the probe's weights on the device at once, at most (`probe_width`)


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
    spread: float  # interquartile range / median of the offloaded probe's calls: how steady the machine was


def relative_spread(times: list[float]) -> float:
    """Interquartile range over median: 0 on a quiet machine; a load that comes and goes widens it."""
    if len(times) < 4:
        return 0.0
    q1, median, q3 = statistics.quantiles(times, n=4)
    return (q3 - q1) / median if median > 0 else 0.0


def interleaved_times(fns: list[Callable[[], Any]], sync: Callable[[], None]) -> list[list[float]]:
    """Seconds of each call of each function, called in turn (a load on the machine falls on all alike):
    ``PROBE_CALLS`` rounds, fewer (at least 5) past ``PROBE_SECONDS``; two untimed calls each first."""
    for fn in fns:
        fn(), fn()
    sync()
    times: list[list[float]] = [[] for _ in fns]
    while len(times[0]) < PROBE_CALLS and (len(times[0]) < 5 or sum(map(sum, times)) < PROBE_SECONDS):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - start)
    return times


def probe_width(max_bytes: int | None) -> int:
    """The probe's width where calibration may hold at most ``max_bytes`` of device memory (None: no bound):
    its weights are on the device up to three times at once (the plain graph's copy, the resident runtime's,
    the streamed one's slots: ``PROBE_COPIES`` times its ``32 * PROBE_BLOCKS * width**2`` bytes), so it shrinks with
    the bound -- the overheads it measures are host costs per op, call and fetch, not the work -- to an even
    number (two heads) of at least 8."""
    if max_bytes is None:
        return PROBE_WIDTH
    fits = math.isqrt(max(max_bytes // (PROBE_COPIES * 32 * PROBE_BLOCKS), 1))  # 8 w² floats a block
    return max(8, min(PROBE_WIDTH, fits - fits % 2))


def _probe(device: torch.device, width: int = PROBE_WIDTH) -> tuple[nn.Module, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _Probe(width).eval(), torch.randn(1, PROBE_SEQ, width, device=device)


def _graph_runner(gm, example_inputs: list, compiler: str) -> Callable:
    if compiler == "inductor":
        return inductor_compile(gm, example_inputs)
    return gm


@contextlib.contextmanager
def _offloaded_probes(policies: list[OffloadPolicy], device: torch.device, width: int = PROBE_WIDTH
                      ) -> Iterator[list[Callable[[], Any]]]:
    """A call of the probe offloaded under each policy (no_grad), removed afterwards."""
    x = _probe(device, width)[1]
    runs = []
    for policy in policies:  # the engine's own path: runtime, backend, graph runner and transfer ops
        model = _probe(device, width)[0]
        runtime = build_runtime(model, policy)
        runs.append((runtime, torch.compile(type(model).forward.__get__(model), backend=RuntimeBackend(runtime))))
    try:
        yield [functools.partial(torch.no_grad()(run), x) for _, run in runs]
    finally:
        for runtime, _ in runs:
            runtime.unpack()


def _probe_graph(device: torch.device, rates: Any, width: int = PROBE_WIDTH) -> tuple:
    """The probe's captured graph, its example inputs, its groups, and ``rates`` with no overheads."""
    model, x = _probe(device, width)
    gm, example_inputs = capture_graph(model.forward, (x.cpu(),), {}, "the calibration probe")
    specs = plan_groups(model, OffloadPolicy(strategy="layerwise", device="cpu"))
    free = dataclasses.replace(rates, op_overhead_s=0.0, call_overhead_s=0.0, fetch_overhead_s=0.0, compute_scale=1.0)
    return gm, example_inputs, specs, free


def _sync(device: torch.device) -> Callable[[], None]:
    return lambda: synchronize(device)


def op_seconds(device: torch.device, compiler: str, rates: Any, width: int = PROBE_WIDTH) -> float:
    """Per charged node: the probe's graph run as the compiler runs it (eager: the GraphModule itself;
    inductor: compiled), less its predicted work."""
    probe = _probe_graph(device, rates, width)
    graph_s = statistics.median(interleaved_times([_graph_call(probe, device, compiler)], _sync(device))[0])
    return _per_op(probe, graph_s)


def _graph_call(probe: tuple, device: torch.device, compiler: str) -> Callable[[], Any]:
    gm, example_inputs = probe[:2]
    run = torch.no_grad()(_graph_runner(gm, example_inputs, compiler))
    return functools.partial(run, *[t.to(device) if isinstance(t, torch.Tensor) else t for t in example_inputs])


def _per_op(probe: tuple, graph_s: float) -> float:
    gm, example_inputs, specs, free = probe
    return max(graph_s - build_table(gm, example_inputs, specs, free).compute_s, 0.0) / max(charged_nodes(gm), 1)


def measure_overheads(device: torch.device, rates: Any, width: int = PROBE_WIDTH) -> Overheads:
    """Per op, per call and per fetch under the eager compiler, from the probe's graph, the probe offloaded
    with every group resident and with every block streamed, called in turn. ``rates``: the device's
    `DeviceRates` with work rates and bandwidth measured. The call and fetch costs are the entry path and
    the transfer ops, the same under every compiler; `op_seconds` gives another compiler's per-op cost."""
    probe = _probe_graph(device, rates, width)
    gm, example_inputs, specs, free = probe
    streamed = OffloadPolicy(strategy="layerwise", device=str(device), prefetch=0)
    with _offloaded_probes([streamed.replace(strategy="budget", offload_gb=0.0), streamed], device, width) as calls:
        graph, resident, stream = interleaved_times([_graph_call(probe, device, "eager")] + calls, _sync(device))
    op_s = _per_op(probe, statistics.median(graph))
    table = build_table(gm, example_inputs, specs, dataclasses.replace(free, op_overhead_s=op_s))
    # the resident probe runs the same graph, plus a view per weight (table.call_overhead_s, no call cost yet)
    call_s = max(statistics.median(r - g for g, r in zip(graph, resident)) - table.call_overhead_s, 0.0)
    blocks = [i for i, s in enumerate(specs) if s.is_block]
    extra_s = statistics.median(b - a for a, b in zip(resident, stream))
    fetch_s = max((extra_s - sum(table.transfer_s(g) for g in blocks)) / len(blocks), 0.0)
    return Overheads(op_s, call_s, fetch_s, relative_spread(stream))


def _rates_key(device: torch.device, compiler: str) -> tuple:
    # CPU rates depend on the intra-op threads (a loaded machine is steadier with fewer)
    return str(device), compiler, torch.get_num_threads() if device.type == "cpu" else 0


def device_rates(device: torch.device | str, compiler: str = "eager", max_bytes: int | None = None) -> DeviceRates:
    """Measured once per device (work rates, bandwidth; host overheads per op, per call and per fetch from
    `calibrate.measure_overheads`) and per compiler (its per-op cost), cached for the process. ``max_bytes``:
    the most device memory the rates' probes may hold (`costmodel.calibration_bytes`); rates measured under a
    larger bound (or none) serve a smaller one, never the reverse."""
    device = torch.device(device)
    key = _rates_key(device, compiler)
    cached = _RATES.get(key)
    if cached is None or not _covers(_BOUNDS.get(key), max_bytes):
        if compiler != "eager":
            eager = device_rates(device, "eager", max_bytes)
            _RATES[key] = dataclasses.replace(
                eager, op_overhead_s=op_seconds(device, compiler, eager, probe_width(max_bytes)), compute_scale=1.0)
        else:
            base = measure_rates(device, max_bytes)
            found = measure_overheads(device, base, probe_width(max_bytes))
            _RATES[key] = dataclasses.replace(base, op_overhead_s=found.op_s, call_overhead_s=found.call_s,
                                              fetch_overhead_s=found.fetch_s, call_spread=found.spread)
        _BOUNDS[key] = max_bytes
    return _RATES[key]


def _covers(measured: int | None, wanted: int | None) -> bool:
    """Rates measured with probes bounded by ``measured`` bytes (None: full size) serve a plan bounded by ``wanted``."""
    return measured is None or (wanted is not None and measured >= wanted)
