"""Cost tables from captured graphs: compute per graph position from fake-tensor shapes (FLOPs for matmul,
linear, convolution and attention; bytes moved for everything else), the activation peak along node order,
host→device bandwidth measured once per device, and the host overheads of running the offloaded graph
(per op, per fetch, per call) measured once per device and compiler (`calibrate`)."""

from __future__ import annotations

import dataclasses
import math
import operator
import time
from typing import Any, Callable

import torch
import torch.fx as fx

from ..grouping import GroupSpec
from ..runtime import can_pin, size_class, stream_module, synchronize
from ..runtime.layout import layout_groups
from ..passes.analysis import _storage, _value, collect_uses, routed_reads, weight_inputs
from .planner import CostTable, GroupCost

# -- device rates ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class DeviceRates:
    flops_per_s: float
    memory_bytes_per_s: float  # device memory bandwidth seen by elementwise ops
    op_overhead_s: float  # host cost of one graph node as the compiler runs it (calibrate.py)
    h2d_bytes_per_s: float  # host -> device copy bandwidth
    fetch_overhead_s: float  # fixed cost of one fetch: prefetch, wait and evict ops, the copy's launch
    overlap: bool  # copies run on a copy stream beside compute
    call_overhead_s: float = 0.0  # fixed cost of one call of the offloaded model: guards, wrapper, runner
    compute_scale: float = 1.0  # measured / predicted work (FLOPs, bytes), refined after offloaded runs
    call_spread: float = 0.0  # how much the calibration's calls varied: interquartile range / median

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)




def _best_time(fn: Callable[[], Any], sync: Callable[[], None], repeat: int = 5) -> float:
    fn()
    sync()
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


CALIBRATION_FLOOR_BYTES = 64 << 10  # the least a probe gets: below it, a probe times the launch, not the work
CALIBRATION_SHARE = 4  # calibration takes at most 1/4 of the device budget (the floor aside)


