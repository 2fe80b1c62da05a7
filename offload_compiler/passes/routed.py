"""Routed fetch: an expert weight read only by router indices (``w[ids]``, transformers' ``batched_mm`` experts)
is fetched as the experts those indices name, not whole.

`analysis.routed_reads` finds the reads and their bound (the index's element count, capped at the expert count,
fixed by the graph's shapes); `route_reads` replaces each ``w[ids]`` with the ``routed`` op, which copies the
experts named into a fixed slot of ``bound`` experts and gathers ``w[ids]`` from it. The weight's placeholder
is then read by nothing: its group has no use, so the schedule neither fetches nor evicts it, and the verifier
still finds no host read. The choice is per graph and static: the decode graph (one token, top_k experts)
routes, a prefill graph whose bound is every expert fetches the group whole.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .analysis import RoutedRead, WeightInput

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
            old = env[r.node]
            with graph.inserting_before(old):
                new = graph.call_function(OPS.routed.default, (runtime_id, r.group, r.slot, env[r.ids], r.bound,
                                                               r.expert_bytes))
            new.meta.update(old.meta)
            new.meta["offload_routed"] = r
            old.replace_all_uses_with(new)
            graph.erase_node(old)
    new_gm = fx.GraphModule(gm, graph)
    new_gm.meta.update(gm.meta)
    return new_gm, {env[p]: w for p, w in weights.items()}


def routed_view(node: fx.Node) -> tuple[int, int, int] | None:
    """(group, bound, expert bytes) of a ``routed`` node; None for any other node."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or (
            target._schema.name != "offload_compiler::routed"):  # (by name: the passes may not import `ops`)
        return None
    _, group, _, _, bound, expert_bytes = node.args
    return group, bound, expert_bytes
