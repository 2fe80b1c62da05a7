"""A simulated accelerator: a device that is not the host, with CUDA's stream rules checked.

``simulated_device()`` installs it once per process and returns its device string ("sim:0"); pass that as
``OffloadPolicy(device=...)``. Tensors on it are not CPU tensors: a compute op that meets a non-scalar CPU
tensor raises torch's own "Expected all tensors to be on the same device", so a route that reads host
weights fails at the op instead of computing the right numbers from host memory. Each op runs at once, in
issue order, on CPU views of the device memory (about 0.5 ms of Python dispatch per op: keep models tiny).

How it is built (torch's public extension points for an out-of-tree backend, no C++):

- the PrivateUse1 dispatch key renamed to ``sim`` (permanent for the process) and a device module
  registered for it, reachable as ``torch.get_device_module("sim")`` (`Stream`, `Event`, `current_stream`,
  `stream`, `synchronize`, memory counters, `graph`); as on CUDA, the current stream is per host thread
  (each thread starts on the default stream);
- device memory: blocks of host memory handed to torch through DLPack with the extension device type, so
  torch frees them like any storage and the allocator hears of it (memory counters, the reuse rule);
- one catch-all fallback kernel for the key: view ops run torch's own CPU kernels on the device tensors
  (they only touch metadata), every other op runs on CPU views of its device arguments and its fresh
  outputs are copied into new device memory; where the CPU kernel does not do what CUDA's does (convolutions
  reach ``convolution_overrideable`` off the CPU and CUDA; ``histc`` of integers), `_CUDA_KERNELS` stands in;
  what CUDA accepts, it accepts: a composite op's Python scalar operand (``x % 16``) and host index tensors
  of advanced indexing. The kernel runs outside dynamo (``torch.compiler.disable``): called from a frame that
  dynamo runs without a graph, it is the device's, not the model's code.

The checker (`_Checker`) keeps a vector clock per stream: an op on stream S ticks S's own entry, an event
snapshots the clock of the stream it is recorded on, and a wait joins that snapshot into the waiting
stream. Every op's reads and writes of device memory are recorded with (stream, tick); an access is legal
only if the accessing stream's clock covers every conflicting earlier access of another stream (read after
write, write after read or write). It raises `OrderingViolation` on:

- reading memory written on another stream without an event wait ordering the read after the write;
- writing memory another stream read or wrote without such a wait;
- the caching allocator's rule: a block is allocated on the current stream and counts as written there at
  allocation (the allocator may hand out memory that stream's queued work still uses), so another stream
  must wait on the allocating stream before touching it;
- a non_blocking copy from host memory whose source the host changed before it knew the copy finished
  (shown when the copy's destination is read): on an accelerator the copy reads pinned host memory when
  the stream reaches it, not when it is issued (this simulator has no pinned memory and is stricter there
  than CUDA is for pageable memory, on purpose: code written for pinned buffers must order its host writes);
- capture rules (`graph`): waiting inside a capture on an event recorded outside it, a stream forked into
  the capture and not joined back when it ends, a host synchronisation during a capture.

Ops are not delayed, so a violation is found even where real hardware would happen to win the race.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import itertools
import threading
import types
import weakref
from typing import Any, Iterator

import torch

NAME = "sim"

_DL_CPU, _DL_EXT_DEV = 1, 12  # DLPack device types: host memory, an out-of-tree device (torch: PrivateUse1)
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_INSTALL_LOCK = threading.Lock()
_installed: str | None = None
_LIBRARY = _ATEN = None  # torch.library registrations, kept for the process


class OrderingViolation(RuntimeError):
    """Device work whose order CUDA's rules do not guarantee: a race that real hardware may or may not lose."""


# -- device memory ------------------------------------------------------------------------------------

_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _retag(tensor: torch.Tensor, dl_device_type: int) -> torch.Tensor:
    """The same memory as a tensor of another device type: DLPack's device field rewritten in flight (offset 8
    of DLTensor: after the data pointer). The new tensor keeps the old one alive, so its memory too."""
    capsule = torch.utils.dlpack.to_dlpack(tensor)
    ctypes.c_int32.from_address(_capsule_pointer(capsule, b"dltensor") + 8).value = dl_device_type
    return torch.utils.dlpack.from_dlpack(capsule)


def host_view(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over a simulated-device tensor's memory (what the device's kernels compute on)."""
    return _retag(tensor, _DL_CPU)


class _Block(bytearray):
    """Host memory backing one device allocation; weak-referenceable, so its release is observed."""


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses a tensor's elements reach: [first, last + 1) over its strides."""
    if t.numel() == 0:
        return 0, 0
    reach = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if stride > 0)
    low = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if stride < 0)
    return t.data_ptr() + low * t.element_size(), t.data_ptr() + (reach + 1) * t.element_size()


