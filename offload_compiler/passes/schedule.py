"""Schedule: where each streamed group is prefetched, waited for and evicted, from graph positions alone.

A *use* of a group is one node that reads its weights directly, spanning from that node to the last node
that reads them through views. Uses of a group that follow each other with no other group's use between
form a *run*; each run is one *fetch instance* (fetched, used, evicted). A group used in more than
``max_runs`` separated runs (a weight read in every block) is fetched once for its whole span instead.
"""

from __future__ import annotations

import dataclasses


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


def build_schedule(uses: list[Use], prefetch: int, max_runs: int = 2) -> Schedule:
    """Fetch instances ordered by first use; instance i is prefetched at the wait of instance i - prefetch."""
    spans = []
    for group, group_runs in _runs(uses).items():
        if len(group_runs) > max_runs:
            group_runs = [[u for run in group_runs for u in run]]
        for run in group_runs:
            spans.append((min(u.start for u in run), group, max(u.end for u in run), tuple(run)))
    spans.sort(key=lambda s: (s[0], s[1]))
    instances = tuple(Instance(i, group, start, end, run) for i, (start, group, end, run) in enumerate(spans))
    return Schedule(instances, _prefetch_points(instances, prefetch), prefetch)


def _prefetch_points(instances: tuple[Instance, ...], prefetch: int) -> tuple[int, ...]:
    """Instance i is prefetched at the wait of instance i - prefetch, but never before the previous copy of
    its group was evicted (a weight used at both ends must not be on the device twice), and in order."""
    points: list[int] = []
    last_end: dict[int, int] = {}
    for inst in instances:
        at = max(inst.index - prefetch, 0, points[-1] if points else 0)
        previous_end = last_end.get(inst.group)
        if previous_end is not None:
            while instances[at].start <= previous_end:
                at += 1
        points.append(at)
        last_end[inst.group] = inst.end
    return tuple(points)


def peak_bytes(schedule: Schedule, nbytes: dict[int, int]) -> int:
    """Peak of streamed bytes alive at once when prefetches, waits and evicts run in schedule order."""
    events: list[tuple[int, int, int]] = []  # (position, order within position, delta)
    for inst in schedule.instances:
        events.append((schedule.instances[schedule.prefetch_at[inst.index]].start, 0, nbytes[inst.group]))
        events.append((inst.end, 1, -nbytes[inst.group]))
    live = peak = 0
    for _, _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return peak
