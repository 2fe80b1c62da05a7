"""Schedule: where each streamed group is prefetched, waited for and evicted, from graph positions alone.

A *use* of a group is one node that reads its weights directly, spanning from that node to the last node
that reads them through views. Uses of a group that follow each other with no other group's use between
form a *run*; each run is one *fetch instance* (fetched, used, evicted). A group used in more than
``max_runs`` separated runs (a weight read in every block) is fetched once for its whole span instead.

With ``carry`` (prefetch wrap-around), the instances a call would prefetch at its very start are instead
prefetched near the end of the previous call, where the next call's instances would be prefetched if the
calls were one long sequence: their copies overlap the last groups' compute, and they stay on the device
between calls (the graph's initial live bytes). That includes the first ``prefetch + 1`` reads of groups on
disk (``read_ahead``), which a call issues at its start: the previous call issues them once the reads before
them in the cyclic order were waited for, so the disk reads on across the calls' boundary.
"""

from __future__ import annotations

import dataclasses

# prefetch modes (`ops.prefetch`, `OffloadRuntime.prefetch`): copy now; take the copy the previous call carried,
# else copy; carry to the next call
FETCH, ADOPT, CARRY = 0, 1, 2
# a group read in more separated runs than this is fetched once for its whole span (`build_schedule`)
MAX_RUNS = 2


@dataclasses.dataclass(frozen=True)
class Use:
    group: int
    start: int  # position of the node reading the weight directly
    end: int    # position of the last node reading it through views
    key: object = None  # identifies the use for the rewrite (the reading node)


@dataclasses.dataclass(frozen=True)
class Instance:
    index: int
    group: int
    start: int
    end: int
    uses: tuple[Use, ...]


@dataclasses.dataclass(frozen=True)
class Schedule:
    instances: tuple[Instance, ...]
    prefetch_at: tuple[int, ...]  # instance i is prefetched just before the wait of instance prefetch_at[i]
    prefetch: int
    # (instance, at): the instance's copy for the next call is prefetched before the wait of instance `at`,
    # or after the graph's last node when `at` is the number of instances
    carry_at: tuple[tuple[int, int], ...] = ()

    @property
    def carried(self) -> frozenset[int]:
        return frozenset(i for i, _ in self.carry_at)

    def instance_of(self) -> dict[object, Instance]:
        return {use.key: inst for inst in self.instances for use in inst.uses}


def _runs(uses: list[Use]) -> dict[int, list[list[Use]]]:
    runs: dict[int, list[list[Use]]] = {}
    ends: dict[int, int] = {}
    previous = None
    for use in sorted(uses, key=lambda u: (u.start, u.group, u.end)):
        group_runs = runs.setdefault(use.group, [])
        if group_runs and (previous == use.group or use.start <= ends[use.group]):
            group_runs[-1].append(use)
            ends[use.group] = max(ends[use.group], use.end)
        else:
            group_runs.append([use])
            ends[use.group] = use.end
        previous = use.group
    return runs


def build_schedule(uses: list[Use], prefetch: int, max_runs: int = MAX_RUNS, carry: bool = False,
                   read_ahead: frozenset[int] = frozenset()) -> Schedule:
    """Fetch instances ordered by first use; instance i is prefetched at the wait of instance i - prefetch
    (an instance of a ``read_ahead`` group, on disk: at the latest, at the wait of the previous such instance);
    with ``carry``, the first ones are prefetched for the next call at the end of this one."""
    spans = []
    for group, group_runs in _runs(uses).items():
        if len(group_runs) > max_runs:
            group_runs = [[u for run in group_runs for u in run]]
        for run in group_runs:
            spans.append((min(u.start for u in run), group, max(u.end for u in run), tuple(run)))
    spans.sort(key=lambda s: (s[0], s[1]))
    instances = tuple(Instance(i, group, start, end, run) for i, (start, group, end, run) in enumerate(spans))
    points = _prefetch_points(instances, prefetch, read_ahead)
    carried = _carry_points(instances, points, prefetch, read_ahead) if carry else ()
    return Schedule(instances, points, prefetch, carried)


