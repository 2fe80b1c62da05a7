"""The `auto` planner: pure functions from a cost table to the fastest plan that fits a device budget.

A *cost table* describes one captured graph: each group's bytes, where the graph reads each group (the same
``Use`` records the schedule pass works on), the predicted compute seconds of every graph position, the
host→device bandwidth, and the activation peak. A *choice* is a set of resident groups and a prefetch depth.

`predict` replays exactly what the engine would do with a choice — the same `build_schedule` and slot
colouring (`passes.slots.schedule_pool_bytes`) the backend uses — so the predicted weight memory equals the
device slots and resident groups the runtime holds (at least the ledger's peak of copies in flight). Time comes from a two-resource replay: compute runs position by position; each fetch is issued
at the wait where the schedule issues it and either runs on a copy engine beside compute (``overlap``, an
accelerator with a copy stream) or inline on the compute thread (CPU). Compute waits for each fetch it reads.

`solve` is an exact branch and bound over residency for every prefetch depth. Keeping more groups resident
is *not* always faster (an early small streamed group is where the first prefetches are issued; without it
they start later), so the bounds are relaxations that hold for every completion of a partial choice:
  * time: every group decided streamed is fetched at least once before its first use, on one copy engine
    that starts at 0 and never idles (inline copies: each adds its transfer time; the undecided groups that
    fit the room left are kept resident, as a fractional knapsack);
  * peak: a streamed group is on the device at some moment together with every resident group, so
    activations + resident bytes + the largest group not yet resident bounds the peak from below.
The search stops after ``max_nodes`` and then says the plan is not proven optimal.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Iterable

import torch

from ..passes.schedule import Schedule, Use, build_schedule
from ..passes.slots import schedule_pool_bytes
from ..runtime.disk import beyond_budget

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class GroupCost:
    name: str
    nbytes: int
    is_block: bool = False
    # its flat buffers' (numel, dtype) (`runtime.slots.size_class`): groups of one size class share device
    # slots; () where unknown: a class of its own, of its bytes
    size_class: tuple = ()

    @property
    def slot_class(self) -> tuple:
        return self.size_class or ((self.nbytes, torch.uint8),)


@dataclasses.dataclass(frozen=True)
class CostTable:
    groups: tuple[GroupCost, ...]
    uses: tuple[Use, ...]  # where the graph reads each group (graph positions)
    node_seconds: tuple[float, ...]  # predicted compute time of each graph position
    bandwidth: float  # host -> device bytes per second
    activation_bytes: int = 0  # predicted activation peak on the device
    fetch_overhead_s: float = 0.0  # fixed cost of one fetch (prefetch, wait and evict ops, copy launch)
    call_overhead_s: float = 0.0  # fixed cost of one call (guards, wrapper, graph runner, weight views)
    dispatch_s: float = 0.0  # the part of node_seconds that is per-op dispatch, not work
    overlap: bool = True  # fetches run beside compute (copy stream) instead of inline
    blocks_per_group: int = 1
    carry: bool = False  # prefetch wrap-around (policy.prefetch_next_call): steady-state calls are predicted
    host_budget: int | None = None  # host memory for the packed weights (the disk tier): the rest is on disk
    disk_bandwidth: float = 0.0  # bytes per second a fill reads from disk
    # the groups the graph reads only by indices (`passes.analysis.routed_reads`: a table's lookup, routed
    # experts), each read as (group, its slot's key, the slot's bytes): streamed, such a group is not fetched
    # whole but the rows named are copied into a fixed slot (`TransferEngine.plan_routed`, one per key)
    routed: tuple[tuple[int, tuple, int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "uses", compress_uses(self.uses))
        prefix = [0.0]
        for seconds in self.node_seconds:
            prefix.append(prefix[-1] + seconds)
        object.__setattr__(self, "_prefix", tuple(prefix))

    @property
    def routed_groups(self) -> frozenset[int]:
        return frozenset(g for g, _, _ in self.routed)

    def routed_slot_bytes(self, resident: frozenset[int]) -> int:
        """The routed slots of the routed groups not kept resident (reads of one key share a slot)."""
        return sum({key: nbytes for g, key, nbytes in self.routed if g not in resident}.values())

    def streamed_bytes(self, group: int) -> int:
        """The least device memory streaming ``group`` holds: its copy's slot, or a routed group's row slots."""
        routed = {key: nbytes for g, key, nbytes in self.routed if g == group}
        return sum(routed.values()) if routed else self.groups[group].nbytes

    @property
    def used_groups(self) -> tuple[int, ...]:
        return tuple(sorted({u.group for u in self.uses}))

    def compute_between(self, start: int, end: int) -> float:
        return self._prefix[end] - self._prefix[start]

    @property
    def compute_s(self) -> float:
        return self._prefix[-1]

    def transfer_s(self, group: int, on_disk: bool = False) -> float:
        """A fetch of ``group``; from disk, the read and then the copy (counted one after the other)."""
        nbytes = self.groups[group].nbytes
        return self.fetch_overhead_s + nbytes / self.bandwidth + (nbytes / self.disk_bandwidth if on_disk else 0.0)

    def on_disk(self, resident: frozenset[int]) -> frozenset[int] | None:
        """The groups the host store will leave on disk when ``resident`` stay on the device (every other group
        with bytes is streamed, as `auto.planned_specs` makes them): `runtime.disk.beyond_budget`'s rule. None
        where no choice of disk groups fits the host budget."""
        if self.host_budget is None:
            return frozenset()
        sizes = [g.nbytes for g in self.groups]
        return beyond_budget(sizes, [i for i, size in enumerate(sizes) if size and i not in resident], self.host_budget)

    def first_use(self) -> dict[int, int]:
        first: dict[int, int] = {}
        for use in self.uses:
            first.setdefault(use.group, use.start)
        return first

    def group_compute_s(self) -> dict[int, float]:
        """Compute attributed to each group: from each of its fetches to the next fetch of any group, when
        everything is streamed (the compute a streamed group's transfer can hide behind, or not)."""
        instances = build_schedule(list(self.uses), 0).instances
        out = {g: 0.0 for g in self.used_groups}
        for inst, nxt in zip(instances, instances[1:] + (None,)):
            out[inst.group] += self.compute_between(inst.start, nxt.start if nxt else len(self.node_seconds))
        return out


def compress_uses(uses: Iterable[Use]) -> tuple[Use, ...]:
    """Merge uses of one group that follow each other with no other group's use between: removing other
    groups never separates them, so the schedule of any residency choice is unchanged, and it is cheaper."""
    merged: list[Use] = []
    for use in sorted(uses, key=lambda u: (u.start, u.group, u.end)):
        if merged and merged[-1].group == use.group:
            last = merged[-1]
            merged[-1] = Use(last.group, last.start, max(last.end, use.end), last.key)
        else:
            merged.append(Use(use.group, use.start, use.end, len(merged)))
    return tuple(merged)


@dataclasses.dataclass(frozen=True)
class Choice:
    resident: frozenset[int]
    prefetch: int


@dataclasses.dataclass(frozen=True)
class Prediction:
    time_s: float
    compute_s: float
    transfer_s: float  # sum of the fetches' transfer times (hidden or not)
    # resident + the device slots its fetches land in (`passes.slots.schedule_pool_bytes`, the backend's own
    # number): the device memory held for weights from the first call on, at least the ledger's peak
    weights_peak_bytes: int
    resident_bytes: int
    activation_bytes: int
    fetches: int
    schedule: Schedule
    call_s: float = 0.0  # the call's fixed cost
    disk: frozenset[int] = frozenset()  # the groups read from disk at each of their fetches (host_budget)
    resident_groups: frozenset[int] = frozenset()  # the groups read that it keeps resident

    @property
    def peak_bytes(self) -> int:
        return self.weights_peak_bytes + self.activation_bytes

    @property
    def stall_s(self) -> float:
        """Time waiting for copies: never negative (the replay adds the compute up in pieces; what it left
        over was rounding, printed as ``stalls -0.000 ms``)."""
        return max(self.time_s - self.compute_s - self.call_s, 0.0)


def schedule_for(table: CostTable, choice: Choice) -> Schedule:
    """The schedule the backend builds for ``choice`` (`backend.rewrite_graph`): reads of its groups on disk
    ahead, back to back."""
    # a routed group streamed is read through its routed slot, outside the schedule (`backend.rewrite_graph`)
    fetched_whole = [u for u in table.uses if u.group not in choice.resident and u.group not in table.routed_groups]
    return build_schedule(fetched_whole, choice.prefetch,
                          carry=table.carry, read_ahead=table.on_disk(choice.resident) or frozenset())


def predict(table: CostTable, choice: Choice) -> Prediction:
    """The choice's forward time and device peak; a time of infinity where the host budget cannot hold what it
    keeps in memory (`CostTable.on_disk`)."""
    schedule = schedule_for(table, choice)
    used = set(table.used_groups)
    resident_bytes = sum(table.groups[g].nbytes for g in choice.resident & used)
    slots = (schedule_pool_bytes(schedule, lambda g: table.groups[g].slot_class)
             + table.routed_slot_bytes(choice.resident))
    disk = table.on_disk(choice.resident)
    time_s = math.inf if disk is None else table.call_overhead_s + _replay(table, schedule, disk=disk)
    return Prediction(time_s, table.compute_s,
                      sum(table.transfer_s(i.group, i.group in (disk or ())) for i in schedule.instances),
                      resident_bytes + slots, resident_bytes, table.activation_bytes,
                      len(schedule.instances), schedule, table.call_overhead_s, disk or frozenset(),
                      choice.resident & used)


def _replay(table: CostTable, schedule: Schedule, events: list | None = None,
            disk: frozenset[int] = frozenset()) -> float:
    """Forward time of a schedule: waits in order, each issuing the prefetches the schedule puts there.
    With carried instances (wrap-around) it is a steady-state call: they were issued by the previous call at
    their carry points, so they are ready at the start unless the copies ran past the end of that call.
    ``events`` collects (kind, group, start, end) for a timeline."""
    instances = schedule.instances
    carried = schedule.carried
    issued_at: dict[int, list[int]] = {}
    for inst in instances:
        if inst.index not in carried:
            issued_at.setdefault(schedule.prefetch_at[inst.index], []).append(inst.index)
    carried_at: dict[int, list[int]] = {}
    for index, at in schedule.carry_at:
        carried_at.setdefault(at, []).append(index)
    clock = copy_free = 0.0
    position = 0
    done: dict[int, float] = {i: 0.0 for i in carried}
    carried_done: dict[int, float] = {}
    record = events.append if events is not None else (lambda _: None)

    def issue(index: int, into: dict[int, float]) -> None:
        nonlocal clock, copy_free
        group = instances[index].group
        seconds = table.transfer_s(group, group in disk)
        if table.overlap:
            start = max(clock, copy_free)
            copy_free = into[index] = start + seconds
        else:
            start, clock = clock, clock + seconds
            into[index] = clock
        record(("transfer", group, start, into[index]))

    for inst in instances:
        record(("compute", -1, clock, clock + table.compute_between(position, inst.start)))
        clock += table.compute_between(position, inst.start)
        position = inst.start
        for ahead in issued_at.get(inst.index, ()):
            issue(ahead, done)
        for index in carried_at.get(inst.index, ()):
            issue(index, carried_done)
        clock = max(clock, done[inst.index])
    record(("compute", -1, clock, clock + table.compute_between(position, len(table.node_seconds))))
    clock += table.compute_between(position, len(table.node_seconds))
    for index in carried_at.get(len(instances), ()):
        issue(index, carried_done)
    # copies still running at the end delay the next call's first wait: charged to this call
    return max([clock] + list(carried_done.values()))


def timeline(table: CostTable, choice: Choice) -> list[tuple[str, int, float, float]]:
    events: list[tuple[str, int, float, float]] = []
    _replay(table, schedule_for(table, choice), events, table.on_disk(choice.resident) or frozenset())
    return events


# -- the search ---------------------------------------------------------------------------------------

class InfeasibleBudgetError(ValueError):
    """No plan fits the device budget; ``needed_bytes`` is the smallest budget that works."""

    def __init__(self, message: str, needed_bytes: int, budget_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.budget_bytes = budget_bytes


@dataclasses.dataclass(frozen=True)
class Solution:
    choice: Choice
    prediction: Prediction
    optimal: bool  # the search finished: no choice is faster (within the model)
    nodes: int


def _faster(a: Prediction, b: Prediction) -> bool:
    return a.time_s < b.time_s and not math.isclose(a.time_s, b.time_s, rel_tol=1e-12, abs_tol=1e-15)


def _better(a: Prediction, b: Prediction | None) -> bool:
    """Faster; among equally fast (within rounding), a lower peak, then fewer fetches."""
    if b is None or _faster(a, b):
        return True
    return not _faster(b, a) and (a.peak_bytes, a.fetches) < (b.peak_bytes, b.fetches)


def prefetch_depths(table: CostTable, max_prefetch: int) -> range:
    """Depths that can differ: beyond (fetches - 1) every fetch is issued at the first wait anyway."""
    fetches = len(build_schedule(list(table.uses), 0).instances)
    return range(0, max(min(max_prefetch, fetches - 1), 0) + 1)


def minimum_budget(table: CostTable, max_nodes: int = 20000) -> tuple[int, Prediction]:
    """The smallest peak of any plan. Prefetching only lengthens fetches' lives, so depth 0; the residency
    search is a branch and bound: resident bytes plus the largest group not resident bounds a peak below.
    Keeping a group resident can lower the peak: a group read in more than ``max_runs`` separate runs is
    fetched once for its whole span, and a resident group between its runs can merge them."""
    best = predict(table, Choice(frozenset(), 0))
    order = sorted(table.used_groups, key=lambda g: (-table.groups[g].nbytes, g))
    suffix_max = [0] * (len(order) + 1)  # a group resident holds its bytes, streamed at least its streamed bytes
    for i in range(len(order) - 1, -1, -1):
        suffix_max[i] = max(table.streamed_bytes(order[i]), suffix_max[i + 1])
    nodes = 0

    def search(i: int, resident: frozenset[int], resident_bytes: int, largest_streamed: int) -> None:
        nonlocal best, nodes
        nodes += 1
        if nodes > max_nodes or (table.activation_bytes + resident_bytes + max(largest_streamed, suffix_max[i])
                                 >= best.peak_bytes):
            return
        if i == len(order):
            prediction = predict(table, Choice(resident, 0))
            if prediction.peak_bytes < best.peak_bytes:
                best = prediction
            return
        g, size = order[i], table.groups[order[i]].nbytes
        search(i + 1, resident, resident_bytes, max(largest_streamed, table.streamed_bytes(g)))
        search(i + 1, resident | {g}, resident_bytes + size, largest_streamed)

    search(0, frozenset(), 0, 0)
    return best.peak_bytes, best


def infeasible_message(table: CostTable, budget_bytes: int) -> InfeasibleBudgetError:
    needed, prediction = minimum_budget(table)
    mib = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
    resident = sorted(prediction.resident_groups)
    live = resident + _live_at_peak(prediction.schedule, table)
    parts = " + ".join(f"{table.groups[g].name!r} {mib(table.groups[g].nbytes)}" for g in live) or "none"
    return InfeasibleBudgetError(
        f"device_budget_gb={budget_bytes / GIB:.4g} ({budget_bytes} B) is too small: the smallest plan needs "
        f"{needed / GIB:.4g} GiB ({needed} B) = activations {mib(table.activation_bytes)} + weights "
        f"{mib(prediction.weights_peak_bytes)} on the device at its peak ({parts}). Set device_budget_gb >= "
        f"{math.ceil(needed / GIB * 1e6) / 1e6}, or shrink what is live at the peak "
        f"(blocks_per_group=1, a shorter input)", needed, budget_bytes)


def _live_at_peak(schedule: Schedule, table: CostTable) -> list[int]:
    """Streamed groups alive together at the schedule's peak."""
    windows = [[i.group for i in schedule.instances
                if schedule.instances[schedule.prefetch_at[i.index]].start <= inst.start <= i.end]
               for inst in schedule.instances]
    return max(windows, key=lambda gs: sum(table.groups[g].nbytes for g in gs), default=[])


def solve(table: CostTable, budget_bytes: int, max_prefetch: int = 4, max_nodes: int = 5000) -> Solution:
    """The fastest (resident set, prefetch depth) whose predicted peak fits ``budget_bytes``."""
    needed, _ = minimum_budget(table)
    if needed > budget_bytes:
        raise infeasible_message(table, budget_bytes)
    used = table.used_groups
    order = sorted(used, key=lambda g: (-table.groups[g].nbytes, g))  # big decisions first
    nbytes = [table.groups[g].nbytes for g in order]
    streamed = [table.streamed_bytes(g) for g in order]  # at most nbytes: a routed group's row slots
    # suffix_max[i]: the least any of order[i:] holds, resident or streamed, at its largest
    suffix_max = [0] * (len(order) + 1)
    for i in range(len(order) - 1, -1, -1):
        suffix_max[i] = max(streamed[i], suffix_max[i + 1])
    state = {"best": None, "choice": None, "nodes": 0}

    def offer(choice: Choice, prediction: Prediction) -> None:
        if (prediction.peak_bytes <= budget_bytes and math.isfinite(prediction.time_s)
                and _better(prediction, state["best"])):
            state["best"], state["choice"] = prediction, choice

    def search(depth: int, i: int, resident: frozenset[int], resident_bytes: int, largest_streamed: int) -> None:
        state["nodes"] += 1
        if state["nodes"] > max_nodes:
            return
        if table.activation_bytes + resident_bytes + max(largest_streamed, suffix_max[i]) > budget_bytes:
            return
        best = state["best"]
        if best is not None:
            room = budget_bytes - resident_bytes
            # a routed group streamed is never fetched whole: its time is not in the replay either
            decided_streamed = set(order[:i]) - resident - table.routed_groups
            bound = (_overlap_bound(table, decided_streamed) if table.overlap
                     else _inline_bound(table, order, i, resident, room, largest_streamed))
            if not _faster_than_bound(best, bound):
                return
        optimistic = Choice(resident | frozenset(order[i:]), depth)
        offer(optimistic, predict(table, optimistic))
        if i == len(order):
            return
        g = order[i]
        search(depth, i + 1, resident | {g}, resident_bytes + nbytes[i], largest_streamed)
        search(depth, i + 1, resident, resident_bytes, max(largest_streamed, streamed[i]))

    for depth in prefetch_depths(table, max_prefetch):
        offer(Choice(frozenset(), depth), predict(table, Choice(frozenset(), depth)))
        search(depth, 0, frozenset(), 0, 0)
    if state["best"] is None:  # minimum_budget guarantees a choice within the device budget: the host's failed
        raise _host_infeasible(table, budget_bytes)
    return Solution(state["choice"], state["best"], state["nodes"] <= max_nodes, state["nodes"])


def _host_infeasible(table: CostTable, budget_bytes: int) -> InfeasibleBudgetError:
    """No plan within the device budget leaves few enough bytes in host memory: the resident groups' host copies
    stay there, so the host budget must hold what the device budget forces resident."""
    return InfeasibleBudgetError(
        f"host_budget_gb={table.host_budget / GIB:.4g} cannot hold what every plan within device_budget_gb="
        f"{budget_bytes / GIB:.4g} keeps in host memory (the host copies of the groups it keeps resident, and the "
        f"groups no plan streams); raise host_budget_gb, or lower device_budget_gb so that more is streamed",
        table.host_budget or 0, budget_bytes)


def _faster_than_bound(best: Prediction, bound_s: float) -> bool:
    return bound_s < best.time_s and not math.isclose(bound_s, best.time_s, rel_tol=1e-12, abs_tol=1e-15)


def _overlap_bound(table: CostTable, streamed: set[int]) -> float:
    """A lower bound on the time of any plan streaming at least ``streamed``, copies beside compute: each of
    these groups is fetched at least once before its first use, on one copy engine that never idles. With
    wrap-around a call's first copies run in the previous call, so only the copy engine's total counts."""
    if table.carry:
        return table.call_overhead_s + max(table.compute_s, sum(table.transfer_s(g) for g in streamed))
    first = table.first_use()
    clock = copy_free = 0.0
    position = 0
    for start, g in sorted((first[g], g) for g in streamed):
        clock += table.compute_between(position, start)
        position = start
        copy_free += table.transfer_s(g)
        clock = max(clock, copy_free)
    return table.call_overhead_s + clock + table.compute_between(position, len(table.node_seconds))


def _inline_bound(table: CostTable, order: list[int], i: int, resident: frozenset[int], room: int,
                  largest_streamed: int) -> float:
    """A lower bound on the time below a node when fetches run inline: every streamed group is fetched at
    least once, and the undecided groups kept resident must fit the room left (a fractional knapsack,
    keeping resident first the groups dearest to stream per byte)."""
    decided = set(order[:i])
    streamed_s = sum(table.transfer_s(g) for g in decided - resident - table.routed_groups)
    room -= table.activation_bytes + largest_streamed
    # a routed group costs no fetch time streamed (see `schedule_for`): keeping it resident saves none
    rest = sorted((g for g in order[i:] if g not in table.routed_groups),
                  key=lambda g: -table.transfer_s(g) / max(table.groups[g].nbytes, 1))
    for g in rest:
        size = table.groups[g].nbytes
        keep = 1.0 if size <= room else max(room, 0) / size
        room -= size
        streamed_s += (1.0 - keep) * table.transfer_s(g)
    return table.call_overhead_s + table.compute_s + streamed_s


def solve_brute_force(table: CostTable, budget_bytes: int, max_prefetch: int = 4) -> Solution:
    """Every residency subset and depth; for checking `solve` on small tables."""
    used = table.used_groups
    best, best_choice = None, None
    for depth in range(max_prefetch + 1):
        for r in range(len(used) + 1):
            for resident in itertools.combinations(used, r):
                choice = Choice(frozenset(resident), depth)
                prediction = predict(table, choice)
                if prediction.peak_bytes <= budget_bytes and _better(prediction, best):
                    best, best_choice = prediction, choice
    if best is None:
        raise infeasible_message(table, budget_bytes)
    return Solution(best_choice, best, True, 0)
