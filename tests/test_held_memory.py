"""The device memory an offloaded model holds for weights is what every claim says it is, on a device that is not
the host (`offload_compiler.testing.simulated_device`, whose allocator counts every byte).

The slot pool is allocated whole at the first call and held after it: the claims (describe_plan's saving line,
plan_summary's ``saving``, offload_stats, auto's prediction) counted only the copies in flight (the ledger's
peak), 43% of T5 where the device held 100% of it, and auto's plans held more than their device budget."""

import gc
import warnings

import pytest
import torch

from offload_compiler import OffloadPolicy, describe_plan, offload_compile, offload_plan, offload_stats, plan_summary
from offload_compiler.backend import _parked_instance
from offload_compiler.passes.slots import schedule_pool_bytes, schedule_slot_events, sized_slots, sizes_bytes
from offload_compiler.runtime import size_class
from offload_compiler.testing import simulated_device

pytest.importorskip("transformers")
from offload_compiler.testing.models import ARCHITECTURES, BUILDERS, llama  # noqa: E402

DEVICE = simulated_device()
sim = torch.get_device_module(DEVICE)
MODELS = {"t5": ARCHITECTURES["t5"], "llama": BUILDERS["llama"], "dit": BUILDERS["dit"]}


def _to_device(inputs: dict) -> dict:
    return {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in inputs.items()}


def _held_after_calls(model, inputs: dict, policy: OffloadPolicy, calls: int = 2):
    """The offloaded model and the device bytes it holds once its calls returned (their outputs freed): its
    weights' memory, allocated by offload_compile and the first call."""
    inputs = _to_device(inputs)
    gc.collect()
    sim.synchronize()
    base = sim.memory_allocated()
    m = offload_compile(model, policy)
    with torch.no_grad():
        for _ in range(calls):
            out = m(**inputs)
            del out
    gc.collect()
    sim.synchronize()
    return m, sim.memory_allocated() - base


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_claimed_device_weight_memory_is_what_the_device_holds(name):
    model, inputs = MODELS[name]()
    m, held = _held_after_calls(model, inputs, OffloadPolicy(strategy="layerwise", device=DEVICE))
    saving = plan_summary(m)["saving"]
    stats = offload_stats(m)
    assert saving["verified"] and saving["device_weight_peak_bytes"] == held
    assert stats.device_weight_bytes == stats.peak_device_weight_bytes == held
    runtime = m._offload_runtime
    assert stats.pool_bytes == saving["pool_bytes"] == runtime.pool.nbytes + runtime.transfers.routed_slot_bytes
    # the copies in flight fit in it, and are what was planned
    assert stats.peak_resident_bytes + stats.unmanaged_bytes <= held
    assert f"device weight peak {held / 2**20:.3f} MiB" in describe_plan(m)


def test_t5_blocks_of_several_sizes_share_device_slots():
    """T5's blocks differ in size (the first layers' relative attention bias, the decoder's cross-attention):
    slots per size class held prefetch + 1 copies of each, the whole model; slots shared by the groups of one
    dtype, each sized to the largest copy it takes, hold about the copies in flight."""
    model, inputs = ARCHITECTURES["t5"]()
    total = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    m, held = _held_after_calls(model, inputs, OffloadPolicy(strategy="layerwise", device=DEVICE))
    runtime = m._offload_runtime
    (plan,) = runtime.graph_plans
    per_class = sizes_bytes(sized_slots(schedule_slot_events(plan.schedule),
                                        lambda g: size_class(runtime.groups[g]))[1])
    assert runtime.pool.nbytes < 0.6 * per_class
    assert held < 0.6 * total and plan_summary(m)["saving"]["share_of_model"] < 0.6


@pytest.mark.parametrize("name,fields", [("t5", {}), ("llama", {"prefetch_next_call": True}),
                                         ("dit", {"prefetch": 2})])
def test_the_planners_pool_of_a_schedule_is_the_backends(name, fields):
    """`auto` sizes a candidate's pool from its schedule (`schedule_pool_bytes`), the backend from the rewritten
    graph's transfer ops: the same slots."""
    model, inputs = MODELS[name]()
    m, _ = _held_after_calls(model, inputs, OffloadPolicy(strategy="layerwise", device=DEVICE, **fields))
    runtime = m._offload_runtime
    for plan in runtime.graph_plans:
        routed = sum(r.bound * r.expert_bytes for r in plan.routed)
        parked = _parked_instance(plan.schedule, runtime)
        assert schedule_pool_bytes(plan.schedule, lambda g: size_class(runtime.groups[g]), parked) == (
            plan.pool_bytes - routed)


def test_auto_holds_no_more_than_its_device_budget():
    """auto's budget check counted the copies in flight: a plan within device_budget_gb=0.0009 held 1.07 MiB
    of slots. The weights it predicts are the memory the device holds between calls, and a call's peak
    (activations too) stays within the budget."""
    budget_gb = 0.0009
    budget = int(budget_gb * 2**30)
    model, inputs = llama(layers=4, hidden=64, vocab=2048)  # embedding and head larger than a block
    inputs = _to_device(inputs)
    gc.collect()
    sim.synchronize()
    base = sim.memory_allocated()
    m = offload_compile(model, OffloadPolicy(strategy="auto", device=DEVICE, device_budget_gb=budget_gb))
    with torch.no_grad():
        out = m(**inputs)
        del out
        gc.collect()
        sim.synchronize()
        sim.reset_peak_memory_stats()
        out = m(**inputs)
        del out
    gc.collect()
    sim.synchronize()
    held = sim.memory_allocated() - base
    plan = offload_plan(m)
    assert plan.predicted_weights_peak_bytes + m._offload_runtime.unmanaged_bytes == held <= budget
    assert plan_summary(m)["saving"]["device_weight_peak_bytes"] == held
    assert sim.max_memory_allocated() - base <= budget


@pytest.mark.parametrize("model_name,layers,prefetch", [("gpt2", 8, 1), ("llama", 6, 1)])
def test_the_estimate_before_the_first_call_counts_the_slots_disk_groups_are_read_ahead_into(
        tmp_path, model_name, layers, prefetch):
    """With a disk tier each group on disk is read prefetch + 1 reads ahead, holding more slots than prefetch + 1:
    the estimate before the first call counts them, and warns where they hold over half the model."""
    from offload_compiler import OffloadSavingWarning
    from offload_compiler.testing import models

    model, inputs = getattr(models, model_name)(layers=layers)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    policy = OffloadPolicy(strategy="layerwise", device=DEVICE, prefetch=prefetch, compiler="eager",
                           host_budget_gb=0.4 * total / 2**30, disk_dir=str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = offload_compile(model, policy)
    assert any(g.on_disk for g in m._offload_runtime.groups)
    before = plan_summary(m)["saving"]
    assert not before["verified"]
    with torch.no_grad():
        m(**_to_device(inputs))
    after = plan_summary(m)["saving"]
    assert after["verified"]
    # the same slots, sized before any graph exists (the pool rounds each slot's buffers up a little)
    assert before["device_weight_peak_bytes"] == pytest.approx(after["device_weight_peak_bytes"], rel=0.01)
    warned = any(issubclass(w.category, OffloadSavingWarning) for w in caught)
    assert warned == (after["share_of_model"] > 0.5)
