"""Fuse each wait with the evicts and prefetches that run just before it into one ``transfer`` op.

Under inductor every transfer op is a trip through the dispatcher (schema, boxing, back into Python), which
costs more than the work the op does for a small group. After the graph was verified and its slots planned,
the evicts and prefetches emitted since the previous transfer op are folded into the next wait, in their
order: ``transfer(runtime, steps, group, key, deps)`` runs them, then the wait, and returns the wait's buffers.

Nothing runs in another order than the verified graph says, except that an evict moves later, past compute
that reads no offloaded weight, to the wait after it; no copy is made in between (copies start only at
prefetches and waits), so the device slots and the ledger's peak are those planned. The fused op depends on
everything its parts depended on; a later op that depended on a fused part depends on the fused op.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

OPS = torch.ops.offload_compiler
EVICT, PREFETCH = 0, 1  # a step: (kind, group, a, b) with (poison, park) for an evict and (key, mode) for a prefetch


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


def fuse_transfers(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` (rewritten and verified) with each wait fused with the evicts and prefetches before it."""
    graph = gm.graph
    pending: list[fx.Node] = []  # evicts and prefetches since the last op that cannot take them
    previous: fx.Node | None = None
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in (OPS.evict.default, OPS.prefetch.default):
            pending.append(node)
        elif node.target is OPS.resident.default:
            pending = []
        elif node.target is OPS.wait.default:
            previous = _fuse(graph, pending, node, previous)
            pending = []
    graph.lint()
    gm.recompile()
    return gm


def _fuse(graph: fx.Graph, parts: list[fx.Node], wait: fx.Node, previous: fx.Node | None) -> fx.Node:
    fused = set(parts) | {wait}
    deps = [d for part in [*parts, wait] for d in _deps(part) if d not in fused]
    if previous is not None:  # in order after the previous fused op, even with no evict between them
        deps.append(previous)
    deps = list(dict.fromkeys(deps))
    steps = [value for part in parts for value in _step(part)]
    with graph.inserting_before(wait):
        transfer = graph.call_function(OPS.transfer.default, (wait.args[0], steps, wait.args[1], wait.args[2], deps))
        first = graph.call_function(operator.getitem, (transfer, 0))
    transfer.meta.update(wait.meta)
    wait.replace_all_uses_with(transfer)
    for part in parts:  # later ops ordered after a fused evict or prefetch are ordered after the fused op
        part.replace_all_uses_with(first)
    for part in reversed(parts):
        graph.erase_node(part)
    graph.erase_node(wait)
    return first
