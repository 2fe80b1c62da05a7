"""The graph engine: a captured graph → schedule → insert transfers → verify → run eagerly or with inductor.

`RuntimeBackend` is the dynamo backend of one offloaded model; the public ``omni_offload`` backend
(`offload_compiler.offloaded`) offloads the model in place and then uses the same engine.
"""

from __future__ import annotations

import dataclasses
import traceback
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

from . import ops  # noqa: F401  (registers the transfer ops)
from .errors import OffloadRefusal
from .grouping import GroupSpec, plan_groups
from .lowering import compile_for_inductor, lower_for_eager, picker
from .passes.analysis import RoutedRead, collect_uses, routed_reads, weight_inputs
from .passes.routed import route_reads
from .passes.insert import insert_transfers
from .passes.schedule import Schedule, build_schedule
from .passes.slots import pool_bytes, slot_events
from .passes.verify import Verified, verify
from .policy import COMPONENT_STRATEGIES, OffloadPolicy
from .host_masters import HostMaster, OnDemand, host_of, release_masters, replace_tensors, with_host_masters
from .runtime import OffloadRuntime
from .storage import FilledBuckets

OFFLOAD_ENDED = ("this offload has ended: remove_offload() gave the model back; offload it again with "
                 "offload_compile(model, policy)")
MAX_VARIANTS = 1024  # per captured graph: weight sets it was called with (one per layer for a reused layer graph)


@dataclasses.dataclass(frozen=True)
class GraphPlan:
    """What the passes decided for one captured graph."""
    schedule: Schedule
    verified: Verified
    num_nodes: int
    carry_keys: frozenset[int] = frozenset()  # fetch keys carried from one call of the graph to the next
    pool_bytes: int = 0  # the device slots its streamed fetches land in (at least the streamed peak)
    routed: tuple[RoutedRead, ...] = ()  # expert weights fetched as the experts the router named (`passes.routed`)


# where each weight moved to the compute device by `_unmanaged_to_device` was before: model -> {(module, table,
# name): device}, kept across the runtimes one offload builds (``auto``), given back by `restore_unmanaged`
_MOVED: "weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, str, str], tuple[nn.Module, torch.device]]]" = \
    weakref.WeakKeyDictionary()


def _unmanaged_to_device(model: nn.Module, specs: list, policy: OffloadPolicy, move: bool
                         ) -> tuple[list[tuple], dict[int, torch.Tensor]]:
    """Weights in no group (outside the components; buffers with ``offload_buffers=False``) are not managed:
    they live on the compute device. Where each was is kept for `restore_unmanaged`. Returned, for undoing this
    call where building its runtime fails: the keys of the weights it moved (a runtime built again keeps the
    earlier ones' record), and the objects it replaced by new ones (a device ``.data =`` cannot move to), by
    the new one's id."""
    device = policy.torch_device
    managed = {id(w.tensor) for spec in specs for w in spec.weights}
    moved: dict[int, torch.Tensor] = {}
    before = _MOVED.setdefault(model, {})
    added: list[tuple] = []
    originals: dict[int, torch.Tensor] = {}
    for path, module in model.named_modules():
        for table in ("_parameters", "_buffers"):
            for name, tensor in getattr(module, table).items():
                if tensor is None or id(tensor) in managed or tensor.device == device:
                    continue
                if not move:
                    raise ValueError(f"{path + '.' if path else ''}{name} is outside the offloaded groups, so it must "
                                     f"live on {device}, but it is on {tensor.device}: move the model to {device} "
                                     f"before torch.compile, or use offload_compile")
                key = (id(module), table, name)
                if key not in before:
                    before[key] = (module, tensor.device)
                    added.append(key)
                if id(tensor) not in moved:
                    moved[id(tensor)] = _moved_to(tensor, device)
                    if moved[id(tensor)] is not None:
                        originals[id(moved[id(tensor)])] = tensor
    replace_tensors(model, {i: t for i, t in moved.items() if t is not None})
    return added, originals


