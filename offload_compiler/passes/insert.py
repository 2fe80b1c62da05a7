"""Rewrite a captured graph so every offloaded weight is read from a fetched device copy.

Order is carried by data (DESIGN.md): each prefetch takes the previous prefetch's token and the tokens of
the evicts emitted since it; each wait takes the newest prefetch token and the evicts emitted since the last
wait; each evict takes the fetched views and every node that reads them. Tokens nobody consumes, and every fetched
or resident view, become extra graph outputs that the caller drops: nothing is dead code, and the views, which
are fixed device slots, are never reused for another value. The lowerings (`lowering`, `passes.fuse`) keep what
their compiler needs of this.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from ..subclasses import is_traceable_subclass, plain_leaves, rebuild_weight
from .analysis import Reads, WeightInput, _value
from .schedule import ADOPT, CARRY, FETCH, Schedule

OPS = torch.ops.offload_compiler


@dataclasses.dataclass(frozen=True)
class Rewritten:
    graph_module: fx.GraphModule
    num_outputs: int  # outputs of the original graph; the rest are tokens and resident buffers
    carry_keys: frozenset[int] = frozenset()  # fetch keys whose copies this graph prefetches for its next call


LeafLayout = tuple[int, tuple[int, ...], tuple[int, ...], int]  # bucket, shape, stride, offset
# group -> per weight slot: its leaves (one for a plain weight; a subclass weight's inner tensors), and whether
# the weight is a subclass rebuilt around them
Layout = dict[int, list[tuple[tuple[LeafLayout, ...], bool]]]


def _weight_views(graph: fx.Graph, fetched: fx.Node, group: int, slots: set[int], layout: Layout,
                  runtime_id: int = 0) -> tuple[list[fx.Node], dict[int, fx.Node]]:
    """The fetch op's flat device buffers (one per dtype: separate allocations, so the op's outputs alias
    nothing) and, over them, the weight of each slot this graph reads: a view per leaf, and around a subclass
    weight's leaves the subclass rebuilt (`rebuild_weight`: quantized weights, DTensors)."""
    n_buckets = 1 + max(leaf[0] for leaves, _ in layout[group] for leaf in leaves)
    items = [graph.call_function(operator.getitem, (fetched, b)) for b in range(n_buckets)]
    views = {}
    for slot in sorted(slots):
        leaves, rebuilt = layout[group][slot]
        leaf_views = [graph.call_function(torch.ops.aten.as_strided.default,
                                          (items[bucket], list(shape), list(stride), offset))
                      for bucket, shape, stride, offset in leaves]
        views[slot] = (graph.call_function(rebuild_weight, (leaf_views, runtime_id, group, slot)) if rebuilt
                       else leaf_views[0])
        views[slot].meta["offload_slot"] = (group, slot)
    return items, views


def _plain_readers(graph: fx.Graph, leaves: list[fx.Node]) -> list[fx.Node]:
    """The evict takes plain tensors: a reader whose value is a subclass (a DTensor result) is ordered through
    its inner tensors (`plain_leaves`, no computation)."""
    plain = []
    for leaf in leaves:
        value = _value(leaf)
        if not isinstance(value, torch.Tensor):
            # a reader with no tensor result: ``x[mask] = weight`` (operator.setitem) wrote the weight into x, so
            # the evict is ordered after the write through x (functionalized, x after the write is its new value)
            plain.extend(a for a in leaf.args[:1] if leaf.target is operator.setitem and isinstance(a, fx.Node)
                         and isinstance(_value(a), torch.Tensor))
        elif is_traceable_subclass(value):
            parts = graph.call_function(plain_leaves, (leaf,))
            plain.extend(graph.call_function(operator.getitem, (parts, i)) for i in range(len(plain_leaves(value))))
        else:
            plain.append(leaf)
    return plain


