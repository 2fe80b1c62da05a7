"""Capture the graphs dynamo hands a backend, without rewriting them, and read them (for tests of the passes)."""

import torch


def capture(model, *args, fullgraph=False, **kwargs):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=fullgraph)(*args, **kwargs)
    return graphs[0]


def ancestors(node) -> set:
    """Every node ``node`` was computed from."""
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(current.all_input_nodes)
    return seen
