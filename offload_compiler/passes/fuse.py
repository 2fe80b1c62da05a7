"""Lower a verified graph for inductor: one ``transfer`` op per wait, returning the weights' leaves.

Under inductor every op is a trip through the dispatcher (schema, boxing, back into Python), which costs more
than the work the op does for a small group, and every view a graph makes of a buffer is one more call per
weight per call. After the graph was verified and its slots planned:

- the evicts and prefetches emitted since the previous transfer op are folded into the next wait, in their
  order; their steps are recorded once (``plan``, a callback: `OffloadRuntime.plan_transfer`) and the op
  passes one int: ``transfer(runtime, plan, deps)``. A resident fetch becomes a transfer with no steps.
- the op returns the group's leaves over its device slot, each with its layout (`DeviceSlot.leaves`), and
  every ``as_strided`` view the insert pass made over the flat buffers reads its leaf instead.
- the flat buffers are no longer graph outputs: the leaves are never reused by inductor by other means
  (`backend.register_transfer_lowering`); the tokens nobody consumes stay outputs, so no op is dropped.

Nothing runs in another order than the verified graph says, except that an evict moves later, past compute
that reads no offloaded weight, to the wait after it; no copy is made in between (copies start only at
prefetches and waits), so the device slots and the ledger's peak are those planned. The fused op depends on
everything its parts depended on; a later op that depended on a fused part depends on the fused op.
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx as fx

OPS = torch.ops.offload_compiler
EVICT, PREFETCH = 0, 1  # a step: (kind, group, a, b) with (poison, park) for an evict and (key, mode) for a prefetch
# records a transfer's (steps, key or None for a resident copy, group); returns the int the op passes
PlanTransfer = Callable[[tuple, "int | None", int], int]


def _step(node: fx.Node) -> tuple[int, int, int, int]:
    if node.target is OPS.evict.default:
        park = node.args[5] if len(node.args) > 5 else False
        return EVICT, node.args[1], int(node.args[2]), int(park)
    mode = node.args[4] if len(node.args) > 4 else 0
    return PREFETCH, node.args[1], node.args[2], mode


def _deps(node: fx.Node) -> list[fx.Node]:
    """What a transfer op waits for, as graph values: a prefetch's and a wait's deps; an evict's buffers and
    readers."""
    if node.target is OPS.evict.default:
        return [*node.args[3], *node.args[4]]
    return list(node.args[3])


def leaf_indices(layout: list[tuple[tuple, bool]]) -> dict[tuple, int]:
    """(bucket, shape, stride, offset) of each leaf of a group's weights (``layout``: per weight, its leaves
    and whether it is rebuilt) → the leaf's place in the group's leaves (`DeviceSlot.leaves`)."""
    flat = [leaf for leaves, _ in layout for leaf in leaves]
    return {(bucket, tuple(shape), tuple(stride), offset): i for i, (bucket, shape, stride, offset) in enumerate(flat)}


def fuse_transfers(gm: fx.GraphModule, plan: PlanTransfer, layout: dict[int, list], num_outputs: int
                   ) -> fx.GraphModule:
    """``gm`` (rewritten and verified, ``num_outputs`` its model outputs: -1 for one) lowered as the module doc
    says. ``layout``: group → per weight, its leaves (`OffloadRuntime.layout`)."""
    graph = gm.graph
    pending: list[fx.Node] = []  # evicts and prefetches since the last op that cannot take them
    previous: fx.Node | None = None
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in (OPS.evict.default, OPS.prefetch.default):
            pending.append(node)
        elif node.target is OPS.resident.default:
            runtime, group = node.args[:2]
            with graph.inserting_before(node):
                transfer = graph.call_function(OPS.transfer.default, (runtime, plan((), None, group), []))
            _read_leaves(node, transfer, leaf_indices(layout[group]))
        elif node.target is OPS.wait.default:
            previous = _fuse(graph, pending, node, previous, plan, layout)
            pending = []
    _drop_slot_outputs(graph, num_outputs)
    _drop_implied_deps(graph)
    graph.lint()
    gm.recompile()
    return gm


def _fuse(graph: fx.Graph, parts: list[fx.Node], wait: fx.Node, previous: fx.Node | None, plan: PlanTransfer,
          layout: dict[int, list]) -> fx.Node:
    fused = set(parts) | {wait}
    deps = [d for part in [*parts, wait] for d in _deps(part) if d not in fused]
    if previous is not None:  # in order after the previous fused op, even with no evict between them
        deps.append(previous)
    deps = list(dict.fromkeys(deps))
    runtime, group, key = wait.args[:3]
    steps = tuple(_step(part) for part in parts)
    with graph.inserting_before(wait):
        transfer = graph.call_function(OPS.transfer.default, (runtime, plan(steps, key, group), deps))
    transfer.meta.update(wait.meta)
    first = _read_leaves(wait, transfer, leaf_indices(layout[group]))
    for part in parts:  # later ops ordered after a fused evict or prefetch are ordered after the fused op
        part.replace_all_uses_with(first)
    for part in reversed(parts):
        graph.erase_node(part)
    return first


def _read_leaves(fetched: fx.Node, transfer: fx.Node, index: dict[tuple, int]) -> fx.Node:
    """Every view of ``fetched``'s flat buffers reads its leaf from ``transfer``; what else used a buffer (an
    evict's order, a graph output) uses the first leaf. Returns that first leaf."""
    graph = fetched.graph
    with graph.inserting_after(transfer):
        first = graph.call_function(operator.getitem, (transfer, 0))
    for item in list(fetched.users):  # getitem(fetched, bucket)
        for view in [u for u in item.users if u.target is torch.ops.aten.as_strided.default]:
            _, shape, stride, offset = view.args
            with graph.inserting_before(view):
                leaf = graph.call_function(operator.getitem,
                                           (transfer, index[(item.args[1], tuple(shape), tuple(stride), offset)]))
            leaf.meta.update(view.meta)
            view.replace_all_uses_with(leaf)
            graph.erase_node(view)
        item.replace_all_uses_with(first)
        graph.erase_node(item)
    graph.erase_node(fetched)
    return first


