"""Transfer ops inserted into the graph. They are opaque kernels with fake implementations, so AOT autograd
and inductor treat them as extern calls; their order is fixed by token tensors (data), not by declared
effects, which inductor does not honour for ordering (see DESIGN.md).

The ops are defined with ``torch.library.Library`` define/impl rather than ``torch.library.custom_op``: the
same schema, a fraction of the dispatch cost per call (custom_op wraps every call in Python layers that the
hot path pays once per op per group)."""

from __future__ import annotations

import torch

from ._registry import runtime_by_id
from ._torch_private import profiler_enabled

NAMESPACE = "offload_compiler"
_LIB = torch.library.Library(NAMESPACE, "DEF")
# order tokens, never written: an op's result must not be one of its inputs, so consecutive prefetches
# (each takes the previous one's token) alternate between two, and evicts return a third
_PREFETCH_TOKENS = [torch.empty(0), torch.empty(0)]
_EVICT_TOKEN = torch.empty(0)


def _define(schema: str, impl, fake, tags: tuple = ()) -> None:
    name = schema.split("(", 1)[0]
    _LIB.define(schema, tags=tags)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)


def _token(*_) -> torch.Tensor:
    return torch.empty(0)


def _fake_buffers(runtime: int, group: int, *_) -> list[torch.Tensor]:
    rt = runtime_by_id(runtime)
    return [torch.empty(numel, dtype=dtype, device=rt.device) for numel, dtype in rt.bucket_layout(group)]


def prefetch(runtime: int, group: int, key: int, deps: list[torch.Tensor], mode: int = 0) -> torch.Tensor:
    """Start copying ``group`` into the slot planned for ``key`` (asynchronously on an accelerator); returns a
    token. ``mode``: `passes.schedule.FETCH`, `ADOPT` or `CARRY` (see `OffloadRuntime.prefetch`)."""
    runtime_by_id(runtime).prefetch(key, group, mode)
    _PREFETCH_TOKENS.reverse()
    return _PREFETCH_TOKENS[0]


def wait(runtime: int, group: int, key: int, deps: list[torch.Tensor]) -> list[torch.Tensor]:
    """``to_device``: the flat buffers (one per dtype) of the group's device slot, ready for compute. The graph
    returns them as extra outputs, so inductor never frees or reuses the slot's memory."""
    return runtime_by_id(runtime).wait(key, group)


def evict(runtime: int, group: int, poison: bool, buffers: list[torch.Tensor], users: list[torch.Tensor],
          park: bool = False) -> torch.Tensor:
    """Runs after every reader of ``buffers``; their slot is free for the next fill after it, unless ``park``
    keeps the copy on the device for the next call."""
    runtime_by_id(runtime).evict(group, poison, park)
    return _EVICT_TOKEN


def resident(runtime: int, group: int) -> list[torch.Tensor]:
    """The flat buffers of a resident group's persistent device copy (fetched on first use or after a host
    change)."""
    return runtime_by_id(runtime).resident(group)


