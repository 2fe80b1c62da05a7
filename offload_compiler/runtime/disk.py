"""The disk tier: groups whose host buffers live in files instead of host memory.

A group on disk keeps the host store's layout: each of its buckets is a region of one file under ``disk_dir``
(`DiskSpace`: the groups' buckets in their order) holding the bucket's flat bytes, and the bucket's host buffer
is a shared mapping of that region, so
everything that reads or writes a weight's host bytes — ``state_dict``, ``load_state_dict``, a host master's
on-demand read, `HostStore.unpack` — works as for a group in memory, through the page cache. A fill does not
read through the mapping: it reads the file (``readinto``) straight into the slot on the CPU, or into a
staging buffer that is then copied to the device, and drops the pages it read from the page cache
(``posix_fadvise``), so the reads of a call leave neither resident pages in this process nor a second copy of
the model in the page cache. Dropping pages after reading, not ``O_DIRECT``: direct I/O needs buffers and
offsets aligned to the disk's block size, which a slot's buffers are not, and gets no readahead (4 MiB direct
reads into aligned memory ran at 2.4 GB/s here, where the same reads through the page cache ran at 3.2).

The file is unlinked as soon as it is made: the mappings and the open descriptor keep it, and nothing is left
in ``disk_dir`` when the process ends, however it ends.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import itertools
import mmap
import os
import tempfile
import threading
import time
from typing import Iterable, Iterator, Sequence

import torch

from .layout import Group


class DiskSpace:
    """One file under ``folder`` for the buckets of the groups on disk: each bucket a page-aligned region of it,
    in the order of ``sizes`` (the groups' order, which is their call order in a stack of blocks). One file,
    not one per bucket: reading the regions one after another is then reading the file start to end, and a
    disk reads a file's consecutive ranges faster than as many files (measured on this project's virtual disk:
    eight 45 MB groups read in turn at 3.2 GB/s as ranges of one file, at 2.2 GB/s as eight files, and at 2.2
    GB/s as ranges of one file read out of order). The file is unlinked as soon as it is made: the descriptor
    and the mapping keep it, and nothing is left in ``folder`` when the process ends, however it ends. The
    descriptor closes once every region handed out (`file`) is closed.

    The file is mapped once, whole (`mapping`, at the first region mapped), and each region's tensor views
    that one mapping: a mapping holds a descriptor of its own (``mmap`` duplicates it), so one per region would
    hold one descriptor per bucket on disk and run a model of a thousand blocks out of the process's
    descriptors (1024 by default). The tier holds two however many groups it has: the file's and the
    mapping's, which closes once the last tensor viewing it is freed."""

    def __init__(self, folder: str, sizes: Sequence[int]) -> None:
        page = mmap.ALLOCATIONGRANULARITY  # a mapping starts at a multiple of it
        self.offsets: list[int] = []
        total = 0
        for nbytes in sizes:
            self.offsets.append(total)
            total += -(-nbytes // page) * page
        self.sizes = list(sizes)
        self.nbytes = total
        self.folder = folder
        self._mapping: mmap.mmap | None = None
        with self.errors("making a file"):
            fd, self.path = tempfile.mkstemp(prefix="offload-", suffix=".bin", dir=folder)
        try:
            with self.errors("sizing the file"):
                os.unlink(self.path)
                os.ftruncate(fd, total)  # sparse: a region takes disk space once written
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.open = 0  # regions handed out and not closed

    @property
    def closed(self) -> bool:
        return self.fd < 0

    @contextlib.contextmanager
    def errors(self, doing: str) -> Iterator[None]:
        """An OSError while making, writing or mapping the file says which ``disk_dir``, why, and what to do
        (the bare error names a file that no longer exists, or a path the user never gave); its type and
        ``errno`` stay, so a caller's handling of the OS error still applies."""
        try:
            yield
        except OSError as exc:
            message = (f"disk_dir={self.folder!r} cannot hold the disk tier's file: {doing} failed "
                       f"({exc.strerror or exc}). The weights beyond host_budget_gb ({self.nbytes / 2**20:.1f} MiB) "
                       f"are written there: give disk_dir a writable directory on a fast local disk with room for them")
            raise (type(exc)(exc.errno, message) if exc.errno is not None else type(exc)(message)) from exc

    def file(self, index: int) -> "DiskFile":
        """Region ``index`` (of ``sizes``), as a `DiskFile`."""
        if self.closed:
            raise ValueError(f"{self.path}: every region was closed, and the file with them")
        self.open += 1
        return DiskFile(self, self.offsets[index], self.sizes[index])

    def mapping(self) -> mmap.mmap:
        """A shared mapping of the whole file (made at the first call; the tensors viewing it keep it alive)."""
        if self._mapping is None:
            with self.errors("mapping the file"):
                self._mapping = mmap.mmap(self.fd, self.nbytes)
        return self._mapping

    def release(self) -> None:
        self.open -= 1
        if self.open == 0 and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self._mapping = None  # closes with the last tensor viewing it

    def abandon(self) -> None:
        """Closed now where no region is open (a load that failed before, or after, handing them out)."""
        if self.open == 0 and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self._mapping = None

    def __del__(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)
            self.fd = -1


class DiskFile:
    """One bucket's bytes in a region of a `DiskSpace` (``new``: a file of its own): where they are (``base``),
    their mapping (`mapped`), their reads."""

    read_only = False

    def __init__(self, space: DiskSpace, base: int, nbytes: int) -> None:
        self.space = space
        self.base = base
        self.nbytes = nbytes
        self.path = space.path
        self.fd = space.fd

    @classmethod
    def new(cls, folder: str, nbytes: int) -> "DiskFile":
        """A bucket in a file of its own (`read_bandwidth`'s probe)."""
        return DiskSpace(folder, [nbytes]).file(0)

    def write(self, offset: int, tensor: torch.Tensor) -> None:
        """``tensor``'s bytes (a dense host tensor, in its storage order) at byte ``offset`` of the bucket."""
        view = _memory(tensor)
        done = 0
        with self.space.errors("writing the weights"):
            while done < len(view):
                done += os.pwrite(self.fd, view[done:], self.base + offset + done)

    def mapped(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The bucket as a flat tensor viewing its region of the file's shared mapping (written through to it)."""
        with self.space.errors("writing the weights"):
            os.fdatasync(self.fd)
        _drop_pages(self.fd, self.base, self.nbytes)  # written: not kept in the page cache
        if not numel:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self.space.mapping(), dtype=dtype, count=numel, offset=self.base)

    def read_into(self, target: torch.Tensor) -> None:
        """The whole bucket into ``target`` (a contiguous host tensor of its size), its pages dropped after."""
        _read(self.fd, _memory(target), self.base, self.path)
        _drop_pages(self.fd, self.base, self.nbytes)

    def read_range(self, offset: int, target: torch.Tensor) -> None:
        """Bytes of the bucket from ``offset`` into ``target`` (contiguous, host), its pages dropped after."""
        view = _memory(target)
        _read(self.fd, view, self.base + offset, self.path)
        _drop_pages(self.fd, self.base + offset, len(view))

    def close(self) -> None:
        """Done with the region; the file closes with its last region (the mappings keep their bytes)."""
        if self.fd >= 0:
            self.fd = -1
            self.space.release()

    def __del__(self) -> None:  # a runtime collected without unpacking: its descriptor goes with it
        if hasattr(self, "space"):
            self.close()


class CheckpointFile:
    """A checkpoint file opened (read-only) when it is mapped, and its private mapping (`tensor`: its bytes as
    uint8; a write stays in this process's memory, never in the file). The reads of its extents go through
    this descriptor, not the path: the mapping and the reads are then the same file even where the path is
    given another file since (``os.replace``, a checkpoint saved again), as a state dict of the mapping shows
    what the calls compute with. Closed when the last of its users is done (`release`): the loader, which
    holds it from the start (a group's extents given up while loading must not close it under the next), and
    each `CheckpointExtents` reading from it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.users = 1
        self.fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(self.fd).st_size
            # the tensor keeps the mapping alive (it holds a descriptor of its own until then)
            self.tensor = (torch.frombuffer(mmap.mmap(self.fd, size, access=mmap.ACCESS_COPY), dtype=torch.uint8)
                           if size else torch.empty(0, dtype=torch.uint8))
        except BaseException:
            self.close()
            raise

    def acquire(self) -> "CheckpointFile":
        self.users += 1
        return self

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            self.close()


class CheckpointExtents:
    """One bucket's bytes where a safetensors checkpoint already holds them: per weight, an extent of a file
    (``path``, byte ``start``, ``nbytes``) that goes at byte ``at`` of the bucket, read through the descriptor
    opened when the file was mapped (``files``: path -> `CheckpointFile`). The weights are views of that
    private mapping (``addresses``: where each starts), so nothing is copied at loading; the checkpoint is never
    written (`HostStore.refresh` moves the group to its region of the tier's file at its first change)."""

    read_only = True

    def __init__(self, extents: list[tuple[str, int, int, int]], addresses: tuple[int, ...],
                 files: dict[str, CheckpointFile]) -> None:
        self.extents = extents
        self.addresses = addresses
        self.nbytes = sum(nbytes for _, _, nbytes, _ in extents)
        self._files = {path: files[path].acquire() for path in dict.fromkeys(path for path, _, _, _ in extents)}

    def read_into(self, target: torch.Tensor) -> None:
        """Each extent into its place in ``target`` (a contiguous host tensor of the bucket's size)."""
        view = _memory(target)
        for path, start, nbytes, at in self.extents:
            fd = self._fd(path)
            _read(fd, view[at:at + nbytes], start, path)
            _drop_pages(fd, start, nbytes)

    def read_range(self, offset: int, target: torch.Tensor) -> None:
        """Bytes of the bucket from ``offset`` into ``target`` (contiguous, host): from the extent holding them."""
        view = _memory(target)
        for path, start, nbytes, at in self.extents:
            if at <= offset and offset + len(view) <= at + nbytes:
                fd = self._fd(path)
                _read(fd, view, start + offset - at, path)
                _drop_pages(fd, start + offset - at, len(view))
                return
        raise ValueError(f"bytes {offset}..{offset + len(view)} of a bucket span more than one checkpoint extent")

    def _fd(self, path: str) -> int:
        file = self._files.get(path)
        if file is None or file.fd < 0:
            raise ValueError(f"{path}: read after its group let the checkpoint go (remove_offload)")
        return file.fd

    def close(self) -> None:
        files, self._files = self._files, {}
        for file in files.values():
            file.release()

    def __del__(self) -> None:  # a runtime collected without unpacking
        if hasattr(self, "_files"):
            self.close()


READ_CHUNK = 4 << 20  # one read call's bytes: a single read of a whole group (100+ MB) ran at 1.1 GB/s where
#                       4 MiB reads of the same file, pages dropped, ran at 1.8 GB/s (the kernel's readahead
#                       pipelines a sequence of reads; one huge request is split and waited for piece by piece)


def _read(fd: int, view: memoryview, start: int, path: str) -> None:
    """``len(view)`` bytes of the file from byte ``start`` into ``view``, in `READ_CHUNK` reads."""
    done, total = 0, len(view)
    try:
        while done < total:
            got = os.preadv(fd, [view[done:min(done + READ_CHUNK, total)]], start + done)
            if not got:
                raise OSError(f"{path} ended at byte {start + done} while {total - done} more bytes were to be "
                              f"read (truncated since it was written?)")
            done += got
    except OSError as exc:
        exc.add_note(f"reading bytes {start}..{start + total} of {path} (failed at byte {start + done})")
        raise


def _memory(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a dense host tensor's memory."""
    nbytes = tensor.numel() * tensor.element_size()
    if not nbytes:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _drop_pages(fd: int, start: int, length: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)


def beyond_budget(sizes: Sequence[int], streamed: Iterable[int], budget: int) -> frozenset[int] | None:
    """The groups (indices into ``sizes``) to put on disk so that the rest fit ``budget`` bytes of host memory:
    streamed groups only (a resident group is read once), the largest first (fewest groups for the bytes).
    Among groups of one size (a model's blocks), as many as the budget needs, spread evenly over their index
    order (`_spread`), which is their call order in a stack of blocks: a read from disk takes longer than a
    copy from memory, and a group read ahead overlaps the groups in memory computed before it (the schedule
    reads each group on disk once the read before it was waited for), so groups in memory between the reads
    keep the disk and the compute busy together, where a run of groups on disk leaves the compute waiting on
    the disk and then the disk idle while the groups in memory compute.
    None where even every streamed group on disk leaves too much. The planner predicts with this rule and the
    host store applies it (`disk_groups`): the two agree by construction."""
    held = sum(sizes)
    by_size: dict[int, list[int]] = {}
    for index in sorted(streamed):
        by_size.setdefault(sizes[index], []).append(index)
    chosen: list[int] = []
    for size in sorted(by_size, reverse=True):
        if held <= budget or size == 0:
            break
        tier = by_size[size]
        needed = min(len(tier), -(-(held - budget) // size))
        chosen.extend(_spread(tier, needed))
        held -= needed * size
    return frozenset(chosen) if held <= budget else None


def _spread(indices: list[int], count: int) -> list[int]:
    """``count`` of ``indices`` (sorted), evenly spaced from the first: 5 of 12 blocks are blocks 0, 2, 4, 7, 9."""
    return [indices[j * len(indices) // count] for j in range(count)]


def disk_groups(groups: list[Group], budget: int) -> frozenset[int]:
    """`beyond_budget` for a runtime's groups; raises where the budget cannot be met."""
    chosen = beyond_budget([g.nbytes for g in groups], [g.index for g in groups if g.streamed], budget)
    if chosen is None:
        kept = sum(g.nbytes for g in groups if not g.streamed)
        raise ValueError(f"host_budget_gb={budget / 2**30:.3g} is below what stays in host memory with every streamed "
                         f"group on disk: {kept / 2**30:.3g} GiB of groups resident on the device (their host copies). "
                         f"Raise host_budget_gb to at least that, or stream more of the model")
    return chosen


MADV_PAGEOUT = 21  # Linux 5.4+: reclaim these pages now (a clean file page is dropped; nothing is lost)


def _file_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of regular files (Linux ``/proc/self/maps``, which lists them in
    address order, never overlapping); none elsewhere."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):  # an inode and a path: a file
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found.append((start, end))
    return found


class _Snapshot(threading.local):
    mappings: list[tuple[int, int]] | None = None


_SNAPSHOT = _Snapshot()


@contextlib.contextmanager
def one_read_of_mappings() -> Iterator[None]:
    """Within it, `release_mapped_pages` reads this process's file mappings once (on this thread), not once per
    group: the read and its parse cost about a millisecond per group with torch's libraries mapped. Sound for
    weights that exist when it is entered (packing a model's groups): a tensor in a mapped file keeps that
    mapping alive, and memory outside every file mapping stays outside, so the snapshot answers for them as a
    fresh read would."""
    if _SNAPSHOT.mappings is not None:  # nested: the outer snapshot holds
        yield
        return
    _SNAPSHOT.mappings = _file_mappings()
    try:
        yield
    finally:
        _SNAPSHOT.mappings = None


def release_mapped_pages(tensors: list[torch.Tensor]) -> int:
    """Ask the kernel to reclaim the pages of ``tensors`` that lie in a mapped file (a model loaded by
    ``from_pretrained`` views its safetensors files' mapping, alive until its last weight is repacked): once a
    group is copied into its own buffer, its bytes there would otherwise stay resident beside the copy, and
    packing a whole model would hold it twice at the end. ``MADV_PAGEOUT`` drops clean file pages and loses
    nothing (a page written since is kept, or swapped); anonymous memory is never advised. Returns the bytes
    advised (0 where the OS has no such call)."""
    mappings = _SNAPSHOT.mappings if _SNAPSHOT.mappings is not None else _file_mappings()
    if not mappings or not tensors:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    libc = _libc()
    if libc is None:
        return 0
    starts = [low for low, _ in mappings]
    advised = 0
    for tensor in tensors:
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        # the mappings in address order: from the last one starting at or before the tensor, those it overlaps
        for low, high in itertools.islice(mappings, max(bisect.bisect_right(starts, start) - 1, 0), None):
            if low >= end:
                break
            first, last = max(start, low), min(end, high)
            first = (first + page - 1) // page * page  # whole pages inside the tensor only
            last = last // page * page
            if first < last and libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_PAGEOUT) == 0:
                advised += last - first
    return advised


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


_BANDWIDTH: dict[str, float] = {}


def read_bandwidth(folder: str, nbytes: int = 64 << 20) -> float:
    """Bytes per second reading a file of ``nbytes`` in ``folder`` with its pages dropped first, as a fill
    reads (median of 3; measured once per folder and process, for `strategy="auto"`)."""
    if folder not in _BANDWIDTH:
        # written and read through one buffer of a read call's size, as `_read` reads a group: host memory
        # grows by that, not by the file twice (a planned host budget can be smaller than the file)
        chunk = min(READ_CHUNK, nbytes)
        nbytes = nbytes // chunk * chunk
        buffer = torch.ones(chunk // 4)
        file = DiskFile.new(folder, nbytes)
        try:
            for offset in range(0, nbytes, chunk):
                file.write(offset, buffer)
            os.fsync(file.fd)
            times = []
            for _ in range(3):
                _drop_pages(file.fd, 0, nbytes)
                start = time.perf_counter()
                for offset in range(0, nbytes, chunk):
                    _read(file.fd, _memory(buffer), file.base + offset, file.path)
                times.append(time.perf_counter() - start)
                _drop_pages(file.fd, 0, nbytes)
        finally:
            file.close()
        _BANDWIDTH[folder] = nbytes / sorted(times)[1]
    return _BANDWIDTH[folder]
