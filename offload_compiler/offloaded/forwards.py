"""The offloaded model: the model object itself, with exactly one `OffloadState`, reached one way (`state_of`).

Every entry point ends here — `offload_compile` (modules and pipelines, every strategy, ``auto`` included) and
``torch.compile(model, backend="omni_offload")`` — as FSDP2's ``fully_shard`` does: the model is offloaded in
place. Its class is swapped for a subclass of `OffloadedModule` (and of its own class, with its name) that
carries the guards (``.to``, dtype changes, copy, pickle, ``load_state_dict(assign=True)``); its ``forward``,
and those of the modules that contain its groups or are its components, become `_OffloadedForward` objects
that run the offloaded graphs; hooks registered on any of its modules afterwards are refused (the captured
graphs could not see them).

How a call reaches the weights, route by route:
- a direct call, ``generate()``, a pipeline holding the object, a container or component called on its own:
  ``module.forward`` is an `_OffloadedForward`, which runs the module's own offloaded graph;
- any other module holding offloaded weights, called from Python outside an offloaded call (by hand, from a
  method of the model, from its forward reached around the instance attribute): ``module.forward`` is a
  `_RoutedPart`, which runs that module's own offloaded graph;
- the user's ``torch.compile`` around the model (or around code calling it): `_OffloadedForward.__call__`
  is ``torch.compiler.disable``d, so the model is a clean boundary in the user's graph (its own graph runs,
  already compiled as the policy says); under ``fullgraph=True`` dynamo's error names the reason;
- our own capture: while the model's graph is captured or run, the installed forwards are swapped for
  `_TraceThrough` objects, which dynamo traces into (one graph per call, no break per container), as it traces
  into the `_RoutedPart` objects;
- part of the forward run by dynamo without a graph (a graph break inside a loop): the modules it calls are
  parts called from Python, so each runs its own offloaded graph (slower, module by module), and a weight it
  computes with directly is a host master, read on demand for that op (`host_masters`); what such code read,
  measured (bytes fetched by those graphs, bytes and ops on demand), is said once per model.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import itertools
import logging
import sys
import threading
import types
import warnings
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._torch_private import capture_config, compile_under_config, compiled_models, compiled_module_of, \
    config_for_call, filter_fake_tensor_log, guards_only_on, inlined_only, is_tracing_error, leave_fullgraph_region, \
    model_error, own_refusal, pytree, restore_fullgraph_region, symbolic_sizes, user_frame
from ..planning.auto import OffloadPlan, plan_offload, planned_runtime, planned_specs, resolve_budget
from ..planning.planner import GIB, InfeasibleBudgetError
from ..backend import OFFLOAD_ENDED, RuntimeBackend, build_runtime, compile_graph
from ..components import DIT_MODULES, ENTRY_METHODS, pipeline_streamed
from ..errors import OffloadRefusal
from ..grouping import blocks_attr_within, component_block_groups, plan_groups
from ..host_masters import HostMaster
from ..policy import COMPONENT_STRATEGIES, OffloadPolicy, validate_device
from ..runtime import OffloadRuntime

STATE_ATTR = "_offload_state"
HOOKS_REFUSED = ("{model} is offloaded: its graphs were captured with the hooks it had then, so a hook {action} now "
                 "would be silently ignored. Change hooks before offloading: m = remove_offload(m), change the "
                 "hook, then offload_compile(m, policy)")


@dataclasses.dataclass(eq=False)
class OffloadState:
    """Everything offloading attached to one model (or pipeline). ``runtime`` is None until ``auto`` plans."""
    owner: Any
    policy: OffloadPolicy
    runtime: OffloadRuntime | None = None
    plan: OffloadPlan | None = None
    modules: nn.Module | None = None  # the model, or a pipeline's components seen as one (`PipelineModules`)
    classes: list = dataclasses.field(default_factory=list)  # (module, its class before offloading)
    forwards: dict = dataclasses.field(default_factory=dict)  # (module, method name) -> its _OffloadedForward
    hooks: HookWatch = dataclasses.field(default_factory=lambda: HookWatch())  # the hook dicts of every module
    unplanned: list = dataclasses.field(default_factory=list)  # auto on a pipeline: denoisers planned at their first call
    plans: dict = dataclasses.field(default_factory=dict)  # auto on a pipeline: denoiser path -> its plan
    parts: dict = dataclasses.field(default_factory=dict)  # module -> (its __dict__, its `_RoutedPart`, its forward
    #   set on the instance before offloading or None): the other modules holding weights (`add_part`)
    routing: int = 0  # depth of offloaded calls (and captures) running now
    outside: Outside | None = None  # what the current offloaded call read outside its own graphs (`Outside`)
    traced_runtime: OffloadRuntime | None = None  # the backend route's first runtime (`_with_masters`)
    warned_outside: bool = False  # the one warning that part of a call ran outside its graphs was given
    ended: bool = False
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    limits: Any = dataclasses.field(default_factory=capture_config)  # entered around a call only where its
    #   compiles cannot carry it themselves (`_torch_private.config_for_call`)

    def __post_init__(self) -> None:
        if self.modules is None and isinstance(self.owner, nn.Module):
            self.modules = self.owner

    @property
    def name(self) -> str:
        return type(self.owner).__name__

    def check_usable(self) -> None:
        if self.ended:
            raise OffloadRefusal(OFFLOAD_ENDED)
        changed = None if self.routing else self.hooks.change()  # during a call: the model's own (`adopt_hooks`)
        if changed is not None:
            raise OffloadRefusal(HOOKS_REFUSED.format(model=self.name, action=changed))

    def adopt_hooks(self) -> None:
        """At the end of an offloaded call: hooks that the model's own forward registered or removed during it are
        the model's (transformers installs its output-capturing hooks at the first call with
        ``output_hidden_states=True`` or ``output_attentions=True``); that call's graph was traced with them. They
        are taken as the model's hooks, and the graphs captured before them are captured again at their next call
        (dynamo does not guard hooks, so those graphs would silently skip them)."""
        if self.hooks.change() is not None:
            self.hooks.accept()
            self.recompile()

    def recompile(self) -> None:
        """Every offloaded forward compiles again at its next call (hooks changed, or the runtime was rebuilt)."""
        for forward in self.forwards.values():
            forward.recompile()
        for _, part, _ in self.parts.values():
            part.recompile()

    @contextlib.contextmanager
    def tracing_through(self) -> Iterator[None]:
        """While our own graph is captured or run, dynamo traces into the installed forwards and routed parts
        (and nothing is refused: the graph fetches what it reads)."""
        saved = [(key, key[0].__dict__.get(key[1])) for key in self.forwards]
        for (module, method), forward in self.forwards.items():
            module.__dict__[method] = forward.through
        self.routing += 1
        _OFFLOADED_CALLS.depth += 1
        try:
            yield
        finally:
            _OFFLOADED_CALLS.depth -= 1
            self.routing -= 1
            for (module, method), previous in saved:
                module.__dict__[method] = previous

    def warn_outside(self, outside: Outside) -> None:
        """Once per model, at the end of the first offloaded call that read weights outside its own graphs:
        code dynamo ran without a graph (a graph break inside a loop, a frame past its recompile limit). It still
        streamed -- the modules it called as their own graphs, the weights it computed with on demand, op by op
        (host masters) -- and this says what that cost, as measured, and the fix."""
        if self.warned_outside or not outside:
            return
        self.warned_outside = True
        what = []
        if outside.part is not None:
            what.append(f"the modules it called, such as {_path_of(self, outside.part) or type(outside.part).__name__}, "
                        f"each ran as their own offloaded graph ({_size(outside.part_bytes)} fetched), with no "
                        f"prefetch ahead and a dispatch per module")
        if outside.on_demand_ops:
            what.append(f"{outside.on_demand_weights} weights it computed with directly were fetched on demand for "
                        f"each op ({_size(outside.on_demand_bytes)} in {outside.on_demand_ops} ops, "
                        f"offload_stats(m).on_demand_bytes)")
        warnings.warn(
            f"offload_compiler: part of {self.name}'s forward ran outside its offloaded graphs (dynamo ran it "
            f"without a graph: a graph break inside a loop, or a frame past its recompile limit); it still "
            f"streamed: {'; '.join(what)}. Slower, like a hook-based offloader, for that code only. Make that code "
            f"traceable to stream it within one graph (TORCH_LOGS=graph_breaks shows where)", UserWarning,
            stacklevel=4)

    def add_part(self, module: nn.Module) -> None:
        """Route ``module`` (it holds offloaded weights) through a `_RoutedPart` of its own."""
        previous = module.__dict__.get("forward")
        part = module.__dict__["forward"] = _RoutedPart(module, self, previous)
        self.parts[module] = (module.__dict__, part, previous)

    def plan_now(self, args: tuple, kwargs: dict) -> OffloadPlan:
        """``auto``: plan from this call of the whole model (nothing runs), then build the runtime and the
        forwards of the chosen groups."""
        if self.plan is None:
            model = self.owner
            try:
                with self.tracing_through():
                    plan = plan_offload(model, self.policy, *args, **kwargs)
            except InfeasibleBudgetError as error:  # every later call plans again, with the same budget
                error.add_note(f"{self.name} is offloaded with this budget and stays unplanned (nothing moved, its "
                               f"weights are unchanged); to change the budget: offload_compile(remove_offload(m), "
                               f"policy.replace(device_budget_gb=...))")
                raise
            self.runtime = planned_runtime(model, self.policy, plan)
            self.plan = plan
            install_forwards(model, self)
        return self.plan

    def plan_component(self, path: str, args: tuple, kwargs: dict) -> None:
        """``auto`` on a pipeline: plan denoiser ``path`` from this, its first call (nothing runs), within its
        share of the budget, then rebuild the runtime with the planned groups (the graphs compiled so far,
        the encoders', are compiled again at their next call)."""
        module = self.modules.get_submodule(path)
        share = self._component_budget()
        policy = _within(self.policy, path).replace(device_budget_gb=share / GIB)
        try:
            with self.tracing_through():
                plan = plan_offload(module, policy, *args, **kwargs)
        except InfeasibleBudgetError as error:
            error.add_note(f"(the budget above is {path}'s share of {self.name}'s device_budget_gb: what the "
                           f"components kept on the device and the encoders' streaming window leave)")
            raise
        plan.as_component(path, self.name, self.policy)  # its budget printed as path's share of the user's
        self.plans[path] = plan
        self.plan = self.plan or plan
        self.unplanned.remove(path)
        self.runtime.unpack()
        self.runtime = pipeline_runtime(self.modules, self.policy, self.name, self.plans)
        self.recompile()

    def _component_budget(self) -> int:
        """A denoiser's share of ``device_budget_gb``: what the components kept on the device (the VAE) and
        the encoders' streaming window leave, split between the denoisers."""
        budget, source = resolve_budget(self.policy)
        runtime = self.runtime
        kept = 0 if self.policy.device_budget_gb == "free" else runtime.unmanaged_bytes  # "free" counts them already
        denoisers = [p for p in self.plans] + self.unplanned
        encoders = [g.nbytes for g in runtime.groups if g.name.split(".", 1)[0] not in denoisers]
        window = (self.policy.prefetch + 1) * max(encoders, default=0)
        share = (budget - kept - window) // max(len(denoisers), 1)
        if share <= 0:
            raise InfeasibleBudgetError(
                f"{source} leaves nothing for {self.name}'s denoisers: {kept} B stay on the device (the VAE and other "
                f"components) and the encoders stream {window} B at a time; raise device_budget_gb",
                needed_bytes=kept + window + 1, budget_bytes=budget)
        return share


def state_of(obj: Any) -> OffloadState | None:
    """The one way to the offload state: on the model (or pipeline) itself, through a torch.compile wrapper."""
    return getattr(compiled_module_of(obj), "__dict__", {}).get(STATE_ATTR)


# -- the offloaded class ------------------------------------------------------------------------------------

class OffloadedModule(nn.Module):
    """Base of every offloaded model's class: ``offload_compile(model, policy)`` returns ``model`` itself, its
    class swapped for a subclass of ``(OffloadedModule, Class)`` named like ``Class``. Parameters, buffers and ``state_dict`` are
    the model's own (host masters); it runs inference only; `remove_offload` restores the class."""

    @property
    def _offload(self) -> OffloadState:
        return self.__dict__[STATE_ATTR]

    @property
    def offload_policy(self) -> OffloadPolicy:
        state = self._offload
        return state.policy if state.runtime is None else state.runtime.policy

    @property
    def _offload_runtime(self) -> OffloadRuntime | None:
        return self._offload.runtime

    @property
    def device(self) -> torch.device:
        """The compute device (the weights' home is host memory)."""
        return self._offload.policy.torch_device

    def plan(self, *args: Any, **kwargs: Any) -> OffloadPlan:
        """``strategy="auto"``: plan for these inputs now (nothing runs); later calls use that plan."""
        state = self._offload
        if state.policy.strategy != "auto":
            raise ValueError(f"plan() is for strategy='auto'; this model is offloaded with strategy="
                             f"{state.policy.strategy!r} (describe_plan(m) shows its plan)")
        state.check_usable()
        with state.lock:
            return state.plan_now(args, kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        raise TypeError("an offloaded module cannot be copied (its weights live in shared host buffers): copy the "
                        "model first and offload the copy, offload_compile(copy.deepcopy(remove_offload(m)), policy), "
                        "or save m.state_dict()")

    def __reduce_ex__(self, protocol: int) -> Any:
        raise TypeError("an offloaded module cannot be pickled or torch.save()d: save m.state_dict() (the original "
                        "parameter names), or the model returned by remove_offload(m)")

    def to(self, *args: Any, **kwargs: Any) -> "OffloadedModule":
        device, dtype = _to_target(*args, **kwargs)
        if dtype is not None:
            self._apply(None)
        if device is not None:
            try:  # a device this machine does not have is an error, as it is for a plain module
                device = validate_device(device)
            except ValueError as error:
                raise RuntimeError(f"{type(self).__name__}.to({device}): {error}. The model is unchanged: it keeps "
                                   f"its weights in host memory and computes on {self.device}") from None
            if device != self.device:
                warnings.warn(f"offload_compiler: .to({device}) ignored: this module keeps its weights in host "
                              f"memory and computes on {self.device}. To compute elsewhere: "
                              f"offload_compile(remove_offload(m), policy.replace(device=...))", UserWarning,
                              stacklevel=2)
        return self

    def cuda(self, device: Any = None) -> "OffloadedModule":
        return self.to(torch.device("cuda") if device is None else torch.device("cuda", device)
                       if isinstance(device, int) else device)

    def cpu(self) -> "OffloadedModule":
        return self.to("cpu")

    def _apply(self, fn: Any, recurse: bool = True) -> "OffloadedModule":
        raise OffloadRefusal("changing the dtype or storage of an offloaded module's weights (.half(), .to(dtype), "
                             "...) would detach them from their host buffers; convert first: "
                             "offload_compile(remove_offload(m).to(dtype), policy)")

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the offloaded weights' host masters; "
                             "use assign=False (the default), which copies into them")
        if self._offload.runtime is not None:  # copies still queued may read the host buffers written here
            self._offload.runtime.wait_for_copies()
        return super().load_state_dict(state_dict, strict=strict)


_CLASSES: dict[type, type] = {}


def _offloaded_class(cls: type) -> type:
    if cls not in _CLASSES:
        # the model's own names: in messages, plans and repr, and for libraries that key what they know of a
        # class on its name (transformers' output capture looks up str(model.__class__): under another name an
        # offloaded BertModel returned no hidden states). isinstance(m, OffloadedModule) tells it is offloaded
        namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        _CLASSES[cls] = type(cls.__name__, (OffloadedModule, cls), namespace)
    return _CLASSES[cls]


BOUNDARY = ("an offloaded model runs its own offloaded graph (compiled as its OffloadPolicy says); torch.compile "
            "around it cannot trace its weights without their transfers, so it is a graph boundary. Call it outside "
            "fullgraph=True regions, or compile it through its policy (compiler='inductor', fullgraph=True)")

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks")


class HookWatch:
    """The forward hooks of every module of an offloaded model, as they were when its graphs were captured
    (dynamo does not guard module hooks: a hook changed later would be silently ignored). Checked at every
    call without touching the dicts, which stay the modules' own plain dicts (a dict of another type makes
    dynamo guard each one in Python at every call): while no hook handle was made anywhere since the last
    check and no dict shrank, nothing changed; otherwise the keys are compared."""

    def __init__(self) -> None:
        self.dicts: list[dict] = []
        self.keys: list[tuple] = []
        self.size = 0
        self.handles = RemovableHandle.next_id

    def add(self, module: nn.Module) -> None:
        for attr in _HOOK_DICTS:
            hooks = module.__dict__[attr]
            self.dicts.append(hooks)
            self.keys.append(tuple(hooks))
            self.size += len(hooks)
        self.handles = RemovableHandle.next_id

    def change(self) -> str | None:
        """None while every hook dict holds the hooks it held at offloading; else "registered" or "removed"."""
        if RemovableHandle.next_id == self.handles and sum(map(len, self.dicts)) == self.size:
            return None
        for hooks, keys in zip(self.dicts, self.keys):
            if tuple(hooks) != keys:
                return "registered" if set(hooks) - set(keys) else "removed"
        self.handles = RemovableHandle.next_id  # handles made elsewhere (another model): nothing here changed
        return None

    def accept(self) -> None:
        """The hooks as they are now are the model's (`OffloadState.adopt_hooks`)."""
        self.keys = [tuple(hooks) for hooks in self.dicts]
        self.size = sum(map(len, self.dicts))
        self.handles = RemovableHandle.next_id


# -- forwards ------------------------------------------------------------------------------------------------

class _OffloadedForward:
    """A module's forward (or another entry method, `ENTRY_METHODS`) while its model is offloaded: runs the
    module's own offloaded graph. ``function``: what the method runs, where not the class's (a forward set on the
    instance before offloading)."""

    def __init__(self, module: nn.Module, state: OffloadState, method: str = "forward",
                 function: Any = None) -> None:
        self._state = state
        self._module = module
        self._root = module is state.owner
        self._method = method
        self._warned_inputs = False
        self.forward = function if function is not None else getattr(type(module), method).__get__(module)
        self.through = _TraceThrough(self)
        self._compiled = None
        try:  # inspect.signature(m.forward) is the method's own (transformers' generate checks kwargs against it)
            self.__signature__ = inspect.signature(self.forward)
        except (TypeError, ValueError):  # no signature to give
            pass

    def recompile(self) -> None:
        """The runtime was rebuilt (``auto`` planned a pipeline's denoiser): compile again at the next call."""
        self._compiled = None

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        outer = leave_fullgraph_region()  # called from the user's torch.compile(m, fullgraph=True): see there
        try:
            return self._offloaded_call(*args, **kwargs)
        finally:
            restore_fullgraph_region(outer)

    def _offloaded_call(self, *args: Any, **kwargs: Any) -> Any:
        state = self._state
        with state.lock:
            state.check_usable()
            if state.runtime is None:
                if not self._root:
                    raise OffloadRefusal(f"strategy='auto' plans from a call of the whole {state.name}: call the "
                                         f"model (or m.plan(...)) once before calling its parts on their own")
                state.plan_now(args, kwargs)
            elif state.unplanned:
                path = _path_of(state, self._module)
                if path in state.unplanned:
                    state.plan_component(path, args, kwargs)
            runtime = state.runtime
            args, kwargs, needs_grad = self._inputs_on_device(args, kwargs, runtime.device)
            calls = runtime.graph_calls
            outer = not state.routing  # a part called from a frame run without a graph adds to its caller's
            if outer:
                state.outside = Outside(runtime)
            measure = state.plan.measure(runtime) if self._root and state.plan else contextlib.nullcontext()
            compiled = self._compiled or self._compile(runtime)
            try:
                with torch.no_grad(), config_for_call(compiled, state.limits), state.tracing_through(), measure:
                    out = self._run(compiled, args, kwargs)
            except BaseException as exc:
                if is_tracing_error(exc):
                    # dynamo may have given up on a frame of this failed call (the model's own ``raise`` on a bad
                    # input, traced: "Failed to handle graph break gracefully") and run that code object without
                    # a graph from then on: our forwards' frames included, so every later call would read its
                    # weights on demand. Fresh code objects for them (`_own_frame`) at the next call.
                    state.recompile()
                raise
            finally:
                if outer:
                    state.adopt_hooks()
            if runtime.graph_calls == calls and not _reads_are_counted(runtime):
                raise OffloadRefusal(  # a tensor-subclass weight is no host master (see `_reads_are_counted`)
                    f"{state.name} ran without its offloaded graph: torch.compile fell back to plain eager "
                    f"execution, so nothing was offloaded. Dynamo does this for a frame with a graph break inside a "
                    f"loop or past its recompile limit; TORCH_LOGS=graph_breaks,recompiles shows which")
            if outer:
                state.warn_outside(state.outside.end())
        return _inference_only(out) if needs_grad or self._trainable() else out

    def _trainable(self) -> bool:
        """The plain module's outputs would require grad for its weights: grad mode on, a weight requiring it."""
        return torch.is_grad_enabled() and any(p.requires_grad for p in self._module.parameters())

    __call__ = torch.compiler.disable(_call, reason=BOUNDARY)

    def _compile(self, runtime: OffloadRuntime) -> Any:
        """The module's forward compiled with our backend; dynamo's raised limits and logging calls traced as no-ops
        (`_torch_private.capture_config`) are in force while it compiles, not while it runs."""
        self._compiled = compile_under_config(_own_frame(self.forward), backend=RuntimeBackend(runtime),
                                              fullgraph=runtime.policy.fullgraph,
                                              options={"guard_filter_fn": _PART_GUARDS})  # popped by torch
        return self._compiled

    def _run(self, compiled: Any, args: tuple, kwargs: dict) -> Any:
        try:
            return compiled(*args, **kwargs)
        except Exception as exc:
            failure = exc
        refusal = own_refusal(failure)
        if refusal is not None and refusal is not failure:
            refusal.offload_trace = failure
            raise refusal from None
        error = model_error(failure) if is_tracing_error(failure) else None
        if error is None:
            raise failure
        if symbolic_sizes(str(error)):  # traced with symbolic sizes (s27): once more with these shapes, outside
            try:                        # the handler above, so that the retry's chain holds only its own errors
                with torch.compiler.config.patch(automatic_dynamic_shapes=False):  # the call's own sizes
                    return compiled(*args, **kwargs)
            except Exception as again:
                static_error = model_error(again) if is_tracing_error(again) else None
                if static_error is not None:
                    failure, error = again, static_error
        raise self._input_error(error, failure, args, kwargs) from None

    def _input_error(self, error: BaseException, exc: BaseException, args: tuple, kwargs: dict) -> BaseException:
        """The model's own error while tracing it (a wrong input shape), short: the module and method, the
        inputs it was given, what failed and where. Dynamo's full report is the error's ``offload_trace``."""
        state, module = self._state, self._module
        path = _path_of(state, module)
        call = f"{state.name}{'.' + path if path else ''}.{self._method}({_describe_inputs(self.forward, args, kwargs)})"
        text = str(error).strip()
        what = text.splitlines()[0].rstrip(".") if text else type(error).__name__
        line = user_frame(exc)
        try:
            short = type(error)(f"{call} failed: {what}{f' (at {line})' if line else ''}. Check the inputs against "
                                f"what {type(module).__name__}.{self._method} expects; the model is unchanged")
        except Exception:  # an exception type with other arguments: the model's own error as raised
            short = error
        short.offload_trace = exc
        return short

    def _inputs_on_device(self, args: tuple, kwargs: dict, device: torch.device) -> tuple[tuple, dict, bool]:
        """Tensor inputs elsewhere than the compute device are moved there (warned once); data-less (meta)
        inputs are refused. Also says whether an input requires grad (the outputs then do, as the plain
        model's would: `_inference_only`)."""
        tensors = list(_tensor_leaves((args, kwargs)))
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        if all(t.device == device for t in tensors):  # every call but a misplaced one: nothing to rebuild
            return args, kwargs, needs_grad
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
            self._warned_inputs = True
            warnings.warn(f"offload_compiler: inputs on {sorted(set(moved))} were moved to the compute device "
                          f"{device}; pass them on {device} to avoid the copy", RuntimeWarning, stacklevel=5)
        return args, kwargs, needs_grad


def _to_target(*args: Any, device: Any = None, dtype: torch.dtype | None = None, **_: Any) \
        -> tuple[torch.device | None, torch.dtype | None]:
    """The device and dtype that ``module.to(*args, **kwargs)`` names, in the forms ``Tensor.to`` documents:
    ``to(device, dtype)``, ``to(dtype)``, ``to(tensor)``, by keyword too (``non_blocking``, ``copy`` and
    ``memory_format`` say nothing of either). Not validated: a device this machine lacks is the caller's error."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0].device, args[0].dtype
    if args and isinstance(args[0], torch.dtype):
        dtype = args[0]
    elif args:
        device = args[0]
        if len(args) > 1 and isinstance(args[1], torch.dtype):
            dtype = args[1]
    return (None if device is None else torch.device(device)), dtype


_ATOMS = (bool, int, float, str, type(None))


def _tensor_leaves(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors among a call's arguments, as ``pytree.tree_leaves`` finds them: plain tuples, lists and
    dicts are walked here (this runs at every call, and pytree's generic walk costs tens of µs on a
    decode step's arguments), any other value by pytree."""
    stack = [tree]
    while stack:
        value = stack.pop()
        kind = type(value)
        if kind is tuple or kind is list:
            stack.extend(value)
        elif kind is dict:
            stack.extend(value.values())
        elif isinstance(value, torch.Tensor):
            yield value
        elif kind not in _ATOMS:
            yield from (leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor))