def transfer(runtime: int, plan: int, deps: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A wait (or a resident copy) fused with the evicts and prefetches just before it (`passes.fuse`): one op
    where there were several, its steps recorded once in the runtime (`OffloadRuntime.plan_transfer`). Returns
    the group's leaves, each a view of its device slot with its own layout: the compiled graph needs no view op
    per weight. Inductor must never reuse them for other values (see `backend.register_transfer_lowering`)."""
    return runtime_by_id(runtime).run_transfer(plan)


def transfer_direct(runtime: int, plan: int, deps: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """`transfer` as inductor's generated code calls it, past the dispatcher (`lowering._call_directly`); under
    a profiler it still shows as the op."""
    if profiler_enabled():
        with torch.profiler.record_function("offload_compiler::transfer"):
            return runtime_by_id(runtime).run_transfer(plan)
    return runtime_by_id(runtime).run_transfer(plan)


def _fake_leaves(runtime: int, plan: int, deps) -> list[torch.Tensor]:
    rt = runtime_by_id(runtime)
    group = rt.groups[rt.transfer_group(plan)]
    return [torch.empty_strided(leaf.shape, leaf.stride, dtype=group.buckets[leaf.bucket].dtype, device=rt.device)
            for leaf in group.leaves]


_define("prefetch(int runtime, int group, int key, Tensor[] deps, int mode=0) -> Tensor", prefetch, _token)
_define("wait(int runtime, int group, int key, Tensor[] deps) -> Tensor[]", wait, _fake_buffers)
_define("evict(int runtime, int group, bool poison, Tensor[] buffers, Tensor[] users, bool park=False) -> Tensor",
        evict, _token, tags=(torch.Tag.flexible_layout,))
_define("resident(int runtime, int group) -> Tensor[]", resident, _fake_buffers)
_define("transfer(int runtime, int plan, Tensor[] deps) -> Tensor[]", transfer, _fake_leaves)


def routed(runtime: int, group: int, slot: int, ids: torch.Tensor, bound: int, expert_bytes: int,
           deps: list[torch.Tensor]) -> torch.Tensor:
    """``weight[ids]`` for a weight read by indices (`passes.routed`: router indices, a table's lookup): only the
    rows ``ids`` names are copied, into a fixed slot of ``bound`` rows, and gathered from there. A fresh tensor, as the
    index it replaces made: nothing reads the slot after the op returns. ``deps``: what must run first (under
    inductor, the evicts before it in the verified graph: `passes.fuse`), read by nothing."""
    return runtime_by_id(runtime).routed(group, slot, ids, bound, expert_bytes)


def _fake_routed(runtime: int, group: int, slot: int, ids: torch.Tensor, bound: int, expert_bytes: int,
                 deps: list[torch.Tensor]) -> torch.Tensor:
    rt = runtime_by_id(runtime)
    leaf = rt.groups[group].slots[slot].leaves[0]
    dtype = rt.groups[group].buckets[leaf.bucket].dtype
    return ids.new_empty((*ids.shape, *leaf.shape[1:]), dtype=dtype, device=rt.device)


_define("routed(int runtime, int group, int slot, Tensor ids, int bound, int expert_bytes, Tensor[] deps) -> Tensor",
        routed, _fake_routed)


def routed_grouped(runtime: int, group: int, slot: int, offs: torch.Tensor, bound: int, expert_bytes: int,
                   deps: list[torch.Tensor]) -> list[torch.Tensor]:
    """An expert weight read as a grouped product's operand with offsets (transformers' ``grouped_mm``
    experts, `passes.routed`): only the experts with tokens are copied, into ``bound`` rows, and returned
    with the offsets remapped to them (``[weight, offsets]``; the rows past the experts named hold no tokens).
    Fresh tensors, as for `routed`; ``deps`` as there."""
    return runtime_by_id(runtime).routed_grouped(group, slot, offs, bound, expert_bytes)


def _fake_routed_grouped(runtime: int, group: int, slot: int, offs: torch.Tensor, bound: int, expert_bytes: int,
                         deps: list[torch.Tensor]) -> list[torch.Tensor]:
    rt = runtime_by_id(runtime)
    leaf = rt.groups[group].slots[slot].leaves[0]
    dtype = rt.groups[group].buckets[leaf.bucket].dtype
    return [offs.new_empty((bound, *leaf.shape[1:]), dtype=dtype, device=rt.device), offs.new_empty((bound,))]


_define("routed_grouped(int runtime, int group, int slot, Tensor offs, int bound, int expert_bytes, Tensor[] deps) "
        "-> Tensor[]", routed_grouped, _fake_routed_grouped)


def materialize(value: torch.Tensor) -> torch.Tensor:
    """A copy of a weight reader's value, placed right after the reader; later nodes use the copy, and the
    weight's evict follows it. Inductor lowers in graph order and may otherwise re-compute a pointwise reader
    from the weight inside a later kernel (a residual add), which can run after the weight's evict. Under
    inductor it is an extern call (see `lowering`'s module doc for why not a lowering)."""
    return value.clone()


_define("materialize(Tensor value) -> Tensor", materialize, torch.empty_like)


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` as one opaque op: a streamed weight's linear reader under inductor (`passes.insert`). Its
    result is always a buffer of its own, computed when the op runs, so the weight's evict can follow it
    with no copy (`materialize`); inductor cannot re-compute it inside a later kernel. Its own fake: ``F.linear``
    computes on fake tensors."""
    return torch.nn.functional.linear(input, weight, bias)


_define("linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor", linear, linear)

# What inductor's generated code calls for `materialize` and `linear` (`lowering._call_directly`): torch's
# builtins, bound when this module is imported, and imported by the generated code from here, so what it calls
# never depends on what ``torch.clone`` or ``F.linear`` is when a graph is lowered (a profiler, a test or another
# library may have wrapped it in a function that cannot be imported by its name)
direct_clone = torch.clone
direct_linear = torch.nn.functional.linear