def _moved_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """``tensor`` on ``device``: the same object where ``.data =`` can move it (CPU, CUDA), as ``nn.Module.to``
    keeps it (None returned); else a new tensor to put in its place, as ``nn.Module.to`` makes then (a
    PrivateUse1 device: Ascend's NPU, the simulated accelerator). Ties stay ties either way."""
    on_device = tensor.detach().to(device)
    try:
        tensor.data = on_device
        return None
    except RuntimeError:
        return nn.Parameter(on_device, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) \
            else on_device


def restore_unmanaged(model: nn.Module, keys: list[tuple] | None = None) -> None:
    """The undo of `_unmanaged_to_device` (at `remove_offload`): every weight it moved to the compute device goes
    back to the device it was on, with the values it has now; ``keys``: only those (what one call moved)."""
    moved: dict[int, torch.Tensor] = {}
    if keys is None:
        record = _MOVED.pop(model, {})
    else:
        kept = _MOVED.get(model, {})
        record = {key: kept.pop(key) for key in keys if key in kept}
        if not kept:
            _MOVED.pop(model, None)
    for (_, table, name), (module, device) in record.items():
        tensor = getattr(module, table).get(name)
        if tensor is not None and tensor.device != device and id(tensor) not in moved:
            moved[id(tensor)] = _moved_to(tensor, device)
    replace_tensors(model, {i: t for i, t in moved.items() if t is not None})


def weights_added_later(model: nn.Module, runtimes: list[OffloadRuntime]) -> dict[tuple, torch.Tensor]:
    """The parameters and buffers of ``model`` that none of ``runtimes`` took when offloading: added or replaced
    since (a fused projection, an adapter, a new ``nn.Parameter``), by (module, table, name). Read before the
    runtimes unpack, while their ids are those of the tensors in the model."""
    known = {i for rt in runtimes for i in (*rt.group_of, *rt.unmanaged_ids)}
    return {(module, table, name): tensor for module in model.modules()
            for table in ("_parameters", "_buffers") for name, tensor in getattr(module, table).items()
            if tensor is not None and id(tensor) not in known}


def move_weights_added_later(model: nn.Module, added: dict[tuple, torch.Tensor], device: torch.device,
                             units: list[nn.Module]) -> list[tuple[str, torch.device]]:
    """At `remove_offload`: weights added after offloading that sit on the compute ``device`` -- computed there
    from the fetched copies of offloaded weights, which are on that device (diffusers' ``fuse_qkv_projections``
    builds its fused Linear there) -- go to where the other weights of their unit (the model, or one component
    of a pipeline) are, where those are all on one other device: else the plain model would mix devices and
    could not run, and changing it un-offloaded then offloading again, the fix the refusal names, would fail.
    Returns their dotted names and where each went (for the warning)."""
    moved: dict[int, torch.Tensor] = {}
    names: list[tuple[str, torch.device]] = []
    added_ids = {id(t) for t in added.values()}
    for unit in units:
        paths = {id(sub): path for path, sub in unit.named_modules(remove_duplicate=False)}
        devices = {t.device for t in (*unit.parameters(), *unit.buffers()) if id(t) not in added_ids}
        if len(devices) != 1 or device in devices:
            continue
        target = next(iter(devices))
        for (module, table, name), tensor in added.items():
            if id(module) not in paths or getattr(module, table).get(name) is not tensor or tensor.device != device:
                continue
            names.append((f"{paths[id(module)] + '.' if paths[id(module)] else ''}{name}", target))
            if id(tensor) not in moved:
                moved[id(tensor)] = _moved_to(tensor, target)
    replace_tensors(model, {i: t for i, t in moved.items() if t is not None})
    return names


