"""Live offload runtimes by integer id. The graph's transfer ops (`offload_compiler.ops`) and its DTensor
rebuilds (`offload_compiler.distributed.from_local_slot`) hold a runtime's id, never the object, and look it up
here. It sits below `runtime` (which registers each `OffloadRuntime` it creates) so that `distributed`, which
`runtime` imports, reaches a runtime without importing `runtime`."""

from __future__ import annotations

import weakref

# id -> a weak reference to the runtime: a plain dict, so a lookup on the hot path (one per transfer op) runs no
# Python frame; a runtime's entry goes with it
_RUNTIMES: "dict[int, weakref.ref]" = {}


def register(runtime) -> None:
    runtime_id = runtime.id
    _RUNTIMES[runtime_id] = weakref.ref(runtime, lambda _: _RUNTIMES.pop(runtime_id, None))


def runtime_by_id(runtime_id: int) -> "OffloadRuntime":  # noqa: F821
    ref = _RUNTIMES.get(runtime_id)
    runtime = ref() if ref is not None else None
    if runtime is None:
        raise RuntimeError(f"offload runtime {runtime_id} no longer exists (its model was garbage-collected)")
    return runtime
