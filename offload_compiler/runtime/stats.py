"""What a runtime reports: its counters as `OffloadStats` (bytes moved, the ledger's peak, what is held on the
device now), and its plan for people (`describe`). Reads, never changes, the runtime's state.
"""

from __future__ import annotations

import dataclasses

import torch

from .layout import Group


@dataclasses.dataclass(frozen=True)
class OffloadStats:
    bytes_transferred: int
    peak_resident_bytes: int
    fetch_count: int
    live_device_bytes: int  # device weight copies alive now
    resident_bytes: int  # persistent device copies of resident groups held now
    streamed_bytes: int  # weights of the groups that are streamed per use
    total_bytes: int  # all weights of the model
    parked_bytes: int = 0  # components kept on the device after their forward (alternating, model)
    unmanaged_bytes: int = 0  # weights outside every group, living on the compute device
    carried_bytes: int = 0  # prefetched by the last call for the next one (prefetch_next_call), held now
    carry_hits: int = 0  # calls' first fetches served by the previous call's prefetch
    on_demand_bytes: int = 0  # weights read outside an offloaded graph, each op's copy fetched for it alone
    disk_bytes_read: int = 0  # of bytes_transferred, read from the disk tier's files (host_budget_gb)
    disk_bytes: int = 0  # weights whose host copy is on disk, not in host memory
    routed_bytes: int = 0  # of bytes_transferred, moved by routed fetches (the rows indices named: a table's
    # lookups, the experts routed to)
    routed_fetches: int = 0  # routed fetches run (one per weight read by indices per call)
    expert_bytes: int = 0  # of bytes_transferred, fused expert weights moved (whole fetches and routed ones)
    calls: int = 0  # offloaded graph calls since the last reset
    # device memory held for weights from the first call on (`held_device_weight_bytes`): the slots every
    # streamed copy lands in (the pool, allocated whole, filled or not), routed slots, resident groups, and the
    # weights outside the groups. ``peak_resident_bytes`` (the ledger) counts only slots while a copy fills them
    pool_bytes: int = 0  # of it, the device slots: the pool's and the routed fetches'
    device_weight_bytes: int = 0
    # the model is its one component (`Group.whole_model`): its slots are held only while a call runs, so
    # ``device_weight_bytes`` is held during a call and, between calls, only ``unmanaged_bytes``
    slots_given_back: bool = False
    # fetches the plans made that a copy held within the call served instead, moving nothing: the parts that code
    # dynamo ran without a graph called one by one, each a graph of its own over the same group
    # (`TransferEngine.holding_copies`); bytes_transferred + held_hit_bytes is what the plans fetched
    held_hits: int = 0
    held_hit_bytes: int = 0

    @property
    def expert_bytes_per_call(self) -> float:
        """Expert weight bytes moved per offloaded graph call (a decode step is one call)."""
        return self.expert_bytes / self.calls if self.calls else 0.0

    @property
    def peak_device_weight_bytes(self) -> int:
        """Device memory held for weights at its most: what the plan holds (`device_weight_bytes`: the slot
        pool is allocated whole at the first call and kept), at least the ledger's peak of copies in flight
        plus the weights that never leave the device (a runtime that has not planned holds no slots yet)."""
        return max(self.device_weight_bytes, self.peak_resident_bytes + self.unmanaged_bytes)

    def __str__(self) -> str:
        # each figure in the unit that shows it (`readable_bytes`): a routed fetch or a carried copy of a small
        # model is kilobytes, which a fixed MiB printed as 0.00
        size = readable_bytes
        total = self.total_bytes + self.unmanaged_bytes
        kept = f", {size(self.unmanaged_bytes)} kept on the device" if self.unmanaged_bytes else ""
        carried = (f"; {size(self.carried_bytes)} prefetched for the next call ({self.carry_hits} used)"
                   if self.carried_bytes or self.carry_hits else "")
        carried += (f"; {size(self.on_demand_bytes)} fetched on demand outside the offloaded graphs"
                    if self.on_demand_bytes else "")
        carried += (f"; {size(self.disk_bytes)} on disk, {size(self.disk_bytes_read)} read from it"
                    if self.disk_bytes else "")
        carried += (f"; {counted(self.held_hits, 'planned fetch', 'planned fetches')} served by copies held within "
                    f"the call ({size(self.held_hit_bytes)} not moved)" if self.held_hits else "")
        carried += (f"; experts {size(self.expert_bytes_per_call)} per call" if self.expert_bytes else "")
        carried += (f"; {size(self.routed_bytes)} in {counted(self.routed_fetches, 'routed fetch', 'routed fetches')} "
                    f"(the rows indices named)" if self.routed_fetches else "")
        held = (f"while a call runs (between calls {size(self.unmanaged_bytes)}: its device slots are given back "
                f"after each call) " if self.slots_given_back else "")
        return (f"moved {size(self.bytes_transferred)} in {counted(self.fetch_count, 'fetch', 'fetches')}; "
                f"device weights held {size(self.peak_device_weight_bytes)} of {size(total)} {held}"
                f"({size(self.pool_bytes)} of device slots; {size(self.resident_bytes)} resident, "
                f"{size(self.streamed_bytes)} streamed{kept}); copies in flight at most "
                f"{size(self.peak_resident_bytes)}{carried}")


