"""Runtime state of one offloaded model: host masters, device copies, the live-bytes ledger and stats.

Everything that changes while a model runs lives in `OffloadRuntime`. The graph's transfer ops
(`offload_compiler.ops`) call into it by integer id.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
import warnings
import weakref
from typing import Callable, NamedTuple

import torch

from ._dynamo import prefer_device_while_tracing
from ._registry import register
from .grouping import GroupSpec
from .passes.fuse import EVICT as EVICT_STEP
from .passes.schedule import ADOPT, CARRY, FETCH
from .policy import OffloadPolicy
from .host_masters import HostMaster, OnDemand, host_of, point_at, release_masters, watch_state_dict
from .subclasses import Path, RebuildSpec, leaf_at, leaf_paths, own_storage, rebuild, rebuild_spec, set_leaf

log = logging.getLogger("offload_compiler")

_NEXT_ID = itertools.count(1)


CARRY_MISSES_TO_STOP = 2  # a key whose carried copies were dropped unused this often (never used) stops carrying


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

    @property
    def peak_device_weight_bytes(self) -> int:
        """Peak of all weights on the device: the ledger's peak plus the weights that never leave it."""
        return self.peak_resident_bytes + self.unmanaged_bytes

    def __str__(self) -> str:
        mib = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
        total = self.total_bytes + self.unmanaged_bytes
        kept = f", {mib(self.unmanaged_bytes)} kept on the device" if self.unmanaged_bytes else ""
        carried = (f"; {mib(self.carried_bytes)} prefetched for the next call ({self.carry_hits} used)"
                   if self.carried_bytes or self.carry_hits else "")
        carried += (f"; {mib(self.on_demand_bytes)} fetched on demand outside the offloaded graphs"
                    if self.on_demand_bytes else "")
        return (f"moved {mib(self.bytes_transferred)} in {self.fetch_count} fetches; "
                f"peak device weights {mib(self.peak_device_weight_bytes)} of {mib(total)} "
                f"({mib(self.resident_bytes)} resident, {mib(self.streamed_bytes)} streamed{kept}){carried}")


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
    slot: "DeviceSlot"


@dataclasses.dataclass
class Leaf:
    """Where one plain tensor of a weight sits inside its group's flat buffer of one dtype: the weight itself,
    or an inner tensor (at ``path``) of a tensor-subclass weight (quantized data, scales; a DTensor's shard).
    ``stride`` is its layout in the buffer: its own where that is dense (channels_last, transposed; the graph
    views it so), else contiguous; ``own_stride`` is what unpack restores."""
    tensor: torch.Tensor  # the weight
    path: Path
    bucket: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    numel: int
    own_stride: tuple[int, ...]
    host_ptr: int = 0

    @property
    def value(self) -> torch.Tensor:
        """The tensor holding this leaf's host bytes (a host master's host view)."""
        return host_of(leaf_at(self.tensor, self.path))

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
    """One flat host buffer (one dtype) of a group; ``owner`` is set for a leaf that cannot be packed
    (it shares storage with another tensor), which is then copied from the leaf itself."""
    dtype: torch.dtype
    numel: int
    host: torch.Tensor | None
    owner: Leaf | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def source(self) -> torch.Tensor:
        return self.host if self.owner is None else self.owner.value.detach().reshape(-1)


@dataclasses.dataclass
class Group:
    index: int
    name: str
    streamed: bool
    slots: list[Slot]
    buckets: list[Bucket]
    exclusive: bool = False
    packed: bool = False

    @functools.cached_property
    def nbytes(self) -> int:  # the buckets' sizes are fixed by layout_group
        return sum(b.nbytes for b in self.buckets)

    @functools.cached_property
    def leaves(self) -> list[Leaf]:  # fixed by layout_group
        return [leaf for slot in self.slots for leaf in slot.leaves]


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


def is_accelerator(device: torch.device) -> bool:
    """A compute device that is not the host: its memory is not host memory, copies to it are transfers."""
    return device.type != "cpu"


def stream_module(device: torch.device):
    """The device module (``torch.cuda``, ``torch.xpu``, ``torch.npu``, a simulated device's...) whose streams and
    events the runtime's copies use, or None where the device has none (the CPU; MPS, which has no streams):
    copies are then issued in order on the one queue."""
    if not is_accelerator(device):
        return None
    try:
        module = torch.get_device_module(device)
    except (RuntimeError, AttributeError):
        return None
    needed = ("Stream", "Event", "current_stream", "stream")
    return module if all(hasattr(module, name) for name in needed) else None


