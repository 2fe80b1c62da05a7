"""The callables installed on an offloaded model's modules, and their installation.

- `_OffloadedForward`: a module's forward (or entry method) while offloaded; runs the module's own offloaded
  graph, compiled at its first call; where dynamo traces one of our offloaded calls, it traces into the module's
  code instead;
- `RoutedPart`: the base of the class every other module holding offloaded weights gets (`routed_class`, one per
  class); its forward is traced into inside an offloaded call, and runs the module's own offloaded graph when
  called from Python.

They live together: a routed part runs as an `_OffloadedForward`.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import warnings
from typing import Any

import torch
from torch import nn

from .._torch_private import compile_under_config, config_for_call, filter_fake_tensor_log, inlined_only, \
    is_tracing_error, leave_fullgraph_region, model_error, own_refusal, raised_within, restore_fullgraph_region, \
    short_reason, symbolic_sizes, user_frame
from .._transformers_private import hooks_see_the_active_collector
from ..backend import RegionTakesAFloat, RuntimeBackend
from ..errors import OffloadRefusal
from ..host_masters import GUARD_FILTER, HostMaster
from ..planning.auto import OffloadPlan
from ..planning.capture import own_frame
from ..runtime import OffloadRuntime
from .auto_plan import plan_component, plan_model
from .call_io import describe_inputs, inference_only, moved_to, tensor_leaves, user_stacklevel
from .kept import KeptWeights
from .state import OFFLOADED_CALLS, OWN_FORWARD, PART_OF, OffloadState
from .targets import entry_methods, modules_with_forwards, region_blocks, weight_holders

BOUNDARY = ("an offloaded model runs its own offloaded graph (compiled as its OffloadPolicy says); torch.compile "
            "around it cannot trace its weights without their transfers, so it is a graph boundary. Call it outside "
            "fullgraph=True regions, or compile it through its policy (compiler='inductor', fullgraph=True)")


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
        self.previous = function  # what the instance set as this method before offloading (given back at detach)
        self.forward = function if function is not None else getattr(type(module), method).__get__(module)
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
        OFFLOADED_CALLS.entered += 1
        try:
            try:
                return self._offloaded_call(*args, **kwargs)
            except Exception as failure:
                if not drop_regions(self._state, failure):
                    raise
                refused = failure
            out = self._offloaded_call(*args, **kwargs)  # its own error, if any, is the call's
            _warn_regions_off(self._state, refused)
            return out
        finally:
            OFFLOADED_CALLS.entered -= 1
            restore_fullgraph_region(outer)

    def _offloaded_call(self, *args: Any, **kwargs: Any) -> Any:
        state = self._state
        with state.lock:
            state.check_usable()
            if state.awaits_plan:
                if self._root and self._method == "forward":  # auto plans from the model's forward
                    plan_now(state, args, kwargs)
                elif state.runtime is None:
                    state.stream_before_plan()
                    if self._root:  # an entry method (a VAE's decode): a forward may never come to plan from
                        warnings.warn(
                            f"offload_compiler: strategy='auto' plans from {state.name}'s forward; its "
                            f"{self._method} runs before any plan, streaming every group one block at a time (the "
                            f"least device memory, not planned for device_budget_gb). To plan now, call "
                            f"m.plan(<forward's inputs>) (nothing runs), or use strategy='layerwise'",
                            UserWarning, stacklevel=user_stacklevel())
            elif state.unplanned:
                path = state.path_of(self._module)
                if path in state.unplanned:
                    plan_component(state, path, args, kwargs)
            runtime = state.runtime
            args, kwargs, needs_grad = self._inputs_on_device(args, kwargs, runtime.device)
            calls = runtime.graph_calls
            outer = state.begin_call(runtime, self._module, self._method)
            measure = state.plan.measure(runtime) if self._root and state.plan else contextlib.nullcontext()
            compiled = self._compiled or self._compile(runtime)
            try:
                with torch.no_grad(), config_for_call(compiled, state.limits), state.tracing_through(), measure:
                    out = self._run(compiled, args, kwargs)
            except BaseException as exc:
                if is_tracing_error(exc) or (outer and state.outside.end()):
                    # dynamo may have given up on a frame of this failed call (the model's own ``raise`` on a bad
                    # input, traced: "Failed to handle graph break gracefully") and run that code object without
                    # a graph from then on -- our forwards' frames included, so later calls would run their parts
                    # as graphs of their own, or read weights on demand: a call that failed with code run outside
                    # its graphs shows it. Fresh code objects for them (`own_frame`) at the next call.
                    state.recompile()
                raise
            finally:
                if outer:
                    runtime.release_held()  # copies its parts' graphs held (`_route_call`)
                    state.adopt_hooks()
            if runtime.graph_calls == calls and not _reads_are_counted(runtime):
                raise OffloadRefusal(  # a tensor-subclass weight is no host master (see `_reads_are_counted`)
                    f"{state.name} ran without its offloaded graph: torch.compile fell back to plain eager "
                    f"execution, so nothing was offloaded. Dynamo does this for a frame with a graph break inside a "
                    f"loop or past its recompile limit; TORCH_LOGS=graph_breaks,recompiles shows which")
            if outer:
                state.end_call()
        return inference_only(out) if needs_grad or self._trainable() else out

    def _trainable(self) -> bool:
        """The plain module's outputs would require grad for its weights: grad mode on, a weight requiring it."""
        return torch.is_grad_enabled() and any(p.requires_grad for p in self._module.parameters())

    _boundary = torch.compiler.disable(_call, reason=BOUNDARY)

    @inlined_only  # called from Python -- by the user, or from a frame dynamo runs without a graph -- it is a call
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() and _tracing_an_offloaded_call():  # our own capture: one graph, the
            return self.forward(*args, **kwargs)  # module's code traced into, no break per container
        return self._boundary(*args, **kwargs)  # the user's torch.compile around it: a graph boundary

    def _compile(self, runtime: OffloadRuntime) -> Any:
        """The module's forward compiled with our backend; dynamo's raised limits and logging calls traced as no-ops
        (`_torch_private.capture_config`) are in force while it compiles, not while it runs."""
        self._compiled = compile_under_config(own_frame(self.forward), backend=RuntimeBackend(runtime),
                                              fullgraph=runtime.policy.fullgraph,
                                              options=_PART_GUARD_OPTIONS)
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
        if not is_tracing_error(failure):  # raised while a graph ran: an op's own error (a dtype mix that fake
            if not isinstance(failure, OffloadRefusal):  # tensors accepted), torch's text as the plain model's
                failure.add_note(f"in {self._call_text(args, kwargs)}, run offloaded; the model is unchanged")
            raise failure
        error = model_error(failure)
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

    def _call_text(self, args: tuple, kwargs: dict) -> str:
        """The call as the user made it: ``Llama.model.layers.0.forward(hidden_states=Tensor[1, 5, 64] float32)``."""
        path = self._state.path_of(self._module)
        return f"{self._state.name}{'.' + path if path else ''}.{self._method}({describe_inputs(self.forward, args, kwargs)})"

    def _input_error(self, error: BaseException, exc: BaseException, args: tuple, kwargs: dict) -> BaseException:
        """The model's own error while tracing it (a wrong input shape), short: the module and method, the
        inputs it was given, what failed and where. Dynamo's full report is the error's ``offload_trace``."""
        module = self._module
        call = self._call_text(args, kwargs)
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
        model's would: `inference_only`)."""
        tensors = list(tensor_leaves((args, kwargs)))
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        if all(t.device == device for t in tensors):  # every call but a misplaced one: nothing to rebuild
            return args, kwargs, needs_grad
        args, kwargs, moved = moved_to(device, args, kwargs)
        if moved and not self._warned_inputs:
            self._warned_inputs = True
            warnings.warn(f"offload_compiler: inputs on {sorted(set(moved))} were moved to the compute device "
                          f"{device}; pass them on {device} to avoid the copy", RuntimeWarning,
                          stacklevel=user_stacklevel())
        return args, kwargs, needs_grad


