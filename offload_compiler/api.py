"""Public entry points: `offload_compile`, `offload_stats`, `reset_offload_stats`, `describe_plan`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import warnings

import torch.utils._pytree as pytree

from .backend import OFFLOAD_ENDED, RuntimeBackend, build_runtime, forget_runtime, runtime_of
from .policy import COMPONENT_STRATEGIES, OffloadPolicy
from .runtime import OffloadRuntime, OffloadStats

RECOMPILE_LIMIT = 4096


class OffloadedModule(nn.Module):
    """The model, run through its rewritten graph(s). Parameters, buffers and ``state_dict`` are the
    original model's (host masters); inference only (the forward runs under ``torch.no_grad``).

    The model's own ``forward`` is replaced too, and so are those of the modules that contain its groups (an
    encoder, a decoder stack), so whatever calls them itself — ``generate()``, which runs an encoder-decoder's
    encoder on its own, a pipeline holding the original object — runs offloaded as well."""

    def __init__(self, model: nn.Module, runtime: OffloadRuntime) -> None:
        super().__init__()
        self._orig_mod = model
        object.__setattr__(self, "_offload_runtime", runtime)
        offload_forwards(model, runtime)

    @property
    def offload_policy(self) -> OffloadPolicy:
        return self._offload_runtime.policy

    @property
    def device(self) -> torch.device:
        """The compute device (the weights' home is host memory)."""
        return self._offload_runtime.device

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._offload_runtime.closed:
            raise RuntimeError(OFFLOAD_ENDED)
        return self._orig_mod(*args, **kwargs)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The original model's names (as in its ``state_dict``), not ``_orig_mod.``-prefixed ones."""
        return self._orig_mod.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._orig_mod.named_buffers(prefix, recurse, remove_duplicate)

    def __deepcopy__(self, memo: dict) -> Any:
        raise TypeError("an offloaded module cannot be copied (its weights live in shared host buffers): copy the "
                        "model first and offload the copy, offload_compile(copy.deepcopy(remove_offload(m)), policy), "
                        "or save m.state_dict()")

    def __reduce_ex__(self, protocol: int) -> Any:
        raise TypeError("an offloaded module cannot be pickled or torch.save()d: save m.state_dict() (the original "
                        "parameter names), or the model returned by remove_offload(m)")

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


class PipelineModules(nn.Module):
    """The nn.Module attributes of a pipeline object (diffusers-style), seen as one model."""

    def __init__(self, pipeline: Any) -> None:
        super().__init__()
        found = {name: value for name, value in vars(pipeline).items() if isinstance(value, nn.Module)}
        if not found:
            raise TypeError(f"offload_compile takes an nn.Module or a pipeline whose components are nn.Module "
                            f"attributes; {type(pipeline).__name__} has none")
        for name, module in found.items():
            self.add_module(name, module)


def offload_compile(model: Any, policy: OffloadPolicy | None = None, **fields: Any) -> Any:
    """Offload ``model``'s weights to host memory and run it through graphs with explicit transfers.

    ``model`` is an nn.Module (returns an `OffloadedModule`) or, for the component strategies, a pipeline
    object whose components are nn.Module attributes (returns the pipeline, its components offloaded)."""
    if policy is None:
        policy = OffloadPolicy(**fields)
    elif fields:
        policy = policy.replace(**fields)
    if not isinstance(policy, OffloadPolicy):
        raise TypeError(f"policy must be an OffloadPolicy; got {type(policy).__name__}")
    if isinstance(model, OffloadedModule):
        raise ValueError(f"this is already an offloaded module ({type(model._orig_mod).__name__}); to change its "
                         f"policy, offload the original again: offload_compile(remove_offload(m), policy)")
    if runtime_of(model) is not None:  # offloaded before (a retry with a fixed policy): the old offload ends
        remove_offload(model)
    if policy.strategy == "auto":  # the planner needs the graph, so it plans at the first call
        from .auto import AutoOffloadedModule
        return AutoOffloadedModule(model, policy)
    if not isinstance(model, nn.Module):
        if policy.strategy not in COMPONENT_STRATEGIES + ("sequential",):
            raise TypeError(f"offload_compile takes an nn.Module; a pipeline object ({type(model).__name__}) works "
                            f"with strategy 'model', 'alternating' or 'sequential'")
        modules = PipelineModules(model)
        runtime = build_runtime(modules, policy)
        _offload_component_calls(modules, runtime)
        model._offload_runtime = runtime
        return model
    runtime = build_runtime(model, policy)
    if policy.strategy in COMPONENT_STRATEGIES or policy.strategy == "sequential":
        _offload_component_calls(model, runtime)
    return OffloadedModule(model, runtime)


def offload_forwards(model: nn.Module, runtime: OffloadRuntime) -> None:
    """The model's forward, and those of the modules containing its groups, run through offloaded graphs."""
    model.forward = _OffloadedForward(model, runtime, root=True)
    for name in _containers_of_groups(model, runtime):
        module = model.get_submodule(name)
        if not isinstance(module.__dict__.get("forward"), _OffloadedForward):
            module.forward = _OffloadedForward(module, runtime, root=True)


def _containers_of_groups(model: nn.Module, runtime: OffloadRuntime) -> list[str]:
    """Modules strictly between the model and its groups that have a forward of their own (``encoder``,
    ``model.decoder``; not the blocks, not module lists)."""
    names: dict[str, None] = {}
    for group in runtime.groups:
        parts = group.name.split(".") if group.name not in ("", "(root)") else []
        for end in range(1, len(parts)):
            names[".".join(parts[:end])] = None
    found = []
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue
        if type(module).forward is not nn.Module.forward:  # ModuleList/ModuleDict have none
            found.append(name)
    return found


def _offload_component_calls(model: nn.Module, runtime: OffloadRuntime) -> None:
    """Each component's forward becomes a graph of its own on the shared runtime."""
    for group in runtime.groups:
        if group.name in ("", "(root)"):
            continue
        try:
            module = model.get_submodule(group.name)
        except AttributeError:
            continue
        module.forward = _OffloadedForward(module, runtime)


class _OffloadedForward:
    """A module's forward, compiled with the model's offload backend; refuses to run un-offloaded. Installed
    on the model itself (``root``) and on each component, which are often called on their own from Python (a
    thinker's output feeds a talker, a pipeline calls its text encoder)."""

    def __init__(self, module: nn.Module, runtime: OffloadRuntime, root: bool = False) -> None:
        self._runtime = runtime
        self._root = root
        self._warned_inputs = False
        self._forward = type(module).forward.__get__(module)
        self._compiled = torch.compile(self._forward, backend=RuntimeBackend(runtime),
                                       fullgraph=runtime.policy.fullgraph)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # inside an enclosing offloaded graph: trace through
            return self._forward(*args, **kwargs)
        runtime = self._runtime
        if runtime.closed:
            raise RuntimeError(OFFLOAD_ENDED)
        args, kwargs = self._inputs_on_device(args, kwargs)
        calls = runtime.graph_calls
        # every offloaded model of one class is a cache entry of the same code object in dynamo
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT,
                                                         accumulated_recompile_limit=RECOMPILE_LIMIT):
            try:
                out = self._compiled(*args, **kwargs)
            except torch._dynamo.exc.TorchRuntimeError as exc:
                model_error = _model_error(exc)
                if model_error is None:
                    raise
                model_error.add_note(f"(raised while tracing the offloaded model with fake tensors: {exc.args[0]})"
                                     if exc.args else "(raised while tracing the offloaded model)")
                raise model_error from None  # the model's own error (bad shapes), not dynamo's report of it
        if runtime.graph_calls == calls and (self._root or any(g.streamed for g in runtime.groups)):
            raise RuntimeError(
                f"{runtime.model_name} ran without its offloaded graph: torch.compile fell back to plain eager "
                f"execution, so nothing was offloaded. Dynamo does this for a frame with a graph break inside a loop "
                f"or past its recompile limit; TORCH_LOGS=graph_breaks,recompiles shows which")
        return out

    def _inputs_on_device(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Tensor inputs elsewhere than the compute device are moved there (warned once); data-less (meta)
        inputs are refused, and so are inputs that require grad (inference only)."""
        device = self._runtime.device
        moved = []

        def place(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            if value.requires_grad and torch.is_grad_enabled():
                raise ValueError("an input requires grad, but an offloaded model runs inference only (no backward "
                                 "through the transfers): pass inputs.detach(), or train the model un-offloaded")
            if value.device == device:
                return value
            if value.is_meta:
                raise ValueError(f"an input is on the meta device, so it has no data to compute on; pass real "
                                 f"tensors (on {device})")
            moved.append(str(value.device))
            return value.to(device)

        args, kwargs = pytree.tree_map(place, (args, kwargs))
        if moved and not self._warned_inputs:
            self._warned_inputs = True
            warnings.warn(f"offload_compiler: inputs on {sorted(set(moved))} were moved to the compute device "
                          f"{device}; pass them on {device} to avoid the copy", RuntimeWarning, stacklevel=4)
        return args, kwargs


def _model_error(exc: BaseException) -> BaseException | None:
    """The error the model's code raised while dynamo traced it (with fake tensors), under dynamo's wrappers."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if not isinstance(exc, torch._dynamo.exc.TorchDynamoException) and isinstance(
                exc, (RuntimeError, ValueError, TypeError, IndexError)):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


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


def release_device_copies(module: Any) -> int:
    """Free the device memory an offloaded model holds between calls: resident groups, parked components and
    copies prefetched for the next call (``prefetch_next_call``). The next call fetches what it needs again.
    Returns the bytes released."""
    return _runtime(module).release_device_copies()


def describe_plan(module: Any) -> str:
    return _runtime(module).describe()


def remove_offload(module: Any) -> nn.Module:
    """Undo offloading: every weight gets its own host storage back, device copies are dropped, and the
    original model is returned (equal to what was offloaded; the offloaded wrapper refuses further calls)."""
    runtime = _runtime(module)
    runtime.unpack()
    model = module._orig_mod if hasattr(module, "_orig_mod") else module
    modules = model.modules() if isinstance(model, nn.Module) else (
        m for value in vars(model).values() if isinstance(value, nn.Module) for m in value.modules())
    for submodule in modules:  # components called on their own run their own forward again
        if isinstance(submodule.__dict__.get("forward"), _OffloadedForward):
            del submodule.forward
    if not isinstance(model, nn.Module):
        del model._offload_runtime
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
