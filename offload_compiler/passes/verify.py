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
from .nodes import Evict, Prefetch, Resident, fetch_of, transfer_view
from .routed import routed_view
from .schedule import ADOPT, CARRY

OPS = torch.ops.offload_compiler


class ScheduleError(RuntimeError):
    """The rewritten graph could read a weight that is not on the device."""


@dataclasses.dataclass(frozen=True)
class Verified:
    streamed_peak_bytes: int
    resident_bytes: int
    fetches: int
    carried_bytes: int = 0  # prefetched for the next call: on the device between calls
    # routed fetches (`passes.routed`): how many per call, and the most bytes they can move per call (each moves
    # a data-dependent subset of its weight's experts, at most its slot's)
    routed_fetches: int = 0
    routed_bound_bytes: int = 0
    resident_groups: frozenset[int] = frozenset()  # whose copies stay on the device once made (``resident_bytes``)

    @property
    def peak_bytes(self) -> int:
        return self.streamed_peak_bytes + self.resident_bytes


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

    transfers = [view for view in map(transfer_view, nodes) if view is not None]
    evict_of: dict[fx.Node, Evict] = {fetch_of(evict.buffers[0]).node: evict for evict in transfers
                                      if isinstance(evict, Evict) and evict.buffers}

    for view in (n for n in nodes if "offload_slot" in n.meta):
        fetch = fetch_of(view)
        placeholder = by_slot[view.meta["offload_slot"]]
        storage = _storage(_value(placeholder))
        if storage is None:
            continue
        # re-derive readers on the rewritten graph, with the original weight's storage as the alias key
        view.meta.setdefault("example_value", _value(placeholder))
        found = [r for user in view.users if user.op != "output" and user.target is not OPS.evict.default
                 for r in readers(view, user, placeholder.name).leaves]  # (the graph outputs every view)
        if isinstance(fetch, Resident):
            continue
        evict = evict_of.get(fetch.node)
        if evict is None:
            if any(user.op != "output" for user in view.users) and not all(
                    position[r] > position[fetch.node] for r in found):
                raise ScheduleError(f"{placeholder.name} is read before it is fetched")
            continue
        ordered = {_reader_of(n) for n in evict.users}
        for reader in found:
            if not position[fetch.node] < position[reader] < position[evict.node]:
                raise ScheduleError(f"{reader.format_node()} reads {placeholder.name} outside its fetch window")
            written = reader.target is operator.setitem and reader.args[0] in ordered  # ordered through x in x[i] = w
            if reader not in ordered and not written:
                raise ScheduleError(f"the evict of {placeholder.name} does not depend on {reader.format_node()}")

    prefetches = [view for view in transfers if isinstance(view, Prefetch)]
    carried = sum(group_bytes[p.group] for p in prefetches if p.mode == CARRY)
    if carried != sum(group_bytes[p.group] for p in prefetches if p.mode == ADOPT):
        raise ScheduleError("the copies this graph carries to its next call are not the ones it starts with")
    live = peak = carried  # in steady state the previous call's carried copies are alive at the start
    resident = fetches = routed = routed_bound = 0
    resident_groups = set()
    for node in nodes:
        view = transfer_view(node)
        if view is None:
            found = routed_view(node)
            if found is not None:  # its slot holds the experts named only while the op runs
                _, bound, expert_bytes = found
                peak = max(peak, live + bound * expert_bytes)
                routed += 1
                routed_bound += bound * expert_bytes
            continue
        if isinstance(view, Prefetch):
            if view.mode != ADOPT:
                live += group_bytes[view.group]
                fetches += 1
            peak = max(peak, live)
        elif isinstance(view, Evict) and not view.park:  # parked stays
            live -= group_bytes[view.group]
        elif isinstance(view, Resident):
            resident += group_bytes[view.group]
            resident_groups.add(view.group)
    return Verified(peak, resident, fetches, carried, routed, routed_bound, frozenset(resident_groups))