def _reads_are_counted(runtime: OffloadRuntime) -> bool:
    """Whether every streamed weight is a host master, so that a call which ran none of its graphs still
    streamed what it read. Not yet masters: tensor-subclass weights (quantized, DTensor shards)."""
    return all(isinstance(slot.tensor, HostMaster) for group in runtime.groups if group.streamed
               for slot in group.slots)


@torch.compiler.assume_constant_result  # read once while dynamo traces, a constant of the graph with no guard
def _tracing_an_offloaded_call() -> bool:
    """Whether the graph dynamo traces now is one of our offloaded calls' (our backend: its graphs run only
    inside offloaded calls) rather than the user's ``torch.compile`` of code that calls a part. A constant of
    the graph, not a guard checked at each call."""
    return getattr(OFFLOADED_CALLS, "depth", 0) > 0


class RoutedPart(KeptWeights):
    """The class every other module holding offloaded weights (a block, a layer's projection, a tied ``lm_head``)
    gets while offloaded: a subclass of this and of its own class, one per class (`routed_class`), named like it.
    Where dynamo traces an offloaded call, its ``forward`` traces straight into the class's own (the graph fetches
    what it reads). Called from Python -- by hand (``m.model.layers[0](h)``), from a method of the model, from a
    frame of an offloaded call that dynamo runs without a graph (a graph break inside a loop) -- or met by the
    user's ``torch.compile`` (a graph boundary, as the model is), it runs the module's own offloaded graph,
    compiled at that first call: no route reads host memory.

    The routing is the class's, not an object's per module: every layer of a stack traces through the same
    code and class, so dynamo can reuse one captured block for all of them (``torch.compiler.nested_compile_region``)
    and guards nothing per module beyond what the plain model's graph guards. The forward is `_routed_forward`'s."""

    _offload_region = None  # the class's forward as a nested compile region (`routed_class(cls, region=True)`)

    def _compute_device(self) -> torch.device:
        return self.__dict__[PART_OF].policy.torch_device

    def _owning_offload(self) -> Any:
        return self.__dict__.get(PART_OF)

    def __deepcopy__(self, memo: dict) -> nn.Module:
        """A copy of a part (``copy.deepcopy(m.model.layers[0])``) is a plain module of its own class, its weights
        plain tensors in host memory holding copies of their values (ties within the copy kept)."""
        copied = object.__new__(base_class(type(self)))
        memo[id(self)] = copied
        copied.__dict__.update(self._plain_attributes(lambda value: copy.deepcopy(value, memo)))
        for table, parameter in ((copied._parameters, True), (copied._buffers, False)):
            for name, value in table.items():
                if isinstance(value, HostMaster):  # a copied master (its own copy of the bytes) -> plain, once
                    table[name] = memo.setdefault(("offload_plain", id(value)), _plain_tensor(value, parameter))
        return copied

    def __copy__(self) -> nn.Module:
        """A shallow copy (``copy.copy``) is a module of its own class sharing the part's submodules and weights
        (host masters: read outside an offloaded graph, they are fetched on demand)."""
        copied = object.__new__(base_class(type(self)))
        copied.__dict__.update(self._plain_attributes(lambda value: value))  # shared, as copy.copy shares them
        return copied

    def _plain_attributes(self, copy_value: Any) -> dict:
        own = self.__dict__.get(OWN_FORWARD)
        attributes = {name: copy_value(value) for name, value in self.__dict__.items()
                      if name not in (OWN_FORWARD, PART_OF)}
        if own is not None:
            attributes["forward"] = copy_value(own)
        return attributes

    def __reduce_ex__(self, protocol: int) -> Any:
        state = self.__dict__[PART_OF]
        raise TypeError(f"{type(self).__name__} is part of the offloaded {state.name}: pickle or "
                        f"torch.save() its state_dict(), or the model returned by remove_offload(m)")


