"""Group layout: where each plain tensor of a group's weights sits in the group's flat host buffers (one per
dtype). Pure description: deciding the layout touches no tensor data (`host` packs the data into it, `slots`
views device copies through it, and the passes read it as `weight_layout`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from ..grouping import GroupSpec
from ..host_masters import host_of, point_at
from ..storage import viewed
from ..subclasses import Path, RebuildSpec, leaf_at, leaf_paths, rebuild_spec, set_leaf


@dataclasses.dataclass
class Leaf:
    """Where one plain tensor of a weight sits inside its group's flat buffer of one dtype: the weight itself,
    or an inner tensor (at ``path``) of a tensor-subclass weight (quantized data, scales; a DTensor's shard).
    ``stride`` is its layout in the buffer: its own where that is dense (channels_last, transposed; the graph
    views it so), else contiguous; ``own_stride`` is what unpack restores; ``host_ptr`` its data when packed
    (a leaf given new data since is copied in again before the next fill)."""
    tensor: torch.Tensor  # the weight
    path: Path
    bucket: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    numel: int
    own_stride: tuple[int, ...]
    host_ptr: int = 0
    # a leaf that cannot be packed: every such leaf over its storage (itself included), whose versions when its
    # staging copy was made are ``host_version`` (a write through any of them changes its bytes)
    family: tuple["Leaf", ...] = dataclasses.field(default=(), repr=False, compare=False)
    host_version: tuple[int, ...] = ()

    @property
    def value(self) -> torch.Tensor:
        """The tensor holding this leaf's host bytes (a host master's host view)."""
        return host_of(leaf_at(self.tensor, self.path))

    def family_version(self) -> tuple[int, ...]:
        return tuple(leaf.value._version for leaf in self.family)

    def assign(self, value: torch.Tensor) -> None:
        """Point this leaf at new host bytes (a view into its group's flat buffer, a master's too)."""
        if self.path:
            set_leaf(self.tensor, self.path, value)
        else:
            point_at(self.tensor, value)

    def host_view(self, flat: torch.Tensor) -> torch.Tensor:
        """This leaf's place in its flat buffer, with its layout."""
        return flat.as_strided(self.shape, self.stride, self.offset)


@dataclasses.dataclass
class Slot:
    """One weight of a group: its leaves (one for a plain weight) and, for a subclass weight, how the graph
    rebuilds it around them."""
    name: str
    tensor: torch.Tensor
    leaves: list[Leaf]
    rebuild: RebuildSpec | None = None


@dataclasses.dataclass
class Bucket:
    """One flat host buffer (one dtype) of a group. ``owner`` is set for a leaf that cannot be packed (it shares
    storage with another tensor, so it keeps its own): on an accelerator ``host`` is then a staging copy of it,
    pinned as the other buffers are, so a fill never copies from the leaf's pageable memory (which blocks the
    host, and cannot be captured into a graph); on the CPU the fill copies from the leaf itself."""
    dtype: torch.dtype
    numel: int
    host: torch.Tensor | None
    owner: Leaf | None = None
    file: Any = None  # a `disk.DiskFile` where the group is on disk (``host`` then maps it)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def source(self) -> torch.Tensor:
        """What a fill copies from: the flat buffer (an owner's staging copy), else the owner leaf itself."""
        return self.host if self.host is not None else self.owner.value.detach().reshape(-1)


@dataclasses.dataclass
class Group:
    index: int
    name: str
    streamed: bool
    slots: list[Slot]
    buckets: list[Bucket]
    exclusive: bool = False
    whole_model: bool = False  # the model's one component (`GroupSpec.whole_model`): its slot leaves after each call
    users: tuple[str, ...] = ()  # the blocks that call it (`GroupSpec.users`)
    experts: bool = False  # a block's fused expert weights (`GroupSpec.experts`)
    lookup: bool = False  # an embedding table alone in its group (`GroupSpec.lookup`)
    is_block: bool = False  # a block of a stack, or blocks merged (`GroupSpec.is_block`)
    on_disk: bool = False  # its host buffers are files (`disk`), read at each fill
    packed: bool = False
    staged: tuple[Leaf, ...] = ()  # the owner leaves copied through a staging buffer (set by packing)
    # (host masters, their ``host_ptr``s) where every leaf is a master's own bytes (`HostStore.refresh`); ():
    # not such a group; None: not known yet (packing and a repack set it to None: a ``host_ptr`` changed)
    pointers: tuple | None = dataclasses.field(default=None, repr=False, compare=False)
    # plain aliases of its weights' host bytes handed out and alive (`HostStore.watch`): id -> [a tensor sharing
    # the alias's version counter (None where writes bump none: a numpy array), its version last seen, the weight]
    aliases: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @functools.cached_property
    def nbytes(self) -> int:  # the buckets' sizes are fixed by layout_group
        return sum(b.nbytes for b in self.buckets)

    @functools.cached_property
    def leaves(self) -> list[Leaf]:  # fixed by layout_group
        return [leaf for slot in self.slots for leaf in slot.leaves]

    @functools.cached_property
    def owners(self) -> tuple[Leaf, ...]:  # the leaves that could not be packed (`Bucket.owner`)
        return tuple(b.owner for b in self.buckets if b.owner is not None)


