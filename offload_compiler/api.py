"""Public entry points: `offload_compile`, `offload_stats`, `reset_offload_stats`, `describe_plan`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import warnings

import torch.utils._pytree as pytree

from .backend import RuntimeBackend, build_runtime, forget_runtime, runtime_of
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
        object.__setattr__(self, "_warned_inputs", False)
        object.__setattr__(self, "_compiled", torch.compile(
            model, backend=RuntimeBackend(runtime), fullgraph=policy.fullgraph))

    @property
    def offload_policy(self) -> OffloadPolicy:
        return self._offload_runtime.policy

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        runtime = self._offload_runtime
        if runtime.closed:
            raise RuntimeError("remove_offload() gave this model back; call the module it returned, "
                               "or offload_compile it again")
        args, kwargs = self._inputs_on_device(args, kwargs)
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

    def _inputs_on_device(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Tensor inputs elsewhere than the compute device are moved there (warned once); data-less
        (meta) inputs are refused."""
        device = self._offload_runtime.device
        moved = []

        def place(value: Any) -> Any:
            if not isinstance(value, torch.Tensor) or value.device == device:
                return value
            if value.is_meta:
                raise ValueError(f"an input is on the meta device, so it has no data to compute on; pass real "
                                 f"tensors (on {device})")
            moved.append(str(value.device))
            return value.to(device)

        args, kwargs = pytree.tree_map(place, (args, kwargs))
        if moved and not self._warned_inputs:
            object.__setattr__(self, "_warned_inputs", True)
            warnings.warn(f"offload_compiler: inputs on {sorted(set(moved))} were moved to the compute device "
                          f"{device}; pass them on {device} to avoid the copy", RuntimeWarning, stacklevel=3)
        return args, kwargs

    def to(self, *args: Any, **kwargs: Any) -> "OffloadedModule":
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None:
            self._apply(None)
        if device is not None:
            warnings.warn(f"offload_compiler: .to({device}) ignored: this module keeps its weights in host memory "
                          f"and computes on {self._offload_runtime.device}. To compute elsewhere: "
                          f"offload_compile(remove_offload(m), policy.replace(device=...))", UserWarning, stacklevel=2)
        return self

    def cuda(self, device: Any = None) -> "OffloadedModule":
        return self.to(torch.device("cuda") if device is None else torch.device("cuda", device)
                       if isinstance(device, int) else device)

    def cpu(self) -> "OffloadedModule":
        return self.to("cpu")

    def _apply(self, fn: Any, recurse: bool = True) -> "OffloadedModule":
        raise RuntimeError("changing the dtype or storage of an offloaded module's weights (.half(), .to(dtype), "
                           "...) would detach them from their host buffers; convert first: "
                           "offload_compile(remove_offload(m).to(dtype), policy)")

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


def remove_offload(module: Any) -> nn.Module:
    """Undo offloading: every weight gets its own host storage back, device copies are dropped, and the
    original model is returned (equal to what was offloaded; the offloaded wrapper refuses further calls)."""
    runtime = _runtime(module)
    runtime.unpack()
    model = module._orig_mod if hasattr(module, "_orig_mod") else module
    forget_runtime(model)
    return model


def inject_fault(module: Any, stage: str, group: int | str | None = None, exception: BaseException | None = None,
                 times: int = 1) -> None:
    """Debug surface: make the next ``times`` fetches or evicts (``stage``) of ``group`` (an index, a group
    name, or None for any) raise ``exception`` — to check that a failing copy or an interrupt in the middle of
    a forward leaves the model whole."""
    runtime = _runtime(module)
    if isinstance(group, str):
        names = [g.name for g in runtime.groups]
        if group not in names:
            raise ValueError(f"unknown group {group!r}; the groups are {names}")
        group = names.index(group)
    runtime.inject_fault(stage, group, exception, times)