def build_runtime(model: nn.Module, policy: OffloadPolicy, pack_now: bool = True,
                  specs: list[GroupSpec] | None = None, name: str | None = None,
                  filled: FilledBuckets | None = None) -> OffloadRuntime:
    """The runtime of ``model`` under ``policy`` (groups from `plan_groups` unless a planner chose ``specs``):
    grouped weights packed into host buffers (now, or at their first fetch; ``filled``: the buffers a checkpoint
    was read into, taken as they are), the others moved to the device. ``name`` (in messages and plans)
    defaults to the model's class name."""
    specs = plan_groups(model, policy) if specs is None else specs
    moved, originals = _unmanaged_to_device(model, specs, policy, move=pack_now)
    on_demand = OnDemand()
    planned = specs
    try:
        if pack_now:  # see host_masters: no read outside an offloaded graph goes unseen, by construction
            specs = with_host_masters(model, specs, policy.torch_device, weakref.ref(on_demand))
        return OffloadRuntime(policy, specs, name or type(model).__name__, pack_now, model=model,
                              on_demand=on_demand, filled=filled)
    except BaseException:
        # one transaction (README, "Reliability"): a failure while building (the disk tier's file cannot be
        # sized, pinning or packing fails) leaves the model as it was. The runtime unpacked what it packed
        # (`OffloadRuntime.__init__`); the masters of a runtime that never got that far are released here
        if specs is not planned:
            held = {id(t) for module in model.modules() for t in (*module._parameters.values(),
                                                                  *module._buffers.values())}
            release_masters(model, {id(w.tensor): (w.tensor, host_of(w.tensor)) for spec in specs
                                    for w in spec.weights if isinstance(w.tensor, HostMaster) and id(w.tensor) in held})
        replace_tensors(model, originals)  # the very objects, their values untouched: nothing ran
        restore_unmanaged(model, moved)  # the others moved by ``.data``, moved back alike
        raise


def rewrite_graph(gm: fx.GraphModule, example_inputs: list, runtime: OffloadRuntime
                  ) -> tuple[fx.GraphModule, int, GraphPlan]:
    """The pure part: a captured graph and its runtime's layout → the rewritten, verified graph."""
    weights = weight_inputs(gm, example_inputs, runtime.group_of, lambda g, s: runtime.groups[g].slots[s].name)
    streamed = {g.index for g in runtime.groups if g.streamed}
    # groups this graph reads only by indices (a table's lookup, routed experts): their reads become routed
    # fetches of the rows named, outside the schedule
    routed = routed_reads(weights, streamed)
    if routed:
        gm, weights = route_reads(gm, weights, routed, runtime.id)
    uses, reads = collect_uses(gm, weights, streamed)
    policy = runtime.policy
    alternating = policy.strategy in COMPONENT_STRATEGIES
    # alternating: a component is alone on the device while it runs, so nothing is fetched ahead of it
    on_disk = frozenset(g.index for g in runtime.groups if g.on_disk)
    schedule = build_schedule(uses, 0 if alternating else policy.prefetch, carry=policy.prefetch_next_call,
                              read_ahead=on_disk)
    resident = {w.group for w in weights.values()} - streamed
    parked = _parked_instance(schedule, runtime)
    rewritten = insert_transfers(gm, weights, schedule, reads, resident, runtime.id, runtime.layout,
                                 runtime.new_fetch_key, parked, materialize_readers=policy.compiler == "inductor")
    group_bytes = {g.index: g.nbytes for g in runtime.groups}
    verified = verify(rewritten.graph_module, weights, group_bytes)
    events = slot_events(rewritten.graph_module)
    pooling = runtime.transfers.pooling(events)
    slots, sizes = pooling.plan(events, runtime.pool.sizes(), runtime.transfers.growable_slots())
    runtime.plan_slots(slots, pooling, sizes)
    routed_slots = runtime.transfers.plan_routed([r for rs in routed.values() for r in rs])
    return rewritten.graph_module, rewritten.num_outputs, GraphPlan(
        schedule, verified, len(gm.graph.nodes), rewritten.carry_keys,
        pool_bytes(slots, pooling.slot_class, sizes) + routed_slots,
        tuple(r for rs in routed.values() for r in rs))