# -- streams and events ----------------------------------------------------------------------------------

class Stream:
    """A queue of device work. Ops issued while it is current run on it (see `stream`)."""
    _ids = itertools.count(0)

    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.id = next(Stream._ids)
        self.device = torch.device(NAME, 0)
        self.priority = priority
        self.clock: dict[int, int] = {self.id: 0}  # per stream: how much of its work this stream is ordered after

    def wait_event(self, event: "Event") -> None:
        _checker().wait(self, event)

    def wait_stream(self, stream: "Stream") -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = event if event is not None else Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True  # work runs when issued

    def synchronize(self) -> None:
        _checker().host_waits(self.clock, f"stream {self.id}.synchronize()")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("sim-stream", self.id))

    def __repr__(self) -> str:
        return f"<sim stream {self.id}>"


class Event:
    """A point in a stream's work: `record` snapshots the stream's clock, `wait` orders another stream after it."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.clock: dict[int, int] | None = None  # None: never recorded (waiting on it is a no-op, as in CUDA)
        # a record inside a capture is a node of the graph, not a record of the event: waits inside that capture
        # see it, eager waits after it still see the last eager record (stale, as on CUDA)
        self.capture: int | None = None
        self.captured_clock: dict[int, int] | None = None

    def record(self, stream: Stream | None = None) -> None:
        _checker().record(stream if stream is not None else current_stream(), self)

    def wait(self, stream: Stream | None = None) -> None:
        (stream if stream is not None else current_stream()).wait_event(self)

    def query(self) -> bool:
        if self.clock is not None:
            _checker().host_knows(self.clock)
        return True

    def synchronize(self) -> None:
        if self.clock is not None:
            _checker().host_waits(self.clock, "event.synchronize()")

    def elapsed_time(self, end: "Event") -> float:
        return 0.0


# -- the checker ----------------------------------------------------------------------------------------

class _Access:
    __slots__ = ("start", "end", "write", "stream", "tick", "what")

    def __init__(self, start: int, end: int, write: bool, stream: int, tick: int, what: str) -> None:
        self.start, self.end, self.write, self.stream, self.tick, self.what = start, end, write, stream, tick, what


class _InFlight:
    """A non_blocking copy from host memory, which on hardware reads its source when its stream gets there."""
    __slots__ = ("block", "start", "end", "source", "snapshot", "stream", "tick", "read")

    def __init__(self, block, start, end, source, stream, tick) -> None:
        self.block, self.start, self.end, self.source = block, start, end, source
        self.snapshot = source.clone()
        self.stream, self.tick = stream, tick
        self.read = False  # its result was read: from then on, a change of its source is a wrong result

    def changed(self) -> bool:
        return not torch.equal(self.source, self.snapshot)


class _Capture:
    def __init__(self, index: int, origin: Stream) -> None:
        self.index = index
        self.origin = origin
        self.streams: dict[int, Stream] = {origin.id: origin}  # joined into the capture (the origin, forks)
        self.last_tick: dict[int, int] = {}  # per stream: its last op inside the capture
        self.ops: list[tuple] = []


class _Checker:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.default = Stream()
        self._local = threading.local()  # the current stream is per host thread, as CUDA's
        self.streams: dict[int, Stream] = {self.default.id: self.default}
        self.host: dict[int, int] = {}  # per stream: the work the host knows finished
        self.accesses: dict[int, list[_Access]] = {}  # block address -> accesses not yet superseded
        self.bases: list[int] = []  # sorted addresses of the live blocks (a storage slice starts inside one)
        self.sizes: dict[int, int] = {}
        self.in_flight: list[_InFlight] = []
        self.pending: list[str] = []  # violations found where raising is impossible (an allocation's release)
        self.allocated = self.peak = 0
        self.capture: _Capture | None = None
        self._captures = itertools.count(1)

    @property
    def current(self) -> Stream:
        """The calling thread's current stream: the default stream until that thread sets another."""
        return getattr(self._local, "stream", self.default)

    @current.setter
    def current(self, stream: Stream) -> None:
        self._local.stream = stream

    # streams' clocks
    def tick(self, stream: Stream) -> int:
        self.streams.setdefault(stream.id, stream)
        stream.clock[stream.id] += 1
        if self.capture is not None and stream.id in self.capture.streams:
            self.capture.last_tick[stream.id] = stream.clock[stream.id]
        return stream.clock[stream.id]

    def record(self, stream: Stream, event: Event) -> None:
        with self.lock:
            self.streams.setdefault(stream.id, stream)
            capture = self.capture
            if capture is not None and stream.id in capture.streams:
                event.capture, event.captured_clock = capture.index, dict(stream.clock)
            else:
                event.clock = dict(stream.clock)

    def wait(self, stream: Stream, event: Event) -> None:
        with self.lock:
            capture = self.capture
            in_capture = capture is not None and event.capture == capture.index
            if capture is not None and stream.id in capture.streams and not in_capture:
                if event.clock is None:
                    return
                raise OrderingViolation(
                    f"stream {stream.id} waits, inside a graph capture, on an event recorded outside it "
                    f"(cudaErrorStreamCaptureIsolation): record the event inside the capture, or order the work "
                    f"before the capture begins")
            clock = event.captured_clock if in_capture else event.clock
            if clock is None:
                return
            if in_capture and stream.id not in capture.streams:
                capture.streams[stream.id] = stream  # a fork: the stream joins the capture
                capture.last_tick.setdefault(stream.id, stream.clock[stream.id])
            for sid, t in clock.items():
                if stream.clock.get(sid, 0) < t:
                    stream.clock[sid] = t

    def host_knows(self, clock: dict[int, int]) -> None:
        for sid, t in clock.items():
            if self.host.get(sid, 0) < t:
                self.host[sid] = t
        self.in_flight = [c for c in self.in_flight if self.host.get(c.stream, 0) < c.tick]

    def host_waits(self, clock: dict[int, int], what: str) -> None:
        with self.lock:
            if self.capture is not None:
                raise OrderingViolation(f"{what} during a graph capture: the host cannot wait for work that is "
                                        f"recorded, not run (cudaErrorStreamCaptureUnsupported)")
            self.host_knows(clock)

    def synchronize(self) -> None:
        with self.lock:
            for stream in self.streams.values():
                self.host_waits(stream.clock, "synchronize()")

    # memory
    def allocate(self, nbytes: int, stream: Stream) -> tuple[_Block, int]:
        block = _Block(max(nbytes, 1))
        address = torch.frombuffer(block, dtype=torch.uint8).data_ptr()
        with self.lock:
            self.allocated += nbytes
            self.peak = max(self.peak, self.allocated)
            # the caching allocator may hand this stream memory its queued work still reads: the block counts as
            # written by the allocating stream now, so another stream must wait on that stream before touching it
            tick = self.tick(stream)
            self.accesses[address] = [_Access(address, address + nbytes, True, stream.id, tick, "its allocation")]
            bisect.insort(self.bases, address)
            self.sizes[address] = nbytes
        weakref.finalize(block, self._released, address, nbytes, stream)
        return block, address

    def _released(self, address: int, nbytes: int, owner: Stream) -> None:
        """The caching allocator's rule, at the free: the block goes back to the stream it was allocated on,
        which may reuse it at once; work of another stream on it must be ordered before that stream's next
        work, or known finished by the host (``record_stream``'s purpose). Found in a finalizer, where
        raising is impossible: raised at the next op."""
        with self.lock:
            for a in self.accesses.get(address, ()):
                if (a.stream != owner.id and owner.clock.get(a.stream, 0) < a.tick
                        and self.host.get(a.stream, 0) < a.tick):
                    self.pending.append(
                        f"a {nbytes}-byte device block allocated on stream {owner.id} was freed while {a.what} on "
                        f"stream {a.stream} (its op {a.tick}) may still be running: the allocator hands it to "
                        f"stream {owner.id}'s next allocation at once (wait on stream {a.stream}, or synchronize it, "
                        f"before dropping the last reference)")
                    break
            self.allocated -= nbytes
            self.accesses.pop(address, None)
            self.sizes.pop(address, None)
            index = bisect.bisect_left(self.bases, address)
            if index < len(self.bases) and self.bases[index] == address:
                del self.bases[index]

    def region(self, t: torch.Tensor) -> tuple[int, int, int] | None:
        """(block address, first, end) of the memory a device tensor reaches; None for no bytes."""
        start, end = _span(t)
        index = bisect.bisect_right(self.bases, start) - 1
        if start == end or index < 0:
            return None
        base = self.bases[index]
        return (base, start, end) if start < base + max(self.sizes[base], 1) else None

    def access(self, stream: Stream, tick: int, what: str, reads, writes) -> None:
        """Check and record one op's accesses: ``reads``/``writes`` are (block address, start, end)."""
        for address, start, end in reads:
            self._check(stream, address, start, end, False, what)
            if self.in_flight:
                self._check_host_source(stream, address, start, end, what)
        for address, start, end in writes:
            self._check(stream, address, start, end, True, what)
        for address, start, end in reads:
            self._note(stream, tick, address, start, end, False, what)
        for address, start, end in writes:
            self._note(stream, tick, address, start, end, True, what)
            if self.in_flight:  # a copy overwritten before anything read it can no longer do harm
                self.in_flight = [c for c in self.in_flight if c.read or not (
                    c.block == address and start <= c.start and c.end <= end)]

    def _check(self, stream: Stream, address: int, start: int, end: int, write: bool, what: str) -> None:
        for a in self.accesses.get(address, ()):
            if a.stream == stream.id or a.end <= start or end <= a.start or not (write or a.write):
                continue
            if stream.clock.get(a.stream, 0) < a.tick:
                kind = ("writes" if write else "reads") + (" memory written" if a.write else " memory read")
                raise OrderingViolation(
                    f"{what} on stream {stream.id} {kind} by {a.what} on stream {a.stream} (its op {a.tick}), "
                    f"bytes [{max(start, a.start) - address}, {min(end, a.end) - address}) of a "
                    f"{self.sizes.get(address, 0)}-byte device block, with no event wait "
                    f"ordering it after that work: record an event on stream {a.stream} after it and wait on it "
                    f"on stream {stream.id}")

    @staticmethod
    def _covers(a: _Access, start: int, end: int) -> bool:
        return start <= a.start and a.end <= end

    def _note(self, stream: Stream, tick: int, address: int, start: int, end: int, write: bool, what: str) -> None:
        accesses = self.accesses.get(address)
        if accesses is None:
            return  # memory the allocator never saw (not expected): nothing to order against
        if write:  # a checked write supersedes every access it covers
            accesses[:] = [a for a in accesses if not self._covers(a, start, end)]
        else:  # a later read of the same stream supersedes its earlier reads
            accesses[:] = [a for a in accesses if a.write or a.stream != stream.id or not self._covers(a, start, end)]
        accesses.append(_Access(start, end, write, stream.id, tick, what))

    def _check_host_source(self, stream: Stream, address: int, start: int, end: int, what: str) -> None:
        for c in self.in_flight:
            if c.block == address and c.start < end and start < c.end:
                c.read = True
                if c.changed():
                    raise self._host_write_violation(c, f"{what} on stream {stream.id} reads its result")

    def check_host_sources(self) -> None:
        """Copies whose results were read: their sources must not change until the host knows they finished
        (the device may run the copy after the host's write, and the reader then saw the new bytes)."""
        for c in self.in_flight:
            if c.read and c.changed():
                raise self._host_write_violation(c, "its result was read")

    def _host_write_violation(self, c: _InFlight, how: str) -> OrderingViolation:
        self.in_flight.remove(c)
        return OrderingViolation(
            f"the host changed the source of a non_blocking copy to the device (stream {c.stream}, its op "
            f"{c.tick}) before it knew the copy had finished, and {how}: the device may copy old, new or mixed "
            f"bytes (synchronize the copy's stream, or an event recorded after it, before writing its source)")

    def copied_from_host(self, stream: Stream, tick: int, address: int, start: int, end: int,
                         source: torch.Tensor) -> None:
        self.in_flight.append(_InFlight(address, start, end, source, stream.id, tick))

    def raise_pending(self) -> None:
        if self.pending:
            message, self.pending = self.pending[0], []
            raise OrderingViolation(message)