def _own_frame(function: Any) -> Any:
    """``function``, called from a frame whose code object belongs to this one forward. Dynamo keeps its compiled
    graphs (and counts recompiles) on the code object of the frame it compiles. Compiling the module's forward
    itself would put the graphs of every offloaded model of a class -- of every transformers class, whose
    forwards share one decorator ``wrapper`` -- on that shared code object: a later ``torch.compile`` of any model
    with that forward (``backend="omni_offload"`` included) would then meet dynamo's recompile limit at its
    first call and silently run un-compiled (for ``omni_offload``: un-offloaded), and every call of every model
    would check all those graphs' guards. Dynamo traces into ``function`` from here (inlined, no cache entry)."""
    def offloaded_call(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)
    code = offloaded_call.__code__.replace()  # a new code object, not shared with any other forward
    return types.FunctionType(code, offloaded_call.__globals__, offloaded_call.__name__, offloaded_call.__defaults__,
                              offloaded_call.__closure__)


class Outside:
    """What one offloaded call read outside its own graphs, measured: the bytes that parts called from Python
    (from code dynamo ran without a graph) fetched as their own graphs, and what host masters fetched on demand
    (`host_masters.OnDemand`) -- no count of dynamo's is read."""

    def __init__(self, runtime: OffloadRuntime) -> None:
        self.runtime = runtime
        demand = runtime.on_demand
        self._start = (demand.bytes, demand.ops, len(demand.weights))
        self.part: nn.Module | None = None  # the first part called from Python during the call
        self.part_bytes = 0
        self.on_demand_bytes = self.on_demand_ops = self.on_demand_weights = 0

    def add_part(self, module: nn.Module, nbytes: int) -> None:
        self.part = self.part if self.part is not None else module
        self.part_bytes += nbytes

    def end(self) -> "Outside":
        demand = self.runtime.on_demand
        self.on_demand_bytes, self.on_demand_ops, self.on_demand_weights = (
            max(now - then, 0) for now, then in zip((demand.bytes, demand.ops, len(demand.weights)), self._start))
        return self

    def __bool__(self) -> bool:
        return self.part is not None or self.on_demand_ops > 0