def calibration_bytes(device: torch.device, budget: int | None) -> int | None:
    """The most device memory `measure_rates` may hold at once for a plan under ``budget`` bytes: a quarter of
    it, at least `CALIBRATION_FLOOR_BYTES`; None (the full-size probes) without a budget or where the device is
    the host (``cpu``: its "device memory" is host memory, no allocator runs out of it first)."""
    if budget is None or device.type == "cpu":
        return None
    return max(CALIBRATION_FLOOR_BYTES, budget // CALIBRATION_SHARE)


def measure_rates(device: torch.device, max_bytes: int | None = None) -> DeviceRates:
    """Micro-benchmarks, well under a second: a matmul, an elementwise add, and host→device copies of up to 16
    MiB (pinned on an accelerator, as the runtime's host masters are). No overheads: see `device_rates`.

    Device memory: each probe is freed before the next, and ``max_bytes`` (`calibration_bytes`: a share of the
    plan's device budget) bounds what one holds at once -- a 512x512 matmul and 16 MiB tensors would take ~33
    MiB whatever the budget, more than a device with only the budget free has. Smaller probes still measure a
    rate (the floor keeps each well above a launch's cost), a pessimistic one where launches dominate."""
    streams = stream_module(device) is not None  # copies overlap compute on a device with streams
    sync = lambda: synchronize(device)  # noqa: E731
    cap = max_bytes if max_bytes is not None else 1 << 62
    n = min(512, math.isqrt(cap // 8))  # the operand and its product
    a = torch.randn(n, n, device=device)
    flops = 2 * n**3 / _best_time(lambda: a @ a, sync)
    del a
    elements = min(1 << 22, cap // 8)  # the operand and the sum
    big = torch.randn(elements, device=device)
    memory = 3 * big.nbytes / _best_time(lambda: big + big, sync)
    del big
    host = torch.empty(min(1 << 22, cap // 4))  # the copy's destination
    if can_pin(device):
        host = host.pin_memory()
    dest = torch.empty_like(host, device=device)
    copy_s = _best_time(lambda: dest.copy_(host, non_blocking=streams), sync)
    return DeviceRates(flops, memory, 0.0, host.nbytes / copy_s, 0.0, overlap=streams)


# -- compute per node -----------------------------------------------------------------------------------

def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _numel(t: torch.Tensor) -> int:
    return int(math.prod(int(s) for s in t.shape))


def _nbytes(t: torch.Tensor) -> int:
    return _numel(t) * t.element_size()


def _name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


MATMULS = {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "__matmul__", "einsum"}
ATTENTION = {"scaled_dot_product_attention"}
CONVOLUTIONS = {"conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d",
                "conv_transpose2d", "conv_transpose3d"}


def node_flops(node: fx.Node) -> int:
    """FLOPs of the ops that dominate models' compute, from the shapes dynamo recorded."""
    name = _name(node)
    args = [_value(a) if isinstance(a, fx.Node) else a for a in node.args]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    outputs = _tensors(_value(node))
    if not outputs or not tensors:
        return 0
    out = outputs[0]
    if name in ATTENTION and len(tensors) >= 2:
        q, k = tensors[0], tensors[1]
        return 4 * _numel(q) * int(k.shape[-2]) if q.dim() >= 2 and k.dim() >= 2 else 0
    if name in CONVOLUTIONS and len(tensors) >= 2:
        inp, weight = tensors[0], tensors[1]
        per_output = _numel(weight) // max(int(weight.shape[0]), 1)
        return 2 * max(_numel(out), _numel(inp)) * per_output
    if name in MATMULS:
        if name in ("addmm", "baddbmm", "addbmm"):
            tensors = tensors[1:]
        if name == "einsum" or not tensors or tensors[0].dim() == 0:
            return 2 * _numel(out)
        return 2 * _numel(out) * int(tensors[0].shape[-1])
    return 0


def node_bytes(node: fx.Node) -> int:
    """Bytes an op reads and writes; views (outputs sharing an input's storage) move nothing."""
    ins = [t for a in node.all_input_nodes for t in _tensors(_value(a))]
    outs = _tensors(_value(node))
    in_storages = {_storage(t) for t in ins} - {None}
    if outs and all(_storage(t) in in_storages for t in outs):
        return 0
    return sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs)


def charged(node: fx.Node) -> bool:
    """Nodes that run an op producing tensors (getitem and Python scalar arithmetic cost next to nothing)."""
    if node.op not in ("call_function", "call_method", "call_module") or node.target is operator.getitem:
        return False
    return bool(_tensors(_value(node)))


def charged_nodes(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if charged(n))


def node_seconds(node: fx.Node, rates: DeviceRates) -> float:
    """The node's work (FLOPs or bytes, whichever binds; scaled by refined measurements) plus its dispatch."""
    if not charged(node):
        return 0.0
    work = max(node_flops(node) / rates.flops_per_s, node_bytes(node) / rates.memory_bytes_per_s)
    return rates.op_overhead_s + rates.compute_scale * work


# -- activations ----------------------------------------------------------------------------------------

def activation_peak(gm: fx.GraphModule, weight_nodes: set[fx.Node]) -> int:
    """Peak bytes of non-weight tensors alive along node order: each storage lives from the node that
    creates it to the last user of any node that holds it (graph outputs live to the end)."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    weight_storages = {_storage(_value(n)) for n in weight_nodes} - {None}
    born: dict[Any, tuple[int, int]] = {}  # storage -> (first position, bytes)
    dies: dict[Any, int] = {}
    for node in nodes:
        if node in weight_nodes:
            continue
        last = max((position[u] for u in node.users), default=position[node])
        for t in _tensors(_value(node)):
            key = _storage(t)
            if key is None or key in weight_storages:
                continue
            try:
                size = t.untyped_storage().nbytes()
            except (NotImplementedError, RuntimeError):
                size = _nbytes(t)
            born.setdefault(key, (position[node], int(size)))
            dies[key] = max(dies.get(key, 0), last)
    deltas = [0] * (len(nodes) + 1)
    for key, (start, size) in born.items():
        deltas[start] += size
        deltas[dies[key] + 1] -= size
    live = peak = 0
    for delta in deltas:
        live += delta
        peak = max(peak, live)
    return peak


# -- the table ------------------------------------------------------------------------------------------

def build_table(gm: fx.GraphModule, example_inputs: list, specs: list[GroupSpec], rates: DeviceRates,
                blocks_per_group: int = 1, carry: bool = False) -> CostTable:
    group_of = {id(w.tensor): (gi, si) for gi, spec in enumerate(specs) for si, w in enumerate(spec.weights)}
    weights = weight_inputs(gm, example_inputs, group_of, lambda g, s: specs[g].weights[s].name)
    uses, _ = collect_uses(gm, weights, set(range(len(specs))))
    routed = routed_reads(weights, set(range(len(specs))))
    return CostTable(
        groups=tuple(GroupCost(s.name, s.nbytes, s.is_block, size_class(layout))
                     for s, layout in zip(specs, layout_groups(specs))),
        uses=tuple(uses),
        node_seconds=tuple(node_seconds(n, rates) for n in gm.graph.nodes),
        bandwidth=rates.h2d_bytes_per_s,
        activation_bytes=activation_peak(gm, set(weights)),
        fetch_overhead_s=rates.fetch_overhead_s,
        call_overhead_s=rates.call_overhead_s + len(weights) * rates.op_overhead_s,  # a view per weight, resident or not
        dispatch_s=charged_nodes(gm) * rates.op_overhead_s,
        overlap=rates.overlap,
        blocks_per_group=blocks_per_group,
        carry=carry,
        routed=tuple((r.group, routed_slot_key(specs[r.group].weights[r.slot].tensor, r.bound),
                      r.bound_bytes) for reads in routed.values() for r in reads))


def routed_slot_key(weight: torch.Tensor, bound: int) -> tuple:
    """The key of a routed read's slot (`TransferEngine.plan_routed`): reads of one row shape, dtype and bound
    share a slot."""
    return tuple(weight.shape[1:]), weight.dtype, bound