def _host_bytes(tensor: torch.Tensor, path: Path) -> torch.Tensor:
    """A leaf's host bytes as the tensor whose storage others may share (a host master's bytes are an alias
    of their own storage object, see `host_masters`)."""
    return viewed(host_of(leaf_at(tensor, path)))


def overlapping(tensors: list[torch.Tensor]) -> set[int]:
    """ids of tensors whose bytes overlap another tensor's (views of one fused weight): those cannot be
    packed without breaking the sharing, so they are copied from the tensor itself."""
    spans = sorted((t.untyped_storage().data_ptr(), t.data_ptr(),
                    t.data_ptr() + t.numel() * t.element_size(), id(t)) for t in tensors if t.numel())
    shared: set[int] = set()
    reach = (None, -1, None)
    for storage, start, end, ident in spans:
        if storage == reach[0] and start < reach[1]:
            shared.update((ident, reach[2]))
        if storage != reach[0] or end > reach[1]:
            reach = (storage, end, ident)
    return shared


def dense_layout(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """The strides cover exactly ``numel`` consecutive elements (a permutation of a contiguous layout)."""
    expected = 1
    for size, step in sorted(((size, step) for size, step in zip(shape, stride) if size != 1), key=lambda d: d[1]):
        if step != expected:
            return False
        expected *= size
    return 0 not in shape


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def layout_group(index: int, spec: GroupSpec, unpackable: set[int] = frozenset()) -> Group:
    """Where each leaf of a group's weights goes in its flat buffers (one per dtype); touches no tensor data."""
    slots: list[Slot] = []
    buckets: list[Bucket] = []
    by_dtype: dict[torch.dtype, int] = {}
    for w in spec.weights:
        leaves = []
        for path in leaf_paths(w.tensor):
            t = _host_bytes(w.tensor, path)
            shape, numel, own = tuple(t.shape), t.numel(), tuple(t.stride())
            packed = id(t) not in unpackable
            stride = own if packed and dense_layout(shape, own) else contiguous_stride(shape)
            if not packed:  # copied from the leaf itself, into a bucket of its own
                leaf = Leaf(w.tensor, path, len(buckets), 0, shape, stride, numel, own)
                buckets.append(Bucket(t.dtype, numel, None, owner=leaf))
            else:
                if t.dtype not in by_dtype:
                    by_dtype[t.dtype] = len(buckets)
                    buckets.append(Bucket(t.dtype, 0, None))
                bucket = buckets[by_dtype[t.dtype]]
                leaf = Leaf(w.tensor, path, by_dtype[t.dtype], bucket.numel, shape, stride, numel, own)
                bucket.numel += numel
            leaves.append(leaf)
        slots.append(Slot(w.name, w.tensor, leaves, rebuild_spec(w.tensor)))
    return Group(index, spec.name, spec.streamed, slots, buckets, spec.exclusive, spec.whole_model,
                 users=spec.users, experts=spec.experts, lookup=spec.lookup, is_block=spec.is_block)


def layout_groups(specs: list[GroupSpec]) -> list[Group]:
    """The layout of every group of a model; leaves that share bytes with another leaf (views of one fused
    weight) are not packed (see `Bucket`), and know the others over their storage (`Leaf.family`)."""
    unpackable = overlapping([_host_bytes(w.tensor, path) for spec in specs for w in spec.weights
                              for path in leaf_paths(w.tensor)])
    groups = [layout_group(i, spec, unpackable) for i, spec in enumerate(specs)]
    families: dict[int, list[Leaf]] = {}
    for group in groups:
        for bucket in group.buckets:
            if bucket.owner is not None:
                families.setdefault(viewed(bucket.owner.value).untyped_storage().data_ptr(), []).append(bucket.owner)
    for family in families.values():
        for leaf in family:
            leaf.family = tuple(family)
    return groups


def weight_layout(slot: Slot) -> tuple:
    """What the passes need of one weight: each leaf's (bucket, shape, stride, offset), and whether the graph
    rebuilds a subclass around them."""
    return tuple((leaf.bucket, leaf.shape, leaf.stride, leaf.offset) for leaf in slot.leaves), slot.rebuild is not None