def _drop_implied_deps(graph: fx.Graph) -> None:
    """A transfer's deps keep only those no other of its deps depends on: inductor runs a kernel after
    everything its inputs were computed from, and every dep is a buffer of its own (an extern reader's result,
    a value `ops.materialize` copies, a leaf), so the dropped ones still run before the transfer. A leaf of an
    earlier transfer that another dep depends on is implied too: all its leaves are ready together. A Llama layer's
    transfer waits for one value instead of ten, and the readers between are freed as early as without offloading.
    """
    order = {node: i for i, node in enumerate(graph.nodes)}
    for transfer in [n for n in graph.nodes if n.target is OPS.transfer.default]:
        deps = transfer.args[2]
        if len(deps) < 2:
            continue
        earliest = min(order[d] for d in deps)
        implied: set[fx.Node] = set()
        stack = [a for d in deps for a in d.all_input_nodes]
        while stack:
            node = stack.pop()
            if node not in implied:
                implied.add(node)
                if order[node] > earliest:  # nothing earlier than the earliest dep can be one
                    stack.extend(node.all_input_nodes)
        transfer.args = (*transfer.args[:2], [d for d in deps if d not in implied and not _leaf_of(d, implied)])


def _leaf_of(node: fx.Node, transfers: set[fx.Node]) -> bool:
    return node.target is operator.getitem and node.args[0] in transfers


def _drop_slot_outputs(graph: fx.Graph, num_outputs: int) -> None:
    """The extra outputs that only kept slot memory from inductor's reuse (leaves of a transfer) go; the model's
    outputs and the tokens stay."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    kept = max(num_outputs, 1)
    results = output.args[0]
    extras = [r for r in results[kept:] if not (isinstance(r, fx.Node) and r.target is operator.getitem
                                                  and r.args[0].target is OPS.transfer.default)]
    output.args = (tuple(results[:kept]) + tuple(extras),)
