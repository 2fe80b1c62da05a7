"""``torch.compile(model, backend="omni_offload")``: the first graph offloads the model in place, when it first runs."""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .._torch_private import compiled_models
from ..backend import build_runtime, compile_graph
from ..errors import OffloadRefusal
from ..policy import OffloadPolicy
from ..runtime.device import is_accelerator
from .forwards import install_forwards
from .install import attach, refuse_other_offloaders
from .state import OffloadState, Phase, state_of


def omni_offload(gm: fx.GraphModule, example_inputs: list, options: dict | None = None, mode: str | None = None,
                 **_: Any):
    """``torch.compile(model, backend="omni_offload", options={"strategy": ..., ...} | {"policy": policy})``.

    The first graph offloads the model in place (as `offload_compile` would, with packing deferred to the
    first fetch: this graph was traced over the unpacked weights); from then on every call of the model —
    the compiled wrapper, ``generate()``, the object itself — runs its offloaded forward."""
    if mode not in (None, "default"):  # torch.compile passes its mode on to a backend that is not inductor
        raise ValueError(f"torch.compile(..., backend='omni_offload', mode={mode!r}): omni_offload takes no mode; it "
                         f"compiles with options={{'compiler': ...}}. CUDA graphs: capture the offloaded forward "
                         f"by hand (torch.cuda.graph)")
    policy = OffloadPolicy.from_options(options)
    if policy.strategy == "auto":
        raise ValueError("strategy='auto' plans before compiling: use offload_compiler.offload_compile(model, "
                         "OffloadPolicy(strategy='auto', device_budget_gb=...)) instead of torch.compile")
    if is_accelerator(policy.torch_device):
        raise OffloadRefusal(
            f"torch.compile(model, backend='omni_offload') streams only where the device is the host (device='cpu'): "
            f"torch traces the model before the backend sees it, over its own weights, so weights in host memory "
            f"meet inputs on {policy.device} in that trace (or, on the host, the graph mixes both devices), and "
            f"weights already on {policy.device} cannot be pointed at host buffers. Nothing was changed. Use "
            f"offload_compiler.offload_compile(model, OffloadPolicy(..., device='{policy.device}')), which makes "
            f"the weights device-typed before any trace, and call it with inputs on {policy.device}")
    root = model_holding(example_inputs)
    if root is None:
        raise OffloadRefusal(
            "omni_offload offloads the nn.Module given to torch.compile (torch.compile(model, backend="
            "'omni_offload')), whose parameters this graph reads; it found none holding them (a function was "
            "compiled, or weights that are no module's parameters). Use offload_compiler.offload_compile(model, "
            "policy) instead")
    state = state_of(root)
    if state is None:
        refuse_other_offloaders(root)
        state = OffloadState(root, policy, build_runtime(root, policy, pack_now=False))
        state.publish()
        return _AttachAtFirstRun(compile_graph(gm, example_inputs, state.runtime), state)
    if state.policy != policy:
        raise ValueError(f"{state.name} is already offloaded with another policy ({state.policy}); "
                         f"remove_offload(model) first, then compile it with the new options")
    return compile_graph(gm, example_inputs, state.runtime)


def model_holding(example_inputs: list) -> nn.Module | None:
    """The model compiled with ``torch.compile(model, backend="omni_offload")``: the module inside a live
    ``torch.compile`` wrapper that holds every parameter among the graph's inputs, by identity. Where wrappers of
    a model and of one of its parts both hold them, the part (the innermost) is the one whose call is compiled."""
    params = {id(t) for t in example_inputs if isinstance(t, nn.Parameter)}
    tensors = {id(t) for t in example_inputs if isinstance(t, torch.Tensor)}
    found = []
    for model in dict.fromkeys(compiled_models()):
        held = {id(t) for t in itertools.chain(model.parameters(), model.buffers())}
        if params <= held and tensors & held:
            found.append(model)
    inner = [m for m in found if not any(o is not m and any(s is m for s in o.modules()) for o in found)]
    return inner[0] if inner else None


class _AttachAtFirstRun:
    """The first graph of ``omni_offload``: the model is made offloaded in place when this graph first runs,
    not while dynamo is still compiling (it checks its guards on the model right after the backend returns)."""

    def __init__(self, run: Any, state: OffloadState) -> None:
        self._run = run
        self._state = state

    def __call__(self, *args: Any) -> Any:
        state = self._state
        with state.lock:
            if state.phase is not Phase.PENDING:  # attached by an earlier run, or removed since
                return self._run(*args)
            out = self._run(*args)  # over the plain weights it was traced with, streamed by its own plan
            state.use_runtime_with_masters()
            attach(state, [state.owner])
            install_forwards(state.owner, state)
            return out