_CHECKER: _Checker | None = None


def _checker() -> _Checker:
    if _CHECKER is None:
        raise RuntimeError("the simulated device is not installed: call offload_compiler.testing.simulated_device()")
    return _CHECKER


def _device_tensor(checker: _Checker, shape, stride, dtype: torch.dtype, stream: Stream) -> torch.Tensor:
    """New device memory for a tensor of this geometry, allocated on ``stream``."""
    numel = 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(shape) else 0
    nbytes = numel * dtype.itemsize
    block, _ = checker.allocate(nbytes, stream)
    cpu = torch.frombuffer(block, dtype=torch.uint8)[:nbytes].view(dtype)  # holds the block: its lifetime
    return _retag(cpu.as_strided(tuple(shape), tuple(stride)), _DL_EXT_DEV)


# -- the device's kernel -----------------------------------------------------------------------------------

_COPIES = {torch.ops.aten.copy_.default, torch.ops.aten._copy_from.default,
           torch.ops.aten._copy_from_and_resize.default}
_FACTORIES_WITHOUT_DATA = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default}
_HOST_VISIBLE = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
                 torch.ops.aten.equal.default}


_METADATA = {torch.ops.aten.set_.source_Storage_storage_offset, torch.ops.aten.set_.source_Storage,
             torch.ops.aten.set_.source_Tensor, torch.ops.aten.set_.default}