def _plain_tensor(master: HostMaster, parameter: bool) -> torch.Tensor:
    """A copied master's bytes as a plain tensor (a parameter where it was one)."""
    return nn.Parameter(master.host, requires_grad=master.requires_grad) if parameter else master.host


def _routed_forward(traced: Any, region: Any = None) -> Any:
    """A routed class's forward. Where dynamo traces an offloaded call it traces straight into ``traced(self,
    ...)`` -- the class's own forward or `_own_forward` -- or, for a block under ``regional=True``, into its
    nested compile ``region`` where dynamo can reuse it (`_region_where_reusable`), chosen when the class was
    made, so the trace reads no attribute of the instance to choose (nor walks the class's MRO) and dynamo
    guards nothing per module for the choice. Called from Python (by hand, from a method of the model, from a
    frame of an offloaded call that dynamo runs without a graph), it runs the module's own offloaded graph."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() and _tracing_an_offloaded_call():
            if region is not None and _region_where_reusable(args, kwargs):
                return region(self, *args, **kwargs)  # called from here: no frame of ours between (see there)
            return traced(self, *args, **kwargs)
        return _route(self, *args, **kwargs)
    return inlined_only(forward)  # one code object for every routed class: marked once


def _own_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """What a part whose instance set its own ``forward`` before offloading runs where dynamo traces an offloaded
    call: that forward (kept aside by `OffloadState.route_part`)."""
    return module.__dict__[OWN_FORWARD](*args, **kwargs)


def _region_where_reusable(args: tuple, kwargs: dict) -> bool:
    """Whether a block traced as a nested compile region runs as the region where dynamo traces an offloaded
    call (dynamo could reuse it for the next block), rather than its code inline (it could not). Dynamo reuses a
    region only for calls whose inputs it can fingerprint (tensors, numbers, strings, None, modules, and tuples,
    lists and dicts of them); any other object -- a transformers KV cache, which every decoder layer also writes
    into -- makes it trace the region again at every block, paying on top of inline tracing the region's own
    costs (the body speculated as a subgraph, the inputs flattened through its traced pytree, the new graph
    compared with each one installed before), for no reuse. The choice reads only the types of the call's
    inputs: no guard per block. The region is called from the routed forward itself: with one more frame of ours
    between the block's call and the region (passing ``*args, **kwargs`` on), dynamo's fingerprint of the
    region's inputs took 20 ms per block of a tiny DiT against plain ``torch.compile``'s 12 (the first call 5 ms
    more per block; benchmarks/regional_phases.py), though it traced the same instructions."""
    return _fingerprintable(args) and _fingerprintable(kwargs.values())


_FINGERPRINTED = (torch.Tensor, bool, int, float, str, nn.Module)


def _fingerprintable(values: Any) -> bool:
    """Whether dynamo can fingerprint every one of ``values`` as a nested compile region's input (its
    ``classify_vt`` leaves, within tuples, lists and dicts). A plain loop: dynamo traces it at every block."""
    for value in values:
        if isinstance(value, (tuple, list)):
            if not _fingerprintable(value):
                return False
        elif isinstance(value, dict):
            if not _fingerprintable(value.values()):
                return False
        elif value is not None and not isinstance(value, _FINGERPRINTED):
            return False
    return True


_ROUTED: dict[tuple, type] = {}


def routed_class(cls: type, region: bool = False, own_forward: bool = False, structure: tuple | None = None) -> type:
    """The class a routed part of class ``cls`` gets: one per class (and ``region``, ``own_forward``), made once,
    with the class's names (in messages and repr, and for libraries that key what they know of a class on its
    name) and the signature of its forward (``inspect.signature(part.forward)``). ``region``: a block of a stack
    under ``OffloadPolicy(regional=True)``, traced as a nested compile region of its class and ``structure``
    (`targets.block_structure`): one region per class and structure, reused only for blocks built alike.
    ``own_forward``: the instance set a ``forward`` of its own before offloading, which it runs instead of the
    class's."""
    region = region and not own_forward
    key = (cls, region, own_forward, structure if region else None)
    if key not in _ROUTED:
        if own_forward:
            traced, region_forward = _own_forward, None
        elif region:
            traced, region_forward = cls.forward, torch.compiler.nested_compile_region(cls.forward)
        else:
            traced, region_forward = cls.forward, None
        forward = _routed_forward(traced, region_forward)
        forward.__name__ = forward.__qualname__ = "forward"
        try:
            forward.__signature__ = inspect.signature(cls.forward)
        except (TypeError, ValueError):  # no signature to give
            pass
        namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "forward": forward,
                     "_offload_region": region_forward}
        _ROUTED[key] = type(cls.__name__, (RoutedPart, cls), namespace)
    return _ROUTED[key]


