"""Weights as plain tensors: a traceable tensor-subclass weight moves as the plain tensors inside it.

A weight that is a tensor subclass with ``__tensor_flatten__`` / ``__tensor_unflatten__`` (torchao's Int8Tensor
and Float8Tensor, optimum-quanto's WeightQBytesTensor, DTensor, ...) is a tree: it wraps named inner tensors
(quantized data, scales, zero points; a DTensor's local shard), which may be such subclasses in turn. The plain
tensors at the bottom are its *leaves*, named by their attribute path. The engine packs and moves the leaves
(the quantized bytes; each rank's shard) like any plain weight, and the graph rebuilds the weight around the
fetched leaves with `rebuild_weight`, which calls the subclass's own ``__tensor_unflatten__`` (no data is
touched, no communication). A plain weight is its own single leaf, at path ``()``.

A subclass without ``__tensor_flatten__`` cannot be taken apart (nor traced by dynamo): `untraceable` says so,
and grouping refuses it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import torch

from ._registry import runtime_by_id
from .host_masters import HostMaster
from .storage import own_storage

Path = tuple[str, ...]


def is_traceable_subclass(tensor: object) -> bool:
    """A tensor subclass that flattens into inner tensors (``torch.Tensor`` and ``nn.Parameter`` do not). A
    host master is the engine's own plain weight (its bytes are its one leaf), not such a subclass."""
    return (isinstance(tensor, torch.Tensor) and hasattr(type(tensor), "__tensor_flatten__")
            and not isinstance(tensor, HostMaster))


def untraceable(tensor: torch.Tensor) -> str | None:
    """Why ``tensor`` cannot be moved as plain tensors (a subclass that does not flatten), else None."""
    if is_traceable_subclass(tensor) or type(tensor.data) in (torch.Tensor, HostMaster):
        return None
    return (f"a tensor subclass ({type(tensor.data).__name__}) without __tensor_flatten__/__tensor_unflatten__, "
            f"so its inner tensors cannot be moved")


def _inner(tensor: torch.Tensor) -> tuple[list[str], Any]:
    names, ctx = tensor.__tensor_flatten__()
    return list(names), ctx


def leaf_paths(tensor: torch.Tensor) -> list[Path]:
    """The attribute paths of the plain tensors inside ``tensor``, in flatten order; ``[()]`` for a plain one.
    Inner values that are not tensors (a DTensor's device mesh) are no leaves: the rebuild keeps them."""
    if not is_traceable_subclass(tensor):
        return [()]
    paths: list[Path] = []
    for name in _inner(tensor)[0]:
        inner = getattr(tensor, name)
        if isinstance(inner, torch.Tensor):
            paths.extend((name, *sub) for sub in leaf_paths(inner))
    return paths


def leaf_at(tensor: torch.Tensor, path: Path) -> torch.Tensor:
    for name in path:
        tensor = getattr(tensor, name)
    return tensor


def plain_leaves(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors inside ``tensor`` (``[tensor]`` for a plain one). A graph node too: the evict of a
    weight orders after a subclass-valued reader through its leaves."""
    return [leaf_at(tensor, path) for path in leaf_paths(tensor)]


def leaf_nbytes(tensor: torch.Tensor) -> int:
    """The bytes a weight moves: its leaves' (a quantized weight's quantized bytes, a DTensor's local shard)."""
    return sum(leaf.numel() * leaf.element_size() for leaf in plain_leaves(tensor))


def set_leaf(tensor: torch.Tensor, path: Path, value: torch.Tensor) -> None:
    """Point one leaf of a weight at new data (a view into a group's flat host buffer): a plain weight's
    ``.data``; an inner tensor of a subclass, set as the attribute it is."""
    if not path:
        tensor.data = value
        return
    if value.storage_offset() != 0:
        # dynamo cannot fakify a subclass whose inner tensor starts inside its storage (torch's meta_utils: "Attempted
        # to set the storage of a tensor on device cpu to a storage on different device meta")
        value = own_storage(value)
    setattr(leaf_at(tensor, path[:-1]), path[-1], value)


@dataclasses.dataclass(frozen=True)
class RebuildSpec:
    """How ``__tensor_unflatten__`` rebuilds one subclass tensor from its inner tensors: ``inner`` per tensor
    name, None for a leaf or the spec of a nested subclass; ``constants`` the inner values that are not tensors."""
    cls: type
    inner: tuple[tuple[str, RebuildSpec | None], ...]
    constants: tuple[tuple[str, Any], ...]
    ctx: Any
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def matches(self, other: RebuildSpec | None) -> bool:
        """The same rebuild (a graph compiled for one weight may run another's leaves): compared field by field;
        a context that cannot be compared does not match."""
        try:
            return bool(self == other)
        except Exception:
            return False


def rebuild_spec(tensor: torch.Tensor) -> RebuildSpec | None:
    """The rebuild recipe of a subclass weight, None for a plain one. Taken from a detached alias: the graph
    rebuilds weights for inference (a DTensor's flatten context carries ``requires_grad``)."""
    if not is_traceable_subclass(tensor):
        return None
    tensor = tensor.detach()
    names, ctx = _inner(tensor)
    inner, constants = [], []
    for name in names:
        value = getattr(tensor, name)
        if isinstance(value, torch.Tensor):
            inner.append((name, rebuild_spec(value)))
        else:
            constants.append((name, value))
    return RebuildSpec(type(tensor), tuple(inner), tuple(constants), ctx, tuple(tensor.shape), tuple(tensor.stride()))


def rebuild(spec: RebuildSpec, leaves: Iterator[torch.Tensor]) -> torch.Tensor:
    """The subclass tensor of ``spec`` around ``leaves`` (consumed in `leaf_paths` order)."""
    inner: dict[str, Any] = dict(spec.constants)
    for name, nested in spec.inner:
        inner[name] = next(leaves) if nested is None else rebuild(nested, leaves)
    return spec.cls.__tensor_unflatten__(inner, spec.ctx, spec.size, spec.stride)


def rebuild_weight(leaves: list[torch.Tensor], runtime_id: int, group: int, slot: int) -> torch.Tensor:
    """Graph node: the subclass weight of ``slot`` rebuilt around its fetched leaves (views of a device slot).
    Under inductor it is traced once, when compiled; eagerly it runs per call."""
    rt = runtime_by_id(runtime_id)
    return rebuild(rt.rebuild_specs[(rt.actual_group(group), slot)], iter(leaves))