def _metadata_only(op: torch._ops.OpOverload) -> bool:
    """Views, and ``set_`` (a tensor over a given storage): torch's CPU kernels change only metadata."""
    if op in _METADATA:
        return True
    returns = op._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _same_device_error(op) -> RuntimeError:
    return RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                        f"{NAME}:0 and cpu! (when running {op} on the simulated device)")


_HOST_INDEXED = ("aten::index.", "aten::index_put", "aten::_index_put_impl_")


def _as_tensor(value: Any) -> Any:
    return torch.tensor(value) if isinstance(value, (bool, int, float, complex)) else value


class _Args:
    """An op's arguments with every device tensor replaced by a CPU view of its memory, and what it reads
    and writes, as (block address, start, end)."""

    def __init__(self, checker: _Checker, op, args: tuple, kwargs: dict) -> None:
        self.checker = checker
        self.op = op
        self.reads: list[tuple[int, int, int]] = []
        self.writes: list[tuple[int, int, int]] = []
        self.views: dict[int, torch.Tensor] = {}  # id(cpu view) -> the device tensor it stands for
        written = {a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        self.out_names = {a.name for a in op._schema.arguments
                          if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write}
        self.outs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (CPU stand-in, device tensor) of out= args
        if op in _COPIES and op is not torch.ops.aten.copy_.default:
            written = {"dst"}  # _copy_from(self, dst) writes dst, without saying so in its schema
        names = [a.name for a in op._schema.arguments]
        self.copy = op in _COPIES
        self.host_source: torch.Tensor | None = None
        # a composite op's scalar operand (``x % 16``: remainder.Scalar calls remainder.Tensor_out with a wrapped
        # number) reaches a Python kernel as the number itself: the CPU kernel takes it as a 0-dim tensor again
        tensors = {a.name for a in op._schema.arguments if str(a.type) == "Tensor"}
        args = tuple(_as_tensor(v) if i < len(names) and names[i] in tensors else v for i, v in enumerate(args))
        kwargs = {k: _as_tensor(v) if k in tensors else v for k, v in kwargs.items()}
        # CUDA's advanced indexing takes host index tensors (it copies them to the device first)
        host_ok = {"indices"} if op.name().startswith(_HOST_INDEXED) else set()
        self.args = tuple(self._arg(v, names[i] in written if i < len(names) else False,
                                    host_ok=i < len(names) and names[i] in host_ok) for i, v in enumerate(args))
        self.kwargs = {k: self._arg(v, k in written, k in self.out_names, k in host_ok) for k, v in kwargs.items()}

    def _arg(self, value: Any, written: bool, out: bool = False, host_ok: bool = False) -> Any:
        if isinstance(value, torch.Tensor):
            if out and value.device.type == NAME:
                return self._out(value)
            if host_ok and value.device.type == "cpu":
                return value
            return self._tensor(value, written)
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(self._arg(v, written, out, host_ok) for v in value)
        if isinstance(value, torch.device) and value.type == NAME:
            return torch.device("cpu")
        return value

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        """An out= argument: the kernel gets a CPU tensor it may resize (device memory cannot be resized in
        place); what it computed goes to the device tensor after (`finish_outs`)."""
        region = self.checker.region(t)
        if region is not None:
            self.writes.append(region)
        standin = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        self.outs.append((standin, t))
        self.views[id(standin)] = t
        return standin

    def finish_outs(self) -> None:
        for standin, t in self.outs:
            if standin.shape != t.shape or standin.stride() != t.stride():
                _resize(self.checker, t, standin.shape, standin.stride())
            host_view(t).copy_(standin)

    def _tensor(self, t: torch.Tensor, written: bool) -> torch.Tensor:
        if t.device.type == "cpu":
            if t.dim() and not self.copy:
                raise _same_device_error(self.op)
            if self.copy and not written:
                self.host_source = t
            return t
        region = self.checker.region(t)
        if region is not None:
            (self.writes if written else self.reads).append(region)
            if written and not self.copy:
                self.reads.append(region)  # an in-place op reads what it writes
        view = host_view(t)
        self.views[id(view)] = t
        return view


def _kernel_traced(op, *args, **kwargs):
    """Every op on the simulated device."""
    checker = _checker()
    with checker.lock:
        checker.raise_pending()
        if checker.in_flight:
            checker.check_host_sources()
        if _metadata_only(op):  # metadata only: torch's CPU kernel works on the device tensor itself
            return op.redispatch(_CPU_KEYS, *args, **kwargs)
        if op in _FACTORIES_WITHOUT_DATA:
            return _empty(checker, op, *args, **kwargs)
        if op is torch.ops.aten.resize_.default:
            size = tuple(args[1])
            stride = torch.empty(size, device="meta", memory_format=kwargs.get("memory_format")
                                 or torch.contiguous_format).stride()
            return _resize(checker, args[0], size, stride)
        stream = checker.current
        if op in _HOST_VISIBLE:
            checker.host_waits(stream.clock, f"{op} (a value read by the host)")
        prepared = _Args(checker, op, args, kwargs)
        tick = checker.tick(stream)
        checker.access(stream, tick, str(op), prepared.reads, prepared.writes)
        if prepared.copy and op is not torch.ops.aten.copy_.default:  # no CPU kernel: the copy itself
            src, dst = prepared.args[0], prepared.args[1]
            if op is torch.ops.aten._copy_from_and_resize.default and dst.shape != src.shape:
                _resize(checker, args[1], src.shape, src.stride())
                dst = host_view(args[1])
            result = dst.copy_(src)
        else:
            result = _CUDA_KERNELS.get(op, op)(*prepared.args, **prepared.kwargs)
            prepared.finish_outs()
        _after_copy(checker, op, prepared, args, kwargs, stream, tick)
        result = _outputs(checker, op, result, prepared, stream)
        if checker.capture is not None and stream.id in checker.capture.streams:
            checker.capture.ops.append((op, args, kwargs, result))
        return result


# A kernel written in Python is a Python frame: called from a frame that dynamo runs (the code after a graph
# break), dynamo would compile the device's own kernel. A device's kernels are never part of the user's program.
_kernel = torch.compiler.disable(_kernel_traced, reason="the simulated device's kernel")


def _histc(values: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    """CUDA's ``histc`` counts integer tensors too (the CPU kernel refuses them; transformers' grouped MoE counts
    tokens per expert so): counted as float, returned in the input's dtype, as CUDA returns it."""
    if values.is_floating_point():
        return torch.histc(values, bins, min, max)
    return torch.histc(values.double(), bins, min, max).to(values.dtype)


def _convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """An out-of-tree device's convolutions reach ``convolution_overrideable``, which has no CPU kernel: the
    device's kernel is torch's convolution on the CPU views."""
    return torch.ops.aten.convolution.default(input, weight, bias, stride, padding, dilation, transposed,
                                              output_padding, groups)


# the simulated device's kernels for ops whose CPU kernel does not do what the CUDA one does, so that a model
# that runs on CUDA runs here; every other op runs torch's own CPU kernel on CPU views of the device memory
_CUDA_KERNELS = {
    torch.ops.aten.histc.default: _histc,
    torch.ops.aten.convolution_overrideable.default: _convolution,
}


def _after_copy(checker: _Checker, op, prepared: _Args, args, kwargs, stream: Stream, tick: int) -> None:
    """A copy to the host the host waits for (``non_blocking=False``); one from the host, non_blocking,
    whose source the host must not change before it knows the copy finished."""
    if not prepared.copy:
        return
    dst = args[1] if op is not torch.ops.aten.copy_.default else args[0]
    non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
    if dst.device.type == "cpu" and not non_blocking:
        checker.host_waits(stream.clock, "a blocking copy to the host")
    elif prepared.host_source is not None and non_blocking and dst.device.type == NAME:
        region = checker.region(dst)
        if region is not None:
            checker.copied_from_host(stream, tick, *region, prepared.host_source)


def _empty(checker: _Checker, op, *args, **kwargs) -> torch.Tensor:
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    size = tuple(args[0])
    if op is torch.ops.aten.empty_strided.default:
        stride = tuple(args[1])
    else:
        stride = torch.empty(size, device="meta", memory_format=kwargs.get("memory_format")
                             or torch.contiguous_format).stride()
    return _device_tensor(checker, size, stride, dtype, checker.current)


def _resize(checker: _Checker, t: torch.Tensor, size, stride) -> torch.Tensor:
    """``resize_`` of a device tensor: in its storage where it fits, else over new memory (the old elements
    kept, as torch's resize keeps them)."""
    needed = (1 + sum((n - 1) * st for n, st in zip(size, stride))) if all(size) else 0
    storage = t.untyped_storage()
    if (t.storage_offset() + needed) * t.element_size() <= storage.nbytes():
        return t.set_(storage, t.storage_offset(), tuple(size), tuple(stride))
    new = _device_tensor(checker, tuple(size), tuple(stride), t.dtype, checker.current)
    keep = min(t.numel(), new.numel())
    if keep:
        host_view(new).view(-1)[:keep].copy_(host_view(t).reshape(-1)[:keep])
    return t.set_(new.untyped_storage(), 0, tuple(size), tuple(stride))


def _outputs(checker: _Checker, op, result: Any, prepared: _Args, stream: Stream) -> Any:
    """The device tensors an op returns: its own argument for an in-place or out= op, else new device memory
    holding what the CPU kernel computed (allocated on the op's stream: the op wrote it)."""
    if isinstance(result, torch.Tensor):
        same = prepared.views.get(id(result))
        if same is not None:
            return same
        if result.device.type != "cpu":
            return result
        stride = result.stride() if _dense(result) else torch.empty_like(result, device="meta").stride()
        out = _device_tensor(checker, result.shape, stride, result.dtype, stream)
        host_view(out).copy_(result)
        return out
    if isinstance(result, (list, tuple)):
        return type(result)(_outputs(checker, op, r, prepared, stream) for r in result)
    return result


def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)


# -- the device module -------------------------------------------------------------------------------------

def current_stream(device: Any = None) -> Stream:
    return _checker().current


def default_stream(device: Any = None) -> Stream:
    return _checker().default


def set_stream(stream: Stream) -> None:
    _checker().current = stream


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    """Ops issued inside run on ``s`` (None: no change), as ``torch.cuda.stream``."""
    if s is None:
        yield
        return
    checker = _checker()
    before, checker.current = checker.current, s
    checker.streams.setdefault(s.id, s)
    try:
        yield
    finally:
        checker.current = before


def synchronize(device: Any = None) -> None:
    _checker().synchronize()


def is_current_stream_capturing() -> bool:
    capture = _checker().capture
    return capture is not None and current_stream().id in capture.streams


def memory_allocated(device: Any = None) -> int:
    return _checker().allocated


def max_memory_allocated(device: Any = None) -> int:
    return _checker().peak


def reset_peak_memory_stats(device: Any = None) -> None:
    checker = _checker()
    checker.peak = checker.allocated


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total): a nominal 16 GiB device."""
    total = 16 << 30
    return total - _checker().allocated, total


def memory_stats(device: Any = None) -> dict[str, int]:
    """The counters under the names torch's allocators report them (``allocated_bytes.all.current``, ...)."""
    checker = _checker()
    stats = {}
    for kind in ("allocated_bytes", "reserved_bytes", "active_bytes"):
        stats[f"{kind}.all.current"], stats[f"{kind}.all.peak"] = checker.allocated, checker.peak
    return stats