def _reads_are_counted(runtime: OffloadRuntime) -> bool:
    """Whether every streamed weight is a host master, so that a call which ran none of its graphs still
    streamed what it read. Not yet masters: tensor-subclass weights (quantized, DTensor shards)."""
    return all(isinstance(slot.tensor, HostMaster) for group in runtime.groups if group.streamed
               for slot in group.slots)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes} B"


class _CallDepth(threading.local):
    depth = 0  # how deep in offloaded calls this thread is (`OffloadState.tracing_through`)


_OFFLOADED_CALLS = _CallDepth()


@torch.compiler.assume_constant_result  # read once while dynamo traces, a constant of the graph with no guard
def _tracing_an_offloaded_call() -> bool:
    """Whether the graph dynamo traces now is one of our offloaded calls' (our backend: its graphs run only
    inside offloaded calls) rather than the user's ``torch.compile`` of code that calls a part. A constant of
    the graph, not a guard checked at each call."""
    return getattr(_OFFLOADED_CALLS, "depth", 0) > 0


class _TraceThrough:
    """An installed forward while its model's own graph is captured or run: dynamo traces into the module's
    code; called from Python meanwhile (code dynamo ran between graphs, another thread) it takes the
    offloaded route."""

    def __init__(self, offloaded: _OffloadedForward) -> None:
        self._offloaded = offloaded

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return self._offloaded.forward(*args, **kwargs)
        return self._offloaded(*args, **kwargs)


