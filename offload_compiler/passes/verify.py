"""Check a rewritten graph before it runs: no compute op may read a weight that is not fetched, and every
reader of a fetched copy must be ordered (by data) before that copy's evict. Also computes the static peak
of device weight bytes of the schedule, which the runtime's ledger must reproduce."""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from ..subclasses import plain_leaves
from .analysis import WeightInput, _storage, _value, readers
from .schedule import ADOPT, CARRY, FETCH

OPS = torch.ops.offload_compiler


class ScheduleError(RuntimeError):
    """The rewritten graph could read a weight that is not on the device."""


@dataclasses.dataclass(frozen=True)
class Verified:
    streamed_peak_bytes: int
    resident_bytes: int
    fetches: int
    carried_bytes: int = 0  # prefetched for the next call: on the device between calls

    @property
    def peak_bytes(self) -> int:
        return self.streamed_peak_bytes + self.resident_bytes


def _fetch_node(view: fx.Node) -> fx.Node:
    node = view  # [rebuild_weight(][as_strided(]getitem(fetch, bucket)...[)]
    while node.target is not operator.getitem:
        node = node.all_input_nodes[0]
    return node.args[0]


def _reader_of(evict_input: fx.Node) -> fx.Node:
    """An evict's input is a reader, its copy (`ops.materialize`), or an inner tensor of a subclass-valued reader
    (getitem(plain_leaves(r), i))."""
    if evict_input.target is OPS.materialize.default:
        return evict_input.args[0]
    if evict_input.target is operator.getitem and getattr(evict_input.args[0], "target", None) is plain_leaves:
        return evict_input.args[0].args[0]
    return evict_input


def verify(gm: fx.GraphModule, weights: dict[fx.Node, WeightInput], group_bytes: dict[int, int]) -> Verified:
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    placeholders = {n.name: n for n in nodes if n.op == "placeholder"}
    by_slot = {(w.group, w.slot): placeholders[p.name] for p, w in weights.items()}

    for p, w in weights.items():
        users = list(placeholders[p.name].users)
        if users:
            raise ScheduleError(f"weight {w.name} is still read from host memory by {users[0].format_node()}")

    evict_of: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if node.target is OPS.evict.default:
            items = node.args[3]
            if items:
                evict_of[items[0].args[0]] = node

    for view in (n for n in nodes if "offload_slot" in n.meta):
        fetch = _fetch_node(view)
        placeholder = by_slot[view.meta["offload_slot"]]
        storage = _storage(_value(placeholder))
        if storage is None:
            continue
        # re-derive readers on the rewritten graph, with the original weight's storage as the alias key
        view.meta.setdefault("example_value", _value(placeholder))
        found = [r for user in view.users if user.op != "output" and user.target is not OPS.evict.default
                 for r in readers(view, user, placeholder.name).leaves]  # (the graph outputs every view)
        if fetch.target is OPS.resident.default:
            continue
        evict = evict_of.get(fetch)
        if evict is None:
            if any(user.op != "output" for user in view.users) and not all(
                    position[r] > position[fetch] for r in found):
                raise ScheduleError(f"{placeholder.name} is read before it is fetched")
            continue
        ordered = {_reader_of(n) for n in evict.args[4]}
        for reader in found:
            if not position[fetch] < position[reader] < position[evict]:
                raise ScheduleError(f"{reader.format_node()} reads {placeholder.name} outside its fetch window")
            written = reader.target is operator.setitem and reader.args[0] in ordered  # ordered through x in x[i] = w
            if reader not in ordered and not written:
                raise ScheduleError(f"the evict of {placeholder.name} does not depend on {reader.format_node()}")

    prefetches = [n for n in nodes if n.target is OPS.prefetch.default]
    mode = lambda n: n.args[4] if len(n.args) > 4 else FETCH  # noqa: E731
    carried = sum(group_bytes[n.args[1]] for n in prefetches if mode(n) == CARRY)
    if carried != sum(group_bytes[n.args[1]] for n in prefetches if mode(n) == ADOPT):
        raise ScheduleError("the copies this graph carries to its next call are not the ones it starts with")
    live = peak = carried  # in steady state the previous call's carried copies are alive at the start
    resident = fetches = 0
    for node in nodes:
        if node.target is OPS.prefetch.default:
            if mode(node) != ADOPT:
                live += group_bytes[node.args[1]]
                fetches += 1
            peak = max(peak, live)
        elif node.target is OPS.evict.default and not (len(node.args) > 5 and node.args[5]):  # parked stays
            live -= group_bytes[node.args[1]]
        elif node.target is OPS.resident.default:
            resident += group_bytes[node.args[1]]
    return Verified(peak, resident, fetches, carried)