def needs_materializing(reader: fx.Node) -> bool:
    """Under inductor every weight reader with a tensor value is copied (`ops.materialize`, an extern call) and
    later nodes read the copy (a linear of one dtype instead becomes our opaque linear: `is_opaque_linear`).
    Which ops get a buffer of their own and which inductor re-computes inside a
    consumer's kernel (a pointwise reader, a gather, a matmul with one row decomposed into a product and a sum, a
    bias added in the next kernel) is inductor's choice, made per shape, device and config; a re-computation may
    run after the weight's evict and read a freed slot. With the copy the order holds whatever inductor chooses.
    A tensor written in place (``x[mask] = weight``: a reader with no value of its own) is ordered before the
    evict through ``x``; a reader whose value is a tensor subclass (a DTensor result) through its inner tensors
    (`_plain_readers`)."""
    value = _value(reader)
    return (reader.op in ("call_function", "call_method") and isinstance(value, torch.Tensor)
            and not is_traceable_subclass(value))


_LINEARS = (torch.nn.functional.linear,)  # how dynamo's graphs call ``nn.Linear`` and ``F.linear``
_LINEAR_ARGS = ("input", "weight", "bias")


def _linear_args(node: fx.Node) -> list | None:
    """A linear's (input, weight[, bias]) as positional arguments; None for any other node."""
    if node.op != "call_function" or node.target not in _LINEARS or set(node.kwargs) - set(_LINEAR_ARGS):
        return None
    args = list(node.args) + [node.kwargs[name] for name in _LINEAR_ARGS[len(node.args):] if name in node.kwargs]
    return args if 2 <= len(args) <= 3 else None


def is_opaque_linear(reader: fx.Node) -> bool:
    """A linear reader (``F.linear``: every ``nn.Linear``) whose inputs and value are plain tensors of one dtype
    -- so no autocast region casts inside it -- becomes our opaque `ops.linear` instead of being copied: its
    result is then a buffer of its own by construction, and no copy is needed (7 of a Llama layer's 9 readers)."""
    args = _linear_args(reader)
    if args is None:
        return False
    values = [_value(a) for a in args if a is not None] + [_value(reader)]
    return (all(isinstance(v, torch.Tensor) and not is_traceable_subclass(v) for v in values)
            and len({v.dtype for v in values}) == 1)


