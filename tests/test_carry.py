"""Prefetch wrap-around (``prefetch_next_call``): the last groups of a call fetch the first groups of the next
call. The ledger shows the copies crossing the call boundary, a changed host weight is never served stale,
and a call that takes another graph, fails, or is released gets no leftover copy."""

import copy
import warnings

import pytest
import torch

from offload_compiler import (OffloadPolicy, OffloadSavingWarning, inject_fault, offload_compile, offload_stats,
                              plan_summary, release_device_copies, remove_offload, reset_offload_stats)
from offload_compiler.api import device_weight_peak
from offload_compiler.runtime.stats import held_device_weight_bytes
from offload_compiler.testing import BlockSpec, ModelSpec, assert_offload_equivalent, build_block_model

SPEC = ModelSpec(16, (BlockSpec("mlp", 32), BlockSpec("attention", 1), BlockSpec("mlp", 16)), False, True, 4, 2)


def _offloaded(prefetch=1, **fields):
    model, x = build_block_model(SPEC, 1)
    policy = OffloadPolicy(strategy="layerwise", device="cpu", prefetch=prefetch, prefetch_next_call=True,
                           debug_poison=True, **fields)
    return model, x, offload_compile(copy.deepcopy(model), policy)


def _first_groups(m, count):
    plan = m._offload_runtime.graph_plans[0]
    return [plan.schedule.instances[i].group for i, _ in plan.schedule.carry_at][:count]


@pytest.mark.parametrize("prefetch", [1, 2])
def test_each_call_starts_with_the_copies_its_previous_call_prefetched(prefetch):
    model, x, m = _offloaded(prefetch)
    expected = model(x).detach()
    assert torch.equal(m(x), expected)
    runtime = m._offload_runtime
    first = _first_groups(m, prefetch)
    carried = sum(runtime.groups[g].nbytes for g in first)
    assert len(first) == prefetch and offload_stats(m).carried_bytes == carried == offload_stats(m).live_device_bytes
    plan = runtime.graph_plans[0]
    instances = len(plan.schedule.instances)
    for _ in range(3):
        reset_offload_stats(m)
        assert torch.equal(m(x), expected)
        stats = offload_stats(m)
        assert stats.carry_hits == prefetch  # the first fetches came from the previous call ...
        assert stats.fetch_count == instances  # ... which copied them: each group once per call, none twice
        assert stats.bytes_transferred == sum(runtime.groups[i.group].nbytes for i in plan.schedule.instances)
        assert stats.peak_resident_bytes == plan.verified.peak_bytes  # the ledger counts the carried copies
        assert stats.live_device_bytes == stats.carried_bytes == carried


def test_wrap_around_costs_the_cyclic_window_not_more():
    _, x, m = _offloaded(1)
    plain = offload_compile(build_block_model(SPEC, 1)[0], OffloadPolicy(strategy="layerwise", device="cpu"))
    m(x), plain(x)
    wrapped, unwrapped = (o._offload_runtime.graph_plans[0].verified for o in (m, plain))
    groups = m._offload_runtime.groups
    order = [groups[i.group].nbytes for i in m._offload_runtime.graph_plans[0].schedule.instances]
    cyclic = max(order[i] + order[(i + 1) % len(order)] for i in range(len(order)))
    assert wrapped.streamed_peak_bytes == cyclic >= unwrapped.streamed_peak_bytes
    assert wrapped.fetches == unwrapped.fetches