class _RoutedPart:
    """The forward of every other module holding offloaded weights (a block, a layer's projection, a tied
    ``lm_head``). Where dynamo traces an offloaded call, it traces straight into the module's own forward (the
    graph fetches what it reads). Called from Python -- by hand (``m.model.layers[0](h)``), from a method of
    the model, from its forward reached around its instance attribute, from a frame of an offloaded call that
    dynamo runs without a graph (a graph break inside a loop) -- or met by the user's ``torch.compile`` (a graph
    boundary, as the model is), it runs the module's own offloaded graph, compiled at that first call: no route
    reads host memory."""

    def __init__(self, module: nn.Module, state: OffloadState, previous: Any) -> None:
        self._state = state
        self._module = module
        self.previous = previous  # a forward set on the instance before offloading, or None
        self.forward = previous or type(module).forward.__get__(module)  # what dynamo traces into
        self._routed: _OffloadedForward | None = None

    @inlined_only  # called from a frame dynamo runs without a graph: Python, so the module's own graph runs
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() and _tracing_an_offloaded_call():
            return self.forward(*args, **kwargs)
        return self._route(*args, **kwargs)

    def _route_call(self, *args: Any, **kwargs: Any) -> Any:
        if self._routed is None:
            self._routed = _OffloadedForward(self._module, self._state, function=self.previous)
        outside = self._state.outside if self._state.routing else None
        if outside is None:  # by hand, outside any offloaded call
            return self._routed(*args, **kwargs)
        before = outside.runtime.bytes_transferred  # within an offloaded call: said at its end (`Outside`)
        try:
            return self._routed(*args, **kwargs)
        finally:
            outside.add_part(self._module, outside.runtime.bytes_transferred - before)

    _route = torch.compiler.disable(_route_call, reason=BOUNDARY)

    @property
    def __signature__(self) -> inspect.Signature:  # inspect.signature(module.forward) is the forward's own
        return inspect.signature(self.previous or type(self._module).forward.__get__(self._module))

    def recompile(self) -> None:
        self._routed = None

    def __deepcopy__(self, memo: dict) -> Any:
        """A copy of the module (``copy.deepcopy(m.model.layers[0])``) is a plain module: its forward is its own."""
        copied = memo.get(id(self._module))
        if copied is None or self.previous is not None:
            return copy.deepcopy(self.previous, memo)
        return type(copied).forward.__get__(copied)

    def __reduce_ex__(self, protocol: int) -> Any:
        raise TypeError(f"{type(self._module).__name__} is part of the offloaded {self._state.name}: pickle or "
                        f"torch.save() its state_dict(), or the model returned by remove_offload(m)")


