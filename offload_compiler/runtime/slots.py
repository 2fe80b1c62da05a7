"""Device slots and the ledger: the fixed device memory streamed copies land in (`DeviceSlot`, grouped by size
class in a `DevicePool`), and the exact live bytes of the copies held in it (`Ledger`). A slot allocates at its
first fill and is reused for the runtime's life, so a call allocates no device memory -- except for a model
that is its one component (`Group.whole_model`), whose slots are given back after each call.
"""

from __future__ import annotations

import torch

from ..subclasses import own_storage, rebuild
from .device import DeviceStreams
from .layout import Group


class DeviceSlot:
    """Fixed device memory for one group copy: one flat buffer per bucket of its size class, allocated once.
    ``group`` is the group whose copy is in it (None when free); a fetch creates no tensor (the graph views
    the weights over the buffers). On a device with streams, ``ready`` is recorded on the copy stream after a
    fill (compute waits on it) and ``free`` on the compute stream after an evict (the next fill waits on it)."""

    def __init__(self, size_class: tuple, device: torch.device, index: int,
                 streams: DeviceStreams | None = None) -> None:
        self.size_class = size_class
        self.index = index
        self.device = device
        self.streams = streams  # None without streams
        self.nbytes = sum(numel * dtype.itemsize for numel, dtype in size_class)
        self.group: int | None = None
        self._buffers: list[torch.Tensor] | None = None
        self._staging: list[torch.Tensor] | None = None  # host buffers a group on disk is read into (`staging`)
        self.ready = self.free = None  # events, made with the buffers
        self.pending = None  # a fill (CPU) or disk read into staging (accelerator) on the worker thread, its future
        self.unsent: Group | None = None  # read into staging on the worker thread; its device copy not yet issued
        self.filled_in_capture = False  # its copy is a node of a captured graph: it exists only after a replay
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}  # group -> its weights over the buffers
        self._leaf_views: dict[int, tuple[torch.Tensor, ...]] = {}  # group -> its plain leaves over the buffers
        self._cut: dict[int, list[torch.Tensor]] = {}  # group -> the buffers cut to its buckets (`buffers_for`)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Allocated at the slot's first fill (the first call), not when a graph is planned: planning touches no
        device memory (and a graph can be rewritten for a device this process cannot allocate on)."""
        if self._buffers is None:
            with torch.inference_mode(False):  # ordinary tensors, whichever mode the first call ran in
                self._buffers = [torch.empty(numel, dtype=dtype, device=self.device)
                                 for numel, dtype in self.size_class]
            if self.streams is not None:
                self.ready, self.free = self.streams.event(), self.streams.event()
                # the caching allocator may have handed the allocating stream memory its queued work still
                # reads: the first fill (on the copy stream, which waits on ``free``) must come after that work
                self.free.record(self.streams.compute())
        return self._buffers

    def buffers_for(self, group: Group) -> list[torch.Tensor]:
        """The buffers cut to ``group``'s buckets, the same tensors on every call: a slot shared by the groups
        of one kind (`passes.slots.Pooling`) is sized to the largest, and a group's copy is the prefix of each
        buffer (its leaves' offsets are within it)."""
        made = self._cut.get(group.index)  # decided once per group: this runs at every fill
        if made is None:
            buffers = self.buffers
            if all(buf.numel() == bucket.numel for buf, bucket in zip(buffers, group.buckets)):
                made = buffers
            else:
                with torch.inference_mode(False):
                    made = [buf[:bucket.numel] for buf, bucket in zip(buffers, group.buckets)]
            self._cut[group.index] = made
        return made

    def staging(self, index: int, pinned: bool) -> torch.Tensor:
        """A host buffer the size of the slot's buffer ``index``, for a group on disk: the file is read into
        it, then copied to the device (pinned where the host store pins, so the copy is asynchronous)."""
        if self._staging is None:
            with torch.inference_mode(False):
                self._staging = [torch.empty(numel, dtype=dtype, pin_memory=pinned)
                                 for numel, dtype in self.size_class]
        return self._staging[index]

    def drop_buffers(self) -> None:
        """Give the slot's device memory back (`OffloadRuntime.release_device_copies`); the next fill
        allocates it again. The caller has ordered every stream's work on it before this point."""
        self._buffers = None
        self._views.clear()
        self._leaf_views.clear()
        self._cut.clear()
        self.ready = self.free = None

    def resize(self, size_class: tuple) -> None:
        """Hold ``size_class`` from now on (a shared slot a new graph grew, holding no copy): the old memory goes
        and the next fill allocates the new size; the copies of the groups it held before are its prefix."""
        self.drop_buffers()
        self._staging = None
        self.size_class = size_class
        self.nbytes = sum(numel * dtype.itemsize for numel, dtype in size_class)

    def leaves(self, group: Group) -> tuple[torch.Tensor, ...]:
        """Each plain leaf of ``group`` (in `Group.leaves` order) over this slot's buffers with its layout, made
        at the first use and the same tensors on every call. Each has a storage object of its own over the
        slot's memory: the ``transfer`` op returns them together, and a custom op's outputs must not share
        storage (AOT autograd checks it); they are never written, and inductor never reuses them."""
        made = self._leaf_views.get(group.index)
        if made is None:
            buffers = self.buffers
            with torch.inference_mode(False):
                made = self._leaf_views[group.index] = tuple(own_storage(leaf.host_view(buffers[leaf.bucket]))
                                                             for leaf in group.leaves)
        return made

    def weights(self, group: Group) -> tuple[torch.Tensor, ...]:
        """Each weight of ``group`` over this slot's buffers, as the insert pass describes it (its leaf; a
        subclass weight rebuilt around its leaves), made at the first use and the same tensors on every call."""
        made = self._views.get(group.index)
        if made is None:
            leaves = iter(self.leaves(group))
            with torch.inference_mode(False):
                made = self._views[group.index] = tuple(
                    next(leaves) if s.rebuild is None else rebuild(s.rebuild, leaves) for s in group.slots)
        return made

    def poison(self) -> None:
        """Fill the slot with values no correct read sees (``debug_poison``): a read after its evict shows."""
        for buf in self.buffers:
            buf.fill_(float("nan") if buf.dtype.is_floating_point or buf.dtype.is_complex
                      else (True if buf.dtype == torch.bool else torch.iinfo(buf.dtype).max))


def size_class(group: Group) -> tuple:
    """Groups whose flat buffers have the same sizes and dtypes share device slots."""
    return tuple((b.numel, b.dtype) for b in group.buckets)


class DevicePool:
    """The device slots of one runtime, per size class; grown only when a graph is compiled (to the most
    slots any verified plan needs at once), never while a graph runs."""

    def __init__(self, device: torch.device, streams: DeviceStreams | None = None) -> None:
        self.device = device
        self.streams = streams
        self.slots: dict[tuple, list[DeviceSlot]] = {}

    def reserve(self, slot_class: tuple, sizes: list[tuple]) -> list[DeviceSlot]:
        """The slots of ``slot_class`` (a size class, or a kind's shared slots: `passes.slots.Pooling`), one of
        each size in ``sizes`` ((numel, dtype) per buffer) by index; those planned before keep theirs."""
        slots = self.slots.setdefault(slot_class, [])
        for index, size in enumerate(sizes):
            if index == len(slots):
                slots.append(DeviceSlot(size, self.device, index, self.streams))
            elif slots[index].size_class != size:  # only a free slot grows, resized before: a planning bug
                raise AssertionError(f"device slot {index} of {slot_class} is {slots[index].size_class}, not {size}")
        return slots

    def sizes(self) -> dict[tuple, list[tuple]]:
        """Each slot's size, per slot class: what a later graph's colouring must fit in (`passes.slots`)."""
        return {cls: [slot.size_class for slot in slots] for cls, slots in self.slots.items()}

    def clear(self) -> None:
        """Forget every slot (the runtime unpacked): their memory goes with the last reference."""
        self.slots = {}

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for slots in self.slots.values() for s in slots)


class Ledger:
    """Exact live bytes of device weight copies, derived from the device pool's state: a slot counts from the
    copy that fills it until the schedule evicts it (or a failed call abandons it); a resident group's copy
    while it is held."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def occupy(self, nbytes: int) -> None:
        self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live

    def release(self, nbytes: int) -> None:
        self.live -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.live
