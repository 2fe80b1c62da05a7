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


Sizes = dict[tuple, list[tuple]]  # slot class -> each slot's (numel, dtype) per buffer, by index


def _fits(size: tuple, need: tuple) -> bool:
    return all(numel >= wanted for (numel, _), (wanted, _) in zip(size, need))


def _grown(size: tuple | None, need: tuple) -> tuple:
    return need if size is None else tuple((max(a, b), dtype) for (a, dtype), (b, _) in zip(size, need))


def _color(events: Events, class_of: Callable[[int], tuple], dedicated: set[int],
           size_of: Callable[[int], tuple], fixed: Sizes, lend: bool = False,
           growable: frozenset[tuple[tuple, int]] = frozenset()) -> tuple[dict[int, tuple[int, int]], Sizes]:
    sizes: Sizes = {cls: list(had) for cls, had in fixed.items()}
    free: dict[tuple, set[int]] = {cls: set(range(len(had))) for cls, had in fixed.items()}  # earlier graphs'
    assigned: dict[int, tuple[int, int]] = {}
    awaiting_carry: dict[tuple, set[int]] = {}  # slots of carried copies whose carry is still ahead
    kept: dict[tuple, set[int]] = {}  # slots of dedicated carried keys: nobody else's

    def place(cls: tuple, candidates: set[int], group: int) -> int:
        """Best fit: the smallest candidate the copy fits in; else the largest one planned by this graph or an
        earlier graph's slot the runtime lets grow (``growable``: it holds no copy now), grown (never more bytes
        than a new slot; any other earlier graph's slot may hold a copy: it never grows); else a new slot.
        Slots of one size class all fit: the lowest index, as a plain colouring."""
        need, had, planned_before = size_of(group), sizes.setdefault(cls, []), len(fixed.get(cls, ()))
        if size_of is class_of and candidates:  # one size per class: a plain colouring
            return min(candidates)
        fitting = [i for i in candidates if had[i] is not None and _fits(had[i], need)]
        growable = [i for i in candidates if i >= planned_before or (cls, i) in grows]
        if fitting:
            index = min(fitting, key=lambda i: (class_bytes(had[i]), i))
        elif growable:
            index = max(growable, key=lambda i: (class_bytes(had[i] or ()), -i))
        else:
            had.append(None)
            index = len(had) - 1
        if index >= planned_before or (cls, index) in grows:
            had[index] = _grown(had[index], need)
        return index

    grows = growable
    lent = _lendable(events) if lend else None
    owner: dict[tuple, int] = {}  # (class, slot) -> the carried key whose carry it awaits
    for _, key, group, mode in events:  # carried copies are in their slots when the graph starts
        if mode == ADOPT and key not in assigned:
            cls = class_of(group)
            available = free.setdefault(cls, set())
            index = place(cls, available - awaiting_carry.get(cls, set()), group)
            available.discard(index)
            assigned[key] = (group, index)
            owner[cls, index] = key
            awaiting_carry.setdefault(cls, set()).add(index)
            if key in dedicated:
                kept.setdefault(cls, set()).add(index)
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
            awaiting = awaiting_carry.get(cls, set())
            preferred = usable - awaiting
            # a slot awaiting a carry, to a fetch given back before that carry: the others stay free for longer ones
            lendable = {i for i in usable & awaiting if lent is not None and lent(key, owner[cls, i])}
            index = place(cls, lendable or preferred or usable, group)
            available.discard(index)
            assigned[key] = (group, index)
    return assigned, sizes


def assign_slots(gm: fx.GraphModule, class_of: Callable[[int], tuple]) -> dict[int, tuple[int, int]]:
    """fetch key -> (group, slot index within its group's size class)."""
    return plan_slots(slot_events(gm), class_of)


def plan_slots(events: Events, class_of: Callable[[int], tuple], size_of: Callable[[int], tuple] | None = None,
               fixed: Sizes | None = None, growable: frozenset = frozenset()) -> dict[int, tuple[int, int]]:
    """fetch key -> (group, slot index within its slot class). ``size_of``: each group's size class where the
    slots of one class may hold groups of several sizes (a kind's shared slots); ``fixed``: the slots earlier
    graphs planned (class -> their sizes), never grown but those of ``growable`` ((class, index): slots the
    runtime can reallocate larger, as they hold no copy)."""
    return sized_slots(events, class_of, size_of, fixed, growable)[0]


def sized_slots(events: Events, class_of: Callable[[int], tuple], size_of: Callable[[int], tuple] | None = None,
                fixed: Sizes | None = None, growable: frozenset = frozenset()
                ) -> tuple[dict[int, tuple[int, int]], Sizes]:
    """`plan_slots` and the size of each slot of each class: the largest group it holds, buffer by buffer."""
    lends = (False, True) if any(mode == CARRY for _, _, _, mode in events) else (False,)
    return min((_resolved(events, class_of, size_of or class_of, fixed or {}, lend, growable) for lend in lends),
               key=lambda planned: _held(planned[1]))


def _held(sizes: Sizes) -> int:
    """What a colouring's slots hold: their bytes (a slot of a class given without its sizes counts one)."""
    return sum(class_bytes(size) if all(isinstance(part, tuple) for part in size) else 1
               for had in sizes.values() for size in had if size is not None)


def _resolved(events: Events, class_of: Callable[[int], tuple], size_of: Callable[[int], tuple], fixed: Sizes,
              lend: bool, growable: frozenset = frozenset()) -> tuple[dict[int, tuple[int, int]], Sizes]:
    """A colouring in which every carried copy finds its slot free where it is carried: a conflict keeps the
    carried key's slot for it alone, and colours again. With ``lend``, a slot awaiting a carry is first given
    to a fetch that gives it back before that carry (`_lendable`)."""
    dedicated: set[int] = set()
    while True:
        try:
            return _color(events, class_of, dedicated, size_of, fixed, lend, growable)
        except _Conflict as conflict:  # at most once per carried key
            dedicated.add(conflict.key)