# torch.accelerator's memory functions ask the device's C++ caching allocator, and its synchronize the C++ device
# guard, which a device built from Python has none of (torch asserts "Allocator for sim is not a DeviceAllocator";
# "Backend doesn't support synchronizing all streams"); where the simulated device is the current accelerator they
# answer from its own counters and checker, as torch.accelerator does for CUDA's
_ACCELERATOR_FUNCTIONS = dict(
    synchronize=lambda device=None, /: synchronize(), empty_cache=lambda: None,
    memory_stats=lambda device_index=None, /: memory_stats(),
    memory_allocated=lambda device_index=None, /: memory_allocated(),
    max_memory_allocated=lambda device_index=None, /: max_memory_allocated(),
    memory_reserved=lambda device_index=None, /: memory_allocated(),
    max_memory_reserved=lambda device_index=None, /: max_memory_allocated(),
    reset_peak_memory_stats=lambda device_index=None, /: reset_peak_memory_stats(),
    reset_accumulated_memory_stats=lambda device_index=None, /: None,
    get_memory_info=lambda device_index=None, /: mem_get_info())


def _answer_accelerator_functions() -> None:
    namespaces = [getattr(torch, "accelerator", None), getattr(getattr(torch, "accelerator", None), "memory", None)]
    for namespace in filter(None, namespaces):
        for name, ours in _ACCELERATOR_FUNCTIONS.items():
            theirs = getattr(namespace, name, None)
            if theirs is None or getattr(theirs, "_sim_routed", False):
                continue

            def routed(*args, _ours=ours, _theirs=theirs):
                current = torch.accelerator.current_accelerator()
                return (_ours if current is not None and current.type == NAME else _theirs)(*args)

            routed._sim_routed = True
            functools.update_wrapper(routed, theirs)
            setattr(namespace, name, routed)


