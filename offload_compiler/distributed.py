"""Per-rank offload under torch.distributed: DTensor (tensor-parallel) weights.

A DTensor is a traceable tensor subclass whose one plain inner tensor is the rank's local shard, so it moves as
any subclass weight does (`offload_compiler.subclasses`): the shard is packed into the group's flat host buffer
(the DTensor object keeps its identity, so dynamo's placeholders still match it), and the graph rebuilds the
DTensor around the fetched shard with its own ``__tensor_unflatten__`` (no communication), so the model's ops
and its collectives see a DTensor on the compute device. Nothing here is a distributed layer of its own:
sharding, meshes and collectives are torch.distributed's.
"""

from __future__ import annotations

import torch

try:  # torch built without distributed support
    from torch.distributed.tensor import DTensor
except Exception:  # pragma: no cover
    DTensor = None


def is_dtensor(tensor: object) -> bool:
    return DTensor is not None and isinstance(tensor, DTensor)


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, any other tensor itself."""
    return tensor._local_tensor if is_dtensor(tensor) else tensor
