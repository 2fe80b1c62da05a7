"""The transfer engine: what the graph's transfer ops do. A prefetch copies a group's host buffers into the
device slot planned for its fetch key (or adopts the copy the previous call carried, or keeps a parked one),
a wait hands the slot to compute, an evict frees it (or parks it); resident groups keep a slot of their own.
It keeps the ledger, remaps group ids for a graph run on other layers' weights, releases what a failed call
held, and injects faults for tests.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import math
from typing import NamedTuple

import torch

from ..errors import OffloadRefusal
from ..passes.fuse import EVICT as EVICT_STEP
from ..passes.schedule import ADOPT, CARRY, FETCH
from .copier import CopyWorker
from .device import DeviceStreams
from .host import HostStore, stamp
from .layout import Group
from ..passes.slots import SHARED, Pooling, choose_pooling
from .slots import DevicePool, DeviceSlot, Ledger, size_class

CARRY_MISSES_TO_STOP = 2  # a key whose carried copies were dropped unused this often (never used) stops carrying


@dataclasses.dataclass
class Fault:
    stage: str
    group: int | None
    exception: BaseException
    times: int


class TransferPlan(NamedTuple):
    """A fused transfer: (is_evict, group, a, b) steps with (poison, park) for an evict and (key, mode) for a
    prefetch; then the wait for ``key`` of ``group``, or its resident copy when ``key`` is None."""
    steps: tuple[tuple[bool, int, int, int], ...]
    key: int | None
    group: int


@dataclasses.dataclass
class Carried:
    """A copy prefetched at the end of a call for the next call of the same graph."""
    group: int
    stamp: tuple  # the group's host weights when copied: a changed weight makes the copy stale
    slot: DeviceSlot


def _read_experts(file, leaf, experts: list[int], expert_bytes: int) -> torch.Tensor:
    """Rows ``experts`` of an expert weight whose bucket is on disk, read from its file into host memory."""
    rows = torch.empty((len(experts), *leaf.shape[1:]), dtype=leaf.value.dtype)
    start = leaf.offset * rows.element_size()
    for i, expert in enumerate(experts):
        file.read_range(start + expert * expert_bytes, rows[i])
    return rows


def _copy_group(buffers: list[torch.Tensor], group: Group) -> None:
    """A group's host buffers into a slot's buffers on the CPU: a group on disk read from its files, past the
    page cache."""
    for bi, (buf, bucket) in enumerate(zip(buffers, group.buckets)):
        if bucket.file is not None:
            _read_bucket(bucket, buf, group, bi)
        else:
            buf.copy_(bucket.source())


def _read_staged(staging: list[torch.Tensor | None], group: Group) -> None:
    """A group's buckets on disk into their host staging buffers (None: a bucket in memory), past the page
    cache."""
    for bi, (buffer, bucket) in enumerate(zip(staging, group.buckets)):
        if buffer is not None:
            _read_bucket(bucket, buffer, group, bi)


def _read_bucket(bucket, target: torch.Tensor, group: Group, index: int) -> None:
    """A bucket on disk into ``target``; an OS error (EIO, a file truncated) keeps its type and says which group
    it was reading, beside the bytes and the file the read itself names."""
    try:
        bucket.file.read_into(target)
    except OSError as exc:
        exc.add_note(f"offload_compiler: reading group {group.name!r} (bucket {index}, {bucket.nbytes} bytes, "
                     f"{bucket.dtype}) from the disk tier")
        raise


# what a call moved, counted since the last reset: one list, so that a counter added is reset and carried over
# (`continue_counters`) with the others
COUNTERS = ("bytes_transferred", "disk_bytes_read", "fetch_count", "carry_hits", "routed_bytes", "routed_fetches",
            "expert_bytes", "held_hits", "held_hit_bytes")


class TransferEngine:
    """The device copies of one runtime's groups and the transfers between host and device. Every copy lands
    in a pool slot planned for its fetch key (`plan_slots`); ``debug_poison`` fills evicted slots with NaN."""

    def __init__(self, host: HostStore, device: torch.device, streams: DeviceStreams | None,
                 debug_poison: bool) -> None:
        self.host = host
        self.groups = host.groups
        self.device = device
        self.streams = streams  # None without streams: copies then run in order on the one queue
        self.debug_poison = debug_poison
        self.captured = False  # a copy was issued inside a graph capture (see `_copy_on_stream`)
        self.group_remap: dict[int, int] | None = None  # per call: compiled group -> group of the weights passed
        self.used_groups: set[int] = set()  # groups a graph read in the current call (fetched or resident)
        self.ledger = Ledger()
        self.bytes_transferred = 0
        self.disk_bytes_read = 0  # of it, read from the disk tier's files
        self.fetch_count = 0
        self.carry_hits = 0
        # fetches a graph's plan made that a copy held within the call served instead (`holding`), and their bytes
        self.held_hits = self.held_hit_bytes = 0
        self.holding = 0  # > 0 while graphs run that hold their evicted copies (`holding`)
        self.routed_bytes = 0  # of bytes_transferred, moved by routed fetches (the rows indices named)
        self.routed_fetches = 0
        self.expert_groups: frozenset[int] = frozenset()  # (set by the runtime) groups of fused expert weights
        self.expert_bytes = 0  # of bytes_transferred, expert weights moved: whole fetches and routed ones
        self._routed_slots: dict[tuple, torch.Tensor] = {}  # (expert shape, dtype, bound) -> its fixed slot
        self.pool = DevicePool(device, streams)
        self._shared_kinds: dict[tuple, bool] = {}  # kind -> its groups share slots (decided by its first graph)
        self.copier = CopyWorker()  # disk reads beside compute (see `copier`): its thread starts at the first read
        self._slot_of: dict[int, DeviceSlot] = {}  # fetch key -> the pool slot its copy lands in (the plan)
        self._pending: dict[int, DeviceSlot] = {}  # fetch key -> slot being filled, not yet waited for
        self._live: dict[int, DeviceSlot] = {}  # group -> slot waited for, not yet evicted (this call)
        self._resident: dict[int, tuple[DeviceSlot, tuple]] = {}  # group -> its own slot, host stamp
        self._parked: dict[int, tuple[DeviceSlot, tuple]] = {}
        # group -> slot, host stamp, poison at release: evicted while `holding`
        self._held: dict[int, tuple[DeviceSlot, tuple, bool]] = {}
        self._carried: dict[int, Carried] = {}  # fetch key -> copy made by the previous call
        self._carry_used: set[int] = set()  # keys whose carried copy was taken at least once
        self._carry_misses: dict[int, int] = {}  # keys whose carried copy was dropped unused, how often
        self._faults: list[Fault] = []
        self._fetch_keys = itertools.count(1)
        self._transfer_plans: list[TransferPlan] = []  # see `plan_transfer`
        self._transfer_plan_index: dict[TransferPlan, int] = {}

    # -- planning, when a graph is compiled -----------------------------------------------------------
    def new_fetch_key(self) -> int:
        return next(self._fetch_keys)

    def pooling(self, events) -> Pooling:
        """How a graph with slot ``events`` (`passes.slots`) pools its fetches: per kind, slots per size class
        or shared by the kind, whichever the kind's first graph needed less of; the decision then holds for the
        runtime's later graphs (their slots are of the same pool)."""
        classes = frozenset(size_class(g) for g in self.groups if g.streamed)
        pooling, self._shared_kinds = choose_pooling(events, self.size_class_of, self._shared_kinds,
                                                     self.pool.sizes(), classes)
        return pooling

    def growable_slots(self) -> frozenset[tuple[tuple, int]]:
        """(slot class, index) of the shared slots a new graph's colouring may grow (`passes.slots._color`):
        those holding no copy of a call in progress or carried for the next one -- free, or holding a parked
        component, which goes, as it would at the slot's next fill (it stays only until another needs the
        room) -- and never filled inside a graph capture (a captured graph keeps its slots' addresses).
        `plan_slots` reallocates a grown one larger; the graphs planned before find their copies at its prefix
        (`DeviceSlot.buffers_for`). Without it a later graph's larger group of the kind got a slot of its own
        next to the free smaller one: a component per graph pooled every component's bytes."""
        busy = {*self._pending.values(), *self._live.values(), *(c.slot for c in self._carried.values())}
        parked = {slot for slot, *_ in (*self._parked.values(), *self._held.values())}
        return frozenset((cls, slot.index) for cls, slots in self.pool.slots.items() if cls[:1] == (SHARED,)
                         for slot in slots
                         if slot not in busy and not slot.filled_in_capture
                         and (slot.group is None or slot in parked))

    def size_class_of(self, group: int) -> tuple:
        return size_class(self.groups[group])

    def plan_slots(self, assignment: dict[int, tuple[int, int]], pooling: Pooling, sizes) -> None:
        """Bind each fetch key to its pool slot: ``assignment`` maps key -> (group, slot index within the
        group's slot class under ``pooling``), as the slot pass planned it, with ``sizes`` each slot's size
        (`passes.slots.sized_slots`: the slots earlier graphs planned are among them, unchanged); the pool grows
        to hold every slot named."""
        for cls, had in sizes.items():
            for slot, size in zip(self.pool.slots.get(cls, ()), had):
                if slot.size_class != size:  # grown (`growable_slots`): its copy goes, then its memory
                    self._vacate(slot)
                    if self.streams is not None:  # the allocator's reuse of it on compute after every copy
                        self.streams.order_compute_after_copies()
                    slot.resize(size)
            self.pool.reserve(cls, had)
        for key, (group, index) in assignment.items():
            self._slot_of[key] = self.pool.slots[pooling.slot_class(group)][index]

    def plan_transfer(self, steps: tuple[tuple[int, int, int, int], ...], key: int | None, group: int) -> int:
        """Record a fused transfer of a compiled graph (`passes.fuse`): the evicts and prefetches of ``steps``
        (kind, group, a, b), in order, then the wait for ``key`` (None: the resident copy of ``group``). Returns
        its index for `run_transfer`; the graph passes one int per call instead of the steps."""
        plan = TransferPlan(tuple((kind == EVICT_STEP, g, a, b) for kind, g, a, b in steps), key, group)
        index = self._transfer_plan_index.get(plan)
        if index is None:
            index = self._transfer_plan_index[plan] = len(self._transfer_plans)
            self._transfer_plans.append(plan)
        return index

    def plan_routed(self, reads) -> int:
        """The fixed slots of a graph's routed fetches (`passes.routed`), made now; returns their bytes. Reads
        of one expert shape, dtype and bound share a slot: each read holds it only while its op runs."""
        keys = {}
        for r in reads:
            group = self.groups[r.group]
            leaf = group.slots[r.slot].leaves[0]
            key = (tuple(leaf.shape[1:]), group.buckets[leaf.bucket].dtype, r.bound)
            if key not in self._routed_slots:
                self._routed_slots[key] = torch.empty((r.bound, *key[0]), dtype=key[1], device=self.device)
            keys[key] = r.bound_bytes
        return sum(keys.values())

    @property
    def routed_slot_bytes(self) -> int:
        """Device bytes of the routed fetches' slots, made when their graphs were planned."""
        return sum(t.nbytes for t in self._routed_slots.values())

    def routed(self, group: int, slot: int, ids: torch.Tensor, bound: int, expert_bytes: int) -> torch.Tensor:
        """``weight[ids]`` for a weight read by indices (router indices; a table's lookup, ``ids`` of any shape):
        the distinct rows ``ids`` names (at most ``bound``, the planned slot's size) are copied from the host into
        the slot, and the result is gathered from there with the indices remapped to the slot's rows."""
        # the indices are on the device: the copy must know them on the host (one small read)
        experts, rows = torch.unique(ids.to("cpu"), return_inverse=True)
        return self._routed_gather(group, slot, experts, rows, bound, expert_bytes)

    def routed_grouped(self, group: int, slot: int, offs: torch.Tensor, bound: int, expert_bytes: int
                       ) -> list[torch.Tensor]:
        """An expert weight read as a grouped product's operand (``grouped_mm(x, w, offs)``, the tokens sorted
        by expert, ``offs`` each expert's cumulative token count): the experts with tokens (at most ``bound``)
        are copied into ``bound`` rows, and the offsets remapped to them. The tokens stay where they are: the
        j-th expert with tokens ends at its own offset, and an expert without tokens is an empty group, so
        ``offs`` at the experts named, padded with the last offset (empty groups), is the compact weight's."""
        host_offs = offs.to("cpu")  # (on an accelerator, one small read as for `routed`)
        counts = torch.diff(host_offs, prepend=host_offs.new_zeros(1))
        experts = counts.nonzero().flatten()
        count = experts.numel()
        # the rows past the experts named repeat the last one (no tokens read them): a device-side gather
        rows = torch.arange(bound).clamp_(max=max(count - 1, 0))
        weight = self._routed_gather(group, slot, experts, rows, bound, expert_bytes)
        compact = torch.cat([host_offs[experts], host_offs[-1:].expand(bound - count)])
        return [weight, compact.to(offs.device)]

    def _routed_gather(self, group: int, slot: int, experts: torch.Tensor, rows: torch.Tensor, bound: int,
                       expert_bytes: int) -> torch.Tensor:
        """Copy ``experts`` (host indices, distinct) of a weight into its fixed slot and gather ``rows`` of the
        slot into a fresh tensor. The copy is synchronous: the op's result is all the graph reads, so the slot
        is free again when the op returns."""
        group = self.actual_group(group)
        g = self.groups[group]
        if not g.packed:
            self.host.pack(g)
        self.host.refresh(g)
        if self._faults:
            self._maybe_fail("fetch", group)
        self.used_groups.add(group)
        leaf = g.slots[slot].leaves[0]
        bucket = g.buckets[leaf.bucket]
        dtype = bucket.dtype
        count = experts.numel()
        if count and not 0 <= int(experts[0]) <= int(experts[-1]) < leaf.shape[0]:  # (sorted: torch.unique)
            raise IndexError(f"index out of range in self: {g.slots[slot].name} has {leaf.shape[0]} rows, an index "
                             f"named {int(experts[0]) if experts[0] < 0 else int(experts[-1])}")
        if count > bound or expert_bytes != math.prod(leaf.shape[1:]) * dtype.itemsize:
            raise AssertionError(f"routed fetch of {g.slots[slot].name}: {count} experts named, slot for {bound}")
        buffer = self._routed_slots[(tuple(leaf.shape[1:]), dtype, bound)]
        self.ledger.occupy(bound * expert_bytes)
        try:
            if bucket.file is not None:  # on disk: read just those experts' bytes (its file, past the page cache)
                buffer[:count].copy_(_read_experts(bucket.file, leaf, experts.tolist(), expert_bytes))
                self.disk_bytes_read += count * expert_bytes
            else:
                buffer[:count].copy_(leaf.host_view(bucket.source()).index_select(0, experts))
            out = buffer[rows.to(buffer.device)]
        finally:
            if self.debug_poison and buffer.is_floating_point():
                buffer.fill_(float("nan"))  # a read of the slot after the op shows as NaN
            self.ledger.release(bound * expert_bytes)
        self.bytes_transferred += count * expert_bytes
        self.routed_bytes += count * expert_bytes
        if group in self.expert_groups:
            self.expert_bytes += count * expert_bytes
        self.routed_fetches += 1
        return out

    def transfer_group(self, plan: int) -> int:
        """The group whose leaves `run_transfer` returns for ``plan`` (as compiled: before any remap)."""
        return self._transfer_plans[plan].group

    # -- filling and freeing slots ------------------------------------------------------------------
    def _fill(self, slot: DeviceSlot, group: Group) -> DeviceSlot:
        """Copy a group's host buffers into its slot (asynchronously on an accelerator); no allocation."""
        if not group.packed:  # deferred while dynamo still traces the unpacked weights
            self.host.pack(group)
        self.host.refresh(group)
        if self._faults:
            self._maybe_fail("fetch", group.index)
        if slot.group is not None:
            self._vacate(slot)
        self._copy_into(slot, group)
        slot.group = group.index
        self.ledger.occupy(group.nbytes)  # the copy's bytes: a shared slot may be larger (the pool counts it)
        self.bytes_transferred += group.nbytes
        self.fetch_count += 1
        if group.index in self.expert_groups:
            self.expert_bytes += group.nbytes
        return slot

    def _copy_into(self, slot: DeviceSlot, group: Group) -> None:
        """The copy itself: on the copy stream on an accelerator, else here (`benchmarks/decode.py --decompose`
        times calls without it)."""
        buffers = slot.buffers_for(group)
        if slot.ready is not None:
            self._copy_on_stream(slot, group)
            return
        if not group.on_disk:  # the common fill: no disk bookkeeping on the hot path
            _copy_group(buffers, group)
            return
        self.disk_bytes_read += sum(b.nbytes for b in group.buckets if b.file is not None)
        slot.pending = self.copier.submit(lambda: _copy_group(buffers, group))  # beside compute (`copier`)

    def _copy_on_stream(self, slot: DeviceSlot, group: Group) -> None:
        """The copy stream refills a slot only after the compute that read its previous contents (the
        slot's ``free`` event; inside a CUDA-graph capture, everything issued before, which also joins the
        copy stream into the capture); compute waits on ``ready``."""
        streams = self.streams
        stream = streams.copy()
        capturing = streams.capturing()
        self.captured |= capturing
        if self.captured:
            # once a graph was captured, its replays (launched by the caller, unseen here) read and write slots
            # between our calls, and events recorded inside the capture are nodes of its graph, not records:
            # ``free`` no longer orders a refill after every reader, so the copy waits for all work issued
            stream.wait_stream(streams.compute())
        else:
            stream.wait_event(slot.free)
        slot.filled_in_capture = capturing
        if group.on_disk:
            self._stage(slot, group, capturing)
            return
        self._send(slot, group, stream)

    def _send(self, slot: DeviceSlot, group: Group, stream) -> None:
        """The copies into the slot on the copy stream, from the group's host buffers (a bucket on disk: from the
        slot's staging buffer, read already); compute waits on ``ready``."""
        sources = [slot.staging(i, self.host.pinned)[:bucket.numel] if bucket.file is not None else bucket.source()
                   for i, bucket in enumerate(group.buckets)]
        with self.streams.on(stream):
            for buf, source in zip(slot.buffers_for(group), sources):
                buf.copy_(source, non_blocking=True)
        slot.ready.record(stream)

    def _stage(self, slot: DeviceSlot, group: Group, capturing: bool) -> None:
        """A group on disk: its files are read into the slot's host staging buffers on the worker thread (beside
        compute, as on the CPU), once the copy that last read those buffers (the slot's previous fill, ordered
        by ``ready``) has finished; the copy to the device is issued when the group is waited for (`_ready`)."""
        if capturing:
            raise OffloadRefusal(f"{group.name} is on disk (host_budget_gb): a captured graph would replay the copy "
                                 f"from the staging buffer without reading the file again. Capture a model without "
                                 f"host_budget_gb, or run this one eagerly")
        slot.ready.synchronize()
        staging = [slot.staging(i, self.host.pinned)[:bucket.numel] if bucket.file is not None else None
                   for i, bucket in enumerate(group.buckets)]
        self.disk_bytes_read += sum(buffer.nbytes for buffer in staging if buffer is not None)
        slot.pending = self.copier.submit(lambda: _read_staged(staging, group))
        slot.unsent = group

    def _ready(self, slot: DeviceSlot) -> DeviceSlot:
        if slot.pending is not None:  # a fill or read on the worker thread: done, or its error raised here
            future, slot.pending = slot.pending, None
            try:
                future.result()
            finally:
                group, slot.unsent = slot.unsent, None
            if group is not None:
                self._send(slot, group, self.streams.copy())
        if slot.ready is not None:
            self.streams.compute().wait_event(slot.ready)
        return slot

    def wait_for_fills(self) -> None:
        """Every fill issued on the worker thread has finished (before the host writes a buffer they read)."""
        self.copier.wait_all()

    def _release(self, slot: DeviceSlot) -> None:
        """The slot's copy is gone (evicted, dropped): free for the next fill once its readers finished."""
        if slot.group is None:
            return
        if slot.pending is not None:  # a fill still in flight: done before the slot is refilled or dropped
            future, slot.pending, slot.unsent = slot.pending, None, None
            concurrent.futures.wait([future])  # its error goes with the copy
        self.ledger.release(self.groups[slot.group].nbytes)
        slot.group = None
        if slot.free is not None:
            slot.free.record(self.streams.compute())

    def _vacate(self, slot: DeviceSlot) -> None:
        """A slot about to be refilled still holds a copy kept between calls (a parked component, a copy
        carried for another graph): that copy goes. A copy of the running call there is a planning bug."""
        for kept in (self._parked, self._held):
            for group, (held, *_) in list(kept.items()):
                if held is slot:
                    del kept[group]
        for key, carried in list(self._carried.items()):
            if carried.slot is slot:
                del self._carried[key]
        if slot in self._pending.values() or slot in self._live.values():
            raise AssertionError(f"device slot {slot.index} of {slot.size_class} refilled while in use")
        self._release(slot)

    # -- debug surface: fault injection -------------------------------------------------------------
    def inject_fault(self, stage: str, group: int | None = None, exception: BaseException | None = None,
                     times: int = 1) -> None:
        """Raise ``exception`` at the next ``times`` ``stage`` events ("fetch" or "evict") of ``group`` (any
        group if None): a failing copy, an interrupt in the middle of a forward."""
        if stage not in ("fetch", "evict"):
            raise ValueError(f"stage must be 'fetch' or 'evict'; got {stage!r}")
        self._faults.append(Fault(stage, group, exception or RuntimeError(f"injected fault at {stage}"), times))

    def _maybe_fail(self, stage: str, group: int) -> None:
        for fault in self._faults:
            if fault.stage == stage and fault.group in (None, group) and fault.times > 0:
                fault.times -= 1
                if fault.times == 0:
                    self._faults.remove(fault)
                raise fault.exception

    # -- the transfer ops ---------------------------------------------------------------------------
    def prefetch(self, key: int, group: int, mode: int = FETCH) -> None:
        """FETCH: copy now; ADOPT: take the copy the previous call carried for ``key`` if still valid (same
        group, host weights unchanged), else copy; CARRY: copy for the next call (prefetch wrap-around).
        Every copy lands in the slot planned for ``key``."""
        group = self.actual_group(group)
        g = self.groups[group]
        slot = self._slot_of[key]
        # inside a graph capture, copies made before it cannot be waited for (their events were recorded outside
        # it), and a copy for the next call would fork the copy stream out of the capture without a join: a
        # captured call copies what it reads, and carries nothing. Nor does any call after a capture: replays
        # (unseen here) write the same slots on the compute stream while a carried copy would be in flight
        capturing = self.streams is not None and self.streams.capturing()
        if mode == CARRY:
            if (not capturing and not self.captured and self.group_remap is None
                    and self._carry_misses.get(key, 0) < CARRY_MISSES_TO_STOP):
                self._carried[key] = Carried(group, stamp(g), self._fill(slot, g))
            return
        if mode == ADOPT and not capturing and self._adopt(key, g):
            return
        if g.exclusive:  # alternating: other components leave before this one arrives
            for other in [o for o in self._parked if o != group]:
                self._unpark(other)
        parked = self._parked.pop(group, None)
        if parked is not None and parked[0] is slot and parked[1] == stamp(g) and not capturing:
            self._pending[key] = slot
            return
        if parked is not None:
            self._release(parked[0])
        self._pending[key] = self._take_held_or_fill(slot, g, capturing)

    @contextlib.contextmanager
    def holding_copies(self):
        """Graphs run inside keep each copy they evict in its slot, held until the next fill that is not its
        group's into that slot, or the end of the call (`release_held`): the parts a frame without a graph calls
        one by one (`offloaded.forwards._route_call`) each run a graph of their own, and where their weights are
        one group (a component under ``sequential``, a block whose own frame broke) each such graph fetched the
        whole group again. Held copies take no memory beyond the pool's slots, and one is dropped before any other
        copy arrives, so the ledger never counts more than one graph's own copies plus one held."""
        self.holding += 1
        try:
            yield
        finally:
            self.holding -= 1

    def _take_held_or_fill(self, slot: DeviceSlot, group: Group, capturing: bool) -> DeviceSlot:
        """The copy held in ``slot`` where it is ``group``'s and its host weights are unchanged (counted as a
        held hit: the plan's fetch, served without moving its bytes); else every held copy goes, then the fill."""
        held = self._held.get(group.index)
        if held is not None and held[0] is slot and held[1] == stamp(group) and not capturing:
            del self._held[group.index]
            self.held_hits += 1
            self.held_hit_bytes += group.nbytes
            return slot
        self.release_held()  # a copy of ``group`` held elsewhere or stale goes with the others
        return self._fill(slot, group)

    def release_held(self) -> None:
        """The copies held within the call go (the call ended, failed, or another copy arrives)."""
        for slot, _, poison in self._held.values():
            if poison and self.debug_poison:
                slot.poison()
            self._release(slot)
        self._held.clear()

    def _adopt(self, key: int, group: Group) -> bool:
        carried = self._carried.pop(key, None)
        if carried is None:
            return False
        if carried.group == group.index and carried.stamp == stamp(group):
            self._pending[key] = carried.slot
            self._carry_used.add(key)
            self.carry_hits += 1
            return True
        self._release(carried.slot)
        return False

    def _unpark(self, group: int) -> None:
        self._release(self._parked.pop(group)[0])

    def wait(self, key: int, group: int) -> list[torch.Tensor]:
        """The group's slot, ready for compute: its flat buffers (the same tensors every call)."""
        slot = self._wait(key, group)
        return slot.buffers_for(self.groups[slot.group])

    def wait_weights(self, key: int, group: int) -> tuple[torch.Tensor, ...]:
        """As `wait`, but the group's weights themselves (made over the slot once): the eager path."""
        slot = self._wait(key, group)
        return slot.weights(self.groups[slot.group])

    def run_transfer(self, plan: int) -> tuple[torch.Tensor, ...]:
        """A planned transfer: its steps, then the group's leaves over its slot, ready for compute."""
        steps, key, group = self._transfer_plans[plan]
        for is_evict, other, a, b in steps:
            if is_evict:
                self.evict(other, a, b)
            else:
                self.prefetch(a, other, b)
        slot = self._resident_slot(group) if key is None else self._wait(key, group)
        return slot.leaves(self.groups[slot.group])

    def _wait(self, key: int, group: int) -> DeviceSlot:
        group = self.actual_group(group)
        self.used_groups.add(group)
        slot = self._pending.pop(key, None)
        if slot is None:
            capturing = self.streams is not None and self.streams.capturing()
            slot = self._take_held_or_fill(self._slot_of[key], self.groups[group], capturing)
        self._live[group] = slot  # before its fill is waited for: a failed fill's slot is released with the call's
        self._ready(slot)
        return slot

    def evict(self, group: int, poison: bool, park: bool = False) -> None:
        group = self.actual_group(group)
        if self._faults:
            self._maybe_fail("evict", group)
        slot = self._live.pop(group)
        if park and not slot.filled_in_capture:  # latency-minimising: stays on the device until another
            # component needs the room (not a copy a capture made: it exists only when the graph replays)
            self._parked[group] = (slot, stamp(self.groups[group]))
            return
        if self.holding and not slot.filled_in_capture:
            self._held[group] = (slot, stamp(self.groups[group]), poison)
            return
        if poison and self.debug_poison:
            slot.poison()
        self._release(slot)

    def actual_group(self, group: int) -> int:
        """The group a graph's ``group`` stands for in this call (a graph run on other layers' weights)."""
        remap = self.group_remap
        return group if remap is None else remap.get(group, group)

    def resident(self, group: int) -> list[torch.Tensor]:
        """The persistent device copy of a resident group (a slot of its own, outside the streamed pool),
        refilled in place when a host weight changed."""
        return self._resident_slot(group).buffers

    def resident_weights(self, group: int) -> tuple[torch.Tensor, ...]:
        slot = self._resident_slot(group)
        return slot.weights(self.groups[slot.group])

    def _resident_slot(self, group: int) -> DeviceSlot:
        group = self.actual_group(group)
        self.used_groups.add(group)
        g = self.groups[group]
        held = self._resident.get(group)
        now = stamp(g)
        # a copy a capture made exists only when its graph replays: outside a capture it is made again
        if held is None or held[1] != now or (held[0].filled_in_capture and not self.streams.capturing()):
            slot = held[0] if held is not None else DeviceSlot(size_class(g), self.device, -1, self.streams)
            if held is not None:
                self._release(slot)
            self._fill(slot, g)
            try:
                self._ready(slot)
            except BaseException:  # a failed fill is no copy: the next call fills the slot again
                self._resident.pop(group, None)
                self._release(slot)
                raise
            self._resident[group] = (slot, now)
        return self._resident[group][0]

    # -- between calls --------------------------------------------------------------------------------
    def begin_graph(self, carry_keys: frozenset[int]) -> None:
        """A graph is about to run: copies carried for another graph (the next call took a different graph:
        new shapes, another component) go now, before this graph's own copies arrive. A key whose copies
        keep going unused (two graphs alternating within one call) stops carrying."""
        for key in [k for k in self._carried if k not in carry_keys]:
            self._release(self._carried.pop(key).slot)
            if key not in self._carry_used:
                self._carry_misses[key] = self._carry_misses.get(key, 0) + 1

    def abandon_pending(self) -> None:
        """A call failed: its copies (prefetched and never waited for, waited for and never evicted) and the
        copies carried for a next call are released, after their copies finished."""
        if self.streams is not None:  # (a failure inside a capture keeps its own error: no synchronize there)
            self.streams.wait_for_copies()
        self.wait_for_fills()
        for slot in [*self._pending.values(), *self._live.values()]:
            self._release(slot)
        self._pending.clear()
        self._live.clear()
        self.release_held()
        self.release_carried()

    def release_carried(self) -> int:
        freed = sum(self.groups[c.group].nbytes for c in self._carried.values())
        for carried in self._carried.values():
            self._release(carried.slot)
        self._carried.clear()
        return freed

    def release_resident(self) -> None:
        self.release_held()
        for slot, _ in [*self._resident.values(), *self._parked.values()]:
            self._release(slot)
        self._resident.clear()
        self._parked.clear()

    def release_device_copies(self) -> int:
        """Drop every device copy held between calls and the pool's memory (`OffloadRuntime`'s, which holds
        the runtime's lock); returns the bytes of copies released."""
        freed = self.release_carried() + sum(self.groups[g].nbytes for g in {*self._resident, *self._parked})
        self.release_resident()
        self._drop_free_slots()
        return freed

    def give_back_slots_after_call(self) -> None:
        """A call ended, and its model is one component (`Group.whole_model`): the device memory of its slots goes
        back now, so the device holds none of its weights between calls (the next call allocates them again).
        Not once a graph was captured: its replays keep writing the slots' addresses."""
        capturing = self.streams is not None and self.streams.capturing()
        if not capturing and not self.captured:
            self._drop_free_slots()

    def _drop_free_slots(self) -> None:
        """The pool's memory goes too (its slots hold no copy between calls): the compute stream is ordered
        after the copy stream first, so the allocator's reuse of the memory on it comes after every copy."""
        if self.streams is not None:
            self.streams.order_compute_after_copies()
        for slots in self.pool.slots.values():
            for slot in slots:
                if slot.group is None:
                    slot.drop_buffers()

    def close(self) -> None:
        """Drop every copy, the pool and the slot plan (the runtime unpacks): nothing is held on the device."""
        self.abandon_pending()
        self.release_resident()
        self.pool.clear()
        self._slot_of.clear()
        self._routed_slots.clear()

    # -- what the stats read ------------------------------------------------------------------------
    def held_bytes(self) -> tuple[int, int, int]:
        """Bytes of the copies held between calls: resident groups, parked components, carried copies."""
        return (sum(self.groups[g].nbytes for g in self._resident),
                sum(self.groups[g].nbytes for g in self._parked),
                sum(self.groups[c.group].nbytes for c in self._carried.values()))

    def continue_counters(self, previous: "TransferEngine") -> None:
        """Count on from ``previous`` (a runtime this one replaced over the same weights): every counter of
        `COUNTERS` and the peak, as if one runtime had moved them."""
        for name in COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(previous, name))
        self.ledger.peak = max(self.ledger.peak, previous.ledger.peak)

    def reset_counters(self) -> None:
        for name in COUNTERS:
            setattr(self, name, 0)
        self.ledger.reset_peak()
