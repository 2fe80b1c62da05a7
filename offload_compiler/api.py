"""Public entry points: `offload_compile`, `offload_stats`, `reset_offload_stats`, `describe_plan`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .backend import RuntimeBackend, build_runtime, runtime_of
from .policy import OffloadPolicy
from .runtime import OffloadRuntime, OffloadStats

RECOMPILE_LIMIT = 4096


class OffloadedModule(nn.Module):
    """The model, run through its rewritten graph(s). Parameters, buffers and ``state_dict`` are the
    original model's (host masters); inference only (the forward runs under ``torch.no_grad``)."""

    def __init__(self, model: nn.Module, policy: OffloadPolicy, runtime: OffloadRuntime) -> None:
        super().__init__()
        self._orig_mod = model
        object.__setattr__(self, "_offload_runtime", runtime)
        object.__setattr__(self, "_compiled", torch.compile(
            model, backend=RuntimeBackend(runtime), fullgraph=policy.fullgraph))

    @property
    def offload_policy(self) -> OffloadPolicy:
        return self._offload_runtime.policy

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        runtime = self._offload_runtime
        calls = runtime.graph_calls
        # every offloaded model of one class is a cache entry of the same code object in dynamo
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT,
                                                         accumulated_recompile_limit=RECOMPILE_LIMIT):
            out = self._compiled(*args, **kwargs)
        if runtime.graph_calls == calls:
            raise RuntimeError(
                f"{runtime.model_name} ran without its offloaded graph: torch.compile fell back to plain eager "
                f"execution, so nothing was offloaded. Dynamo does this for a frame with a graph break inside a loop "
                f"or past its recompile limit; TORCH_LOGS=graph_breaks,recompiles shows which")
        return out

    def state_dict(self, *args: Any, **kwargs: Any):
        return self._orig_mod.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the offloaded weights' host masters; "
                             "use assign=False (the default), which copies into them")
        return self._orig_mod.load_state_dict(state_dict, strict=strict)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._orig_mod, name)


def offload_compile(model: nn.Module, policy: OffloadPolicy | None = None, **fields: Any) -> OffloadedModule:
    """Offload ``model``'s weights to host memory and run it through a graph with explicit transfers."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"offload_compile takes an nn.Module; got {type(model).__name__}")
    if policy is None:
        policy = OffloadPolicy(**fields)
    elif fields:
        policy = policy.replace(**fields)
    if not isinstance(policy, OffloadPolicy):
        raise TypeError(f"policy must be an OffloadPolicy; got {type(policy).__name__}")
    if policy.strategy == "auto":  # the planner needs the graph, so it plans at the first call
        from .auto import AutoOffloadedModule
        return AutoOffloadedModule(model, policy)
    return OffloadedModule(model, policy, build_runtime(model, policy))


def _runtime(module: Any) -> OffloadRuntime:
    runtime = runtime_of(module)
    if runtime is None:
        raise ValueError(
            f"{type(module).__name__} is not offloaded: pass the result of offload_compile(model, policy), or a "
            f"torch.compile(model, backend='omni_offload') module after its first call")
    return runtime


def offload_stats(module: Any) -> OffloadStats:
    """Bytes moved, peak device weight bytes (from the live ledger) and fetches since the last reset."""
    return _runtime(module).stats()


def reset_offload_stats(module: Any) -> None:
    _runtime(module).reset_stats()


def describe_plan(module: Any) -> str:
    return _runtime(module).describe()
