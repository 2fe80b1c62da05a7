"""The host store: the model's offloaded weights packed into flat host buffers, one per group and dtype
(pinned where the device can pin), the weights themselves left as views into them. It packs (now, or at a
group's first fetch), copies a weight given new data back into its buffer before the buffer is read, answers
the passes' questions about the layout (`group_of`, `layout`, `remap_between`), and unpacks.
"""

from __future__ import annotations

import logging
import operator
import warnings
import weakref
from typing import Callable

import torch
from torch import nn

from ..grouping import GroupSpec
from ..host_masters import HostMaster, release_masters
from ..storage import Filled, FilledBuckets, viewed
from .device import DeviceStreams, is_accelerator
from .disk import DiskFile, DiskSpace, disk_groups, release_mapped_pages
from .layout import Bucket, Group, Leaf, dense_layout, layout_groups, weight_layout
from .pinning import HostRegistrations, PinningUnavailable, can_pin, pin_exact

log = logging.getLogger("offload_compiler")


def _nothing() -> None:
    pass


def pack_group(group: Group, pin: bool, on_pin_failure: Callable[[str], None] | None = None,
               registrations: HostRegistrations | None = None, stage_owners: bool = False,
               filled: FilledBuckets | None = None) -> None:
    """Copy a group's leaves into one flat host buffer per dtype (pinned: the buffer, never a subclass's own
    ``pin_memory``) and point each leaf at its place in it, so the module keeps its parameters (a subclass
    weight stays that subclass, and ``state_dict`` works) while one copy moves the group. A leaf that cannot be
    packed (`Bucket.owner`) keeps its storage; ``stage_owners`` (an accelerator) copies it into a staging buffer
    of its own, pinned alike. A bucket found in ``filled`` (a checkpoint read into the bucket's layout) takes
    that buffer as it is."""
    staged = []
    for bi, bucket in enumerate(group.buckets):
        owner = bucket.owner
        if owner is not None and owner.value.device.type != "cpu":
            # a leaf on another device (a DTensor shard placed on a cuda mesh) goes to host memory
            owner.assign(owner.value.detach().to("cpu"))
        if bucket.host is not None or (owner is not None and not stage_owners):
            continue
        members = [owner] if owner is not None else [leaf for leaf in group.leaves if leaf.bucket == bi]
        laid_out = None if owner is not None else _laid_out(bucket, members, filled)
        flat = laid_out.flat if laid_out is not None and laid_out.file is None else None
        if flat is None:
            flat = torch.empty(bucket.numel, dtype=bucket.dtype)
            with torch.no_grad():
                for leaf in members:
                    leaf.host_view(flat).copy_(leaf.value.detach())
            if owner is None:  # copied: pages of a mapped checkpoint the weights were read from can go now
                release_mapped_pages([viewed(leaf.value) for leaf in members])
        if pin:
            try:
                flat = pin_exact(flat, registrations)
            except PinningUnavailable as exc:
                if on_pin_failure is None:
                    raise
                on_pin_failure(str(exc))
        if owner is None:
            for leaf in members:
                leaf.assign(leaf.host_view(flat))
        else:  # the leaf stays where it is (re-pointing it would break the sharing): the buffer is a copy
            owner.host_version = owner.family_version()
            staged.append(owner)
        bucket.host = flat
    for leaf in group.leaves:
        leaf.host_ptr = leaf.value.data_ptr()
    group.pointers = None
    group.staged = tuple(staged)
    group.packed = True


def pack_to_disk(group: Group, region: Callable[[int], DiskFile], filled: FilledBuckets | None = None) -> None:
    """`pack_group` for a group on disk: each bucket's bytes go into its region of the disk tier's file
    (``region(bucket index)``) and the leaves become views of its mapping; host memory keeps nothing of them.
    A bucket loaded from a
    checkpoint keeps what the loader made: its file, or the checkpoint's own extents (read-only: the first
    write into them moves the group to its region of the tier's file, `HostStore.refresh`). A leaf that cannot be packed
    (`Bucket.owner`) keeps its own storage, as in memory."""
    for bi, bucket in enumerate(group.buckets):
        if bucket.owner is not None or bucket.host is not None or bucket.file is not None:
            continue
        members = [leaf for leaf in group.leaves if leaf.bucket == bi]
        laid_out = _laid_out(bucket, members, filled)
        if laid_out is not None and laid_out.file is not None:
            bucket.host, bucket.file = laid_out.flat, laid_out.file
        else:
            _write_bucket(bucket, members, region(bi))
    _packed_on_disk(group)