class Graph:
    """A capture of the work issued on a stream (``torch.cuda.CUDAGraph``'s rules; see `graph`). The work
    runs when issued; ``replay`` issues the captured ops again, writing into the tensors they wrote then."""

    def __init__(self) -> None:
        self.ops: list[tuple] = []

    def replay(self) -> None:
        for op, args, kwargs, captured in self.ops:
            _refill(captured, _kernel(op, *args, **kwargs))


def _refill(captured: Any, fresh: Any) -> None:
    """A replayed op's results into the tensors the captured op returned (later ops read those)."""
    if isinstance(captured, torch.Tensor) and isinstance(fresh, torch.Tensor):
        if fresh is not captured and captured.device.type == NAME:
            host_view(captured).copy_(host_view(fresh))
    elif isinstance(captured, (list, tuple)):
        for c, f in zip(captured, fresh):
            _refill(c, f)


@contextlib.contextmanager
def graph(g: Graph, pool: Any = None, stream: Stream | None = None, capture_error_mode: str = "global"):
    """Capture the work issued on a side stream (``torch.cuda.graph``): every stream forked into the capture
    (it waited on an event recorded inside) must be joined back before the end; no host synchronisation."""
    checker = _checker()
    if checker.capture is not None:
        raise RuntimeError("a graph capture is already under way on the simulated device")
    origin = stream if stream is not None else Stream()
    origin.wait_stream(checker.current)  # as torch.cuda.graph: the capture stream starts after the current work
    capture = checker.capture = _Capture(next(checker._captures), origin)
    before, checker.current = checker.current, origin
    try:
        yield g
        for sid, tick in capture.last_tick.items():
            if sid != origin.id and origin.clock.get(sid, 0) < tick:
                raise OrderingViolation(
                    f"stream {sid} was forked into a graph capture and not joined back before it ended "
                    f"(cudaErrorStreamCaptureUnjoined): make the capturing stream wait on it")
    finally:
        checker.capture = None
        checker.current = before
        checker.current.wait_stream(origin)
    g.ops = capture.ops


