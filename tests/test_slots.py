"""Fixed device slots: every fetch lands in a slot of a pool sized by the verified plan, at the same address
on every call, with no device allocation per call; the ledger counts the slots' copies exactly as planned."""

import copy

import pytest
import torch

from offload_compiler import OffloadPolicy, offload_compile, offload_stats
from offload_compiler.passes.slots import Pooling, choose_pooling, plan_slots, sizes_bytes
from offload_compiler.runtime import ADOPT, CARRY, FETCH
from offload_compiler.testing import BlockSpec, ModelSpec, build_block_model

SPEC = ModelSpec(16, (BlockSpec("mlp", 32), BlockSpec("attention", 1), BlockSpec("mlp", 16)), False, True, 4, 2)


def _record_fetches(runtime) -> list:
    """(group, data_ptr of each flat buffer of its slot) of every wait, in call order."""
    seen = []
    wait = runtime._wait  # what both the eager path and the graph ops take a fetched slot from

    def recording(key, group):
        slot = wait(key, group)
        seen.append((group, tuple(b.data_ptr() for b in slot.buffers)))
        return slot
    runtime._wait = recording
    return seen


def _slot_memory(runtime) -> dict:
    return {id(slot): [b.data_ptr() for b in slot.buffers] for slots in runtime.pool.slots.values() for slot in slots}


@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("carry", [False, True])
def test_each_group_lands_at_the_same_address_every_call_from_a_fixed_pool(compiler, carry):
    model, x = build_block_model(SPEC, 3)
    expected = model(x).detach()
    m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="layerwise", device="cpu", compiler=compiler,
                                                           prefetch_next_call=carry, debug_poison=True))
    assert torch.allclose(m(x), expected, atol=1e-5)  # debug_poison: a read of a refilled slot would be NaN
    runtime = m._offload_runtime
    pool_before = _slot_memory(runtime)
    calls = []
    for _ in range(3):
        seen = _record_fetches(runtime)
        assert torch.allclose(m(x), expected, atol=1e-5)
        calls.append(seen)
        del runtime._wait
    assert calls[0] and calls[0] == calls[1] == calls[2]  # same groups, same addresses, every call
    assert _slot_memory(runtime) == pool_before  # no slot was added or reallocated after the first call
    slot_ranges = [(p, p + b.untyped_storage().nbytes()) for slots in runtime.pool.slots.values()
                   for slot in slots for b, p in zip(slot.buffers, (b.data_ptr() for b in slot.buffers))]
    assert all(any(lo <= ptr < hi for lo, hi in slot_ranges) for _, ptrs in calls[0] for ptr in ptrs if ptr)
    plan = runtime.graph_plans[0]
    stats = offload_stats(m)
    assert stats.peak_resident_bytes == plan.verified.peak_bytes  # the ledger follows the slots' occupancy
    assert plan.verified.streamed_peak_bytes <= plan.pool_bytes == runtime.pool.nbytes
    assert stats.fetch_count >= len(runtime.groups) * 3  # offloading happened
    assert stats.live_device_bytes == stats.carried_bytes  # between calls only the carried copies are on the device


def test_the_pool_holds_prefetch_plus_one_slots_per_size_class():
    model, x = build_block_model(ModelSpec(16, (BlockSpec("mlp", 32),) * 6, False, True, 4, 2), 4)
    for prefetch in (1, 2):
        m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="layerwise", device="cpu", prefetch=prefetch))
        m(x)
        block_class = max(m._offload_runtime.pool.slots.values(), key=len)
        assert len(block_class) == prefetch + 1
        assert "device pool" in m._offload_runtime.describe()


def _chain(n: int, carry: bool) -> list:
    """Slot events of a layerwise chain of n same-size groups, prefetch 1; with carry, group 0 wraps around."""
    events = [("take", 0, 0, ADOPT if carry else FETCH)]
    for i in range(n):
        events.append(("take", i, i, -1))  # the wait
        if i + 1 < n:
            events.append(("take", i + 1, i + 1, FETCH))
        elif carry:
            events.append(("take", 0, 0, CARRY))
        events.append(("give", i, i, -1))
    return events


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 9])
def test_slot_plan_is_a_cyclic_coloring(n):
    same = lambda group: ("block",)  # noqa: E731
    plain = plan_slots(_chain(n, False), same)
    assert {i for _, i in plain.values()} == {0, 1}
    for i in range(n - 1):
        assert plain[i][1] != plain[i + 1][1]  # neighbours overlap: never one slot
    wrapped = plan_slots(_chain(n, True), same)
    assert len({i for _, i in wrapped.values()}) == (2 if n % 2 == 0 else 3)  # an odd cycle needs a third slot
    assert wrapped[n - 1][1] != wrapped[0][1]  # the carried copy and the last group overlap


