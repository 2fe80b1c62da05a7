"""`OffloadRuntime`: one offloaded model's runtime as the rest of the package sees it. It composes the device
streams (`device`), the host store (`host`) and the transfer engine (`transfers`, which holds the device slots
and the ledger), and keeps what belongs to the model rather than to a transfer: its name and a weak reference
to it, the weights outside every group, the compiled graphs' plans and how often each ran, the lock a call
holds, and the stats. The graph's ops reach it by integer id (`_registry`).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Callable

import torch
from torch import nn

from .._registry import register
from ..grouping import GroupSpec
from ..host_masters import OnDemand, watch_state_dict
from ..policy import OffloadPolicy
from ..storage import FilledBuckets
from ..subclasses import leaf_nbytes
from .device import DeviceStreams, is_accelerator, synchronize_streams
from .disk import one_read_of_mappings
from .host import HostStore
from .pinning import HostRegistrations
from .slots import size_class
from .stats import OffloadStats, describe, held_device_weight_bytes, held_pool_bytes
from .transfers import TransferEngine

_NEXT_ID = itertools.count(1)


def _finalize(copy_streams: list, registrations: HostRegistrations | None) -> None:
    """A runtime collected with copies in flight (a carried copy, a call that never waited): the host waits
    for them before its device slots are freed and its pinned buffers unregistered (this runs first)."""
    synchronize_streams(copy_streams)
    if registrations is not None:
        registrations.unregister_all()


def _weakly(method: Callable[[], None]) -> Callable[[], None]:
    """``method`` called through a weak reference (no cycle keeps its object alive)."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()
    return call


def _unmanaged(model: nn.Module, specs: list[GroupSpec]) -> tuple[set[int], int]:
    """The model's tensors in no group (they live on the compute device): their ids and bytes."""
    managed = {id(w.tensor) for spec in specs for w in spec.weights}
    seen: set[int] = set()
    nbytes = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) not in managed and id(tensor) not in seen:
            seen.add(id(tensor))
            nbytes += leaf_nbytes(tensor)
    return seen, nbytes


def _forwarded(component: str, name: str, stub: bool = False) -> property:
    """``name`` of the component at ``component``, read through the runtime. ``stub``: also replaced (and
    restored by ``del``) through it, which only tests and benchmarks do, to record or leave out a step."""
    def get(self):
        return getattr(getattr(self, component), name)

    if not stub:
        return property(get, doc=f"``{component}.{name}``")
    return property(get, lambda self, value: setattr(getattr(self, component), name, value),
                    lambda self: delattr(getattr(self, component), name), doc=f"``{component}.{name}``")


