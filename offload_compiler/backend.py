"""The dynamo backend: capture → schedule → insert transfers → verify → run eagerly or with inductor.

`omni_offload` is registered with torch through the ``torch_dynamo_backends`` entry point, so
``torch.compile(model, backend="omni_offload", options={...})`` works without importing this package.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

from . import ops  # noqa: F401  (registers the transfer ops)
from .grouping import plan_groups
from .passes.analysis import collect_uses, weight_inputs
from .passes.insert import insert_transfers
from .passes.schedule import Schedule, build_schedule
from .passes.verify import Verified, verify
from .policy import OffloadPolicy
from .runtime import OffloadRuntime

_MODULE_RUNTIMES: "weakref.WeakKeyDictionary[nn.Module, OffloadRuntime]" = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class GraphPlan:
    """What the passes decided for one captured graph."""
    schedule: Schedule
    verified: Verified
    num_nodes: int


def build_runtime(model: nn.Module, policy: OffloadPolicy, pack_now: bool = True) -> OffloadRuntime:
    runtime = OffloadRuntime(policy, plan_groups(model, policy), type(model).__name__, pack_now)
    _MODULE_RUNTIMES[model] = runtime
    return runtime


def runtime_of(module: Any) -> OffloadRuntime | None:
    runtime = getattr(module, "_offload_runtime", None)
    if runtime is not None:
        return runtime
    orig = getattr(module, "_orig_mod", None)
    for candidate in (module, orig):
        if isinstance(candidate, nn.Module) and candidate in _MODULE_RUNTIMES:
            return _MODULE_RUNTIMES[candidate]
    return None


def rewrite_graph(gm: fx.GraphModule, example_inputs: list, runtime: OffloadRuntime
                  ) -> tuple[fx.GraphModule, int, GraphPlan]:
    """The pure part: a captured graph and its runtime's layout → the rewritten, verified graph."""
    weights = weight_inputs(gm, example_inputs, runtime.group_of)
    streamed = {g.index for g in runtime.groups if g.streamed}
    uses, reads = collect_uses(gm, weights, streamed)
    schedule = build_schedule(uses, runtime.policy.prefetch)
    resident = {w.group for w in weights.values()} - streamed
    rewritten = insert_transfers(gm, weights, schedule, reads, resident, runtime.id, runtime.layout,
                                 runtime.new_fetch_key)
    verified = verify(rewritten.graph_module, weights, {g.index: g.nbytes for g in runtime.groups})
    return rewritten.graph_module, rewritten.num_outputs, GraphPlan(schedule, verified, len(gm.graph.nodes))


class RuntimeBackend:
    """The backend of one offloaded model. Dynamo keeps backends in its code cache for the life of the
    process, so this holds the runtime weakly: dropping the model frees its weights."""

    def __init__(self, runtime: OffloadRuntime) -> None:
        self._runtime = weakref.ref(runtime)
        self.__name__ = f"offload_backend_{runtime.id}"

    def __call__(self, gm: fx.GraphModule, example_inputs: list, **_: Any) -> Callable:
        return compile_graph(gm, example_inputs, self._runtime())


def compile_graph(gm: fx.GraphModule, example_inputs: list, runtime: OffloadRuntime) -> Callable:
    new_gm, num_outputs, plan = rewrite_graph(gm, example_inputs, runtime)
    runtime.graph_plans.append(plan)
    if runtime.policy.compiler == "inductor":
        from torch._inductor.compile_fx import compile_fx
        inner = compile_fx(new_gm, example_inputs)
    else:
        inner = new_gm
    return _runner(inner, num_outputs, runtime)


def _runner(inner: Callable, num_outputs: int, runtime: OffloadRuntime) -> Callable:
    runtime_ref = weakref.ref(runtime)

    def run(*args):
        rt = runtime_ref()
        rt.graph_calls += 1
        try:
            out = inner(*args)
        except BaseException:
            rt.abandon_pending()
            raise
        return out[0] if num_outputs < 0 else tuple(out[:num_outputs])

    return run


_LOCAL = re.compile(r"^([LG])\['([^']+)'\]")


def _root_module(gm: fx.GraphModule) -> nn.Module | None:
    """The module dynamo is tracing, found from a weight's source name and the frame being compiled."""
    names = []
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.meta.get("grapharg") is not None:
            match = _LOCAL.match(node.meta["grapharg"].source.name)
            if match and ("._parameters[" in node.meta["grapharg"].source.name
                          or "._buffers[" in node.meta["grapharg"].source.name):
                names.append(match.groups())
    if not names:
        return None
    scope, name = max(set(names), key=names.count)
    frame = sys._getframe()
    while frame is not None:
        traced = frame.f_locals.get("frame")
        if traced is not None and hasattr(traced, "f_locals") and hasattr(traced, "f_globals"):
            root = (traced.f_locals if scope == "L" else traced.f_globals).get(name)
            if isinstance(root, nn.Module):
                return root
        frame = frame.f_back
    return None


def _runtime_for(gm: fx.GraphModule, example_inputs: list, policy: OffloadPolicy) -> OffloadRuntime:
    root = _root_module(gm)
    if root is None:
        raise RuntimeError(
            "omni_offload could not find the nn.Module being compiled (its weights must be module parameters or "
            "buffers); use offload_compiler.offload_compile(model, policy) instead")
    runtime = _MODULE_RUNTIMES.get(root)
    if runtime is None or runtime.policy != policy:
        # packing changes the weights' storage offsets, which the graph being compiled was traced with
        runtime = build_runtime(root, policy, pack_now=False)
    return runtime


def omni_offload(gm: fx.GraphModule, example_inputs: list, options: dict | None = None, **_: Any) -> Callable:
    """``torch.compile(model, backend="omni_offload", options={"strategy": ..., ...} | {"policy": policy})``."""
    policy = OffloadPolicy.from_options(options)
    if policy.strategy == "auto":
        raise ValueError("strategy='auto' plans before compiling: use offload_compiler.offload_compile(model, "
                         "OffloadPolicy(strategy='auto', device_budget_gb=...)) instead of torch.compile")
    return compile_graph(gm, example_inputs, _runtime_for(gm, example_inputs, policy))