def base_class(routed: type) -> type:
    """The module's own class, of a `routed_class` (its second base, after `RoutedPart`)."""
    return routed.__bases__[1]


def _route_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state = module.__dict__[PART_OF]
    routed = state.routed_forward(module, part_forward)
    outside = state.outside if state.call_depth else None
    if outside is None:  # by hand, outside any offloaded call
        with _collector_shown_by_hand():
            return routed(*args, **kwargs)
    before = outside.runtime.bytes_transferred  # within an offloaded call: said at its end (`Outside`)
    try:
        with outside.runtime.holding_copies():  # the next part's graph may read the same group
            return routed(*args, **kwargs)
    finally:
        outside.add_part(module, outside.runtime.bytes_transferred - before)


_route = torch.compiler.disable(_route_call, reason=BOUNDARY)


def _collector_shown_by_hand() -> Any:
    """A part called by hand has no transformers ``capture_outputs`` call around it, which would let its graph
    read the output collector in its hooks; shown here, the part is one graph (one fetch of its group) rather
    than a graph per hooked submodule. Only where this thread runs no offloaded call: so the lock it takes is
    never taken while this thread holds a model's lock (the order is always that lock, then the model's)."""
    if OFFLOADED_CALLS.entered:
        return contextlib.nullcontext()
    return hooks_see_the_active_collector()


