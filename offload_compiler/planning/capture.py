"""Capture a forward's graph with dynamo without running it: what ``auto`` plans from (and what the cost
model's calibration probes)."""

from __future__ import annotations

import itertools
import types
from typing import Any, Callable

import torch
import torch.fx as fx

from .._torch_private import cannot_capture_in_one_graph, capture_config, model_raised, short_reason, user_frame


def own_frame(function: Any) -> Any:
    """``function``, called from a frame whose code object belongs to this one caller (an offloaded forward, a
    planning capture). Dynamo keeps its compiled
    graphs (and counts recompiles) on the code object of the frame it compiles. Compiling the module's forward
    itself would put the graphs of every offloaded model of a class -- of every transformers class, whose
    forwards share one decorator ``wrapper`` -- on that shared code object: a later ``torch.compile`` of any model
    with that forward (``backend="omni_offload"`` included) would then meet dynamo's recompile limit at its
    first call and silently run un-compiled (for ``omni_offload``: un-offloaded), and every call of every model
    would check all those graphs' guards. Dynamo traces into ``function`` from here (inlined, no cache entry).
    The code object's name is its own too: what dynamo learns of a frame's inputs across compiles (a number
    that changed between calls, traced as a symbol from then on) is kept by the code's file, line, name and
    the code of the function it closes over -- shared by every transformers forward --, so one model's
    compiles would change how another's are traced (a second model's float made dynamic, which its nested
    compile regions then cannot take)."""
    def offloaded_call(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)
    name = f"offloaded_call_{next(_FRAMES)}"
    code = offloaded_call.__code__.replace(co_name=name, co_qualname=name)  # not shared with any other forward
    return types.FunctionType(code, offloaded_call.__globals__, name, offloaded_call.__defaults__,
                              offloaded_call.__closure__)


_FRAMES = itertools.count()


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
            # static shapes: the plan is for this call's; a code object of its own: no cache entry left on the
            # class's forward (see `own_frame`), so the capture of one model never depends on what came before
            torch.compile(own_frame(forward), backend=recorder, fullgraph=True, dynamic=False)(*args, **kwargs)
    except _Captured:
        pass
    except Exception as exc:
        captured.clear()  # as below: nothing of a failed capture outlives it
        raised = model_raised(exc)
        if raised is not None:  # not a tracing limit: the model's own check refused these inputs
            line = user_frame(exc)
            raise ValueError(f"{name} refused this call's inputs while strategy='auto' traced it to plan: "
                             f"{str(raised).strip()}{f' (at {line})' if line else ''}. Check the inputs against "
                             f"what {name} expects; nothing was planned or moved") from exc
        if cannot_capture_in_one_graph(exc):
            raise ValueError(f"strategy='auto' plans from one captured graph, but dynamo cannot capture {name} as "
                             f"one ({short_reason(str(exc))}); make that code traceable (TORCH_LOGS=graph_breaks "
                             f"shows where) or use strategy='layerwise' or 'budget', which allow graph breaks "
                             f"outside the block loop") from exc
        raise
    if not captured:
        raise RuntimeError(f"dynamo captured no graph from {name}; strategy='auto' cannot plan it")
    # dynamo keeps the backend (``recorder``, and so ``captured``) alive for the life of the process (its
    # compile wrappers by id): left in the list, the graph and its example inputs -- the model's own parameters,
    # a second host copy of every weight once the runtime packs them -- would outlive the plan
    graph = captured[0]
    captured.clear()
    return graph