def _slot_sizes(pool) -> dict[int, int]:
    """Slot bytes -> how many slots of that size, in the pool's order (a kind's shared slots may differ)."""
    counts: dict[int, int] = {}
    for slots in pool.slots.values():
        for slot in slots:
            counts[slot.nbytes] = counts.get(slot.nbytes, 0) + 1
    return counts


def held_pool_bytes(runtime) -> int:
    """The device slots a runtime's compiled graphs planned (`DevicePool`, each slot of its size class) and its
    routed fetches' slots: allocated at the first call, held until the runtime goes."""
    return runtime.pool.nbytes + runtime.transfers.routed_slot_bytes


def held_device_weight_bytes(runtime) -> int:
    """Device memory a runtime holds for weights once its compiled graphs ran: its slots (`held_pool_bytes`),
    the resident groups its graphs read (each copied once, kept) and the weights outside the groups. The
    ledger's peak counts a slot only while a copy fills it; the memory is held whether or not it is filled --
    but for a model that is its one component (``runtime.gives_back_slots``) only while a call runs."""
    resident = set().union(*(p.verified.resident_groups for p in runtime.graph_plans))
    return (held_pool_bytes(runtime) + sum(runtime.groups[g].nbytes for g in resident)
            + runtime.unmanaged_bytes)


