"""Capture a forward's graph with dynamo without running it: what ``auto`` plans from (and what the cost
model's calibration probes)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from .._torch_private import cannot_capture_in_one_graph, capture_config, short_reason


class _Captured(Exception):
    pass


def capture_graph(forward: Callable, args: tuple, kwargs: dict, name: str = "the model"
                  ) -> tuple[fx.GraphModule, list]:
    """The graph of ``forward`` (a model's own forward, bound) and its example inputs, from dynamo, without
    running it: the backend returns a callable that aborts the call."""
    captured = []

    def recorder(gm: fx.GraphModule, example_inputs: list, **_: Any):
        captured.append((gm, list(example_inputs)))

        def abort(*_: Any) -> None:
            raise _Captured()
        return abort

    try:
        with torch.no_grad(), capture_config():
            torch.compile(forward, backend=recorder, fullgraph=True)(*args, **kwargs)
    except _Captured:
        pass
    except Exception as exc:
        if cannot_capture_in_one_graph(exc):
            raise ValueError(f"strategy='auto' plans from one captured graph, but dynamo cannot capture {name} as "
                             f"one ({short_reason(str(exc))}); make that code traceable (TORCH_LOGS=graph_breaks "
                             f"shows where) or use strategy='layerwise' or 'budget', which allow graph breaks "
                             f"outside the block loop") from exc
        raise
    if not captured:
        raise RuntimeError(f"dynamo captured no graph from {name}; strategy='auto' cannot plan it")
    return captured[0]