# -- slots shared by the groups of one dtype (`passes.slots.Pooling`) ----------------------------------------

F32 = torch.float32


def _one_at_a_time(groups: list[int]) -> list:
    """Each group fetched, waited for and evicted before the next: one slot at a time."""
    events = []
    for key, group in enumerate(groups):
        events += [("take", key, group, FETCH), ("take", key, group, -1), ("give", key, group, -1)]
    return events


def test_groups_of_one_dtype_share_slots_sized_to_the_largest_copy():
    sizes = {0: ((100, F32),), 1: ((40, F32),), 2: ((70, F32),)}
    pooling, decided = choose_pooling(_one_at_a_time([0, 1, 2]), sizes.__getitem__)
    assert decided == {(F32,): True}  # one slot of 100 floats, not three of 100, 40 and 70
    slots, planned = pooling.plan(_one_at_a_time([0, 1, 2]))
    assert {index for _, index in slots.values()} == {0} and sizes_bytes(planned) == 400


def test_slots_per_size_class_where_sharing_holds_more():
    """A block copied into the head's free slot (best fit) while the head comes back: shared slots would hold
    two heads; slots per size class hold one head and one block."""
    sizes = {0: ((10, F32),), 2: ((1000, F32),)}
    events = [("take", 0, 2, FETCH), ("take", 0, 2, -1), ("give", 0, 2, -1),  # the head, alone
              ("take", 1, 0, FETCH), ("take", 1, 0, -1),  # a block, in the head's slot if shared
              ("take", 2, 2, FETCH), ("take", 2, 2, -1), ("give", 1, 0, -1), ("give", 2, 2, -1)]
    shared = Pooling(sizes.__getitem__, frozenset({(F32,)}))
    assert sizes_bytes(shared.plan(events)[1]) == 4 * 2000
    pooling, decided = choose_pooling(events, sizes.__getitem__)
    assert decided == {(F32,): False} and sizes_bytes(pooling.plan(events)[1]) == 4 * 1010


def test_a_later_graph_never_grows_a_slot_an_earlier_graph_planned():
    """Slots allocate at their first fill: a later graph's larger copy gets a new slot, a smaller one fits."""
    sizes = {0: ((40, F32),), 1: ((100, F32),), 2: ((30, F32),)}
    pooling = Pooling(sizes.__getitem__, frozenset({(F32,)}))
    _, first = pooling.plan(_one_at_a_time([0]))
    assert first == {("shared", (F32,)): [((40, F32),)]}
    slots, later = pooling.plan(_one_at_a_time([1, 2]), fixed=first)
    assert later[("shared", (F32,))] == [((40, F32),), ((100, F32),)]  # the first slot kept its size
    assert slots[0] == (1, 1) and slots[1] == (2, 0)  # the small copy fits the earlier slot (best fit)


def test_reads_carried_to_the_next_call_cost_no_slot_where_shorter_copies_can_borrow_theirs():
    """The disk tier benchmark's Llama (15 fetches, prefetch=1; layers 0, 2, 4, 7 and 9 and the head on disk) with
    prefetch_next_call: the first two reads (layers 0 and 2) are carried into the slots the next call starts
    with. The layers between borrow those slots and give them back before the carries, so the head takes a slot
    of its own among the block slots: the pool is the one without carrying (one slot of the head's size and
    three of a layer's, shared by the dtype: the small groups' copies fit them), not one layer's more."""
    from offload_compiler.passes.schedule import Use, build_schedule
    from offload_compiler.passes.slots import schedule_pool_bytes
    uses = [Use(g, g, g, key=g) for g in range(15)]
    on_disk = frozenset({1, 3, 5, 8, 10, 14})
    numel = {0: 64, 13: 1024, 14: 32768000}  # rotary's buffer, the norm, the head; the layers 11274240 each
    size = lambda group: ((numel.get(group, 11274240), F32),)  # noqa: E731
    carried = build_schedule(uses, 1, carry=True, read_ahead=on_disk)
    assert [index for index, _ in carried.carry_at] == [1, 0, 3]  # layers 0 and 2 and rotary's buffer
    alone = schedule_pool_bytes(build_schedule(uses, 1, read_ahead=on_disk), size)
    assert schedule_pool_bytes(carried, size) == alone == 4 * (32768000 + 3 * 11274240)