def is_capturing(module) -> bool:
    """Whether the current stream is being captured into a graph (CUDA graphs and their likes)."""
    check = getattr(module, "is_current_stream_capturing", None)
    return bool(check is not None and check())


def synchronize(device: torch.device) -> None:
    """The host waits for the device's work (timing a call): through the device's own module, never
    ``torch.cuda`` for another device; nothing on the CPU, and nothing inside a graph capture, where a host
    synchronisation is illegal (the capture's work runs at replay)."""
    module = stream_module(device)
    if module is not None and hasattr(module, "synchronize") and not is_capturing(module):
        module.synchronize(device)


def can_pin(device: torch.device) -> bool:
    """Whether host memory can be pinned for ``device``: CUDA (and ROCm, which torch calls cuda) through
    ``cudaHostRegister``; another accelerator through ``pin_memory()`` where it is torch's current accelerator
    (XPU, NPU, MPS builds). Elsewhere (a simulated device) host buffers stay pageable."""
    if device.type == "cuda":
        return True
    if not is_accelerator(device) or not hasattr(torch, "accelerator"):
        return False
    current = torch.accelerator.current_accelerator()
    return current is not None and current.type == device.type and _pin_memory_works(device.type)


@functools.cache
def _pin_memory_works(device_type: str) -> bool:
    """Tried once per device type: a backend may register as the accelerator without pinned memory."""
    try:
        return torch.empty(1).pin_memory().is_pinned()
    except RuntimeError:
        return False


class DeviceSlot:
    """Fixed device memory for one group copy: one flat buffer per bucket of its size class, allocated once.
    ``group`` is the group whose copy is in it (None when free); a fetch creates no tensor (the graph views
    the weights over the buffers). On a device with streams, ``ready`` is recorded on the copy stream after a
    fill (compute waits on it) and ``free`` on the compute stream after an evict (the next fill waits on it)."""

    def __init__(self, size_class: tuple, device: torch.device, index: int, streams=None) -> None:
        self.size_class = size_class
        self.index = index
        self.device = device
        self.streams = streams  # the device module (`stream_module`), None without streams
        self.nbytes = sum(numel * dtype.itemsize for numel, dtype in size_class)
        self.group: int | None = None
        self._buffers: list[torch.Tensor] | None = None
        self.ready = self.free = None  # events, made with the buffers
        self.filled_in_capture = False  # its copy is a node of a captured graph: it exists only after a replay
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}  # group -> its weights over the buffers
        self._leaf_views: dict[int, tuple[torch.Tensor, ...]] = {}  # group -> its plain leaves over the buffers

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Allocated at the slot's first fill (the first call), not when a graph is planned: planning touches no
        device memory (and a graph can be rewritten for a device this process cannot allocate on)."""
        if self._buffers is None:
            with torch.inference_mode(False):  # ordinary tensors, whichever mode the first call ran in
                self._buffers = [torch.empty(numel, dtype=dtype, device=self.device)
                                 for numel, dtype in self.size_class]
            if self.streams is not None:
                self.ready, self.free = self.streams.Event(), self.streams.Event()
                # the caching allocator may have handed the allocating stream memory its queued work still
                # reads: the first fill (on the copy stream, which waits on ``free``) must come after that work
                self.free.record(self.streams.current_stream(self.device))
        return self._buffers

    def drop_buffers(self) -> None:
        """Give the slot's device memory back (`OffloadRuntime.release_device_copies`); the next fill
        allocates it again. The caller has ordered every stream's work on it before this point."""
        self._buffers = None
        self._views.clear()
        self._leaf_views.clear()
        self.ready = self.free = None

    def leaves(self, group: "Group") -> tuple[torch.Tensor, ...]:
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

    def weights(self, group: "Group") -> tuple[torch.Tensor, ...]:
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
        for buf in self.buffers:
            buf.fill_(float("nan") if buf.dtype.is_floating_point or buf.dtype.is_complex
                      else (True if buf.dtype == torch.bool else torch.iinfo(buf.dtype).max))


def size_class(group: Group) -> tuple:
    """Groups whose flat buffers have the same sizes and dtypes share device slots."""
    return tuple((b.numel, b.dtype) for b in group.buckets)