@pytest.mark.parametrize("prefetch", [1, 2])
def test_the_estimate_before_the_first_call_is_the_verified_cyclic_window(prefetch):
    """The carried copies take the slots of prefetches the call's end no longer makes: the window the estimate
    made before the graph exists counts is the verified peak of copies in flight (no extra window for them),
    and OffloadSavingWarning is raised only where the estimate is above half the model (prefetch=2 holds 3 of
    the 4 layers; prefetch=1 halves it). The memory held once planned also counts what the estimate cannot
    know before the graph exists (the routed lookup's slot, a carried copy's slot kept for it)."""
    pytest.importorskip("transformers")
    from offload_compiler.testing.models import llama
    model, inputs = llama(layers=4)
    policy = OffloadPolicy(strategy="layerwise", device="cpu", compiler="eager", prefetch=prefetch,
                           prefetch_next_call=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        m = offload_compile(model, policy)
    estimate, verified = device_weight_peak(m._offload_runtime), None
    assert estimate[1] is False
    for _ in range(3):
        m(**inputs)
        verified = device_weight_peak(m._offload_runtime)
        assert offload_stats(m).peak_resident_bytes + m._offload_runtime.unmanaged_bytes <= verified[0]
    runtime = m._offload_runtime
    in_flight = max(p.verified.peak_bytes for p in runtime.graph_plans) + runtime.unmanaged_bytes
    assert verified[1] and in_flight == estimate[0] <= verified[0] == held_device_weight_bytes(runtime)
    assert plan_summary(m)["saving"]["device_weight_peak_bytes"] == verified[0]
    warned = any(issubclass(w.category, OffloadSavingWarning) for w in record)
    total = runtime.total_bytes + runtime.unmanaged_bytes
    assert warned == (estimate[0] > 0.5 * total) == (prefetch == 2)


def test_a_weight_changed_between_calls_is_fetched_again_not_served_stale():
    model, x, m = _offloaded(1)
    m(x)
    first = _first_groups(m, 1)[0]
    name = m._offload_runtime.groups[first].slots[0].name
    with torch.no_grad():
        dict(m.named_parameters())[name].add_(0.5)  # in place: the carried copy is now stale
        dict(model.named_parameters())[name].add_(0.5)
    reset_offload_stats(m)
    assert torch.equal(m(x), model(x).detach())
    # the stale copy was dropped and fetched again: one fetch more than a steady-state call
    assert offload_stats(m).carry_hits == 0 and offload_stats(m).fetch_count == len(
        m._offload_runtime.graph_plans[0].schedule.instances) + 1
    reset_offload_stats(m)
    assert torch.equal(m(x), model(x).detach()) and offload_stats(m).carry_hits == 1  # carried again


def test_a_call_taking_another_graph_drops_the_carried_copies_first():
    model, x, m = _offloaded(1)
    other = x[:, :2].contiguous()  # another shape: dynamo compiles another graph
    for inputs in (x, other, x, other, x):
        reset_offload_stats(m)
        assert torch.equal(m(inputs), model(inputs).detach())
        stats = offload_stats(m)
        plans = m._offload_runtime.graph_plans
        assert stats.peak_resident_bytes <= max(p.verified.peak_bytes for p in plans)
        assert stats.live_device_bytes == stats.carried_bytes  # only the last graph's copies remain
    assert len(plans) >= 2


def test_graphs_alternating_within_a_call_stop_carrying():
    from test_backend import Broken  # a graph break between its blocks: two graphs per call

    model = Broken()
    x = torch.randn(2, 16)
    m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="layerwise", device="cpu",
                                                            prefetch_next_call=True))
    fetches = []
    for _ in range(6):
        reset_offload_stats(m)
        assert torch.equal(m(x), model(x).detach())
        fetches.append(offload_stats(m).fetch_count)
    assert len(m._offload_runtime.graph_plans) == 2
    assert fetches[-1] == 4  # each copy carried into the other graph was dropped unused; carrying stopped
    assert max(fetches[:2]) > 4


def test_a_failed_call_leaves_no_carried_copy_and_the_next_call_is_right():
    model, x, m = _offloaded(2)
    m(x)
    assert offload_stats(m).carried_bytes > 0
    inject_fault(m, "fetch", exception=RuntimeError("copy failed"))
    with pytest.raises(RuntimeError, match="copy failed"):
        m(torch.randn_like(x))
    assert offload_stats(m).live_device_bytes == 0 and offload_stats(m).carried_bytes == 0
    assert torch.equal(m(x), model(x).detach())


def test_release_device_copies_frees_what_waits_for_the_next_call():
    model, x, m = _offloaded(1)
    m(x)
    held = offload_stats(m).carried_bytes
    assert held > 0 and release_device_copies(m) == held
    assert offload_stats(m).live_device_bytes == 0
    reset_offload_stats(m)
    assert torch.equal(m(x), model(x).detach()) and offload_stats(m).carry_hits == 0
    restored = remove_offload(m)
    assert torch.equal(restored(x), model(x))


@pytest.mark.parametrize("strategy, extra", [("budget", {"offload_gb": 4e-6}), ("sequential", {}),
                                             pytest.param("auto", {"device_budget_gb": 0.5}, marks=pytest.mark.slow)])
def test_other_strategies_with_wrap_around(strategy, extra):
    model, x = build_block_model(SPEC, 2)
    policy = OffloadPolicy(strategy=strategy, device="cpu", prefetch_next_call=True, debug_poison=True, **extra)
    report = assert_offload_equivalent(model, policy, x, calls=3)
    assert report.bytes_transferred > 0