def _lendable(events: Events) -> Callable[[int, int], bool]:
    """(fetch key, carried key) -> the fetch gives its slot back before the carried key is carried (by event
    order; a fetch never given back, a parked one, never does)."""
    given: dict[int, int] = {}
    carried: dict[int, int] = {}
    for position, (kind, key, _, mode) in enumerate(events):
        if kind == "give":
            given[key] = position
        elif mode == CARRY:
            carried[key] = position
    return lambda key, carried_key: given.get(key, len(events)) < carried.get(carried_key, -1)


def class_bytes(size_class: tuple) -> int:
    """Device bytes of one slot of ``size_class`` (`DeviceSlot.nbytes`)."""
    return sum(numel * dtype.itemsize for numel, dtype in size_class)


def sizes_bytes(sizes: Sizes) -> int:
    return sum(class_bytes(size) for had in sizes.values() for size in had if size is not None)


def pool_bytes(assignment: dict[int, tuple[int, int]], class_of: Callable[[int], tuple], sizes: Sizes) -> int:
    """Bytes of the distinct slots a graph's fetches land in (``sizes``: each slot's, `sized_slots`)."""
    return sum(class_bytes(sizes[cls][index])
               for cls, index in {(class_of(group), index) for group, index in assignment.values()})


# -- pooling: which groups share slots ---------------------------------------------------------------------
# A slot holds a group of its size class, or, shared by a *kind* (the same bucket dtypes in the same order), any
# group of that kind whose buckets are each no larger than the slot's: the group's weights are views over the
# prefix of its buffers, and each shared slot is sized to the largest group the colouring puts in it. Slots per
# size class hold up to prefetch + 1 copies for every class (a model whose blocks differ slightly: T5's first
# layers, decoder layers with cross-attention); shared slots hold that many in all. Per kind, the smaller wins.

SHARED = "shared"  # marks the slot class of a kind's shared slots (a size class starts with a (numel, dtype))


def slot_kind(size_class: tuple) -> tuple:
    return tuple(dtype for _, dtype in size_class)


@dataclasses.dataclass(frozen=True)
class Pooling:
    """How a runtime's groups share device slots: ``size_class`` of a group, and the kinds whose groups share
    slots (``shared``; the others' slots are per size class)."""
    size_class: Callable[[int], tuple]
    shared: frozenset[tuple] = frozenset()

    def slot_class(self, group: int) -> tuple:
        """The key the colouring gives slots by: the group's kind where the kind shares, else its size class."""
        cls = self.size_class(group)
        kind = slot_kind(cls)
        return (SHARED, kind) if kind in self.shared else cls

    def plan(self, events: Events, fixed: Sizes | None = None, growable: frozenset = frozenset()
             ) -> tuple[dict[int, tuple[int, int]], Sizes]:
        return sized_slots(events, self.slot_class, self.size_class, fixed, growable)


def kind_of_slot_class(slot_class: tuple) -> tuple:
    return slot_class[1] if slot_class[:1] == (SHARED,) else slot_kind(slot_class)


def _bytes_per_kind(sizes: Sizes) -> dict[tuple, int]:
    per_kind: dict[tuple, int] = {}
    for cls, had in sizes.items():
        kind = kind_of_slot_class(cls)
        per_kind[kind] = per_kind.get(kind, 0) + sum(class_bytes(size) for size in had if size is not None)
    return per_kind


def choose_pooling(events: Events, size_class: Callable[[int], tuple], decided: dict[tuple, bool] | None = None,
                   fixed: Sizes | None = None, classes: frozenset[tuple] = frozenset()
                   ) -> tuple[Pooling, dict[tuple, bool]]:
    """Per kind the smaller pool for ``events``: slots per size class, or shared by the kind. A kind an earlier
    graph of the runtime ``decided`` keeps its decision (its slots may be allocated). Returns the pooling and
    every kind's decision (``decided`` and the new ones). Deterministic: ties go to slots per size class, but
    where ``classes`` (the size classes of every group the runtime streams) holds more than one of the kind:
    later graphs fetch those, and shared slots hold them in the slots this graph planned (grown where free,
    `_color`), where slots per size class would add a slot per class -- a component per graph (alternating,
    sequential over a pipeline) held every component at once that way."""
    decided = dict(decided or {})
    by_class = _bytes_per_kind(Pooling(size_class).plan(events, fixed)[1])
    everything = frozenset(slot_kind(size_class(group)) for _, _, group, _ in events)
    by_kind = _bytes_per_kind(Pooling(size_class, everything).plan(events, fixed)[1])
    for kind in everything:
        several = sum(slot_kind(cls) == kind for cls in classes) > 1
        shared, apart = by_kind.get(kind, 0), by_class.get(kind, 0)
        decided.setdefault(kind, shared < apart or (several and shared == apart))
    return Pooling(size_class, frozenset(k for k, shared in decided.items() if shared)), decided


def schedule_pool_bytes(schedule: Schedule, size_class: Callable[[int], tuple],
                        parked: frozenset[int] = frozenset()) -> int:
    """Bytes of the device slots ``schedule``'s fetches land in, as the backend pools and colours the first
    graph of a runtime: what a graph rewritten for it holds (the planner's and the backend's number, one
    function)."""
    events = schedule_slot_events(schedule, parked)
    pooling, _ = choose_pooling(events, size_class)
    return sizes_bytes(pooling.plan(events)[1])