def part_forward(module: nn.Module, state: OffloadState) -> "_OffloadedForward":
    """The offloaded forward a routed part runs when called from Python: the module's own, or the forward its
    instance set before offloading."""
    own = module.__dict__.get(OWN_FORWARD)
    return _OffloadedForward(module, state, function=own or super(RoutedPart, module).forward)


_PART_GUARD_OPTIONS = {"guard_filter_fn": GUARD_FILTER} if GUARD_FILTER is not None else {}  # a host master: by
#   its tensor metadata alone (see there); torch pops the key


class _QuietOwnErrors(logging.Filter):
    """Fake tensors log (to stderr) every op that fails while dynamo traces; inside an offloaded call such a
    failure becomes one short error (`_OffloadedForward._input_error`), so its log record is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return OFFLOADED_CALLS.entered == 0


filter_fake_tensor_log(_QuietOwnErrors())


# -- installation --------------------------------------------------------------------------------------------

def install_forwards(model: nn.Module, state: OffloadState) -> None:
    """The forward and entry methods (`ENTRY_METHODS`: a VAE's ``decode``) of the modules that run graphs of their
    own (`modules_with_forwards`) become `_OffloadedForward` objects; then every other module holding offloaded
    weights becomes a routed part (`RoutedPart`)."""
    for module in modules_with_forwards(model, state):
        if module in state.parts:  # ``auto``: routed until its plan made it a container or component
            state.unroute(module)
        for method in ("forward",) + entry_methods(module):
            if (module, method) not in state.forwards:
                own = module.__dict__.get(method)
                state.add_forward(module, method, _OffloadedForward(module, state, method, function=own))
    routed = {module for module, _ in state.forwards}
    regions = region_blocks(state, model)
    for module in weight_holders(state, model):
        if module in state.parts:  # ``auto``, planned now: its blocks may become regions
            if module in regions and type(module)._offload_region is None and OWN_FORWARD not in module.__dict__:
                state.reroute(module, routed_class(state.parts[module], region=True, structure=regions[module]))
        elif module not in routed and type(module).forward is not nn.Module.forward:
            own = "forward" in module.__dict__
            state.route_part(module, routed_class(type(module), region=module in regions, own_forward=own,
                                                  structure=regions.get(module)))


def drop_regions(state: OffloadState, failure: BaseException) -> bool:
    """``regional``: dynamo refused to trace a block as a nested compile region (Flux's single blocks return two
    views of one tensor: "aliasing during higher order op tracing") -- or failed otherwise where the model's own
    code raised nothing. The blocks are traced inline from then on, for every graph of the model; True if the
    call should be made again."""
    return is_tracing_error(failure) and state.drop_regions(routed_class)


def _warn_regions_off(state: OffloadState, refused: BaseException) -> None:
    """The call made again with the blocks inline succeeded: say once that regions are off, and why."""
    reason = raised_within(refused, RegionTakesAFloat) or short_reason(str(refused))
    warnings.warn(f"offload_compiler: regional compilation is off for {state.name}: dynamo could not trace its "
                  f"blocks as reusable regions ({reason}); each block is traced inline "
                  f"instead (a longer first capture, the same streaming)", UserWarning, stacklevel=user_stacklevel())


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
        own = module.__dict__.get(method)
        state.add_forward(module, method, _OffloadedForward(module, state, method, function=own))


def plan_now(state: OffloadState, args: tuple, kwargs: dict) -> OffloadPlan:
    """``auto``: plan from this call of the whole model (nothing runs), then build the runtime and the
    forwards of the chosen groups."""
    if state.plan is None:
        plan_model(state, args, kwargs)
        install_forwards(state.owner, state)
    return state.plan

