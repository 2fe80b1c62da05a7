"""Transfer ops inserted into the graph. They are custom ops with fake implementations, so dynamo, AOT
autograd and inductor treat them as opaque kernels; their order is fixed by token tensors (data), not by
declared effects, which inductor does not honour for ordering (see DESIGN.md)."""

from __future__ import annotations

import torch
from torch.library import custom_op

from ._registry import runtime_by_id

NAMESPACE = "offload_compiler"


def _token() -> torch.Tensor:
    return torch.empty(0)


def _fake_buffers(runtime: int, group: int) -> list[torch.Tensor]:
    rt = runtime_by_id(runtime)
    return [torch.empty(numel, dtype=dtype, device=rt.device) for numel, dtype in rt.bucket_layout(group)]


@custom_op(f"{NAMESPACE}::prefetch", mutates_args=())
def prefetch(runtime: int, group: int, key: int, deps: list[torch.Tensor], mode: int = 0) -> torch.Tensor:
    """Start copying ``group`` to the device (asynchronously on an accelerator); returns a token. ``mode``:
    `passes.schedule.FETCH`, `ADOPT` or `CARRY` (see `OffloadRuntime.prefetch`)."""
    runtime_by_id(runtime).prefetch(key, group, mode)
    return _token()


@prefetch.register_fake
def _(runtime, group, key, deps, mode=0):
    return _token()


@custom_op(f"{NAMESPACE}::wait", mutates_args=())
def wait(runtime: int, group: int, key: int, deps: list[torch.Tensor]) -> list[torch.Tensor]:
    """``to_device``: the group's device buffers (one flat buffer per dtype), ready for compute."""
    return runtime_by_id(runtime).wait(key, group)


@wait.register_fake
def _(runtime, group, key, deps):
    return _fake_buffers(runtime, group)


@custom_op(f"{NAMESPACE}::evict", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def evict(runtime: int, group: int, poison: bool, buffers: list[torch.Tensor],
          users: list[torch.Tensor], park: bool = False) -> torch.Tensor:
    """Runs after every reader of ``buffers``; the graph drops the buffers right after it, unless ``park``
    keeps them on the device for the next call (they are then graph outputs, so never reused by inductor)."""
    runtime_by_id(runtime).evict(group, buffers, poison, park)
    return _token()


@evict.register_fake
def _(runtime, group, poison, buffers, users, park=False):
    return _token()


@custom_op(f"{NAMESPACE}::materialize", mutates_args=())
def materialize(value: torch.Tensor) -> torch.Tensor:
    """A copy of a weight reader's value, placed right after the reader; later nodes use the copy. Inductor
    lowers in graph order and may otherwise re-compute a pointwise reader from the weight inside a later
    kernel (a residual add), which can run after the weight's evict; an opaque op's result it cannot."""
    return value.clone()


@materialize.register_fake
def _(value):
    return torch.empty_like(value)


@custom_op(f"{NAMESPACE}::resident", mutates_args=())
def resident(runtime: int, group: int) -> list[torch.Tensor]:
    """The persistent device copy of a resident group (fetched on first use or after a host change)."""
    return [t.view(t.shape) for t in runtime_by_id(runtime).resident(group)]


@resident.register_fake
def _(runtime, group):
    return _fake_buffers(runtime, group)