class OffloadRuntime:
    """One model's offload state, shared by every graph captured from it. ``model`` (optional) is the module
    whose groups ``specs`` are: its other weights are counted as kept on the device, and named in refusals;
    on an accelerator its ``state_dict`` gives host masters as plain host tensors until `unpack`.
    ``on_demand`` counts what host masters fetched outside the graphs (`host_masters.with_host_masters`)."""

    def __init__(self, policy: OffloadPolicy, specs: list[GroupSpec], model_name: str = "model",
                 pack_now: bool = True, model: nn.Module | None = None, on_demand: OnDemand | None = None,
                 filled: FilledBuckets | None = None) -> None:
        self.id = next(_NEXT_ID)
        self.policy = policy
        self.model_name = model_name
        self.device = policy.torch_device
        self.streams = DeviceStreams.of(self.device)  # None where the device has no streams
        self.host = HostStore(specs, self.device, policy.pin_memory, self.streams, policy.disk_dir,
                              policy.host_budget_bytes)
        self.transfers = TransferEngine(self.host, self.device, self.streams, policy.debug_poison)
        self.host.wait_for_copies = _weakly(self.wait_for_copies)  # the fill worker's copies too
        self.lock = threading.RLock()
        self.closed = False
        weakref.finalize(self, _finalize, [] if self.streams is None else self.streams.copy_streams,
                         self.host.registrations)
        if pack_now:
            try:
                with one_read_of_mappings():
                    for group in self.host.groups:
                        self.host.pack(group, filled)
            except BaseException:  # building a runtime is one transaction: every weight gets its own storage
                # back (the groups packed, and the part of one packed when it failed), or, loading from a
                # checkpoint, nothing: the loader gives back what the model held
                self.host.unpack(model, copy_back=filled is None)
                raise
        # the model: a weak reference (names in messages) and its weights in no group
        self.model_ref: Callable[[], object] | None = None if model is None else weakref.ref(model)
        self.unmanaged_ids, self.unmanaged_bytes = (set(), 0) if model is None else _unmanaged(model, specs)
        self.on_demand = on_demand or OnDemand()
        self.on_demand.before_write = weakref.WeakMethod(self.wait_for_copies)
        self.on_demand.hand_out = weakref.WeakMethod(self.hand_out)
        self._state_dict_hooks: dict[int, tuple] = {}  # module id -> (module ref, handle)
        if model is not None:
            for module in model.modules():
                watch_state_dict(module, self._state_dict_hooks)
        self.graph_plans: list = []
        self.expert_groups = frozenset(i for i, spec in enumerate(specs) if spec.experts)  # may be fetched routed
        self.transfers.expert_groups = self.expert_groups
        self.graph_calls = 0
        self.plan_calls: list[int] = []  # per graph plan: how often it ran (since the last reset_stats)
        self.earlier_calls: list[tuple[list[int], object, int]] = []  # `calls_by_plan` of the runtimes this one
        #   counts on from (`continue_stats`)

        # the components' state the passes, the backend and the reports read (objects never replaced)
        self.groups = self.host.groups
        self.group_of = self.host.group_of
        self.layout = self.host.layout
        self.rebuild_specs = self.host.rebuild_specs
        self.pool = self.transfers.pool
        self.ledger = self.transfers.ledger
        self.used_groups = self.transfers.used_groups
        # a model that is its one component leaves the device after each call, its slots' memory too
        self.gives_back_slots = any(g.whole_model for g in self.groups)
        # the transfer ops' entry points, bound once: an op reaches the engine with no call in between (the
        # hot path pays a Python frame per op per group for every layer of indirection)
        t = self.transfers
        self.prefetch, self.wait, self.wait_weights, self.evict = t.prefetch, t.wait, t.wait_weights, t.evict
        self.resident, self.resident_weights, self.run_transfer = t.resident, t.resident_weights, t.run_transfer
        self.routed, self.routed_grouped = t.routed, t.routed_grouped
        self.actual_group = t.actual_group  # a subclass weight's rebuild, eagerly once per call
        self.holding_copies = t.holding_copies  # parts called from Python (see `release_held`)
        register(self)

    pinned = _forwarded("host", "pinned")  # False once pinning failed at packing
    bytes_transferred = _forwarded("transfers", "bytes_transferred")
    fetch_count = _forwarded("transfers", "fetch_count")
    carry_hits = _forwarded("transfers", "carry_hits")
    captured = _forwarded("transfers", "captured")
    group_remap = _forwarded("transfers", "group_remap")
    # read, or stubbed, by tests and benchmarks (tests/test_slots.py, test_hot_path.py, benchmarks/decode.py)
    _wait = _forwarded("transfers", "_wait", stub=True)
    _copy_into = _forwarded("transfers", "_copy_into", stub=True)
    _slot_of = _forwarded("transfers", "_slot_of")
    _pending = _forwarded("transfers", "_pending")
    _live = _forwarded("transfers", "_live")
    _resident = _forwarded("transfers", "_resident")
    _transfer_plans = _forwarded("transfers", "_transfer_plans")

    @property
    def _copy_stream(self):
        """The copy stream once made (tests/test_gpu.py)."""
        return None if self.streams is None else self.streams.copy_stream

    @property
    def total_bytes(self) -> int:
        return self.host.total_bytes

    # -- layout and planning, used by the passes, the backend and the ops' fake implementations --------
    def bucket_layout(self, group: int) -> list[tuple[int, torch.dtype]]:
        """Size and dtype of each flat buffer of a group: what `wait` and `resident` return."""
        return list(size_class(self.groups[group]))

    def new_fetch_key(self) -> int:
        return self.transfers.new_fetch_key()

    def plan_slots(self, assignment: dict[int, tuple[int, int]], pooling, sizes) -> None:
        """See `TransferEngine.plan_slots`."""
        self.transfers.plan_slots(assignment, pooling, sizes)

    def plan_transfer(self, steps: tuple[tuple[int, int, int, int], ...], key: int | None, group: int) -> int:
        """See `TransferEngine.plan_transfer`."""
        return self.transfers.plan_transfer(steps, key, group)

    def transfer_group(self, plan: int) -> int:
        return self.transfers.transfer_group(plan)

    def remap_between(self, passed: list, compiled_ids: tuple) -> dict[int, int] | None:
        """See `HostStore.remap_between`."""
        return self.host.remap_between(passed, compiled_ids)

    def add_graph_plan(self, plan) -> int:
        """Record the plan of a newly compiled graph; returns its index (`begin_call` counts its calls)."""
        self.graph_plans.append(plan)
        self.plan_calls.append(0)
        return len(self.graph_plans) - 1

    # -- one call of a graph (the caller holds ``lock``) ----------------------------------------------
    def begin_call(self, plan_index: int, carry_keys: frozenset[int], remap: dict[int, int] | None) -> None:
        """A graph of plan ``plan_index`` is about to run, on the groups ``remap`` maps its own to (None: the
        weights it was compiled with); see `begin_graph` for ``carry_keys``. `end_call` follows, always."""
        self.graph_calls += 1
        self.plan_calls[plan_index] += 1
        self.transfers.begin_graph(carry_keys)
        self.transfers.group_remap = remap

    def end_call(self) -> None:
        self.transfers.group_remap = None
        if self.gives_back_slots:
            self.transfers.give_back_slots_after_call()
        if self.host.watched:  # a plain alias of host bytes lives (`HostStore.watch`): a write through it, which
            self.wait_for_copies()  # nothing intercepts, must not race this call's copies (carried ones too)

    def release_held(self) -> None:
        """An offloaded call ended: the copies its parts' graphs held (`TransferEngine.holding_copies`) go, and
        with them, for a model that is its one component, the memory of their slots (see `end_call`)."""
        self.transfers.release_held()
        if self.gives_back_slots:
            self.transfers.give_back_slots_after_call()

    def hand_out(self, master, alias, tracked: bool) -> None:
        """A plain alias of a weight's host bytes is given to the user (`host_masters._handed_out`): the copies
        queued now may read them, so the host waits for them first; then the host store watches it."""
        self.wait_for_copies()
        self.host.watch(master, alias, tracked)

    def begin_graph(self, carry_keys: frozenset[int]) -> None:
        """See `TransferEngine.begin_graph`."""
        self.transfers.begin_graph(carry_keys)

    def abandon_pending(self) -> None:
        """A call failed: see `TransferEngine.abandon_pending`."""
        self.transfers.abandon_pending()

    def inject_fault(self, stage: str, group: int | None = None, exception: BaseException | None = None,
                     times: int = 1) -> None:
        """See `TransferEngine.inject_fault`."""
        self.transfers.inject_fault(stage, group, exception, times)

    # -- between calls ----------------------------------------------------------------------------------
    def wait_for_copies(self) -> None:
        """The host waits until every copy issued so far has finished reading host memory: before the host
        writes a buffer that a queued copy may still read (repacking a changed weight, `load_state_dict`),
        and before the runtime lets go of its device memory or host buffers. Never inside a graph capture
        (illegal there; a capture's copies read host memory at replay, not now)."""
        if self.streams is not None:
            self.streams.wait_for_copies()
        self.transfers.wait_for_fills()

    def release_carried(self) -> int:
        return self.transfers.release_carried()

    def release_resident(self) -> None:
        self.transfers.release_resident()

    def release_device_copies(self) -> int:
        """Drop every device copy held between calls (resident groups, parked components, copies carried for
        the next call) and the slot pool's memory; the next call fetches what it needs again (a graph captured
        before must be captured again: its slots' addresses are gone). Returns the bytes of copies released."""
        with self.lock:
            return self.transfers.release_device_copies()

    def unpack(self, copy_back: bool = True) -> None:
        """Give every weight its own storage again (the undo of packing; see `HostStore.unpack` for
        ``copy_back``) and drop all device copies and the device pool."""
        with self.lock:
            self.transfers.close()
            self.host.unpack(self.model_ref() if self.model_ref is not None else None, copy_back)
            for _, handle in self._state_dict_hooks.values():
                handle.remove()
            self._state_dict_hooks.clear()
            self.closed = True

    # -- stats --------------------------------------------------------------------------------------
    def stats(self) -> OffloadStats:
        t = self.transfers
        resident, parked, carried = t.held_bytes()
        streamed = sum(g.nbytes for g in self.groups if g.streamed)
        return OffloadStats(t.bytes_transferred, t.ledger.peak, t.fetch_count, t.ledger.live, resident, streamed,
                            self.total_bytes, parked, self.unmanaged_bytes, carried, t.carry_hits,
                            self.on_demand.bytes, t.disk_bytes_read, self.host.disk_bytes, t.routed_bytes,
                            t.routed_fetches, t.expert_bytes,
                            sum(calls for _, _, calls in self.calls_by_plan()),
                            held_pool_bytes(self), held_device_weight_bytes(self) if self.graph_plans else 0,
                            self.gives_back_slots, t.held_hits, t.held_hit_bytes)

    def describe(self) -> str:
        """The plan for people: each group's bytes and residency, and each graph's fetches and peak."""
        return describe(self)

    def continue_stats(self, previous: "OffloadRuntime") -> None:
        """``offload_stats`` counts on from ``previous``, the runtime this one replaced (the backend route's first,
        over the traced plain weights): what its first call moved stays counted."""
        self.transfers.continue_counters(previous.transfers)
        self.on_demand.bytes += previous.on_demand.bytes
        self.earlier_calls = previous.calls_by_plan()

    def calls_by_plan(self) -> list[tuple[list[int], object, int]]:
        """Each verified graph plan that ran since the last `reset_stats`, as (its runtime's group bytes, the
        plan, how often it ran): this runtime's and those of the runtimes it counts on from (`continue_stats`),
        so that the plans account for every byte ``offload_stats`` counts."""
        nbytes = [g.nbytes for g in self.groups]
        return self.earlier_calls + [(nbytes, plan, calls) for plan, calls in zip(self.graph_plans, self.plan_calls)]

    def reset_stats(self) -> None:
        self.plan_calls = [0] * len(self.plan_calls)
        self.earlier_calls = []
        self.transfers.reset_counters()
        self.on_demand.reset()
