"""Capture the graphs dynamo hands a backend, without rewriting them (for tests of the passes)."""

import torch


def capture(model, *args, fullgraph=False, **kwargs):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=fullgraph)(*args, **kwargs)
    return graphs[0]
