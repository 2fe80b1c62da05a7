"""Per-rank offload under torch.distributed: helpers for DTensor (tensor-parallel) weights.

A DTensor parameter is offloaded as its rank's local shard: the shard is packed into the group's flat host
buffer (the DTensor object keeps its identity, so dynamo's placeholders still match it), the fetched flat
buffer is sliced as for any weight, and the graph rebuilds the DTensor from the fetched local view with
`from_local_slot` (``DTensor.from_local(view, mesh, placements, run_check=False)``: no communication), so
the model's ops and its collectives see a DTensor on the compute device. Nothing here is a distributed layer
of its own: sharding, meshes and collectives are torch.distributed's.
"""

from __future__ import annotations

import torch

from ._registry import runtime_by_id

try:  # torch built without distributed support
    from torch.distributed.tensor import DTensor
except Exception:  # pragma: no cover
    DTensor = None


def is_dtensor(tensor: object) -> bool:
    return DTensor is not None and isinstance(tensor, DTensor)


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, any other tensor itself."""
    return tensor._local_tensor if is_dtensor(tensor) else tensor


def dtensor_spec(tensor: torch.Tensor) -> tuple | None:
    """(mesh, placements, global shape, global stride) of a DTensor weight; None for other tensors."""
    if not is_dtensor(tensor):
        return None
    return tensor.device_mesh, tuple(tensor.placements), tuple(tensor.shape), tuple(tensor.stride())


def from_local_slot(view: torch.Tensor, runtime_id: int, group: int, slot: int) -> torch.Tensor:
    """Graph node: the DTensor weight of ``slot`` rebuilt around its fetched local shard ``view``."""
    rt = runtime_by_id(runtime_id)
    mesh, placements, shape, stride = rt.dtensor_specs[(rt._actual(group), slot)]
    return DTensor.from_local(view, mesh, placements, run_check=False, shape=shape, stride=stride)


def set_local(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Point a weight at new host data (a view into a group's flat buffer): a plain tensor's ``.data``; a
    DTensor's local shard."""
    if is_dtensor(tensor):
        if value.storage_offset() != 0:
            # dynamo cannot fakify a DTensor whose shard starts inside its storage (torch's meta_utils: "Attempted
            # to set the storage of a tensor on device cpu to a storage on different device meta"), so the shard
            # aliases the same bytes through a storage that begins at it; that storage slice does not own its
            # bytes, so the alias keeps the buffer it was cut from alive
            start = value.storage_offset() * value.element_size()
            storage = value.untyped_storage()[start:start + value.numel() * value.element_size()]
            alias = torch.empty(0, dtype=value.dtype, device=value.device).set_(storage, 0, value.shape, value.stride())
            alias._offload_base = value
            value = alias
        tensor._local_tensor = value
    else:
        tensor.data = value