def describe(runtime) -> str:
    """The plan of ``runtime`` (an `OffloadRuntime`) for people: each group's bytes and residency, and each
    graph's fetches and peak."""
    mib = lambda n: f"{n / 2**20:9.3f} MiB"  # noqa: E731
    policy = runtime.policy
    lines = [f"offload plan for {runtime.model_name}: strategy={policy.strategy} device={runtime.device} "
             f"prefetch={policy.prefetch}{' (wraps to the next call)' if policy.prefetch_next_call else ''} "
             f"compiler={policy.compiler} pinned={runtime.pinned}"
             + (f" rank={torch.distributed.get_rank()}/{torch.distributed.get_world_size()} (bytes are this "
                f"rank's)" if torch.distributed.is_available() and torch.distributed.is_initialized() else "")]
    for g in runtime.groups:
        residency = "streamed" if g.streamed else "resident" if g.nbytes else "empty (no bytes, never fetched)"
        whole = ("  (the whole model, its one component: fetched for each call, its device memory given back "
                 "after it)" if g.whole_model else "")
        lines.append(f"  group {g.index:3d} {g.name:<40s} {readable_bytes(g.nbytes):>13s}  "
                     f"{residency}{' from disk' if g.on_disk else ''}{_subclass_note(g)}{whole}")
    for i, plan in enumerate(runtime.graph_plans):
        v = plan.verified
        carried = f"; {readable_bytes(v.carried_bytes)} prefetched for its next call" if v.carried_bytes else ""
        routed = (f" + {v.routed_fetches} routed (at most {readable_bytes(v.routed_bound_bytes)})"
                  if v.routed_fetches else "")
        lines.append(f"  graph {i}: {plan.num_nodes} nodes, {v.fetches} fetches{routed} per call, "
                     f"predicted peak {mib(v.peak_bytes)} ({mib(v.resident_bytes)} resident + "
                     f"{mib(v.streamed_peak_bytes)} streamed{carried}); device slots {mib(plan.pool_bytes)}")
        lines += _expert_lines(runtime, plan)
    pool = runtime.pool
    if pool.slots:
        lines.append(f"  device pool {mib(pool.nbytes)}: "
                     + ", ".join(f"{count} x {readable_bytes(nbytes)}" for nbytes, count in _slot_sizes(pool).items()))
    resident = sum(g.nbytes for g in runtime.groups if not g.streamed)
    total, unmanaged = runtime.total_bytes, runtime.unmanaged_bytes
    lines.append(f"  total {mib(total + unmanaged)}: {mib(resident)} resident, {mib(total - resident)} streamed"
                 + (f", {mib(unmanaged)} outside the groups (kept on the device)" if unmanaged else ""))
    if policy.host_budget_gb is not None:
        host, disk = runtime.host.host_bytes, runtime.host.disk_bytes
        lines.append(f"  host tier {mib(host)} in host memory (host_budget_gb={policy.host_budget_gb:g}), disk tier "
                     f"{mib(disk)} in files under {policy.disk_dir}, read at each of their fetches")
    return "\n".join(lines)


def _expert_lines(runtime, plan) -> list[str]:
    """For `describe`: how a graph fetches each group it reads by indices (routed: the rows named, at most the
    bound its shapes allow: a table's lookups, the experts the router names) and each expert group it fetches
    whole (the bound is every expert, or the experts are not read by router indices)."""
    lines = []
    for r in plan.routed:
        name = runtime.groups[r.group].slots[r.slot].name  # (as compiled: a remapped call reads another layer's)
        how = ", offsets remapped" if r.grouped else ""  # a grouped product's operand (`grouped_mm` experts)
        unit = "expert" if r.group in runtime.expert_groups else "row"
        lines.append(f"    routed {name}: at most {r.bound} of {r.experts} {unit}s per call "
                     f"({readable_bytes(r.bound_bytes)} slot, {readable_bytes(r.expert_bytes)} per {unit}{how})")
    routed = {r.group for r in plan.routed}
    whole = sorted({i.group for i in plan.schedule.instances if i.group in runtime.expert_groups} - routed)
    for group in whole:
        lines.append(f"    whole {runtime.groups[group].name}: all experts fetched (bound is every expert, or read "
                     f"other than by router indices)")
    return lines


def counted(n: int, one: str, many: str) -> str:
    """``n`` with its noun, singular for one: ``1 routed fetch``, ``3 routed fetches``."""
    return f"{n} {one if n == 1 else many}"


def readable_bytes(nbytes: int) -> str:
    """``nbytes`` in the largest unit that keeps it at 1 or more (``64 B``, ``1.500 KiB``, ``142.000 MiB``): a
    small group reads as its bytes, not as ``0.000 MiB``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.3f} {unit}"
    return f"{nbytes} B"


def _subclass_note(group: Group) -> str:
    """For `describe`: the group's subclass weights, which move as their inner tensors."""
    kinds: dict[tuple[str, str], int] = {}
    for slot in group.slots:
        if slot.rebuild is not None:
            placements = getattr(slot.tensor, "placements", None)  # a DTensor's sharding
            kind = (slot.rebuild.cls.__name__, f" ({'/'.join(map(str, placements))})" if placements else "")
            kinds[kind] = kinds.get(kind, 0) + 1
    if not kinds:
        return ""
    return "  (inner tensors of " + ", ".join(f"{n} {name} weights{detail}"
                                              for (name, detail), n in sorted(kinds.items())) + ")"
