"""`OffloadState`: everything offloading attached to one model (or pipeline), and its lifecycle (`Phase`).

Every change of the state is a method here: the other modules of the package read its fields and call these.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import threading
import warnings
from typing import Any, Callable, Iterator

from torch import nn

from .._torch_private import capture_config, compiled_module_of
from ..backend import OFFLOAD_ENDED, build_runtime, move_weights_added_later, restore_unmanaged, weights_added_later
from ..components import PipelineModules
from ..errors import OffloadRefusal
from ..planning.auto import OffloadPlan, planned_runtime
from ..policy import OffloadPolicy
from ..runtime import OffloadRuntime
from .call_io import user_stacklevel
from .hooks import HOOKS_REFUSED, HookWatch
from .outside import Outside, size_text
from .pipeline import pipeline_runtime

STATE_ATTR = "_offload_state"
OWN_FORWARD = "_offload_own_forward"  # a routed part's forward set on its instance before offloading
PART_OF = "_offload_part_of"  # the `OffloadState` a routed part belongs to


class Phase(enum.Enum):
    """Where an offload is in its life. ``PENDING``: the state exists and `state_of` finds it, but no class was
    swapped yet (the backend route until its first graph runs). ``ATTACHED``: classes swapped and forwards
    installed; every call runs offloaded graphs. ``DETACHED``: `OffloadState.detach` gave the model back; every
    handle to this state refuses to run. PENDING -> ATTACHED -> DETACHED, or PENDING -> DETACHED."""
    PENDING = "pending"
    ATTACHED = "attached"
    DETACHED = "detached"


class _CallDepth(threading.local):
    depth = 0  # how deep in offloaded calls this thread is (`OffloadState.tracing_through`)
    entered = 0  # `_OffloadedForward._call`s running in this thread, planning before a call's start included


OFFLOADED_CALLS = _CallDepth()


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
    parts: dict = dataclasses.field(default_factory=dict)  # routed part -> its class before offloading: the
    #   other modules holding weights (`route_part`)
    part_forwards: dict = dataclasses.field(default_factory=dict)  # routed part -> the `_OffloadedForward` it
    #   runs when called from Python (`routed_forward`)
    regions: bool = True  # ``regional``: blocks may still be routed as nested compile regions (`drop_regions`)
    phase: Phase = Phase.PENDING
    call_depth: int = 0  # offloaded calls (and captures) running now: a part called from Python inside a call
    #   adds to that call's `Outside`, and hooks are checked only outside calls
    outside: Outside | None = None  # what the current offloaded call read outside its own graphs (`Outside`)
    traced_runtime: OffloadRuntime | None = None  # the backend route's first runtime (`use_runtime_with_masters`)
    warned_outside: bool = False  # the one warning that part of a call ran outside its graphs was given
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    limits: Any = dataclasses.field(default_factory=capture_config)  # entered around a call only where its
    #   compiles cannot carry it themselves (`_torch_private.config_for_call`)

    def __post_init__(self) -> None:
        if self.modules is None and isinstance(self.owner, nn.Module):
            self.modules = self.owner

    @property
    def name(self) -> str:
        return type(self.owner).__name__

    def path_of(self, module: nn.Module) -> str:
        """The dotted path of ``module`` in the offloaded model (or among a pipeline's components)."""
        root = self.modules if self.modules is not None else nn.Module()
        return next((name for name, sub in root.named_modules() if sub is module), "")

    # -- lifecycle ----------------------------------------------------------------------------------------

    def publish(self) -> None:
        """Make this the state that `state_of` finds on the owner."""
        self.owner.__dict__[STATE_ATTR] = self

    def attach_module(self, module: nn.Module, offloaded_class: type) -> None:
        """Swap ``module``'s class for ``offloaded_class`` and watch the hook dicts of every module in it."""
        self.classes.append((module, type(module)))
        module.__class__ = offloaded_class
        module.__dict__[STATE_ATTR] = self
        for sub in module.modules():
            self.hooks.add(sub)
        self.phase = Phase.ATTACHED

    def add_forward(self, module: nn.Module, method: str, forward: Any) -> None:
        """Install ``forward`` (an `_OffloadedForward`) as ``module.method``."""
        self.forwards[(module, method)] = forward
        module.__dict__[method] = forward

    def route_part(self, module: nn.Module, routed_class: type) -> None:
        """Swap ``module``'s class for ``routed_class`` (its `RoutedPart` class); a forward its instance set before
        offloading is kept aside (the routed class runs it) and given back at detach."""
        own = module.__dict__.pop("forward", None)
        if own is not None:
            module.__dict__[OWN_FORWARD] = own
        module.__dict__[PART_OF] = self
        self.parts[module] = type(module)
        module.__class__ = routed_class

    def reroute(self, module: nn.Module, routed_class: type) -> None:
        """Another routed class for routed part ``module`` (a nested compile region, or no longer one)."""
        module.__class__ = routed_class

    def unroute(self, module: nn.Module) -> None:
        """Give a routed part its class (and its own forward) back."""
        module.__class__ = self.parts.pop(module)
        self.part_forwards.pop(module, None)
        module.__dict__.pop(PART_OF, None)
        own = module.__dict__.pop(OWN_FORWARD, None)
        if own is not None:
            module.__dict__["forward"] = own

    def drop_regions(self, plain_class: Callable[[type], type]) -> bool:
        """``regional`` refused by dynamo: every routed part traced as a nested compile region gets its plain routed
        class (``plain_class(its class)``), no later part is made one, and every forward compiles again. Whether
        there were any."""
        regions = [module for module in self.parts if type(module)._offload_region is not None]
        self.regions = False
        for module in regions:
            self.reroute(module, plain_class(self.parts[module]))
        if regions:
            self.recompile()
        return bool(regions)

    def routed_forward(self, module: nn.Module, make: Callable[[nn.Module, "OffloadState"], Any]) -> Any:
        """What routed part ``module`` runs when called from Python (an `_OffloadedForward`, ``make(module, self)``),
        made at its first such call."""
        forward = self.part_forwards.get(module)
        if forward is None:
            forward = self.part_forwards[module] = make(module, self)
        return forward

    def detach(self, copy_back: bool = True) -> Any:
        """Undo offloading: weights get their own storage (and layout) back, classes, forwards and hook dicts are
        restored, device copies dropped. Every handle to the old offload then refuses to run. ``copy_back=False``
        (a failed load from a checkpoint, whose caller gives back the tensors the model held): the weights are
        left as they are, for the caller to replace (`HostStore.unpack`)."""
        with self.lock:
            runtimes = [rt for rt in (self.runtime, self.traced_runtime) if rt is not None]
            added = weights_added_later(self.modules, runtimes) if self.runtime is not None \
                and self.modules is not None else {}
            if self.runtime is not None:
                self.runtime.unpack(copy_back)
            for (module, method), forward in self.forwards.items():
                module.__dict__.pop(method, None)
                if forward.previous is not None:
                    module.__dict__[method] = forward.previous
            for module in list(self.parts):
                self.unroute(module)
            for module, cls in self.classes:
                module.__class__ = cls
                module.__dict__.pop(STATE_ATTR, None)
            if self.modules is not None:  # the weights moved to the compute device go back where they were
                restore_unmanaged(self.modules)
            if added:
                self._move_weights_added_later(added)
            self.owner.__dict__.pop(STATE_ATTR, None)
            self.phase = Phase.DETACHED
            return self.owner

    def _move_weights_added_later(self, added: dict) -> None:
        """See `move_weights_added_later`; said in a warning, since the model now differs from what was offloaded."""
        units = list(self.modules.children()) if isinstance(self.modules, PipelineModules) else [self.modules]
        moved = move_weights_added_later(self.modules, added, self.runtime.device, units)
        if moved:
            to = sorted({str(target) for _, target in moved})
            names = [name for name, _ in moved]
            warnings.warn(f"remove_offload({self.name}): {len(names)} weight(s) added after offloading were on "
                          f"{self.runtime.device}, the offloaded weights' device, where code building weights from "
                          f"them puts them (fused projections: diffusers' fuse_qkv_projections()): moved to {', '.join(to)}, where the "
                          f"model's other weights are, so that the plain model runs: "
                          f"{', '.join(names[:6])}{' ...' if len(names) > 6 else ''}", stacklevel=user_stacklevel())

    def check_usable(self) -> None:
        if self.phase is Phase.DETACHED:
            raise OffloadRefusal(OFFLOAD_ENDED)
        changed = None if self.call_depth else self.hooks.change()  # during a call: the model's own (`adopt_hooks`)
        if changed is not None:
            raise OffloadRefusal(HOOKS_REFUSED.format(model=self.name, action=changed))

    # -- runtimes -----------------------------------------------------------------------------------------

    @property
    def awaits_plan(self) -> bool:
        """``auto`` on a model that no whole call has planned yet (``generate`` of an encoder-decoder calls its
        encoder first): its parts stream meanwhile (`stream_before_plan`)."""
        return self.policy.strategy == "auto" and self.plan is None and self.modules is self.owner

    def stream_before_plan(self) -> None:
        """``auto``: a part is called before the whole model planned. Until the plan, every group streams one
        block at a time, prefetching one: the least device memory any plan of the model needs."""
        self.runtime = build_runtime(self.owner, self.policy.replace(blocks_per_group=1, prefetch=1,
                                                                     prefetch_next_call=False))

    def release_runtime_before_plan(self) -> OffloadRuntime | None:
        """``auto`` is about to plan: the runtime its parts streamed on before (`stream_before_plan`), if any, gives
        the weights back (the planner traces the plain model) and is returned, for `planned` to count on from."""
        before, self.runtime = self.runtime, None
        if before is not None:
            before.unpack()
        return before

    def planned(self, plan: OffloadPlan, before: OffloadRuntime | None = None) -> None:
        """``auto`` on a model: its runtime, built as ``plan`` says; its stats count on from ``before`` (the runtime
        parts streamed on before the plan), whose compiled forwards compile again."""
        self.runtime = planned_runtime(self.owner, self.policy, plan)
        self.plan = plan
        if before is not None:
            self.runtime.continue_stats(before)
            self.recompile()

    def component_planned(self, path: str, plan: OffloadPlan) -> None:
        """``auto`` on a pipeline: denoiser ``path`` is planned; the runtime is built again with the planned groups
        (the graphs compiled so far, the encoders', are compiled again at their next call)."""
        self.plans[path] = plan
        self.plan = self.plan or plan
        self.unplanned.remove(path)
        self.runtime.unpack()  # before the new runtime packs the same weights
        self.runtime = pipeline_runtime(self.modules, self.policy, self.name, self.plans)
        self.recompile()

    def use_runtime_with_masters(self) -> None:
        """After the backend route's first graph ran: its runtime (over the plain weights dynamo traced) gives the
        weights their own storage back, and a runtime with host masters takes its place, as `offload_compile`
        builds it -- so that on this route too a read outside an offloaded graph is fetched on demand and counted.
        The first graph's runtime stays referenced: dynamo may call that graph for another instance of the class
        sharing its code, which it refuses by name (`backend._refuse_foreign_weights`)."""
        traced = self.runtime
        traced.unpack()
        self.runtime = build_runtime(self.owner, traced.policy, name=traced.model_name)
        self.runtime.continue_stats(traced)
        self.traced_runtime = traced

    def recompile(self) -> None:
        """Every offloaded forward compiles again at its next call (hooks changed, or the runtime was rebuilt)."""
        for forward in self.forwards.values():
            forward.recompile()
        self.part_forwards.clear()

    # -- calls --------------------------------------------------------------------------------------------

    def begin_call(self, runtime: OffloadRuntime, module: nn.Module, method: str) -> bool:
        """An offloaded call of ``module.method`` starts; whether it is the outermost one, which measures what the
        whole call reads outside its graphs (a part called from a frame run without a graph adds to its
        caller's)."""
        if self.call_depth:
            return False
        self.outside = Outside(runtime, module, method)
        return True

    def end_call(self) -> None:
        """The outermost offloaded call ended: say once what it read outside its graphs."""
        self._warn_outside(self.outside.end())

    @contextlib.contextmanager
    def tracing_through(self) -> Iterator[None]:
        """While our own graph is captured or run, dynamo traces into the installed forwards and routed parts
        (`forwards._tracing_an_offloaded_call`), and nothing is refused: the graph fetches what it reads."""
        self.call_depth += 1
        OFFLOADED_CALLS.depth += 1
        try:
            yield
        finally:
            OFFLOADED_CALLS.depth -= 1
            self.call_depth -= 1

    def adopt_hooks(self) -> None:
        """At the end of an offloaded call: hooks that the model's own forward registered or removed during it are
        the model's (transformers installs its output-capturing hooks at the first call with
        ``output_hidden_states=True`` or ``output_attentions=True``); that call's graph was traced with them. They
        are taken as the model's hooks, and the graphs captured before them are captured again at their next call
        (dynamo does not guard hooks, so those graphs would silently skip them)."""
        if self.hooks.change() is not None:
            self.hooks.accept()
            self.recompile()

    def _warn_outside(self, outside: Outside) -> None:
        """Once per model, at the end of the first offloaded call that read weights outside its own graphs:
        code dynamo ran without a graph (a graph break inside a loop, a frame past its recompile limit). It still
        streamed -- the modules it called as their own graphs, the weights it computed with on demand, op by op
        (host masters) -- and this says what that cost, as measured, and the fix."""
        if self.warned_outside or not outside:
            return
        self.warned_outside = True
        path = self.path_of(outside.module)
        caller = f"{self.name}{'.' + path if path else ''}'s {outside.method}"
        what = []
        if outside.part is not None:
            what.append(f"the modules it called, such as {self.path_of(outside.part) or type(outside.part).__name__}, "
                        f"each ran as their own offloaded graph ({size_text(outside.part_bytes)} fetched), with no "
                        f"prefetch ahead and a dispatch per module")
        if outside.on_demand_ops:
            what.append(f"{outside.on_demand_weights} weights it computed with directly were fetched on demand for "
                        f"each op ({size_text(outside.on_demand_bytes)} in {outside.on_demand_ops} ops, "
                        f"offload_stats(m).on_demand_bytes)")
        warnings.warn(
            f"offload_compiler: part of {caller} ran outside its offloaded graphs (dynamo ran it "
            f"without a graph: a graph break inside a loop, or a frame past its recompile limit); it still "
            f"streamed: {'; '.join(what)}. Slower, like a hook-based offloader, for that code only. Make that code "
            f"traceable to stream it within one graph (TORCH_LOGS=graph_breaks shows where)", UserWarning,
            stacklevel=user_stacklevel())


def state_of(obj: Any) -> OffloadState | None:
    """The one way to the offload state: on the model (or pipeline) itself, through a torch.compile wrapper."""
    return getattr(compiled_module_of(obj), "__dict__", {}).get(STATE_ATTR)
