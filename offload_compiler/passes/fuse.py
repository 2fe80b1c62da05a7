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
prefetches and waits), so the device slots and the ledger's peak are those planned. A routed op copies rows where
it stands, so it is ordered like a transfer: the evicts and prefetches before it stay ops of their own, which it
depends on, and the transfers and prefetches after it depend on it. The fused op depends on
everything its parts depended on; a later op that depended on a fused part depends on the fused op.
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx as fx

from .nodes import (Evict, Prefetch, Resident, Transfer, Wait, item_source, leaf_positions, leaf_views, set_argument,
                    transfer_view)
from .routed import ROUTED_DEPS, routed_view

OPS = torch.ops.offload_compiler
EVICT, PREFETCH = 0, 1  # a step: (kind, group, a, b) with (poison, park) for an evict and (key, mode) for a prefetch
# records a transfer's (steps, key or None for a resident copy, group); returns the int the op passes
PlanTransfer = Callable[[tuple, "int | None", int], int]


def _step(part: Evict | Prefetch) -> tuple[int, int, int, int]:
    if isinstance(part, Evict):
        return EVICT, part.group, int(part.poison), int(part.park)
    return PREFETCH, part.group, part.key, part.mode


def _deps(part: Evict | Prefetch | Wait) -> list[fx.Node]:
    """What a transfer op waits for, as graph values: a prefetch's and a wait's deps; an evict's buffers and
    readers."""
    if isinstance(part, Evict):
        return [*part.buffers, *part.users]
    return list(part.deps)


def fuse_transfers(gm: fx.GraphModule, plan: PlanTransfer, layout: dict[int, list], num_outputs: int
                   ) -> fx.GraphModule:
    """``gm`` (rewritten and verified, ``num_outputs`` its model outputs: -1 for one) lowered as the module doc
    says. ``layout``: group → per weight, its leaves (`OffloadRuntime.layout`)."""
    graph = gm.graph
    pending: list[fx.Node] = []  # evicts and prefetches since the last op that cannot take them
    routed: list[fx.Node] = []  # routed ops since the last transfer op
    previous: fx.Node | None = None
    for node in list(graph.nodes):
        view = transfer_view(node)
        if isinstance(view, (Evict, Prefetch)):
            if isinstance(view, Prefetch) and routed:  # (one left an op of its own at the end: after them too)
                set_argument(node, "deps", [*view.deps, *routed])
            pending.append(node)
        elif routed_view(node) is not None:
            # a routed op holds its slot of rows where it stands: what came before it (the previous transfer, the
            # evicts and prefetches since, their own ops then, and the routed ops since) runs before it, and the
            # next transfer after it
            node.update_arg(ROUTED_DEPS, [d for d in [previous, *pending, *routed] if d is not None])
            pending = []
            routed.append(_tensor_of(node))
        elif isinstance(view, Resident):
            with graph.inserting_before(node):
                transfer = graph.call_function(OPS.transfer.default, (view.runtime, plan((), None, view.group), []))
            _read_leaves(node, transfer, leaf_positions(layout[view.group]))
        elif isinstance(view, Wait):
            # the parts are decoded when fused, as their args are then: each fusion rewrites what read the
            # nodes it fused
            previous = _fuse(graph, [transfer_view(part) for part in pending], view, [previous, *routed], plan,
                             layout)
            pending, routed = [], []
    _drop_slot_outputs(graph, num_outputs)
    _drop_implied_deps(graph)
    graph.lint()
    gm.recompile()
    return gm


def _fuse(graph: fx.Graph, parts: list[Evict | Prefetch], wait: Wait, after: list[fx.Node | None],
          plan: PlanTransfer, layout: dict[int, list]) -> fx.Node:
    """``after``: the previous fused op (None for the first), and the routed ops since it: the new op runs after
    them, even with no evict between."""
    fused = {part.node for part in parts} | {wait.node}
    deps = [d for part in [*parts, wait] for d in _deps(part) if d not in fused]
    deps += [node for node in after if node is not None]
    deps = list(dict.fromkeys(deps))
    steps = tuple(_step(part) for part in parts)
    with graph.inserting_before(wait.node):
        transfer = graph.call_function(OPS.transfer.default,
                                       (wait.runtime, plan(steps, wait.key, wait.group), deps))
    transfer.meta.update(wait.node.meta)
    first = _read_leaves(wait.node, transfer, leaf_positions(layout[wait.group]))
    for part in parts:  # later ops ordered after a fused evict or prefetch are ordered after the fused op
        part.node.replace_all_uses_with(first)
    for part in reversed(parts):
        graph.erase_node(part.node)
    return first


