"""Runtime and verification: the ledger, host masters, weight updates, and what happens to a bad schedule."""

import dataclasses

import pytest
import torch
from torch import nn

from capture import capture
from offload_compiler.offloaded import state_of
from offload_compiler import OffloadPolicy, describe_plan, offload_compile, offload_stats
from offload_compiler.backend import rewrite_graph
from offload_compiler.grouping import plan_groups
from offload_compiler.passes.analysis import weight_inputs
from offload_compiler.passes.verify import ScheduleError, verify
from offload_compiler.runtime import OffloadRuntime
from offload_compiler.testing import BlockSpec, ModelSpec, assert_offload_equivalent, build_block_model

SPEC = ModelSpec(16, (BlockSpec("mlp", 16), BlockSpec("attention", 2), BlockSpec("mlp", 8)), True, True, 4, 2)


def _move_first_evict_before_its_last_reader(gm):
    """A deliberately wrong schedule: the first evict runs before the last op that reads its weights, and
    no longer depends on it."""
    evict = next(n for n in gm.graph.nodes if n.target is torch.ops.offload_compiler.evict.default)
    last = evict.args[4][-1]
    with gm.graph.inserting_before(last):
        early = gm.graph.call_function(evict.target, evict.args[:4] + (list(evict.args[4][:-1]),))
    evict.replace_all_uses_with(early)
    gm.graph.erase_node(evict)
    gm.recompile()
    return gm


def test_verify_rejects_a_read_after_evict_and_poison_exposes_it():
    model, x = build_block_model(SPEC, 3)
    expected = model(x).detach()
    gm, example_inputs = capture(model, x)
    policy = OffloadPolicy(strategy="layerwise", device="cpu", debug_poison=True)
    runtime = OffloadRuntime(policy, plan_groups(model, policy))
    new_gm, n_out, _ = rewrite_graph(gm, example_inputs, runtime)
    weights = weight_inputs(gm, example_inputs, runtime.group_of)
    # the correct graph verifies and computes the right thing
    assert torch.equal(new_gm(*example_inputs)[0], expected)
    bad = _move_first_evict_before_its_last_reader(new_gm)
    with pytest.raises(ScheduleError, match="outside its fetch window|does not depend"):
        verify(bad, weights, {g.index: g.nbytes for g in runtime.groups})
    out = bad(*example_inputs)[0]
    assert torch.isnan(out).any(), "debug poisoning should turn a read after evict into NaN"


def test_weights_changed_after_compiling_are_used():
    for strategy in ("layerwise", "none", "budget"):
        model, x = build_block_model(SPEC, 4)
        m = offload_compile(model, OffloadPolicy(strategy=strategy, device="cpu",
                                                 offload_gb=2e-6 if strategy == "budget" else None))
        m(x)
        new_state = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in model.state_dict().items()}
        m.load_state_dict(new_state)  # copies into the host masters
        assert torch.equal(m(x), model(x).detach())
        with torch.no_grad():  # an in-place LoRA-style merge
            model.blocks[0].up.weight.add_(0.5)
            model.embed.weight.mul_(1.5)
        assert torch.equal(m(x), model(x).detach())
        model.blocks[0].down.weight.data = torch.randn_like(model.blocks[0].down.weight)  # a replaced tensor
        assert torch.equal(m(x), model(x).detach())
        model.blocks[0].down.weight.data = torch.randn_like(model.blocks[0].down.weight)  # again, once repacked
        assert torch.equal(m(x), model(x).detach())
        stats = offload_stats(m)  # the new weights reached the device: the calls moved them
        assert stats.fetch_count >= 4 and stats.bytes_transferred >= stats.streamed_bytes * 4
        m(x)  # once more with nothing replaced: each fetch checks its masters' pointers in one pass
        streamed = [g for g in state_of(m).runtime.groups if g.streamed]
        assert (streamed or strategy == "none") and all(g.pointers and len(g.pointers[0]) == len(g.leaves)
                                                         for g in streamed)


class Mixed(nn.Module):
    """Two dtypes in one block, an integer buffer, and two parameters that share one storage."""
    _layerwise_offload_blocks_attr = "blocks"

    def __init__(self):
        super().__init__()
        fused = torch.randn(8, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8).to(torch.float64)])
        self.register_buffer("steps", torch.arange(8))
        self.q = nn.Parameter(fused[:4])
        self.k = nn.Parameter(fused[4:])

    def forward(self, x):
        x = self.blocks[0](x) + self.steps
        x = self.blocks[1](x.double()).float()
        return x[:, :4] @ self.q + x[:, 4:] @ self.k


@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_mixed_dtypes_int_buffers_and_shared_storage(compiler):
    report = assert_offload_equivalent(Mixed(), OffloadPolicy(strategy="layerwise", device="cpu", compiler=compiler,
                                                              debug_poison=True), torch.randn(3, 8))
    assert report.bytes_transferred > 0


def test_plan_and_stats_describe_the_run():
    model, x = build_block_model(SPEC, 5)
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu", prefetch=1))
    m(x)
    text = describe_plan(m)
    assert "blocks.0" in text and "streamed" in text and "predicted peak" in text
    stats = offload_stats(m)
    assert stats.live_device_bytes == 0  # nothing outlives the call
    assert "moved" in str(stats) and stats.peak_resident_bytes == m._offload_runtime.graph_plans[0].verified.peak_bytes


def test_stats_show_small_figures_in_a_unit_that_shows_them_and_count_one_fetch_as_one():
    """A tiny model's routed fetch and carried copy are kilobytes: printed as "0.00 MiB in 1 routed fetches"."""
    from offload_compiler.runtime import OffloadStats
    text = str(OffloadStats(bytes_transferred=3 * 2**20, peak_resident_bytes=2**20, fetch_count=1, live_device_bytes=0,
                            resident_bytes=0, streamed_bytes=2**20, total_bytes=2**20, carried_bytes=1536,
                            carry_hits=1, routed_bytes=768, routed_fetches=1))
    assert "moved 3.000 MiB in 1 fetch;" in text
    assert "1.500 KiB prefetched for the next call (1 used)" in text
    assert "768 B in 1 routed fetch (the rows indices named)" in text and "0.00 MiB" not in text
    assert "in 2 routed fetches" in str(dataclasses.replace(OffloadStats(0, 0, 2, 0, 0, 0, 1), routed_bytes=5,
                                                            routed_fetches=2))


def test_dropping_the_model_frees_its_runtime():
    import gc
    import weakref
    model, x = build_block_model(SPEC, 6)
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu"))
    m(x)
    runtime = weakref.ref(m._offload_runtime)
    del m, model
    gc.collect()
    assert runtime() is None
