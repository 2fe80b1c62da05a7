"""Tensors over a storage object of their own: what dynamo needs to fakify a tensor subclass's inner tensor, and
what a custom op's outputs need (they must not share storage)."""

from __future__ import annotations

import weakref
from typing import Any, Mapping, NamedTuple

import torch


def own_storage(value: torch.Tensor) -> torch.Tensor:
    """``value``'s bytes, shape and strides through a storage object of its own that begins at its first element.
    The storage slice does not own its bytes, so the tensor it was cut from lives as long as the alias -- kept in
    `_CUT_FROM`, not as an attribute of the alias: ``torch.save``, pickle and ``copy.deepcopy`` take a tensor's
    attributes with it, and the tensor it was cut from is a whole group's buffer."""
    start = value.storage_offset() * value.element_size()
    storage = value.untyped_storage()[start:start + span(value) * value.element_size()]
    alias = torch.empty(0, dtype=value.dtype, device=value.device).set_(storage, 0, value.shape, value.stride())
    _CUT_FROM[id(alias)] = value
    weakref.finalize(alias, _CUT_FROM.pop, id(alias), None)
    return alias


_CUT_FROM: dict[int, torch.Tensor] = {}  # an `own_storage` alias's id -> the tensor whose bytes it aliases


def span(tensor: torch.Tensor) -> int:
    """Elements from a tensor's first to one past its last (its extent in storage)."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))


def viewed(value: torch.Tensor) -> torch.Tensor:
    """The tensor an `own_storage` alias was cut from (its storage is the one other tensors may share), else
    ``value`` itself."""
    return _CUT_FROM.get(id(value), value)


class Filled(NamedTuple):
    """What a group's bucket was filled into, laid out as the host store lays it out: a flat host buffer (in
    memory, or mapping the `runtime.disk.DiskFile` ``file``), or no buffer and ``file`` the checkpoint's own
    extents (`runtime.disk.CheckpointExtents`) whose mapping the weights already view."""
    flat: torch.Tensor | None
    file: Any = None


FilledBuckets = Mapping[int, Filled]
"""What a checkpoint was read into (`checkpoint.load_checkpoint`), by the address of each bucket's first byte:
handed to the runtime that packs those groups (`offload_compiler.backend.build_runtime`), which takes each as the
bucket's buffer instead of copying into a new one (`runtime.host`)."""
