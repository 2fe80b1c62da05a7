"""Routed fetch: an expert weight read only by router indices (``w[ids]``, transformers' ``batched_mm`` experts,
or ``grouped_mm(x, w.transpose(-2, -1), offs)``, its ``grouped_mm`` experts) is fetched as the experts those
indices name (those with tokens), not whole.

`analysis.routed_reads` finds the reads and their bound (the index's element count, capped at the expert count,
fixed by the graph's shapes); `route_reads` replaces each ``w[ids]`` with the ``routed`` op, which copies the
experts named into a fixed slot of ``bound`` experts and gathers ``w[ids]`` from it; the grouped product reads
the ``routed_grouped`` op's compact copy with its offsets remapped. The weight's placeholder
is then read by nothing: its group has no use, so the schedule neither fetches nor evicts it, and the verifier
still finds no host read. The choice is per graph and static: the decode graph (one token, top_k experts)
routes, a prefill graph whose bound is every expert fetches the group whole.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .._torch_private import OpOverload
from .analysis import ROUTED_OPS, RoutedRead, WeightInput, _value

OPS = torch.ops.offload_compiler


def route_reads(gm: fx.GraphModule, weights: dict[fx.Node, WeightInput], routed: dict[int, list[RoutedRead]],
                runtime_id: int) -> tuple[fx.GraphModule, dict[fx.Node, WeightInput]]:
    """A copy of ``gm`` with each routed read replaced by the ``routed`` op, and ``weights`` keyed by the copy's
    placeholders. ``gm`` itself is left as it is: a graph called with other weights is rewritten again."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    output = graph.graph_copy(gm.graph, env)
    graph.output(output)
    for reads in routed.values():
        for r in reads:
            if r.grouped:
                _route_grouped(graph, env, r, runtime_id)
                continue
            old = env[r.node]
            with graph.inserting_before(old):
                new = graph.call_function(OPS.routed.default, (runtime_id, r.group, r.slot, env[r.ids], r.bound,
                                                               r.expert_bytes, []))
            new.meta.update(old.meta)
            new.meta["offload_routed"] = r
            old.replace_all_uses_with(new)
            graph.erase_node(old)
    new_gm = fx.GraphModule(gm, graph)
    new_gm.meta.update(gm.meta)
    return new_gm, {env[p]: w for p, w in weights.items()}


def _route_grouped(graph: fx.Graph, env: dict[fx.Node, fx.Node], r: RoutedRead, runtime_id: int) -> None:
    """``grouped_mm(x, view(w), offs)`` -> ``grouped_mm(x, view(w'), offs')`` where ``[w', offs'] =
    routed_grouped(offs)``: the experts with tokens and the offsets remapped to them. The weight's views
    are applied again to the compact copy, right before the product (after the offsets are computed)."""
    product, offs = env[r.node], env[r.ids]
    operand = env[r.views[-1]] if r.views else None
    with graph.inserting_before(product):
        fetched = graph.call_function(OPS.routed_grouped.default, (runtime_id, r.group, r.slot, offs, r.bound,
                                                                   r.expert_bytes, []))
        fetched.meta["offload_routed"] = r
        weight = graph.call_function(operator.getitem, (fetched, 0))
        compact_offs = graph.call_function(operator.getitem, (fetched, 1))
        for view in r.views:  # transpose(-2, -1): a view of the compact copy as of the whole weight
            previous = weight
            weight = graph.call_method(view.target, (previous, *env[view].args[1:]))
    weight_fake = _value(r.views[-1] if r.views else r.node.args[1])
    if weight_fake is not None:  # shapes for later passes: bound experts, not all
        weight.meta["example_value"] = weight_fake.new_empty((r.bound, *weight_fake.shape[1:]))
        compact_offs.meta["example_value"] = _value(r.ids).new_empty((r.bound,))
    product.replace_input_with(operand if operand is not None else product.args[1], weight)
    product.replace_input_with(offs, compact_offs)
    for view in reversed(r.views):
        if not env[view].users:
            graph.erase_node(env[view])


ROUTED_DEPS = 6  # the position of ``deps``, last, in both routed ops' arguments (as `route_reads` makes them)


def routed_view(node: fx.Node) -> tuple[int, int, int] | None:
    """(group, bound, expert bytes) of a ``routed`` or ``routed_grouped`` node; None for any other node."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload) or target.name() not in ROUTED_OPS:
        return None
    _, group, _, _, bound, expert_bytes, _deps = node.args
    return group, bound, expert_bytes
