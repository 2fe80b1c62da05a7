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
    if state is not None and state.policy != policy:
        raise ValueError(f"{state.name} is already offloaded with another policy ({state.policy}); "
                         f"remove_offload(model) first, then compile it with the new options")
    return ModelGraph(gm, root, policy, example_inputs)


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


class ModelGraph:
    """A graph ``omni_offload`` compiled. It belongs to the code it was traced from and the options it was
    compiled with, not to one offload of one model: dynamo keeps it in that code's cache for as long as the
    process lives and calls it wherever the code's guards hold again -- after ``remove_offload(model)``, the
    wrapper called again or the model compiled again with the same options (one cache per code object; the
    backend compares equal), or another instance of the class compiled with the same options. So each run
    finds the offload of the model whose weights it is given, as it is now: the first run for a model offloads
    it in place (not while dynamo is still compiling: it checks its guards on the model right after the backend
    returns), and so does the first run after ``remove_offload``. The graph is compiled for each offload it
    runs on, once."""

    def __init__(self, gm: fx.GraphModule, model: nn.Module, policy: OffloadPolicy, example_inputs: list) -> None:
        self._gm = gm
        self._policy = policy
        self._bound: dict[nn.Module, tuple[OffloadState, Any]] = {}  # model -> its offload, this graph compiled for it
        self._bind(model, list(example_inputs))
        self._last = model

    def _bind(self, model: nn.Module, inputs: list) -> tuple[OffloadState, Any]:
        """This graph compiled for ``model``'s offload now, made (pending: the classes are swapped when the graph
        has run) where the model is not offloaded."""
        state = state_of(model)
        if state is None:
            refuse_other_offloaders(model)
            state = OffloadState(model, self._policy, build_runtime(model, self._policy, pack_now=False))
            state.publish()
        self._bound[model] = bound = (state, compile_graph(self._gm, inputs, state.runtime))
        return bound

    def __call__(self, *args: Any) -> Any:
        model = self._model_of(args)
        state, run = self._bound.get(model) or self._bind(model, list(args))
        if state.phase is Phase.DETACHED:
            live = state_of(model)
            if live is None or live.policy == self._policy:  # removed, or offloaded again alike: run on that
                state, run = self._bind(model, list(args))
        with state.lock:
            if state.phase is not Phase.PENDING:  # attached by an earlier run; or detached (offloaded again
                return run(*args)                  # otherwise), which the graph's runner refuses by name
            out = run(*args)  # over the plain weights it was traced with, streamed by its own plan
            state.use_runtime_with_masters()
            attach(state, [state.owner])
            install_forwards(state.owner, state)
            return out

    def _model_of(self, args: tuple) -> nn.Module:
        """The model whose parameters this call passes: the last one it ran for (one set test per call), else
        another compiled model holding them (`model_holding`). Parameters no compiled model holds stay with the
        last model, whose runner refuses them by name."""
        if _holds(self._last, args):
            return self._last
        self._last = next((m for m in self._bound if _holds(m, args)), None) or model_holding(list(args)) or self._last
        return self._last


def _holds(model: nn.Module, args: tuple) -> bool:
    held = {id(t) for t in itertools.chain(model.parameters(), model.buffers())}
    return all(id(t) in held for t in args if isinstance(t, nn.Parameter))