class DevicePool:
    """The device slots of one runtime, per size class; grown only when a graph is compiled (to the most
    slots any verified plan needs at once), never while a graph runs."""

    def __init__(self, device: torch.device, streams=None) -> None:
        self.device = device
        self.streams = streams
        self.slots: dict[tuple, list[DeviceSlot]] = {}

    def reserve(self, size_class: tuple, count: int) -> list[DeviceSlot]:
        slots = self.slots.setdefault(size_class, [])
        while len(slots) < count:
            slots.append(DeviceSlot(size_class, self.device, len(slots), self.streams))
        return slots

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for slots in self.slots.values() for s in slots)


class PinningUnavailable(RuntimeError):
    pass


class HostRegistrations:
    """Host buffers pinned in place with ``cudaHostRegister``. Each is unregistered while its memory is still
    allocated: explicitly when the runtime unpacks, else when the runtime is collected (this object holds the
    buffers, so they cannot be freed first)."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device and context, not only the current one

    def register(self, host: torch.Tensor) -> bool:
        nbytes = host.untyped_storage().nbytes()
        if nbytes == 0:  # cudaHostRegister(NULL, 0) fails; an empty buffer has nothing to copy anyway
            return False
        try:
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(host.data_ptr(), nbytes, self.PORTABLE)
        except Exception as exc:
            log.debug("cudaHostRegister unavailable (%s); using pin_memory()", exc)
            return False
        if int(getattr(err, "value", err)) != 0:
            # torch's binding leaves the error set: cleared, or the next kernel launch would report it
            getattr(cudart, "cudaGetLastError", lambda: None)()
            return False
        self.buffers.append(host)
        return True

    def unregister_all(self) -> None:
        buffers, self.buffers = self.buffers, []
        for host in buffers:
            try:
                cudart = torch.cuda.cudart()
                err = cudart.cudaHostUnregister(host.data_ptr())
                if int(getattr(err, "value", err)) != 0:
                    getattr(cudart, "cudaGetLastError", lambda: None)()
                    log.debug("cudaHostUnregister failed (%s)", err)
            except Exception as exc:  # interpreter shutdown: the process is ending anyway
                log.debug("cudaHostUnregister failed (%s)", exc)


def _pin_exact(host: torch.Tensor, registrations: HostRegistrations | None = None) -> torch.Tensor:
    """Pin an already-filled host buffer in place at its exact size (no power-of-two rounding of the
    caching host allocator) where ``registrations`` can (CUDA); else a pinned copy (``pin_memory()``: the
    current accelerator's pinned memory)."""
    if registrations is not None and registrations.register(host):
        return host
    try:
        return host.pin_memory()
    except RuntimeError as exc:
        raise PinningUnavailable(str(exc).splitlines()[0]) from None


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
            t = host_of(leaf_at(w.tensor, path))
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
    return Group(index, spec.name, spec.streamed, slots, buckets, spec.exclusive)


def pack_group(group: Group, pin: bool, on_pin_failure: Callable[[str], None] | None = None,
               registrations: HostRegistrations | None = None) -> None:
    """Copy a group's leaves into one flat host buffer per dtype (pinned: the buffer, never a subclass's own
    ``pin_memory``) and point each leaf at its place in it, so the module keeps its parameters (a subclass
    weight stays that subclass, and ``state_dict`` works) while one copy moves the group."""
    for bi, bucket in enumerate(group.buckets):
        owner = bucket.owner
        if owner is not None and owner.value.device.type != "cpu":
            # a leaf on another device (a DTensor shard placed on a cuda mesh) goes to host memory
            owner.assign(owner.value.detach().to("cpu"))
        if bucket.owner is not None or bucket.host is not None:
            continue
        flat = torch.empty(bucket.numel, dtype=bucket.dtype)
        members = [leaf for leaf in group.leaves if leaf.bucket == bi]
        with torch.no_grad():
            for leaf in members:
                leaf.host_view(flat).copy_(leaf.value.detach())
        if pin:
            try:
                flat = _pin_exact(flat, registrations)
            except PinningUnavailable as exc:
                if on_pin_failure is None:
                    raise
                on_pin_failure(str(exc))
        for leaf in members:
            leaf.assign(leaf.host_view(flat))
        bucket.host = flat
    for leaf in group.leaves:
        leaf.host_ptr = leaf.value.data_ptr()
    group.packed = True


def _own_copy(packed: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """A packed leaf copied into storage of its own, with the strides it had before packing (channels_last,
    a transposed view's layout) where those describe a dense tensor; contiguous otherwise (expanded weights)."""
    if not dense_layout(tuple(packed.shape), stride):
        return packed.clone(memory_format=torch.contiguous_format)
    return torch.empty_strided(packed.shape, stride, dtype=packed.dtype).copy_(packed)


def _weight_layout(slot: Slot) -> tuple:
    """What the passes need of one weight: each leaf's (bucket, shape, stride, offset), and whether the graph
    rebuilds a subclass around them."""
    return tuple((leaf.bucket, leaf.shape, leaf.stride, leaf.offset) for leaf in slot.leaves), slot.rebuild is not None


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


def _finalize(copy_streams: list, registrations: HostRegistrations | None) -> None:
    """A runtime collected with copies in flight (a carried copy, a call that never waited): the host waits
    for them before its device slots are freed and its pinned buffers unregistered (this runs first)."""
    for stream in copy_streams:
        try:
            stream.synchronize()
        except Exception as exc:  # interpreter shutdown, a capture under way: nothing left to order
            log.debug("copy stream synchronize at collection failed (%s)", exc)
    if registrations is not None:
        registrations.unregister_all()


def tracing_on(device: torch.device):
    """Entered while dynamo captures an offloaded model outside `_dynamo.compile_under_config` (``auto``'s
    planning capture): see `_dynamo.prefer_device_while_tracing`."""
    return prefer_device_while_tracing(device.type)


class OffloadRuntime:
    """One model's offload state, shared by every graph captured from it."""

    def __init__(self, policy: OffloadPolicy, specs: list[GroupSpec], model_name: str = "model",
                 pack_now: bool = True, on_demand: OnDemand | None = None) -> None:
        self.id = next(_NEXT_ID)
        self.policy = policy
        self.model_name = model_name
        self.device = policy.torch_device
        self.pinned = policy.pin_memory and can_pin(self.device)
        if policy.pin_memory and not self.pinned and is_accelerator(self.device):
            log.debug("pin_memory ignored: no pinned host memory for %s; host buffers stay pageable", self.device)
        self.streams = stream_module(self.device)  # the device module whose streams and events order copies
        self.captured = False  # a copy was issued inside a graph capture (see `_copy_on_stream`)
        unpackable = overlapping([host_of(leaf_at(w.tensor, path)) for spec in specs for w in spec.weights
                                  for path in leaf_paths(w.tensor)])
        self.groups = [layout_group(i, spec, unpackable) for i, spec in enumerate(specs)]
        self.lock = threading.RLock()
        self.closed = False
        self._faults: list[Fault] = []
        self._registrations = HostRegistrations() if self.device.type == "cuda" else None
        self._copy_streams: list = []  # the copy stream once made, shared with the finalizer
        self.on_demand = on_demand or OnDemand()  # weights read outside the graphs (host masters, per op)
        self._state_dict_hooks: dict[int, tuple] = {}  # module id -> (module ref, handle): see `keep_state_dicts_plain`
        weakref.finalize(self, _finalize, self._copy_streams, self._registrations)
        if pack_now:
            for group in self.groups:
                self._pack(group)
        self.group_of: dict[int, tuple[int, int]] = {
            id(slot.tensor): (g.index, si) for g in self.groups for si, slot in enumerate(g.slots)}
        self.layout = {g.index: [_weight_layout(s) for s in g.slots] for g in self.groups}
        # tensor-subclass weights (quantized, DTensor): rebuilt in the graph around their fetched leaves
        self.rebuild_specs = {(g.index, si): s.rebuild for g in self.groups for si, s in enumerate(g.slots)
                              if s.rebuild is not None}
        self.graph_plans: list = []
        self.graph_calls = 0
        self.plan_calls: list[int] = []  # per graph plan: how often it ran (since the last reset_stats)
        self.group_remap: dict[int, int] | None = None  # per call: compiled group -> group of the weights passed
        self.unmanaged_bytes = 0  # weights in no group: they live on the compute device
        self.unmanaged_ids: set[int] = set()  # and which tensors those are
        self.model_ref: Callable[[], object] | None = None  # a weak reference to the model (names in messages)
        self.ledger = Ledger()
        self.bytes_transferred = 0
        self.fetch_count = 0
        self.used_groups: set[int] = set()  # groups a graph read in the current call (fetched or resident)
        self.pool = DevicePool(self.device, self.streams)
        self._slot_of: dict[int, DeviceSlot] = {}  # fetch key -> the pool slot its copy lands in (the plan)
        self._pending: dict[int, DeviceSlot] = {}  # fetch key -> slot being filled, not yet waited for
        self._live: dict[int, DeviceSlot] = {}  # group -> slot waited for, not yet evicted (this call)
        self._resident: dict[int, tuple[DeviceSlot, tuple]] = {}  # group -> its own slot, host stamp
        self._parked: dict[int, tuple[DeviceSlot, tuple]] = {}
        self._carried: dict[int, Carried] = {}  # fetch key -> copy made by the previous call
        self._carry_used: set[int] = set()  # keys whose carried copy was taken at least once
        self._carry_misses: dict[int, int] = {}  # keys whose carried copy was dropped unused, how often
        self.carry_hits = 0
        self._fetch_keys = itertools.count(1)
        self._transfer_plans: list[TransferPlan] = []  # see `plan_transfer`
        self._transfer_plan_index: dict[TransferPlan, int] = {}
        register(self)

    # -- layout, used by the passes and by the ops' fake implementations -------------------------
    def bucket_layout(self, group: int) -> list[tuple[int, torch.dtype]]:
        """Size and dtype of each flat buffer of a group: what `wait` and `resident` return."""
        return list(size_class(self.groups[group]))

    def new_fetch_key(self) -> int:
        return next(self._fetch_keys)

    @property
    def total_bytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    # -- the device pool: slots planned per fetch key when a graph is compiled ----------------------
    def plan_slots(self, assignment: dict[int, tuple[int, int]]) -> None:
        """Bind each fetch key to its pool slot: ``assignment`` maps key -> (group, slot index within the
        group's size class), as the slot pass planned it; the pool grows to hold every slot named."""
        for key, (group, index) in assignment.items():
            self._slot_of[key] = self.pool.reserve(size_class(self.groups[group]), index + 1)[index]

    # -- transfers --------------------------------------------------------------------------------
    def _fill(self, slot: DeviceSlot, group: Group) -> DeviceSlot:
        """Copy a group's host buffers into its slot (asynchronously on an accelerator); no allocation."""
        if not group.packed:  # deferred while dynamo still traces the unpacked weights
            self._pack(group)
        self._refresh_host(group)
        if self._faults:
            self._maybe_fail("fetch", group.index)
        if slot.group is not None:
            self._vacate(slot)
        self._copy_into(slot, group)
        slot.group = group.index
        self.ledger.occupy(slot.nbytes)
        self.bytes_transferred += group.nbytes
        self.fetch_count += 1
        return slot

    def _copy_into(self, slot: DeviceSlot, group: Group) -> None:
        """The copy itself: on the copy stream on an accelerator, else here (`benchmarks/decode.py --decompose`
        times calls without it)."""
        buffers = slot.buffers
        if slot.ready is not None:
            self._copy_on_stream(slot, group)
        else:
            for buf, bucket in zip(buffers, group.buckets):
                buf.copy_(bucket.source())

    def _copy_on_stream(self, slot: DeviceSlot, group: Group) -> None:
        """The copy stream refills a slot only after the compute that read its previous contents (the
        slot's ``free`` event; inside a CUDA-graph capture, everything issued before, which also joins the
        copy stream into the capture); compute waits on ``ready``."""
        streams = self.streams
        stream = self._stream()
        capturing = is_capturing(streams)
        self.captured |= capturing
        if self.captured:
            # once a graph was captured, its replays (launched by the caller, unseen here) read and write slots
            # between our calls, and events recorded inside the capture are nodes of its graph, not records:
            # ``free`` no longer orders a refill after every reader, so the copy waits for all work issued
            stream.wait_stream(streams.current_stream(self.device))
        else:
            stream.wait_event(slot.free)
        slot.filled_in_capture = capturing
        with streams.stream(stream):
            for buf, bucket in zip(slot.buffers, group.buckets):
                buf.copy_(bucket.source(), non_blocking=True)
        slot.ready.record(stream)

    def _ready(self, slot: DeviceSlot) -> DeviceSlot:
        if slot.ready is not None:
            self.streams.current_stream(self.device).wait_event(slot.ready)
        return slot

    def _release(self, slot: DeviceSlot) -> None:
        """The slot's copy is gone (evicted, dropped): free for the next fill once its readers finished."""
        if slot.group is None:
            return
        slot.group = None
        self.ledger.release(slot.nbytes)
        if slot.free is not None:
            slot.free.record(self.streams.current_stream(self.device))

    def _vacate(self, slot: DeviceSlot) -> None:
        """A slot about to be refilled still holds a copy kept between calls (a parked component, a copy
        carried for another graph): that copy goes. A copy of the running call there is a planning bug."""
        for group, (held, _) in list(self._parked.items()):
            if held is slot:
                del self._parked[group]
        for key, carried in list(self._carried.items()):
            if carried.slot is slot:
                del self._carried[key]
        if slot in self._pending.values() or slot in self._live.values():
            raise AssertionError(f"device slot {slot.index} of {slot.size_class} refilled while in use")
        self._release(slot)

    def _pack(self, group: Group) -> None:
        with torch.inference_mode(False):  # deferred to the first call, which may run in inference mode
            pack_group(group, self.pinned, self._pinning_failed, self._registrations)

    def _pinning_failed(self, reason: str) -> None:
        """Pinned memory could not be had: keep going with pageable host memory, saying so once."""
        self.pinned = False
        warnings.warn(f"offload_compiler: pinned host memory is unavailable ({reason}); weights stay in pageable "
                      f"memory, so host-to-device copies are slower and not asynchronous", RuntimeWarning,
                      stacklevel=2)

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

    @property
    def _copy_stream(self):
        return self._copy_streams[0] if self._copy_streams else None

    def _stream(self):
        if not self._copy_streams:
            self._copy_streams.append(self.streams.Stream(self.device))
        return self._copy_streams[0]

    def wait_for_copies(self) -> None:
        """The host waits until every copy issued so far has finished reading host memory: before the host
        writes a buffer that a queued copy may still read (repacking a changed weight, `load_state_dict`),
        and before the runtime lets go of its device memory or host buffers. Never inside a graph capture
        (illegal there; a capture's copies read host memory at replay, not now)."""
        stream = self._copy_stream
        if stream is not None and not is_capturing(self.streams):
            stream.synchronize()

    def _refresh_host(self, group: Group) -> None:
        """A leaf whose data was replaced since packing (``.data``, an inner tensor) is copied back into the
        flat buffer."""
        for leaf in group.leaves:  # once per leaf per fetch: a plain weight's leaf is the weight itself
            if leaf.value.data_ptr() != leaf.host_ptr:
                self._repack(group, leaf)

    def _repack(self, group: Group, leaf: Leaf) -> None:
        if group.buckets[leaf.bucket].owner is None:  # an owner bucket is read from the leaf itself
            self.wait_for_copies()  # a queued copy (of this call, or carried from the last) may still read it
            view = leaf.host_view(group.buckets[leaf.bucket].host)
            with torch.no_grad():
                view.copy_(leaf.value.detach())
            leaf.assign(view)
            leaf.host_ptr = leaf.value.data_ptr()

    def prefetch(self, key: int, group: int, mode: int = FETCH) -> None:
        """FETCH: copy now; ADOPT: take the copy the previous call carried for ``key`` if still valid (same
        group, host weights unchanged), else copy; CARRY: copy for the next call (prefetch wrap-around).
        Every copy lands in the slot planned for ``key``."""
        group = self._actual(group)
        g = self.groups[group]
        slot = self._slot_of[key]
        # inside a graph capture, copies made before it cannot be waited for (their events were recorded outside
        # it), and a copy for the next call would fork the copy stream out of the capture without a join: a
        # captured call copies what it reads, and carries nothing. Nor does any call after a capture: replays
        # (unseen here) write the same slots on the compute stream while a carried copy would be in flight
        capturing = self.streams is not None and is_capturing(self.streams)
        if mode == CARRY:
            if (not capturing and not self.captured and self.group_remap is None
                    and self._carry_misses.get(key, 0) < CARRY_MISSES_TO_STOP):
                self._carried[key] = Carried(group, self._stamp(g), self._fill(slot, g))
            return
        if mode == ADOPT and not capturing and self._adopt(key, g):
            return
        if g.exclusive:  # alternating: other components leave before this one arrives
            for other in [o for o in self._parked if o != group]:
                self._unpark(other)
        parked = self._parked.pop(group, None)
        if parked is not None and parked[0] is slot and parked[1] == self._stamp(g) and not capturing:
            self._pending[key] = slot
            return
        if parked is not None:
            self._release(parked[0])
        self._pending[key] = self._fill(slot, g)

    def _adopt(self, key: int, group: Group) -> bool:
        carried = self._carried.pop(key, None)
        if carried is None:
            return False
        if carried.group == group.index and carried.stamp == self._stamp(group):
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
        return self._wait(key, group).buffers

    def wait_weights(self, key: int, group: int) -> tuple[torch.Tensor, ...]:
        """As `wait`, but the group's weights themselves (made over the slot once): the eager path."""
        slot = self._wait(key, group)
        return slot.weights(self.groups[slot.group])

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

    def transfer_group(self, plan: int) -> int:
        """The group whose leaves `run_transfer` returns for ``plan`` (as compiled: before any remap)."""
        return self._transfer_plans[plan].group

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
        group = self._actual(group)
        self.used_groups.add(group)
        slot = self._pending.pop(key, None) or self._fill(self._slot_of[key], self.groups[group])
        self._live[group] = self._ready(slot)
        return slot

    def evict(self, group: int, poison: bool, park: bool = False) -> None:
        group = self._actual(group)
        if self._faults:
            self._maybe_fail("evict", group)
        slot = self._live.pop(group)
        if park and not slot.filled_in_capture:  # latency-minimising: stays on the device until another
            # component needs the room (not a copy a capture made: it exists only when the graph replays)
            self._parked[group] = (slot, self._stamp(self.groups[group]))
            return
        if poison and self.policy.debug_poison:
            slot.poison()
        self._release(slot)

    def _actual(self, group: int) -> int:
        remap = self.group_remap
        return group if remap is None else remap.get(group, group)

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

    @staticmethod
    def _stamp(group: Group) -> tuple:
        """Changes whenever a host weight of the group is modified in place or replaced."""
        return tuple((leaf.value._version, leaf.value.data_ptr()) for leaf in group.leaves)

    def resident(self, group: int) -> list[torch.Tensor]:
        """The persistent device copy of a resident group (a slot of its own, outside the streamed pool),
        refilled in place when a host weight changed."""
        return self._resident_slot(group).buffers

    def resident_weights(self, group: int) -> tuple[torch.Tensor, ...]:
        slot = self._resident_slot(group)
        return slot.weights(self.groups[slot.group])

    def _resident_slot(self, group: int) -> DeviceSlot:
        group = self._actual(group)
        self.used_groups.add(group)
        g = self.groups[group]
        held = self._resident.get(group)
        stamp = self._stamp(g)
        if held is None or held[1] != stamp or (held[0].filled_in_capture and not is_capturing(self.streams)):
            slot = held[0] if held is not None else DeviceSlot(size_class(g), self.device, -1, self.streams)
            if held is not None:
                self._release(slot)
            self._resident[group] = (self._ready(self._fill(slot, g)), stamp)
        return self._resident[group][0]

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
        self.wait_for_copies()  # (a failure inside a capture keeps its own error: no synchronize there)
        for slot in [*self._pending.values(), *self._live.values()]:
            self._release(slot)
        self._pending.clear()
        self._live.clear()
        self.release_carried()

    def release_carried(self) -> int:
        freed = sum(self.groups[c.group].nbytes for c in self._carried.values())
        for carried in self._carried.values():
            self._release(carried.slot)
        self._carried.clear()
        return freed

    def release_resident(self) -> None:
        for slot, _ in [*self._resident.values(), *self._parked.values()]:
            self._release(slot)
        self._resident.clear()
        self._parked.clear()

    def release_device_copies(self) -> int:
        """Drop every device copy held between calls (resident groups, parked components, copies carried for
        the next call) and the slot pool's memory; the next call fetches what it needs again (a graph captured
        before must be captured again: its slots' addresses are gone). Returns the bytes of copies released."""
        with self.lock:
            freed = self.release_carried() + sum(self.groups[g].nbytes for g in {*self._resident, *self._parked})
            self.release_resident()
            self._drop_free_slots()
            return freed

    def _drop_free_slots(self) -> None:
        """The pool's memory goes too (its slots hold no copy between calls): the compute stream is ordered
        after the copy stream first, so the allocator's reuse of the memory on it comes after every copy."""
        if self.streams is not None and self._copy_stream is not None:
            self.streams.current_stream(self.device).wait_stream(self._copy_stream)
        for slots in self.pool.slots.values():
            for slot in slots:
                if slot.group is None:
                    slot.drop_buffers()

    def unpack(self) -> None:
        """Give every weight its own storage again (the undo of packing) and drop all device copies and the
        device pool."""
        with self.lock:
            self.abandon_pending()
            self.release_resident()
            self.pool = DevicePool(self.device, self.streams)
            self._slot_of.clear()
            masters: dict[int, tuple] = {}
            for group in self.groups:
                if not group.packed:
                    continue
                for leaf in group.leaves:
                    owned = group.buckets[leaf.bucket].owner is not None  # never packed: its bytes are its own
                    own = leaf.value if owned else _own_copy(leaf.value.detach(), leaf.own_stride)
                    if isinstance(leaf.tensor, HostMaster):
                        masters[id(leaf.tensor)] = (leaf.tensor, own)
                    elif not owned:
                        leaf.assign(own)
            model = self.model_ref() if self.model_ref is not None else None
            if masters and model is not None:
                release_masters(model, masters)
            for _, handle in self._state_dict_hooks.values():
                handle.remove()
            self._state_dict_hooks.clear()
            if self._registrations is not None:
                self._registrations.unregister_all()  # before the buffers can be freed
            for group in self.groups:
                for bucket in group.buckets:
                    if bucket.owner is None:
                        bucket.host = None
                group.packed = False
            self.closed = True

    def keep_state_dicts_plain(self, model: torch.nn.Module) -> None:
        """On an accelerator, ``state_dict`` of the model and of each of its modules gives host masters as
        their host views (plain tensors, as before offloading), until `unpack`."""
        if is_accelerator(self.device):
            for module in model.modules():
                watch_state_dict(module, self._state_dict_hooks)

    # -- stats --------------------------------------------------------------------------------------
    def stats(self) -> OffloadStats:
        held = sum(self.groups[g].nbytes for g in self._resident)
        parked = sum(self.groups[g].nbytes for g in self._parked)
        streamed = sum(g.nbytes for g in self.groups if g.streamed)
        carried = sum(self.groups[c.group].nbytes for c in self._carried.values())
        return OffloadStats(self.bytes_transferred, self.ledger.peak, self.fetch_count, self.ledger.live,
                            held, streamed, self.total_bytes, parked, self.unmanaged_bytes, carried,
                            self.carry_hits, self.on_demand.bytes)

    def describe(self) -> str:
        """The plan for people: each group's bytes and residency, and each graph's fetches and peak."""
        mib = lambda n: f"{n / 2**20:9.3f} MiB"  # noqa: E731
        lines = [f"offload plan for {self.model_name}: strategy={self.policy.strategy} device={self.device} "
                 f"prefetch={self.policy.prefetch}{' (wraps to the next call)' if self.policy.prefetch_next_call else ''} "
                 f"compiler={self.policy.compiler} pinned={self.pinned}"
                 + (f" rank={torch.distributed.get_rank()}/{torch.distributed.get_world_size()} (bytes are this "
                    f"rank's)" if torch.distributed.is_available() and torch.distributed.is_initialized() else "")]
        for g in self.groups:
            lines.append(f"  group {g.index:3d} {g.name:<40s} {mib(g.nbytes)}  "
                         f"{'streamed' if g.streamed else 'resident'}{_subclass_note(g)}")
        for i, plan in enumerate(self.graph_plans):
            v = plan.verified
            carried = f"; {mib(v.carried_bytes)} prefetched for its next call" if v.carried_bytes else ""
            lines.append(f"  graph {i}: {plan.num_nodes} nodes, {v.fetches} fetches per call, "
                         f"predicted peak {mib(v.peak_bytes)} ({mib(v.resident_bytes)} resident + "
                         f"{mib(v.streamed_peak_bytes)} streamed{carried}); device slots {mib(plan.pool_bytes)}")
        if self.pool.slots:
            lines.append(f"  device pool {mib(self.pool.nbytes)}: "
                         + ", ".join(f"{len(slots)} x {mib(slots[0].nbytes).strip()}" for slots in self.pool.slots.values()))
        resident = sum(g.nbytes for g in self.groups if not g.streamed)
        lines.append(f"  total {mib(self.total_bytes + self.unmanaged_bytes)}: {mib(resident)} resident, "
                     f"{mib(self.total_bytes - resident)} streamed"
                     + (f", {mib(self.unmanaged_bytes)} outside the groups (kept on the device)"
                        if self.unmanaged_bytes else ""))
        return "\n".join(lines)

    def reset_stats(self) -> None:
        self.plan_calls = [0] * len(self.plan_calls)
        self.bytes_transferred = 0
        self.fetch_count = 0
        self.carry_hits = 0
        self.on_demand.bytes = self.on_demand.ops = 0
        self.ledger.reset_peak()