def _write_bucket(bucket: Bucket, members: list[Leaf], file: DiskFile) -> None:
    """The members' bytes (as they are now) into ``file`` in the bucket's layout; they become views of it."""
    itemsize = bucket.dtype.itemsize
    with torch.no_grad():
        for leaf in members:
            value = leaf.value.detach()
            if tuple(value.stride()) != leaf.stride or value.device.type != "cpu":
                value = torch.empty_strided(leaf.shape, leaf.stride, dtype=bucket.dtype).copy_(value)
            file.write(leaf.offset * itemsize, value)
    # written: the pages of a mapped checkpoint the weights viewed can go now, as `pack_group`'s copies' do
    release_mapped_pages([viewed(leaf.value) for leaf in members])
    flat = file.mapped(bucket.dtype, bucket.numel)
    for leaf in members:
        leaf.assign(leaf.host_view(flat))
    previous, bucket.host, bucket.file = bucket.file, flat, file
    if previous is not None:
        previous.close()


def _packed_on_disk(group: Group) -> None:
    for leaf in group.leaves:
        leaf.host_ptr = leaf.value.data_ptr()
        leaf.host_version = (leaf.value._version,)
    group.pointers = None
    group.staged = ()
    group.packed = True


def _laid_out(bucket: Bucket, members: list[Leaf], buckets: FilledBuckets | None) -> Filled | None:
    """What the members were read into, each at its place (one of ``buckets``, `checkpoint.load_checkpoint`),
    else None: packing then copies them."""
    values = [viewed(leaf.value) for leaf in members]  # a host master's bytes: the tensor they were cut from
    filled = buckets.get(values[0].data_ptr()) if buckets and values and values[0].device.type == "cpu" else None
    if filled is None:
        return None
    if filled.flat is None:  # the checkpoint's own bytes: each weight a view of its extent
        places = tuple(v.data_ptr() for v in values)
        return filled if places == filled.file.addresses and all(v.is_contiguous() for v in values) else None
    if filled.flat.dtype != bucket.dtype or filled.flat.numel() != bucket.numel:
        return None
    address = filled.flat.untyped_storage().data_ptr()
    for leaf, value in zip(members, values):
        if (value.untyped_storage().data_ptr() != address or value.storage_offset() != leaf.offset
                or tuple(value.stride()) != leaf.stride):
            return None
    return filled