_PART_GUARDS = guards_only_on({_RoutedPart: "ID_MATCH", HostMaster: "TENSOR_MATCH"})  # see there: by identity, by
#   tensor metadata


def _path_of(state: OffloadState, module: nn.Module) -> str:
    """The dotted path of ``module`` in the offloaded model (or among a pipeline's components)."""
    root = state.modules if state.modules is not None else nn.Module()
    return next((name for name, sub in root.named_modules() if sub is module), "")


def _describe_inputs(function: Any, args: tuple, kwargs: dict) -> str:
    """``x=Tensor[2, 5] float32, scale=2.0``: the inputs of a failed call, by parameter name where known."""
    try:
        named = dict(inspect.signature(function).bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        named = {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}

    def show(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"Tensor[{', '.join(map(str, value.shape))}] {str(value.dtype).replace('torch.', '')}"
        tensors = [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
        if tensors:
            return f"{type(value).__name__} of {len(tensors)} tensors ({', '.join(show(t) for t in tensors[:3])}" \
                   f"{', ...' if len(tensors) > 3 else ''})"
        text = repr(value)
        return text if len(text) <= 40 else f"{type(value).__name__}(...)"
    return ", ".join(f"{name}={show(value)}" for name, value in named.items() if value is not None)


INFERENCE_ONLY = ("offload_compiler runs inference only: there is no backward through an offloaded model (its "
                  "weights are streamed, not kept for autograd). Call it under torch.no_grad() or "
                  "torch.inference_mode(), or train the model un-offloaded: remove_offload(m)")


class _InferenceOnlyOutput(torch.autograd.Function):
    """An offloaded model's output where the plain model's would require grad: the same values, with a
    backward that says why there is none."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value.detach()  # the same storage, not a view: in-place changes stay allowed

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        raise OffloadRefusal(INFERENCE_ONLY)


_ANCHOR = torch.zeros((), requires_grad=True)  # gives the outputs a grad_fn; never receives a gradient


def _inference_only(out: Any) -> Any:
    def mark(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
            return _InferenceOnlyOutput.apply(_ANCHOR, value)
        return value
    return pytree.tree_map(mark, out)


class _QuietOwnErrors(logging.Filter):
    """Fake tensors log (to stderr) every op that fails while dynamo traces; inside an offloaded call such a
    failure becomes one short error (`_OffloadedForward._input_error`), so its log record is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        frame = sys._getframe()
        while frame is not None:
            if frame.f_code is _OffloadedForward._call.__code__:
                return False
            frame = frame.f_back
        return True


filter_fake_tensor_log(_QuietOwnErrors())


def _group_names(state: OffloadState, model: nn.Module) -> list[str]:
    if state.runtime is not None:
        return [g.name for g in state.runtime.groups]
    return [spec.name for spec in plan_groups(model, state.policy.replace(blocks_per_group=1))]


def _containers_of_groups(model: nn.Module, names: list[str]) -> list[str]:
    """Modules strictly between the model and its groups that have a forward of their own (``encoder``,
    ``model.decoder``; not the blocks, not module lists)."""
    prefixes: dict[str, None] = {}
    for name in names:
        parts = name.split(".") if name not in ("", "(root)") else []
        for end in range(1, len(parts)):
            prefixes[".".join(parts[:end])] = None
    return [name for name in prefixes if _has_forward(model, name)]


def _has_forward(model: nn.Module, name: str) -> bool:
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return False
    return type(module).forward is not nn.Module.forward  # ModuleList/ModuleDict have none


def _component_names(state: OffloadState, model: nn.Module) -> list[str]:
    """Components are called on their own (a thinker's output feeds a talker, a pipeline calls its text
    encoder, then its denoiser, then its VAE's ``decode``): each runs a graph of its own. A pipeline's
    components are those holding groups; a model's, those of the component strategies (alternating, model,
    sequential over named components)."""
    policy = state.policy
    if state.runtime is None:
        return []
    if state.owner is not model:  # a pipeline
        holding = {g.name.split(".", 1)[0] for g in state.runtime.groups}
        return [name for name, _ in model.named_children() if name in holding and _has_forward(model, name)]
    if not (policy.strategy in COMPONENT_STRATEGIES or (policy.strategy == "sequential" and policy.components is not None)):
        return []
    return [g.name for g in state.runtime.groups if g.name not in ("", "(root)") and _has_forward(model, g.name)]


def _entry_methods(module: nn.Module) -> tuple[str, ...]:
    return tuple(name for name in ENTRY_METHODS if inspect.isfunction(inspect.getattr_static(type(module), name, None)))


def install_forwards(model: nn.Module, state: OffloadState) -> None:
    """The model's forward and entry methods (unless it is a pipeline's stand-in), its groups' containers'
    forwards and entry methods (a VLM's ``m.model.get_image_features``, which ``generate`` calls on its own), and
    its components' forwards and entry methods (`ENTRY_METHODS`: a VAE's ``decode``); then every other module
    holding offloaded weights gets a `_RoutedPart`."""
    names = _group_names(state, model)
    wanted = [model] if model is state.owner else []
    wanted += [model.get_submodule(n) for n in _containers_of_groups(model, names)]
    wanted += [model.get_submodule(n) for n in _component_names(state, model)]
    for module in wanted:
        for method in ("forward",) + _entry_methods(module):
            if (module, method) not in state.forwards:
                forward = _OffloadedForward(module, state, method)
                state.forwards[(module, method)] = forward
                module.__dict__[method] = forward
    routed = {module for module, _ in state.forwards}
    for module in _weight_holders(state, model):
        if module not in routed and module not in state.parts and type(module).forward is not nn.Module.forward:
            state.add_part(module)


def add_method(state: OffloadState, module: nn.Module, method: str) -> None:
    """Route ``module.method`` through an offloaded graph of its own, as the forwards and entry methods are
    (`register_offload_method`): one captured graph with the method's transfers, instead of each part it calls
    run on its own, and a weight it reads directly (``x @ self.proj.weight``) fetched, not read from host."""
    with state.lock:
        state.check_usable()
        if (module, method) in state.forwards:
            return
        if not inspect.ismethod(getattr(module, method, None)):
            raise ValueError(f"{type(module).__name__}.{method} is not a method of the module; register_offload_method "
                             f"takes the name of a method its class defines (forward is routed already)")
        forward = _OffloadedForward(module, state, method)
        state.forwards[(module, method)] = forward
        module.__dict__[method] = forward


def _weight_holders(state: OffloadState, model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` holding a weight of a group, and those containing them (the model itself not
    included); under ``auto`` before planning, every module holding a weight."""
    if state.runtime is not None:
        offloaded = {id(slot.tensor) for group in state.runtime.groups for slot in group.slots}
    else:
        offloaded = {id(t) for t in itertools.chain(model.parameters(), model.buffers())}
    by_path = dict(model.named_modules(remove_duplicate=False))
    holders: dict[nn.Module, None] = {}
    for path, module in by_path.items():
        own = itertools.chain(module._parameters.values(), module._buffers.values())
        if path and any(id(t) in offloaded for t in own if t is not None):
            names = path.split(".")
            holders.update((by_path[".".join(names[:end])], None) for end in range(1, len(names) + 1))
    return list(holders)


# -- in place: attach and detach ------------------------------------------------------------------------------

def _attach(owner: Any, state: OffloadState, modules: list[nn.Module]) -> None:
    """Swap the classes of ``modules`` (the model, or a pipeline's components) and watch every hook dict."""
    owner.__dict__[STATE_ATTR] = state
    for module in modules:
        install_output_capture(module)
        state.classes.append((module, type(module)))
        module.__class__ = _offloaded_class(type(module))
        module.__dict__[STATE_ATTR] = state
        for sub in module.modules():
            state.hooks.add(sub)


def install_output_capture(model: nn.Module) -> None:
    """Install transformers' output-capturing forward hooks now, as its first call with ``output_hidden_states``
    or ``output_attentions`` would (they stay inactive unless a call asks for those outputs). Installed lazily,
    from inside the first such call -- which many models make themselves (a segmentation or detection head, a
    vision-language model reading its vision tower's hidden states) -- they are taken under a threading lock,
    which dynamo cannot trace: that call's graph breaks (``strategy="auto"``, which plans from one graph, is
    refused), and the hooks appear after the graphs were captured. Installed before offloading, the graphs are
    captured with them from the start.

    Installing on a model also installs on every model nested in it, whether or not that one has its hooks
    already (it has once it was called with ``output_hidden_states``: CLIPTextModel inside
    CLIPTextModelWithProjection, before offloading). A second set would record every layer twice: so a model
    gets them only when none inside it has any, else its submodules are looked at in turn."""
    if "transformers" not in sys.modules:  # then no module here is a transformers model
        return
    try:
        from transformers import PreTrainedModel
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # a transformers version without lazy output capture
        return

    def hooked(module: nn.Module) -> bool:
        return getattr(module, "_output_capturing_hooks_installed", False)

    def install(module: nn.Module) -> None:
        if isinstance(module, PreTrainedModel) and not any(hooked(sub) for sub in module.modules()):
            maybe_install_capturing_hooks(module)
            return
        for child in module.children():
            install(child)

    install(model)


def offload_module(model: nn.Module, policy: OffloadPolicy) -> OffloadState:
    """Offload ``model`` in place. Nothing is attached before the runtime exists (a refused policy leaves the
    model untouched); ``auto`` builds its runtime at its first call."""
    runtime = None if policy.strategy == "auto" else build_runtime(model, policy)
    state = OffloadState(model, policy, runtime)
    _attach(model, state, [model])
    install_forwards(model, state)
    return state


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


BLOCK_STRATEGIES = ("layerwise", "budget", "auto")


def offload_pipeline(pipeline: Any, policy: OffloadPolicy) -> OffloadState:
    """A pipeline object: under the block strategies its encoders and denoisers are streamed block by block
    and the other components (the VAE) live on the compute device (`pipeline_runtime`); ``auto`` plans each
    denoiser at its first call. Under the component strategies and ``sequential``, its components are grouped
    as one model's."""
    modules = PipelineModules(pipeline)
    name = type(pipeline).__name__
    unplanned = []
    if policy.strategy in BLOCK_STRATEGIES:
        runtime = pipeline_runtime(modules, policy, name, {})
        if policy.strategy == "auto":
            unplanned = [path for path in pipeline_streamed(modules, name) if path in DIT_MODULES]
    else:
        runtime = build_runtime(modules, policy, name=name)
    state = OffloadState(pipeline, policy, runtime, modules=modules, unplanned=unplanned)
    _attach(pipeline, state, list(modules.children()))
    install_forwards(modules, state)
    return state


def pipeline_runtime(modules: nn.Module, policy: OffloadPolicy, name: str, plans: dict[str, OffloadPlan]
                     ) -> OffloadRuntime:
    """The runtime of a pipeline under the block strategies: encoders, then denoisers, grouped block by block
    (`component_block_groups`), each denoiser that ``auto`` planned as its plan says; the other components
    on the compute device. With plans, the prefetch depth is the smallest they chose."""
    paths = pipeline_streamed(modules, name)
    planned = {path: planned_specs(modules.get_submodule(path), _within(policy, path), plan)
               for path, plan in plans.items()}
    if plans:
        prefetch = min(plan.prefetch for plan in plans.values())
        policy = policy.replace(prefetch=prefetch, prefetch_next_call=policy.prefetch_next_call and prefetch > 0)
    return build_runtime(modules, policy, specs=component_block_groups(modules, paths, policy, planned), name=name)


def _within(policy: OffloadPolicy, path: str) -> OffloadPolicy:
    return policy.replace(blocks_attr=blocks_attr_within(policy.blocks_attr, path))


def detach(state: OffloadState) -> Any:
    """Undo offloading: weights get their own storage (and layout) back, classes, forwards and hook dicts are
    restored, device copies dropped. Every handle to the old offload then refuses to run."""
    with state.lock:
        if state.runtime is not None:
            state.runtime.unpack()
        for module, method in state.forwards:
            module.__dict__.pop(method, None)
        for attributes, _, previous in state.parts.values():
            attributes.pop("forward", None)
            if previous is not None:
                attributes["forward"] = previous
        for module, cls in state.classes:
            module.__class__ = cls
            module.__dict__.pop(STATE_ATTR, None)
        state.owner.__dict__.pop(STATE_ATTR, None)
        state.ended = True
        return state.owner


# -- torch.compile(model, backend="omni_offload") ------------------------------------------------------------

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
    root = model_holding(example_inputs)
    if root is None:
        raise OffloadRefusal(
            "omni_offload offloads the nn.Module given to torch.compile (torch.compile(model, backend="
            "'omni_offload')), whose parameters this graph reads; it found none holding them (a function was "
            "compiled, or weights that are no module's parameters). Use offload_compiler.offload_compile(model, "
            "policy) instead")
    state = state_of(root)
    if state is None:
        state = OffloadState(root, policy, build_runtime(root, policy, pack_now=False))
        root.__dict__[STATE_ATTR] = state
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
            if state.classes or state.ended:
                return self._run(*args)
            out = self._run(*args)  # over the plain weights it was traced with, streamed by its own plan
            _with_masters(state)
            _attach(state.owner, state, [state.owner])
            install_forwards(state.owner, state)
            return out


def _with_masters(state: OffloadState) -> None:
    """After the backend route's first graph ran: its runtime (over the plain weights dynamo traced) gives the
    weights their own storage back, and a runtime with host masters takes its place, as `offload_compile` builds
    it -- so that on this route too a read outside an offloaded graph is fetched on demand and counted. The first
    graph's runtime stays referenced: dynamo may call that graph for another instance of the class sharing its
    code, which it refuses by name (`backend._refuse_foreign_weights`)."""
    traced = state.runtime
    traced.unpack()
    state.runtime = build_runtime(state.owner, traced.policy, name=traced.model_name)
    state.runtime.continue_stats(traced)
    state.traced_runtime = traced