def _tensor_of(node: fx.Node) -> fx.Node:
    """A tensor ``node`` made, to depend on it: itself, or its first item (``routed_grouped`` returns a list)."""
    if node.target.name() == "offload_compiler::routed_grouped":
        return next(user for user in node.users if user.target is operator.getitem and user.args[1] == 0)
    return node


def _read_leaves(fetched: fx.Node, transfer: fx.Node, index: dict[tuple, int]) -> fx.Node:
    """Every view of ``fetched``'s flat buffers reads its leaf from ``transfer``; what else used a buffer (an
    evict's order, a graph output) uses the first leaf. Returns that first leaf."""
    graph = fetched.graph
    with graph.inserting_after(transfer):
        first = graph.call_function(operator.getitem, (transfer, 0))
    for item in list(fetched.users):  # getitem(fetched, bucket)
        for view in leaf_views(item):
            with graph.inserting_before(view.node):
                leaf = graph.call_function(operator.getitem, (transfer, index[view.key]))
            leaf.meta.update(view.node.meta)
            view.node.replace_all_uses_with(leaf)
            graph.erase_node(view.node)
        item.replace_all_uses_with(first)
        graph.erase_node(item)
    graph.erase_node(fetched)
    return first


def _drop_implied_deps(graph: fx.Graph) -> None:
    """A transfer's deps keep only those no other of its deps depends on: inductor runs a kernel after
    everything its inputs were computed from, and every dep is a buffer of its own (an extern reader's result,
    a value `ops.materialize` copies, a leaf), so the dropped ones still run before the transfer. A leaf of an
    earlier op that another dep depends on (through any of that op's results) is implied too: all its results are
    ready together; two items of one op imply each other that way, so the first of them stays. A Llama layer's
    transfer waits for one value instead of ten, and the readers between are freed as early as without offloading.
    """
    order = {node: i for i, node in enumerate(graph.nodes)}
    for transfer in [view for view in map(transfer_view, graph.nodes) if isinstance(view, Transfer)]:
        deps = list(dict.fromkeys(transfer.deps))
        if len(deps) < 2:
            continue
        earliest = min(order[d] for d in deps)
        above = {d: _ancestors(d, earliest, order) for d in deps}  # what each dep was computed from
        kept: list[fx.Node] = []
        for d in deps:
            source = item_source(d)
            if any(d in above[other] or (source is not None and source in above[other]
                                         and item_source(other) is not source) for other in deps if other is not d):
                continue  # another dep was computed from it (or from the op it is an item of)
            if source is not None and any(item_source(k) is source for k in kept):
                continue  # another item of the same op is kept: they are ready together
            kept.append(d)
        set_argument(transfer.node, "deps", kept)


def _ancestors(node: fx.Node, earliest: int, order: dict[fx.Node, int]) -> set[fx.Node]:
    """The nodes ``node`` was computed from, down to position ``earliest`` (nothing earlier can be a dep)."""
    found: set[fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        current = stack.pop()
        if current not in found:
            found.add(current)
            if order[current] > earliest:
                stack.extend(current.all_input_nodes)
    return found


def _drop_slot_outputs(graph: fx.Graph, num_outputs: int) -> None:
    """The extra outputs that only kept slot memory from inductor's reuse (leaves of a transfer) go; the model's
    outputs and the tokens stay."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    kept = max(num_outputs, 1)
    results = output.args[0]
    extras = [r for r in results[kept:] if not (isinstance(r, fx.Node) and _is_leaf_of_transfer(r))]
    output.args = (tuple(results[:kept]) + tuple(extras),)


def _is_leaf_of_transfer(node: fx.Node) -> bool:
    source = item_source(node)
    return source is not None and isinstance(transfer_view(source), Transfer)