def _own_copy(packed: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """A packed leaf copied into storage of its own, with the strides it had before packing (channels_last,
    a transposed view's layout) where those describe a dense tensor; contiguous otherwise (expanded weights)."""
    if not dense_layout(tuple(packed.shape), stride):
        return packed.clone(memory_format=torch.contiguous_format)
    return torch.empty_strided(packed.shape, stride, dtype=packed.dtype).copy_(packed)


def stamp(group: Group) -> tuple:
    """Changes whenever a host weight of the group is modified in place or replaced; for a weight that shares its
    storage (`Bucket.owner`), also when another weight over that storage is written (`Leaf.family`). A write
    through a plain alias of the host bytes handed out (`HostStore.watch`) shows as a write to its weight."""
    if group.aliases:
        _note_alias_writes(group)
    own = tuple((leaf.value._version, leaf.value.data_ptr()) for leaf in group.leaves)
    return (own, tuple(leaf.family_version() for leaf in group.owners)) if group.owners else own


def _note_alias_writes(group: Group) -> None:
    for entry in tuple(group.aliases.values()):
        _note_alias_write(entry)


def _note_alias_write(entry: list) -> None:
    """An alias's write since it was last looked at (one whose writes bump no version, a numpy array: assumed)
    becomes a version bump of its weight, which is what the stamps read."""
    tracker, seen, master_ref = entry
    if tracker is not None and tracker._version == seen:
        return
    weight = master_ref()
    if weight is not None:
        torch.autograd.graph.increment_version(weight.host)
    if tracker is not None:
        entry[1] = tracker._version


_host = operator.attrgetter("host")
_data_ptr = torch.Tensor.data_ptr


def _master_pointers(group: Group) -> tuple:
    """(the masters, their leaves' ``host_ptr``s) where every leaf of ``group`` is a host master's own bytes
    (its ``host``: `Leaf.value`), so that `HostStore.refresh` can compare the pointers without a Python call per
    leaf; ``()`` where a leaf is not (a subclass's inner tensor, a plain tensor): it never becomes one."""
    leaves = group.leaves
    if not all(not leaf.path and isinstance(leaf.tensor, HostMaster) for leaf in leaves):
        return ()
    return tuple(leaf.tensor for leaf in leaves), tuple(leaf.host_ptr for leaf in leaves)


class HostStore:
    """The host side of one runtime: every group's layout and host buffers. ``streams`` (None without streams)
    is waited for before the host writes a buffer that a queued copy may still read."""

    def __init__(self, specs: list[GroupSpec], device: torch.device, pin_memory: bool,
                 streams: DeviceStreams | None, disk_dir: str | None = None, host_budget: int | None = None) -> None:
        self.streams = streams
        self.disk_dir = disk_dir
        # waits for every copy that may read the host buffers (the runtime's: streams and the fill worker)
        self.wait_for_copies: Callable[[], None] = streams.wait_for_copies if streams is not None else _nothing
        self.pinned = pin_memory and can_pin(device)
        if pin_memory and not self.pinned and is_accelerator(device):
            log.debug("pin_memory ignored: no pinned host memory for %s; host buffers stay pageable", device)
        self.groups = layout_groups(specs)
        for index in disk_groups(self.groups, host_budget) if host_budget is not None else ():
            self.groups[index].on_disk = True
        self._disk_space: DiskSpace | None = None  # made at the first group packed to disk (`_region`)
        self._regions: dict[tuple[int, int], int] = {}
        # a copy to an accelerator reads a pinned buffer, never the leaf's own pageable memory (see `Bucket`)
        self.stage_owners = is_accelerator(device)
        self.registrations = HostRegistrations.for_device(device)
        # what the passes read: weight id -> (group, index in it); per group each weight's leaves
        self.group_of: dict[int, tuple[int, int]] = {
            id(slot.tensor): (g.index, si) for g in self.groups for si, slot in enumerate(g.slots)}
        self.layout = {g.index: [weight_layout(s) for s in g.slots] for g in self.groups}
        # tensor-subclass weights (quantized, DTensor): rebuilt in the graph around their fetched leaves
        self.rebuild_specs = {(g.index, si): s.rebuild for g in self.groups for si, s in enumerate(g.slots)
                              if s.rebuild is not None}

        # the groups with an alias in `Group.aliases`: while any, each call ends waiting for its copies
        self.watched: set[int] = set()
        self._alias_refs: dict[int, weakref.ref] = {}  # a weak reference's callback runs only while it lives

    def watch(self, master: HostMaster, alias, tracked: bool) -> None:
        """``alias``, a plain tensor over ``master``'s host bytes, was handed out: the user may write it (plain
        PyTorch's ``m.state_dict()[k].mul_(2)`` edits the model) and no write through it reaches a master. A
        write through it (its version counter, read by the group's `stamp` while it lives and once when it goes;
        a numpy array, whose writes bump none: assumed at each stamp and when it goes) bumps its weight's version,
        so a device copy made before the write is stale: one check per call and group while an alias lives,
        none otherwise. The caller waited for the queued copies; the runtime waits at the end of each call while
        an alias lives (`OffloadRuntime.end_call`): a write through it never races a copy."""
        place = self.group_of.get(id(master))
        if place is None or id(alias) in self.groups[place[0]].aliases:
            return
        group, key, watched, refs = self.groups[place[0]], id(alias), self.watched, self._alias_refs
        tracker = alias.detach() if tracked else None  # shares the alias's version counter, outlives it
        entry = [tracker, None if tracker is None else tracker._version, weakref.ref(master)]

        def gone(_ref) -> None:
            refs.pop(key, None)
            group.aliases.pop(key, None)
            if not group.aliases:
                watched.discard(group.index)
            _note_alias_write(entry)
        group.aliases[key] = entry
        watched.add(group.index)
        refs[key] = weakref.ref(alias, gone)

    @property
    def total_bytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    # -- packing ------------------------------------------------------------------------------------
    def pack(self, group: Group, filled: FilledBuckets | None = None) -> None:
        """``filled``: buffers a checkpoint was read into, taken as the group's where laid out as it lays them out."""
        with torch.inference_mode(False):  # deferred to the first call, which may run in inference mode
            if group.on_disk:
                pack_to_disk(group, lambda bucket: self._region(group.index, bucket), filled)
            else:
                pack_group(group, self.pinned, self._pinning_failed, self.registrations, self.stage_owners, filled)

    def _region(self, group: int, bucket: int) -> DiskFile:
        """The region of the disk tier's file for a bucket: one file for every bucket of the groups on disk, in
        the groups' order, so that reading them in call order reads the file start to end (`disk.DiskSpace`)."""
        if self._disk_space is None or self._disk_space.closed:
            keys = [(g.index, bi) for g in self.groups if g.on_disk for bi in range(len(g.buckets))]
            self._regions = {key: i for i, key in enumerate(keys)}
            self._disk_space = DiskSpace(self.disk_dir, [self.groups[g].buckets[bi].nbytes for g, bi in keys])
        return self._disk_space.file(self._regions[group, bucket])

    @property
    def host_bytes(self) -> int:
        """Bytes of the packed buffers in host memory (the groups not on disk)."""
        return sum(g.nbytes for g in self.groups if not g.on_disk)

    @property
    def disk_bytes(self) -> int:
        return sum(g.nbytes for g in self.groups if g.on_disk)

    def _pinning_failed(self, reason: str) -> None:
        """Pinned memory could not be had: keep going with pageable host memory, saying so once."""
        self.pinned = False
        warnings.warn(f"offload_compiler: pinned host memory is unavailable ({reason}); weights stay in pageable "
                      f"memory, so host-to-device copies are slower and not asynchronous", RuntimeWarning,
                      stacklevel=2)

    def refresh(self, group: Group) -> None:
        """A leaf whose data was replaced since packing (``.data``, an inner tensor) is copied back into the
        flat buffer. A group read from a checkpoint's own extents moves to its region of the disk tier's file at
        the first change of any of its weights (the checkpoint is never written; a fill reads the file)."""
        if group.on_disk and any(b.file is not None and b.file.read_only for b in group.buckets):
            if group.aliases:  # a write through a state_dict tensor lands in the private mapping, which no fill
                _note_alias_writes(group)  # reads: seen as a write to its weight
            if any(leaf.value.data_ptr() != leaf.host_ptr or (leaf.value._version,) != leaf.host_version
                   for leaf in group.leaves):
                self.wait_for_copies()
                for bi, bucket in enumerate(group.buckets):
                    if bucket.file is not None and bucket.file.read_only:  # its region of the tier's file,
                        # unused while the checkpoint held it: a file per group would hold descriptors per group
                        _write_bucket(bucket, [leaf for leaf in group.leaves if leaf.bucket == bi],
                                      self._region(group.index, bi))
                _packed_on_disk(group)
            return
        pointers = group.pointers
        if pointers is None:  # first fetch since packing
            pointers = group.pointers = _master_pointers(group)
        # every fetch: one C-level pass over the masters' data pointers where that says no leaf was replaced
        if not pointers or tuple(map(_data_ptr, map(_host, pointers[0]))) != pointers[1]:
            for leaf in group.leaves:  # a plain weight's leaf is the weight itself
                if leaf.value.data_ptr() != leaf.host_ptr:
                    self._repack(group, leaf)
            if pointers:
                group.pointers = None  # a leaf repacked: its new pointer is read at the next fetch
        for leaf in group.staged:  # not its buffer: a write in place, through it or another view of its
            if leaf.family_version() != leaf.host_version:  # storage, shows in their versions only
                self._repack(group, leaf)

    def _repack(self, group: Group, leaf: Leaf) -> None:
        bucket = group.buckets[leaf.bucket]
        if bucket.host is None:  # an owner bucket without staging (the CPU) is read from the leaf itself
            return
        self.wait_for_copies()  # a queued copy (of this call, or carried from the last) may still read it
        view = leaf.host_view(bucket.host)
        with torch.no_grad():
            view.copy_(leaf.value.detach())
        if bucket.owner is None:
            leaf.assign(view)
        else:  # a staging copy: the leaf keeps its storage
            leaf.host_version = leaf.family_version()
        leaf.host_ptr = leaf.value.data_ptr()

    def unpack(self, model: nn.Module | None, copy_back: bool = True) -> None:
        """Give every weight its own storage again (the undo of packing), host masters in ``model`` as plain
        tensors; the host buffers are unregistered before they can be freed. The caller has waited for the
        copies that read them. ``copy_back=False``: the weights are not given storage of their own, since the
        caller gives the model back the tensors it held before (a failed load from a checkpoint: copying the
        groups on disk into memory would read a model that may not fit there, to throw it away)."""
        masters: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for group in self.groups if copy_back else ():
            for leaf in group.leaves:
                bucket = group.buckets[leaf.bucket]
                # not in a buffer: never packed (an owner's bytes are its own), or not yet -- a group packed
                # later (lazily), or one a failed packing did not reach (`OffloadRuntime.__init__`), whose masters
                # still view the weights' own bytes
                packed = bucket.owner is None and (group.packed or bucket.host is not None or bucket.file is not None)
                own = _own_copy(leaf.value.detach(), leaf.own_stride) if packed else viewed(leaf.value)
                if isinstance(leaf.tensor, HostMaster):
                    masters[id(leaf.tensor)] = (leaf.tensor, own)
                elif packed:
                    leaf.assign(own)
        if masters and model is not None:
            release_masters(model, masters)
        if self.registrations is not None:
            self.registrations.unregister_all()  # before the buffers can be freed
        for group in self.groups:
            for bucket in group.buckets:
                bucket.host = None
                if bucket.file is not None:
                    bucket.file.close()
                    bucket.file = None
            group.staged = ()
            group.packed = False
        self._disk_space = None  # its descriptor closes with the last region (or here, where none was handed out)

    # -- layout questions of the backend --------------------------------------------------------------
    def _same_layout(self, a: int, b: int) -> bool:
        """Groups whose weights sit alike in buffers alike and are rebuilt alike: a graph of one runs the other."""
        def signature(group: Group) -> tuple:
            return (group.streamed, tuple(self.layout[group.index]),
                    tuple((b.dtype, b.numel, b.owner is None) for b in group.buckets))
        ga, gb = self.groups[a], self.groups[b]
        return signature(ga) == signature(gb) and all(
            sa.rebuild is None if sb.rebuild is None else sb.rebuild.matches(sa.rebuild)
            for sa, sb in zip(ga.slots, gb.slots))

    def remap_between(self, passed: list, compiled_ids: tuple) -> dict[int, int] | None:
        """Group ids mapping the weights a graph was compiled with onto the weights it is called with, when
        every weight sits in the same slot of a group with the same layout; None otherwise."""
        remap: dict[int, int] = {}
        for tensor, compiled_id in zip(passed, compiled_ids):
            now = self.group_of.get(id(tensor))
            then = self.group_of.get(compiled_id)  # the compiled-with weights are alive: dynamo holds them
            if now is None or then is None or now[1] != then[1]:
                return None
            if remap.setdefault(then[0], now[0]) != now[0]:
                return None
            if not self._same_layout(then[0], now[0]):
                return None
        return remap
