"""Full garbage collections wait while dynamo captures one of our graphs.

A capture makes hundreds of thousands of Python objects (dynamo's variable trackers, guards, FX nodes, fake
tensors). Each of them counts towards CPython's collection thresholds, and every full collection walks every
object in the process -- the model's modules, every imported library -- so a capture triggers many full
collections, each long: 0.27 s of a 2.0 s first call of a tiny 8-block DiT, 0.58 s of 3.3 s at 16 blocks (torch
2.13, by hand: ``gc.callbacks`` timing each full collection during the first call under ``regional=True``). While a capture runs, the oldest generation's
threshold is raised so that no full collection starts; the young generations are still collected as usual,
and the threshold is put back when the last capture in the process ends, so the next full collection comes as
it would have (it then frees whatever cyclic garbage the capture left there).

Only the threshold changes, with the public ``gc`` API, and only while one of our captures runs: a process
that disabled the collector, or set thresholds of its own, finds them as it left them afterwards.
"""

from __future__ import annotations

import gc
import threading

_DEFERRED = 1 << 30  # collections of generation 1 before a full one: never, within a capture


class DeferFullCollections:
    """A reusable, reentrant context: no full collection starts inside it. Process-wide (the thresholds are): the
    first entry saves the thresholds, the last exit restores them, whichever threads enter and leave."""

    _lock = threading.Lock()
    _depth = 0
    _saved: tuple[int, ...] | None = None

    def __enter__(self) -> None:
        cls = DeferFullCollections
        with cls._lock:
            if cls._depth == 0:
                cls._saved = gc.get_threshold()
                gc.set_threshold(cls._saved[0], cls._saved[1], _DEFERRED)
            cls._depth += 1

    def __exit__(self, *exc: object) -> None:
        cls = DeferFullCollections
        with cls._lock:
            cls._depth -= 1
            if cls._depth == 0 and cls._saved is not None:
                if gc.get_threshold()[2:3] == (_DEFERRED,):  # not set by someone else since: ours to restore
                    gc.set_threshold(*cls._saved)
                cls._saved = None
