"""Reads of groups on disk on a worker thread, on every device: a prefetched group is read from its files while
the calling thread computes the groups before it -- on the CPU straight into its slot, on an accelerator into the
slot's host staging buffers, whose copy to the device the calling thread issues on the copy stream once the read
is done (`TransferEngine._stage`, `_ready`: the worker never touches a stream, so the device's ordering is the
same as for groups in memory). The worker only moves bytes into host buffers; every decision (which slot, the
ledger, the counters) stays on the calling thread, which waits for a read where the graph waits for its group
(`TransferEngine._ready`), and for every read in flight before the host writes a buffer a read may touch
(`wait_all`). A read releases the GIL, so it overlaps the compute of the calling thread.

Groups in host memory are copied inline: measured on a tiny Llama's decode under inductor on 2 cores
(`benchmarks/decode.py`, 2026-11-25, on a machine shared with other runs; the threaded variant was not kept, so
no committed command reproduces it), handing each copy of about 0.8 MB to the thread made a token 1.73x plain
against 1.29x inline — the worker waits for the GIL while the calling thread runs Python, and a memcpy on the
CPU competes with compute for the same memory bandwidth; a disk read waits on the disk instead.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Callable

import torch

_EXECUTOR: concurrent.futures.ThreadPoolExecutor | None = None
_LOCK = threading.Lock()


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    """One worker thread for the process: fills run one at a time, in the order they were issued."""
    global _EXECUTOR
    with _LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-copy")
        return _EXECUTOR


def _drain_before_fork() -> None:
    """Every read issued so far has finished before the process forks: a read in flight would never finish in
    the child (the worker thread is not copied), and a child waiting for it would hang."""
    executor = _EXECUTOR
    if executor is not None:
        try:
            executor.submit(_nothing).result()  # one worker, reads in order: done after every read before it
        except RuntimeError:  # shut down (interpreter exit): nothing more runs on it
            pass


def _fresh_in_child() -> None:
    """The child of a fork has no worker thread (only the forking thread is copied): it makes its own at its
    first read, with a lock of its own (the parent's may have been held at the fork)."""
    global _EXECUTOR, _LOCK
    _EXECUTOR = None
    _LOCK = threading.Lock()


def _nothing() -> None:
    pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_drain_before_fork, after_in_child=_fresh_in_child)


class CopyWorker:
    """The fills of one runtime in flight on the worker thread."""

    def __init__(self) -> None:
        self.in_flight: set[concurrent.futures.Future] = set()

    def submit(self, fill: Callable[[], None]) -> concurrent.futures.Future:
        future = _executor().submit(_without_grad, fill)
        self.in_flight.add(future)
        future.add_done_callback(self.in_flight.discard)
        return future

    def wait_all(self) -> None:
        """Every fill issued so far has finished (their errors stay with their futures, for their waits)."""
        if self.in_flight:
            concurrent.futures.wait(list(self.in_flight))


def _without_grad(fill: Callable[[], None]) -> None:
    with torch.no_grad():  # grad mode is per thread: a copy from a weight must not record autograd history
        fill()
