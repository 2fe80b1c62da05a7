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
from .schedule import ADOPT, CARRY

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


def pool_bytes(assignment: dict[int, tuple[int, int]], class_of: Callable[[int], tuple],
               group_bytes: dict[int, int]) -> int:
    """Bytes of the distinct slots a graph's fetches use."""
    slots = {(class_of(group), index): group_bytes[group] for group, index in assignment.values()}
    return sum(slots.values())
