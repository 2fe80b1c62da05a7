"""Live offload runtimes by integer id. The graph's transfer ops (`offload_compiler.ops`) and its DTensor
rebuilds (`offload_compiler.distributed.from_local_slot`) hold a runtime's id, never the object, and look it up
here. It sits below `runtime` (which registers each `OffloadRuntime` it creates) so that `distributed`, which
`runtime` imports, reaches a runtime without importing `runtime`."""

from __future__ import annotations

import weakref

_RUNTIMES: "weakref.WeakValueDictionary[int, OffloadRuntime]" = weakref.WeakValueDictionary()  # noqa: F821


def runtime_by_id(runtime_id: int) -> "OffloadRuntime":  # noqa: F821
    runtime = _RUNTIMES.get(runtime_id)
    if runtime is None:
        raise RuntimeError(f"offload runtime {runtime_id} no longer exists (its model was garbage-collected)")
    return runtime