def _prefetch_points(instances: tuple[Instance, ...], prefetch: int, read_ahead: frozenset[int] = frozenset()
                     ) -> tuple[int, ...]:
    """Instance i is prefetched at the wait of instance i - prefetch, but never before the previous copy of
    its group was evicted (a weight used at both ends must not be on the device twice), and in order -- except
    an instance of a ``read_ahead`` group (on disk), prefetched at the wait of the read-ahead instance
    ``prefetch + 1`` before it where that is earlier, the first ``prefetch + 1`` at the call's start: a read
    takes longer than a copy from memory, and the worker reads one file at a time, in the order issued, so the
    reads are issued by their own count, not by the groups between them: the disk reads from the call's start,
    the reads overlap the groups in memory between them, and when a read ends the next one is already queued
    even where the call has not yet reached the group just read (it computes groups in memory before it). Its
    slot is held from there: the plan's peak counts it."""
    points: list[int] = []
    last_end: dict[int, int] = {}
    ordered = 0  # the latest point so far: the other prefetches keep their order
    reads: list[int] = []  # the read-ahead instances so far
    for inst in instances:
        at = max(inst.index - prefetch, 0, ordered)
        if inst.group in read_ahead:
            if prefetch > 0:
                at = min(at, reads[-prefetch - 1] if len(reads) > prefetch else 0)
            reads.append(inst.index)
        previous_end = last_end.get(inst.group)
        if previous_end is not None:
            while instances[at].start <= previous_end:
                at += 1
        points.append(at)
        ordered = max(ordered, at)
        last_end[inst.group] = inst.end
    return tuple(points)


def _carry_points(instances: tuple[Instance, ...], points: tuple[int, ...], prefetch: int,
                  read_ahead: frozenset[int] = frozenset()) -> tuple[tuple[int, int], ...]:
    """Where the next call's first instances (those prefetched at the very start) are prefetched in this call,
    as if calls were one sequence (`_cyclic_points`), but after this call's last copy of their group is gone,
    after every other prefetch, and in the order of those points (reads from disk stay in their order: the
    worker reads them in the order issued)."""
    n = len(instances)
    last_end: dict[int, int] = {}
    for inst in instances:
        last_end[inst.group] = inst.end
    carry: list[tuple[int, int]] = []
    at = max(points, default=0)
    wanted = _cyclic_points(instances, points, prefetch, read_ahead)
    for index in sorted(wanted, key=lambda i: (wanted[i], i)):
        at = max(at, wanted[index])
        while at < n and instances[at].start <= last_end[instances[index].group]:
            at += 1
        carry.append((index, at))
    return tuple(carry)


def _cyclic_points(instances: tuple[Instance, ...], points: tuple[int, ...], prefetch: int,
                   read_ahead: frozenset[int]) -> dict[int, int]:
    """instance -> where the previous call would prefetch it if calls were one sequence: the first ``prefetch``
    instances at the wait of instance n - prefetch + i; the first ``prefetch + 1`` instances of ``read_ahead``
    groups (read from the call's start, `_prefetch_points`) at the wait of the read ``prefetch + 1`` before
    them counting on from the previous call's reads (0 where the previous call has too few), whichever is
    earlier. Only instances prefetched at the call's start, and each list up to its first that is not."""
    n = len(instances)
    wanted: dict[int, int] = {}
    for inst in instances[:prefetch]:
        if points[inst.index] != 0:
            break
        wanted[inst.index] = n - prefetch + inst.index
    reads = [inst.index for inst in instances if inst.group in read_ahead]
    for k, index in enumerate(reads[:prefetch + 1] if prefetch > 0 else []):
        if points[index] != 0:
            break
        before = len(reads) + k - prefetch - 1  # the read prefetch + 1 before it, in the previous call
        wanted[index] = min(wanted.get(index, n), reads[before] if before >= 0 else 0)
    return wanted


def peak_bytes(schedule: Schedule, nbytes: dict[int, int]) -> int:
    """Peak of streamed bytes alive at once when prefetches, waits and evicts run in schedule order; carried
    copies are alive from the start (fetched by the previous call) and again from their carry point."""
    events: list[tuple[float, int, int]] = []  # (position, order within position, delta)
    carried = schedule.carried
    for inst in schedule.instances:
        if inst.index not in carried:
            events.append((schedule.instances[schedule.prefetch_at[inst.index]].start, 0, nbytes[inst.group]))
        events.append((inst.end, 1, -nbytes[inst.group]))
    for index, at in schedule.carry_at:
        position = schedule.instances[at].start if at < len(schedule.instances) else float("inf")
        events.append((position, 0, nbytes[schedule.instances[index].group]))
    live = peak = sum(nbytes[schedule.instances[i].group] for i in carried)
    for _, _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return peak