class RuntimeBackend:
    """The backend of one offloaded model. Dynamo keeps backends in its code cache for the life of the
    process, so this holds the runtime weakly: dropping the model frees its weights."""

    def __init__(self, runtime: OffloadRuntime) -> None:
        self._runtime = weakref.ref(runtime)
        self.__name__ = f"offload_backend_{runtime.id}"
        self.device = runtime.device  # the compute device: dynamo traces host weights with inputs there

    def __call__(self, gm: fx.GraphModule, example_inputs: list, **_: Any) -> Callable:
        return compile_graph(gm, example_inputs, self._runtime())


def _parked_instance(schedule: Schedule, runtime: OffloadRuntime) -> frozenset[int]:
    """Latency-minimising alternation keeps the graph's last component on the device after the call."""
    if runtime.policy.strategy not in COMPONENT_STRATEGIES or not runtime.policy.keep_after_use:
        return frozenset()
    last = [i.index for i in schedule.instances if runtime.groups[i.group].exclusive][-1:]
    return frozenset(last)


def compile_graph(gm: fx.GraphModule, example_inputs: list, runtime: OffloadRuntime) -> Callable:
    return GraphRunner(gm, example_inputs, runtime)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of running a captured graph: its compiled form, and the group ids to remap (see GraphRunner)."""
    run: Callable
    num_outputs: int
    remap: dict[int, int] | None = None
    carry_keys: frozenset[int] = frozenset()
    plan_index: int = 0  # its plan in runtime.graph_plans (a remapped variant moves the same bytes as its base)


def _compile_variant(gm: fx.GraphModule, example_inputs: list, runtime: OffloadRuntime) -> Variant:
    _refuse_parameters_added_later(gm, example_inputs, runtime)
    _refuse_float_region_inputs(gm)
    new_gm, num_outputs, plan = rewrite_graph(gm, example_inputs, runtime)
    index = runtime.add_graph_plan(plan)
    if runtime.policy.compiler == "inductor":
        return Variant(compile_for_inductor(new_gm, example_inputs, runtime, num_outputs), num_outputs, None,
                       plan.carry_keys, index)
    # the graph's own forward: an op's error then propagates as raised, not also printed to stderr with an
    # excerpt of the generated code (what a GraphModule's call does), and one module call less per graph call
    return Variant(lower_for_eager(new_gm, runtime, num_outputs).forward, num_outputs, None, plan.carry_keys, index)


class GraphRunner:
    """Runs one captured graph. Dynamo may call the same graph with other weights of the same shapes (a
    layer's forward captured once and reused for every layer, after a graph break inside the layer), so the
    weights passed are checked on every call: the same weights run the graph as compiled; weights of another
    group with the same layout run it with the group ids remapped; anything else gets a graph of its own."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list, runtime: OffloadRuntime) -> None:
        self._gm = gm
        self._runtime = weakref.ref(runtime)
        positions = [i for i, value in enumerate(example_inputs) if isinstance(value, torch.Tensor) and (
            id(value) in runtime.group_of or isinstance(value, nn.Parameter))]
        self._weights_of = picker(positions)  # the weights passed, as a tuple, in one C call per graph call
        self._compiled_ids = self._ids(example_inputs)
        self._variants: dict[tuple, Variant] = {self._compiled_ids: _compile_variant(gm, example_inputs, runtime)}

    def _ids(self, args) -> tuple:
        return tuple(map(id, self._weights_of(args)))

    def _variant_for(self, args, ids: tuple, rt: OffloadRuntime) -> Variant:
        passed = list(self._weights_of(args))
        remap = rt.remap_between(passed, self._compiled_ids)
        if remap is not None:  # the same graph over other layers' weights: it carries nothing between calls
            base = self._variants[self._compiled_ids]
            variant = Variant(base.run, base.num_outputs, remap, plan_index=base.plan_index)
        else:
            _refuse_foreign_weights(passed, self._compiled_ids, rt)
            variant = _compile_variant(self._gm, list(args), rt)
        if len(self._variants) >= MAX_VARIANTS:  # forget the oldest, never the graph as compiled
            del self._variants[next(k for k in self._variants if k != self._compiled_ids)]
        self._variants[ids] = variant
        return variant

    def __call__(self, *args):
        rt = self._runtime()
        if rt is None:
            raise RuntimeError("this offloaded graph's model no longer exists (garbage-collected), yet dynamo called its "
                               "cached graph, e.g. for another model of its class: offload_compile that model instead")
        if rt.closed:  # another instance sharing this graph (the backend route's first) is told so by name
            _refuse_foreign_weights(list(self._weights_of(args)), self._compiled_ids, rt)
            raise OffloadRefusal(OFFLOAD_ENDED)
        with rt.lock:  # one call at a time: fetch keys and pending copies are per graph, not per thread
            ids = self._ids(args)
            variant = self._variants.get(ids) or self._variant_for(args, ids, rt)
            rt.begin_call(variant.plan_index, variant.carry_keys, variant.remap)
            try:
                out = variant.run(*args)
            except BaseException as exc:
                rt.abandon_pending()
                # the graph's frames in the traceback would keep its device copies alive as long as the
                # caller keeps the exception; the error itself (type, message, lines) is unchanged
                traceback.clear_frames(exc.__traceback__.tb_next if exc.__traceback__ else None)
                named = _lookup_past_its_table(self._gm, args, rt) if isinstance(exc, IndexError) else None
                if named is not None:
                    raise IndexError(named) from exc
                raise
            finally:
                rt.end_call()
        return out[0] if variant.num_outputs < 0 else tuple(out[:variant.num_outputs])


def _lookup_past_its_table(gm: fx.GraphModule, args: tuple, rt: OffloadRuntime) -> str | None:
    """After a call failed with an IndexError: torch's "index out of range in self" with the table named, where a
    lookup of the graph (``F.embedding(ids, w)``, ``ids`` an input of the graph) was given an index outside the
    table's rows -- negative, or past its end. A routed lookup names its table itself (`routed`); one fetched
    whole (tied to the output projection, a symbolic index size) fails inside torch's kernel, which names
    nothing. Checked only once the call failed: checking every call would read the indices on the host, a device
    synchronization per lookup."""
    inputs = {node: i for i, node in enumerate(gm.graph.find_nodes(op="placeholder"))}
    for node in gm.graph.find_nodes(op="call_function", target=torch.nn.functional.embedding):
        ids, table = (node.args + (None, None))[:2]
        if ids not in inputs or table not in inputs:
            continue
        ids, table = args[inputs[ids]], args[inputs[table]]
        if not isinstance(ids, torch.Tensor) or not isinstance(table, torch.Tensor) or not ids.numel():
            continue
        low, high, rows = int(ids.min()), int(ids.max()), table.shape[0]
        if low < 0 or high >= rows:
            where = rt.group_of.get(id(table))
            name = rt.groups[where[0]].slots[where[1]].name if where is not None else f"a {tuple(table.shape)} table"
            return f"index out of range in self: {name} has {rows} rows, an index named {low if low < 0 else high}"
    return None


def _refuse_foreign_weights(passed: list, compiled_ids: tuple, rt: OffloadRuntime) -> None:
    """A graph compiled over offloaded weights, called with weights this runtime does not hold: they would be
    read from wherever they are, un-offloaded. Dynamo does this for another instance of the same class (its
    compiled code is shared when the backend compares equal), and after a parameter was replaced."""
    for tensor, compiled_id in zip(passed, compiled_ids):
        if compiled_id in rt.group_of and id(tensor) not in rt.group_of:
            name = next((s.name for g in rt.groups for s in g.slots if id(s.tensor) == compiled_id), "a weight")
            raise OffloadRefusal(_not_held(rt, f"a weight in place of {name}"))


class RegionTakesAFloat(Exception):
    """A nested compile region (``regional=True``) of a captured graph takes a float that dynamo traced as a
    symbol (a number that changed between calls): torch's region call accepts tensors and integers only, and
    the graph would fail at every call. Raised while dynamo compiles, so the call is captured again with the
    blocks inline (`offloaded.forwards.drop_regions`)."""


def _refuse_float_region_inputs(gm: fx.GraphModule) -> None:
    region_call = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    for node in gm.graph.find_nodes(op="call_function", target=region_call) if region_call is not None else ():
        floats = [arg for arg in node.args[2:] if isinstance(arg, float) or isinstance(arg, fx.Node)
                  and isinstance(arg.meta.get("example_value"), (float, torch.SymFloat))]
        if floats:
            raise RegionTakesAFloat(f"a block's region takes a float that changed between calls ({floats[0]})")


def _refuse_parameters_added_later(gm: fx.GraphModule, example_inputs: list, rt: OffloadRuntime) -> None:
    """A graph reading a parameter that offloading never saw (a block appended, a module or parameter replaced,
    projections fused after offloading): it would read that parameter wherever it is, un-offloaded, and
    silently. Refused at the capture, so the graph is never cached: once the change is undone, the next call
    captures the model as it was and streams it."""
    new = [value for value in example_inputs if isinstance(value, nn.Parameter)
           and id(value) not in rt.group_of and id(value) not in rt.unmanaged_ids]
    if new:
        model = rt.model_ref() if rt.model_ref is not None else None
        names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)} if model else {}
        what = ", ".join(names.get(id(p), f"a {tuple(p.shape)} parameter") for p in new[:4]) + \
            (" ..." if len(new) > 4 else "")
        if not any(id(p) in names for p in new):  # none is the model's: another instance of its class
            raise OffloadRefusal(_not_held(rt, what))
        on_device = sum(p.device == rt.device != torch.device("cpu") for p in new)
        where = (f"; {on_device} of them on {rt.device}, the offloaded weights' device, where code building weights "
                 f"from them puts them" if on_device else "")
        raise OffloadRefusal(
            f"{rt.model_name}'s offloaded graph was called with {what}, which offloading does not hold: weights "
            f"added to the model after offloading (a module added or replaced, a new nn.Parameter assigned, "
            f"projections fused from the offloaded weights, as diffusers' fuse_qkv_projections() does{where}). "
            f"They would be read from wherever they are, un-offloaded. The offloaded model is otherwise unchanged: "
            f"undo the change (remove what was added; fused projections: unfuse_qkv_projections()) and it runs offloaded again; or make "
            f"such changes before offload_compile; to keep it, m = remove_offload(m) (it moves weights added on "
            f"{rt.device} to where the model's weights are), change the model there if needed, then "
            f"offload_compile(m, policy). To change weights in place, assign p.data = new_tensor or use "
            f"load_state_dict")


def _not_held(rt: OffloadRuntime, what: str) -> str:
    return (f"{rt.model_name}'s offloaded graph was called with {what}, which offloading does not hold: it would be "
            f"read from wherever it is, un-offloaded. Either the model changed after offloading (a module added or "
            f"replaced, a new nn.Parameter assigned): change it un-offloaded, m = remove_offload(m), then "
            f"offload_compile(m, policy) (to change weights in place, assign p.data = new_tensor or load_state_dict); "
            f"or this is another {rt.model_name}, which dynamo called this model's compiled code for: compile that "
            f"one too, torch.compile(model, backend='omni_offload', options=...), or offload_compile(model, policy)")
