"""Plan the device slot each fetch lands in, from a rewritten graph's transfer ops alone.

Slots are fixed device memory, one group copy each, shared by the groups of one size class (same flat buffer
sizes and dtypes). A fetch takes a slot at its prefetch (or its wait) and gives it back at its evict, in
graph order, which is also the order the runtime runs them in; so the slots a graph needs are the most copies
of a class alive at once, the same peak the verifier predicts. A graph that carries copies to its next call
(prefetch wrap-around) starts with them in slots and must carry each into the slot its next call starts with:
a carried copy's slot is kept free for it when another is free, and kept for it alone when not.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import torch.fx as fx

from .nodes import Evict, Prefetch, Wait, fetch_of, transfer_view
from .schedule import ADOPT, CARRY, FETCH, Schedule

Events = list[tuple[str, int, int, int]]  # (take | give, fetch key, group, prefetch mode or -1)


def slot_events(gm: fx.GraphModule) -> Events:
    events: Events = []
    for view in map(transfer_view, gm.graph.nodes):
        if isinstance(view, Prefetch):
            events.append(("take", view.key, view.group, view.mode))
        elif isinstance(view, Wait):
            events.append(("take", view.key, view.group, -1))
        elif isinstance(view, Evict) and not view.park:  # parked: kept
            wait = fetch_of(view.buffers[0])  # an evict's buffers are all its wait's
            events.append(("give", wait.key, wait.group, -1))
    return events


def schedule_slot_events(schedule: Schedule, parked: frozenset[int] = frozenset()) -> Events:
    """The events `slot_events` reads from the graph `passes.insert.insert_transfers` rewrites for ``schedule``,
    from the schedule alone (the fetch key of an instance is its index), in the same order: at an instance's
    wait, the prefetches issued there (ADOPT for a carried instance), then the carries issued there, then the
    wait; the evicts after the node where an instance ends (a ``parked`` instance's slot is kept); the carries
    issued after the graph's last node. The planner sizes the device pool of a candidate schedule with it
    before any graph is rewritten."""
    instances = schedule.instances
    carried = schedule.carried
    prefetched_at: dict[int, list[int]] = {}
    for inst in instances:
        prefetched_at.setdefault(schedule.prefetch_at[inst.index], []).append(inst.index)
    carried_at: dict[int, list[int]] = {}
    for index, at in schedule.carry_at:
        carried_at.setdefault(at, []).append(index)
    waits_at: dict[int, list[int]] = {}
    evicts_at: dict[int, list[int]] = {}
    for inst in instances:
        waits_at.setdefault(inst.start, []).append(inst.index)
        evicts_at.setdefault(inst.end, []).append(inst.index)
    events: Events = []
    for position in sorted(set(waits_at) | set(evicts_at)):
        for i in waits_at.get(position, []):
            events += [("take", a, instances[a].group, ADOPT if a in carried else FETCH)
                       for a in prefetched_at.get(i, [])]
            events += [("take", c, instances[c].group, CARRY) for c in carried_at.get(i, [])]
            events.append(("take", i, instances[i].group, -1))
        events += [("give", i, instances[i].group, -1) for i in evicts_at.get(position, []) if i not in parked]
    events += [("take", c, instances[c].group, CARRY) for c in carried_at.get(len(instances), [])]
    return events


class _Conflict(Exception):
    def __init__(self, key: int) -> None:
        self.key = key


def _color(events: Events, class_of: Callable[[int], tuple], dedicated: set[int]) -> dict[int, tuple[int, int]]:
    count: dict[tuple, int] = {}
    free: dict[tuple, set[int]] = {}
    assigned: dict[int, tuple[int, int]] = {}
    awaiting_carry: dict[tuple, set[int]] = {}  # slots of carried copies whose carry is still ahead
    kept: dict[tuple, set[int]] = {}  # slots of dedicated carried keys: nobody else's

    def new_slot(cls: tuple) -> int:
        count[cls] = count.get(cls, 0) + 1
        return count[cls] - 1

    for _, key, group, mode in events:  # carried copies are in their slots when the graph starts
        if mode == ADOPT and key not in assigned:
            cls = class_of(group)
            assigned[key] = (group, new_slot(cls))
            awaiting_carry.setdefault(cls, set()).add(assigned[key][1])
            if key in dedicated:
                kept.setdefault(cls, set()).add(assigned[key][1])
    for kind, key, group, mode in events:
        cls = class_of(group)
        available = free.setdefault(cls, set())
        if kind == "give":
            available.add(assigned[key][1])
        elif mode == CARRY:
            index = assigned[key][1]
            if index not in available:
                raise _Conflict(key)
            available.discard(index)
            awaiting_carry[cls].discard(index)
        elif key not in assigned:
            usable = available - kept.get(cls, set())
            preferred = usable - awaiting_carry.get(cls, set())
            index = min(preferred or usable) if usable else new_slot(cls)
            available.discard(index)
            assigned[key] = (group, index)
    return assigned


def assign_slots(gm: fx.GraphModule, class_of: Callable[[int], tuple]) -> dict[int, tuple[int, int]]:
    """fetch key -> (group, slot index within its group's slot class)."""
    return plan_slots(slot_events(gm), class_of)


def plan_slots(events: Events, class_of: Callable[[int], tuple]) -> dict[int, tuple[int, int]]:
    dedicated: set[int] = set()
    while True:
        try:
            return _color(events, class_of, dedicated)
        except _Conflict as conflict:  # at most once per carried key
            dedicated.add(conflict.key)


def slot_counts(assignment: dict[int, tuple[int, int]], class_of: Callable[[int], tuple]) -> dict[tuple, int]:
    """Slot class -> how many slots of it a graph's fetches use (`DevicePool.reserve` grows to it)."""
    counts: dict[tuple, int] = {}
    for group, index in assignment.values():
        cls = class_of(group)
        counts[cls] = max(counts.get(cls, 0), index + 1)
    return counts


def class_bytes(size_class: tuple) -> int:
    """Device bytes of one slot of ``size_class`` (`DeviceSlot.nbytes`)."""
    return sum(numel * dtype.itemsize for numel, dtype in size_class)


# -- pooling: which groups share slots ---------------------------------------------------------------------
# A slot holds a group of its size class, or any group of its *kind* (the same bucket dtypes in the same order)
# whose buckets are each no larger than the slot's: the group's weights are views over the prefix of its
# buffers. Slots per size class waste nothing per copy but hold prefetch + 1 copies for every class (a model
# whose blocks differ slightly: T5's first layers, decoder layers with cross-attention); slots shared by a
# kind hold prefetch + 1 copies in all, each the kind's largest. Per kind, the smaller pool wins.

def slot_kind(size_class: tuple) -> tuple:
    return tuple(dtype for _, dtype in size_class)


def kind_capacities(size_classes: Iterable[tuple]) -> dict[tuple, tuple]:
    """Kind -> the slot any of ``size_classes`` of that kind fits in: each bucket's largest size. Known from
    the streamed groups alone (a runtime's, when it is built), so a slot's size is fixed before any graph is
    planned: a later graph's fetch never needs a larger one than a slot already allocated."""
    capacity: dict[tuple, tuple] = {}
    for cls in size_classes:
        kind = slot_kind(cls)
        had = capacity.get(kind)
        capacity[kind] = cls if had is None else tuple((max(a, b), dtype) for (a, dtype), (b, _) in zip(had, cls))
    return capacity


@dataclasses.dataclass(frozen=True)
class Pooling:
    """How a runtime's groups share device slots: ``size_class`` of a group, the slot each kind's groups
    share (``capacity``), and the kinds that share it (``shared``; the others get slots per size class)."""
    size_class: Callable[[int], tuple]
    capacity: dict[tuple, tuple]
    shared: frozenset[tuple] = frozenset()

    def slot_class(self, group: int) -> tuple:
        """The key the colouring gives slots by: the group's kind where the kind shares, else its size class."""
        cls = self.size_class(group)
        kind = slot_kind(cls)
        return (SHARED, kind) if kind in self.shared else cls

    def slot_size(self, slot_class: tuple) -> tuple:
        """The (numel, dtype) of each buffer of a slot of ``slot_class``."""
        return self.capacity[slot_class[1]] if slot_class[:1] == (SHARED,) else slot_class


SHARED = "shared"  # marks a slot class of a kind's shared slots (a size class starts with a (numel, dtype))


def pool_bytes(assignment: dict[int, tuple[int, int]], pooling: Pooling) -> int:
    """Bytes of the distinct slots a graph's fetches use: device memory held from its first call on."""
    return sum(count * class_bytes(pooling.slot_size(cls))
               for cls, count in slot_counts(assignment, pooling.slot_class).items())


def _bytes_per_kind(assignment: dict[int, tuple[int, int]], pooling: Pooling) -> dict[tuple, int]:
    per_kind: dict[tuple, int] = {}
    for cls, count in slot_counts(assignment, pooling.slot_class).items():
        size = pooling.slot_size(cls)
        per_kind[slot_kind(size)] = per_kind.get(slot_kind(size), 0) + count * class_bytes(size)
    return per_kind


def choose_pooling(events: Events, size_class: Callable[[int], tuple], capacity: dict[tuple, tuple],
                   decided: dict[tuple, bool] | None = None) -> tuple[Pooling, dict[tuple, bool]]:
    """Per kind the smaller pool for ``events``: slots per size class, or shared by the kind. A kind an earlier
    graph of the runtime ``decided`` keeps its decision (its slots may be allocated). Returns the pooling and
    every kind's decision (``decided`` and the new ones). Deterministic: ties go to slots per size class."""
    decided = dict(decided or {})
    by_class = _bytes_per_kind(plan_slots(events, size_class), Pooling(size_class, capacity))
    all_shared = Pooling(size_class, capacity, frozenset(capacity))
    by_kind = _bytes_per_kind(plan_slots(events, all_shared.slot_class), all_shared)
    for kind, nbytes in by_class.items():
        decided.setdefault(kind, by_kind.get(kind, nbytes) < nbytes)
    return Pooling(size_class, capacity, frozenset(k for k, shared in decided.items() if shared)), decided


def schedule_pool_bytes(schedule: Schedule, size_class: Callable[[int], tuple], capacity: dict[tuple, tuple],
                        parked: frozenset[int] = frozenset(), decided: dict[tuple, bool] | None = None) -> int:
    """Bytes of the device slots ``schedule``'s fetches land in, as the backend pools and colours them: what a
    graph rewritten for it holds (the planner's and the backend's number, one function)."""
    events = schedule_slot_events(schedule, parked)
    pooling, _ = choose_pooling(events, size_class, capacity, decided)
    return pool_bytes(plan_slots(events, pooling.slot_class), pooling)