def insert_transfers(gm: fx.GraphModule, weights: dict[fx.Node, WeightInput], schedule: Schedule,
                     reads: dict[tuple[fx.Node, int], list[Reads]], resident_groups: set[int],
                     runtime_id: int, layout: Layout, fetch_key, park: frozenset[int] = frozenset(),
                     materialize_readers: bool = False) -> Rewritten:
    """``materialize_readers`` (inductor): later nodes read a copy (`ops.materialize`) of each streamed weight
    reader that inductor could re-compute after the evict, made right after the reader."""
    nodes = list(gm.graph.nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    instance_of = schedule.instance_of()
    slots_in_graph: dict[int, set[int]] = {}
    for w in weights.values():
        slots_in_graph.setdefault(w.group, set()).add(w.slot)
    to_materialize = {leaf for rs in reads.values() for r in rs for leaf in r.leaves if needs_materializing(leaf)
                      } if materialize_readers else set()
    to_materialize |= {view for rs in reads.values() for r in rs for view in r.escapes}  # out of the slot

    prefetch_of = {}
    for inst in schedule.instances:
        prefetch_of.setdefault(schedule.prefetch_at[inst.index], []).append(inst)
    waits_at: dict[int, list] = {}
    evicts_at: dict[int, list] = {}
    for inst in schedule.instances:
        waits_at.setdefault(inst.start, []).append(inst)
        evicts_at.setdefault(inst.end, []).append(inst)

    keys = {inst.index: fetch_key() for inst in schedule.instances}
    carried = schedule.carried
    carry_of: dict[int, list[int]] = {}
    for index, at in schedule.carry_at:
        carry_of.setdefault(at, []).append(index)
    last_prefetch: fx.Node | None = None
    evicts_since: list[fx.Node] = []  # since the last prefetch
    evicts_since_wait: list[fx.Node] = []
    fetched: dict[int, tuple[list[fx.Node], dict[int, fx.Node]]] = {}  # instance -> (fetched views, slot -> view)
    resident_views: dict[int, dict[int, fx.Node]] = {}
    slot_views: list[fx.Node] = []  # every view of a device slot: graph outputs
    tokens: list[fx.Node] = []

    def emit_resident() -> None:
        for group in sorted(resident_groups & set(slots_in_graph)):
            buffers = graph.call_function(OPS.resident.default, (runtime_id, group))
            items, resident_views[group] = _weight_views(graph, buffers, group, slots_in_graph[group], layout,
                                                         runtime_id)
            slot_views.extend(items)

    def emit_prefetch(inst, mode: int) -> None:
        nonlocal last_prefetch, evicts_since
        deps = ([last_prefetch] if last_prefetch is not None else []) + evicts_since
        last_prefetch = graph.call_function(OPS.prefetch.default,
                                            (runtime_id, inst.group, keys[inst.index], deps, mode))
        tokens.append(last_prefetch)
        evicts_since = []

    def weight_arg(user: fx.Node, arg: fx.Node) -> fx.Node:
        w = weights[arg]
        if w.group in resident_views:
            return resident_views[w.group][w.slot]
        return fetched[instance_of[(user, w.group)].index][1][w.slot]

    emitted_resident = False
    for position, node in enumerate(nodes):
        if node.op != "placeholder" and not emitted_resident:
            emit_resident()
            emitted_resident = True
        for inst in waits_at.get(position, []):
            for ahead in prefetch_of.get(inst.index, []):
                emit_prefetch(ahead, ADOPT if ahead.index in carried else FETCH)
            for index in carry_of.get(inst.index, []):
                emit_prefetch(schedule.instances[index], CARRY)
            # the evicts before this wait too: with no prefetch after them, nothing else would order them
            buffers = graph.call_function(OPS.wait.default, (runtime_id, inst.group, keys[inst.index],
                                                             [last_prefetch] + evicts_since_wait))
            evicts_since_wait = []
            fetched[inst.index] = _weight_views(graph, buffers, inst.group, slots_in_graph[inst.group], layout,
                                                runtime_id)
            slot_views.extend(fetched[inst.index][0])
        if node.op == "output":
            for index in carry_of.get(len(schedule.instances), []):
                emit_prefetch(schedule.instances[index], CARRY)
            break
        env[node] = graph.node_copy(
            node, lambda arg: weight_arg(node, arg) if arg in weights else env[arg])
        if node in to_materialize and is_opaque_linear(node):
            made = env[node]
            made.target, made.args, made.kwargs = OPS.linear.default, tuple(_linear_args(made)), {}
        elif node in to_materialize:  # the evict follows the copy: under inductor the reader itself may be no
            copied = graph.call_function(OPS.materialize.default, (env[node],))  # buffer but a view of the weight
            copied.meta["example_value"] = _value(node)
            env[node] = copied
        for inst in evicts_at.get(position, []):
            items, _ = fetched[inst.index]
            rs = [r for use in inst.uses for r in reads[use.key]]
            leaves = _plain_readers(graph, list(dict.fromkeys(env[leaf] for r in rs
                                                              for leaf in (*r.leaves, *r.escapes))))
            parked = inst.index in park
            poison = not parked and not any(r.unordered for r in rs)
            token = graph.call_function(OPS.evict.default, (runtime_id, inst.group, poison, items, leaves, parked))
            tokens.append(token)
            evicts_since.append(token)
            evicts_since_wait.append(token)

    output = nodes[-1]
    original = fx.map_arg(output.args[0], lambda arg: weight_arg(output, arg) if arg in weights else env[arg])
    is_seq = isinstance(original, (tuple, list))
    outputs = list(original) if is_seq else [original]
    extras = [t for t in tokens if not t.users] + slot_views
    graph.output(tuple(outputs + extras))
    new_gm = fx.GraphModule(gm, graph)
    new_gm.meta.update(gm.meta)
    return Rewritten(new_gm, len(outputs) if is_seq else -1, frozenset(keys[i] for i in carried))