def _module() -> types.ModuleType:
    mod = types.ModuleType(f"torch.{NAME}", "the simulated accelerator (offload_compiler.testing.simulated)")
    functions = dict(
        is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0, set_device=lambda d: None,
        is_initialized=lambda: True, _lazy_init=lambda: None, _is_in_bad_fork=lambda: False,
        manual_seed=lambda seed: None, manual_seed_all=lambda seed: None, seed=lambda: None,
        get_rng_state=lambda device=None: torch.empty(0, dtype=torch.uint8),
        set_rng_state=lambda state, device=None: None, empty_cache=lambda: None,
        get_amp_supported_dtype=lambda: [torch.float16, torch.bfloat16])
    for name, value in functions.items():
        setattr(mod, name, value)
    for value in (Stream, Event, Graph, OrderingViolation, current_stream, default_stream, set_stream, stream,
                  synchronize, is_current_stream_capturing, memory_allocated, max_memory_allocated,
                  reset_peak_memory_stats, mem_get_info, memory_stats, graph):
        setattr(mod, value.__name__, value)
    mod.memory_reserved = memory_allocated
    return mod


# ops that make a device tensor from host data: ``torch.tensor(data, device=...)`` runs them with the Python key
# excluded (under a fake mode: inside dynamo's trace), where torch's trampoline for a fallback written in Python
# fails to find the op ("func != nullptr"); a kernel registered for the op itself is found
_DIRECT_OPS = ("empty.memory_format", "empty_strided", "copy_", "_copy_from", "_copy_from_and_resize", "lift_fresh",
               # and ops whose kernel for every backend key raises (an out-of-tree device must register its own)
               "convolution_overrideable",
               # and ops whose decomposition for a device without a kernel of its own takes a view that a
               # channels_last input cannot give (a VAE's group norm at batch 2): torch's CPU kernel instead
               "native_group_norm")


