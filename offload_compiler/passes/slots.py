"""Plan the device slot each fetch lands in, from a rewritten graph's transfer ops alone.

Slots are fixed device memory, one group copy each, shared by the groups of one size class (same flat buffer
sizes and dtypes). A fetch takes a slot at its prefetch (or its wait) and gives it back at its evict, in
graph order, which is also the order the runtime runs them in; so the slots a graph needs are the most copies
of a class alive at once, the same peak the verifier predicts. A graph that carries copies to its next call
(prefetch wrap-around) starts with them in slots and must carry each into the slot its next call starts with:
a carried copy's slot is kept free for it when another is free, and kept for it alone when not.
"""

from __future__ import annotations

from typing import Callable

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
    """fetch key -> (group, slot index within its group's size class)."""
    return plan_slots(slot_events(gm), class_of)


def plan_slots(events: Events, class_of: Callable[[int], tuple]) -> dict[int, tuple[int, int]]:
    dedicated: set[int] = set()
    while True:
        try:
            return _color(events, class_of, dedicated)
        except _Conflict as conflict:  # at most once per carried key
            dedicated.add(conflict.key)


def slot_counts(assignment: dict[int, tuple[int, int]], class_of: Callable[[int], tuple]) -> dict[tuple, int]:
    """Size class -> how many slots of it a graph's fetches use (its pool: `DevicePool.reserve` grows to it)."""
    counts: dict[tuple, int] = {}
    for group, index in assignment.values():
        cls = class_of(group)
        counts[cls] = max(counts.get(cls, 0), index + 1)
    return counts


def class_bytes(size_class: tuple) -> int:
    """Device bytes of one slot of ``size_class`` (`DeviceSlot.nbytes`)."""
    return sum(numel * dtype.itemsize for numel, dtype in size_class)


def pool_bytes(assignment: dict[int, tuple[int, int]], class_of: Callable[[int], tuple]) -> int:
    """Bytes of the distinct slots a graph's fetches use: device memory held from its first call on."""
    return sum(count * class_bytes(cls) for cls, count in slot_counts(assignment, class_of).items())


def schedule_pool_bytes(schedule: Schedule, class_of: Callable[[int], tuple],
                        parked: frozenset[int] = frozenset()) -> int:
    """Bytes of the device slots ``schedule``'s fetches land in, as the backend colours them: what the pool
    of a graph rewritten for it holds (the planner's and the backend's number, one function)."""
    return pool_bytes(plan_slots(schedule_slot_events(schedule, parked), class_of), class_of)
