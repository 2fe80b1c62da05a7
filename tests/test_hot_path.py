"""The per-group host work after verification: eagerly, direct runtime calls over ready-made views; under
inductor, one fused transfer op per wait. Both run exactly the verified plan: same fetches, bytes and peak."""

from __future__ import annotations

import copy
import operator

import pytest
import torch

from offload_compiler import OffloadPolicy, offload_compile, offload_stats, reset_offload_stats
from offload_compiler.backend import rewrite_graph
from offload_compiler.grouping import plan_groups
from offload_compiler.lowering import lower_for_eager
from offload_compiler.passes.fuse import EVICT, PREFETCH, fuse_transfers
from offload_compiler.runtime import OffloadRuntime
from offload_compiler.testing import BlockSpec, ModelSpec, build_block_model

OPS = torch.ops.offload_compiler
SPEC = ModelSpec(16, (BlockSpec("mlp", 32), BlockSpec("attention", 1), BlockSpec("mlp", 16)), False, True, 4, 2)


def _rewritten(policy: OffloadPolicy, prepare=lambda model: model):
    from capture import capture
    model, x = build_block_model(SPEC, 5)
    model = prepare(model)
    gm, inputs = capture(model, x)
    runtime = OffloadRuntime(policy, plan_groups(model, policy), pack_now=False)
    new_gm, num_outputs, plan = rewrite_graph(gm, inputs, runtime)
    return new_gm, num_outputs, plan, runtime


def _count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is target)


@pytest.mark.parametrize("prefetch", [1, 2])
def test_fusing_folds_every_evict_and_prefetch_before_a_wait_into_it(prefetch):
    gm, _, plan, _ = _rewritten(OffloadPolicy(strategy="layerwise", device="cpu", prefetch=prefetch))
    waits, evicts, prefetches = (_count(gm, op) for op in (OPS.wait.default, OPS.evict.default, OPS.prefetch.default))
    last_wait = max(i for i, n in enumerate(gm.graph.nodes) if n.target is OPS.wait.default)
    evicts_after_last_wait = sum(1 for i, n in enumerate(gm.graph.nodes)
                                 if n.target is OPS.evict.default and i > last_wait)
    fused = fuse_transfers(copy.deepcopy(gm))
    transfers = [n for n in fused.graph.nodes if n.target is OPS.transfer.default]
    assert len(transfers) == waits == plan.verified.fetches
    assert _count(fused, OPS.wait.default) == 0 and _count(fused, OPS.prefetch.default) == 0
    assert _count(fused, OPS.evict.default) == evicts_after_last_wait  # nothing left to fold them into
    steps = [t.args[1][i:i + 4] for t in transfers for i in range(0, len(t.args[1]), 4)]
    assert sum(1 for s in steps if s[0] == PREFETCH) == prefetches
    assert sum(1 for s in steps if s[0] == EVICT) == evicts - evicts_after_last_wait
    # the fetch keys are those of the verified graph, in its order
    assert [(t.args[2], t.args[3]) for t in transfers] == [
        n.args[1:3] for n in gm.graph.nodes if n.target is OPS.wait.default]
    for earlier, later in zip(transfers, transfers[1:]):  # each fused op ordered after the previous one by data
        assert any(d.op == "call_function" and d.target is operator.getitem and d.args[0] is earlier
                   for d in later.args[4])


def test_eager_lowering_leaves_no_op_and_no_view_per_weight():
    gm, num_outputs, plan, runtime = _rewritten(OffloadPolicy(strategy="layerwise", device="cpu"))
    views_before = _count(gm, torch.ops.aten.as_strided.default)
    lowered = lower_for_eager(copy.deepcopy(gm), runtime, num_outputs)
    targets = {n.target for n in lowered.graph.nodes if n.op == "call_function"}
    assert not targets & {OPS.prefetch.default, OPS.wait.default, OPS.evict.default, OPS.resident.default}
    assert _count(lowered, torch.ops.aten.as_strided.default) == 0 < views_before
    names = [getattr(n.target, "__name__", "") for n in lowered.graph.nodes if n.op == "call_function"]
    assert names.count("offload_wait") == plan.verified.fetches


def test_eager_lowering_reads_quantized_weights_rebuilt_once_per_slot():
    quantization = pytest.importorskip("torchao.quantization")
    from offload_compiler.subclasses import rebuild_weight
    int8 = lambda model: quantization.quantize_(model, quantization.Int8WeightOnlyConfig()) or model  # noqa: E731
    gm, num_outputs, plan, runtime = _rewritten(OffloadPolicy(strategy="layerwise", device="cpu"), int8)
    assert _count(gm, rebuild_weight) > 0
    lowered = lower_for_eager(copy.deepcopy(gm), runtime, num_outputs)
    assert _count(lowered, rebuild_weight) == 0 and _count(lowered, torch.ops.aten.as_strided.default) == 0


@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_lean_paths_move_the_planned_bytes_with_views_made_once(compiler):
    model, x = build_block_model(SPEC, 5)
    expected = model(x).detach()
    m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="layerwise", device="cpu", compiler=compiler,
                                                           debug_poison=True))
    with torch.no_grad():
        assert torch.allclose(m(x), expected, atol=1e-5)  # debug_poison: a read after an evict would be NaN
        runtime = m._offload_runtime
        views = {id(slot): dict(slot._views) for slots in runtime.pool.slots.values() for slot in slots}
        reset_offload_stats(m)
        for _ in range(3):
            assert torch.allclose(m(x), expected, atol=1e-5)
    stats = offload_stats(m)
    plan = runtime.graph_plans[0]
    assert stats.fetch_count == 3 * plan.verified.fetches
    assert stats.bytes_transferred == 3 * sum(g.nbytes for g in runtime.groups if g.streamed)
    assert stats.peak_resident_bytes == plan.verified.peak_bytes
    after = {id(slot): dict(slot._views) for slots in runtime.pool.slots.values() for slot in slots}
    if compiler == "eager":  # the same view objects every call: none made per fetch
        assert after == views and any(views.values())
    else:
        assert not any(after.values())  # inductor views the buffers itself (reinterpret_tensor)