def _register_direct(library: torch.library.Library) -> None:
    for name in _DIRECT_OPS:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload or "default")
        library.impl(op, functools.partial(_kernel, op), "PrivateUse1")


class _DeviceGuard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


class _Hooks(getattr(torch._C._acc, "PrivateUse1Hooks", object)):
    """What autograd's engine asks an out-of-tree device before running a backward on it (without them every
    backward on the device fails with torch's "register PrivateUse1HooksInterface first", before any of the
    model's or our own backward code runs)."""

    def is_available(self) -> bool:
        return True

    def is_built(self) -> bool:
        return True

    def has_primary_context(self, device_index: int) -> bool:
        return True


def simulated_device() -> str:
    """Install the simulated accelerator (once per process) and return its device string, ``"sim:0"``.

    It takes torch's PrivateUse1 backend for the rest of the process: a process that already renamed it for
    a real out-of-tree device (an Ascend NPU, say) cannot have both. Install it before the process runs its first
    backward (on any device) if a backward will reach the simulated device: autograd's engine sizes its device
    queues once, at that first backward, from the devices registered then."""
    global _installed, _CHECKER, _LIBRARY, _ATEN
    with _INSTALL_LOCK:
        if _installed is None:
            taken = torch._C._get_privateuse1_backend_name()
            if taken not in ("privateuseone", NAME):
                raise RuntimeError(f"torch's PrivateUse1 backend is already {taken!r} in this process; the simulated "
                                   f"device needs it")
            if taken != NAME:
                torch.utils.rename_privateuse1_backend(NAME)
                torch._register_device_module(NAME, _module())
                torch.utils.generate_methods_for_privateuse1_backend(for_storage=False)
                _LIBRARY = torch.library.Library("_", "IMPL")  # kept for the process: it holds the registration
                _LIBRARY.fallback(_kernel, "PrivateUse1")
                _ATEN = torch.library.Library("aten", "IMPL")
                _register_direct(_ATEN)
                # ops with a device guard need one for the key (one device: it has nothing to switch)
                torch._C._acc.register_python_privateuseone_device_guard(_DeviceGuard())
                if hasattr(torch._C._acc, "register_python_privateuseone_hook"):  # torch 2.13+
                    torch._C._acc.register_python_privateuseone_hook(_Hooks())
                _answer_accelerator_functions()
            _CHECKER = _Checker()
            _installed = f"{NAME}:0"
    return _installed

