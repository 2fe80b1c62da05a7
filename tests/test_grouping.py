import pytest
import torch
from torch import nn

from offload_compiler import OffloadPolicy
from offload_compiler.grouping import collect_weights, discover_block_paths, plan_groups
from offload_compiler.testing import BlockSpec, ModelSpec, build_block_model
from test_reliability import Plain  # two linears, no blocks

CPU = dict(device="cpu")


class TwoLists(nn.Module):
    def __init__(self, n_double=1, n_single=3):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.double = nn.ModuleList(nn.Linear(8, 8) for _ in range(n_double))
        self.single = nn.ModuleList(nn.Linear(8, 8) for _ in range(n_single))
        self.tiny = nn.ModuleList([nn.LayerNorm(1)])
        self.scale_shift_table = nn.Parameter(torch.zeros(8))


def model(n=3):
    return build_block_model(ModelSpec(8, tuple(BlockSpec("mlp", 8) for _ in range(n)), True, True, 2, 1))[0]


def test_layerwise_groups_blocks_then_outside_weights():
    groups = plan_groups(model(3), OffloadPolicy(strategy="layerwise", **CPU))
    names = [g.name for g in groups]
    assert names[:3] == ["blocks.0", "blocks.1", "blocks.2"]
    assert set(names[3:]) == {"embed", "norm", "(root)"}  # the root's own table is a group too
    assert all(g.streamed for g in groups)
    # every weight exactly once; the tied head appears under its first name only
    weights = [w.name for g in groups for w in g.weights]
    assert len(weights) == len(set(weights)) == len(collect_weights(model(3)))


def test_blocks_per_group():
    groups = plan_groups(model(5), OffloadPolicy(strategy="layerwise", blocks_per_group=2, **CPU))
    assert [g.name for g in groups if g.is_block] == ["blocks.0-1", "blocks.2-3", "blocks.4"]


def test_discovery_finds_every_outermost_block_list():
    assert discover_block_paths(TwoLists()) == ("double", "single")  # "tiny" is under a tenth of the largest
    names = [g.name for g in plan_groups(TwoLists(), OffloadPolicy(strategy="layerwise", **CPU))]
    assert "double.0" in names and "single.2" in names and "(root)" in names and "tiny" in names


def test_declared_attr_wins_and_may_be_a_list():
    class Declared(TwoLists):
        _layerwise_offload_blocks_attr = "single"
    names = [g.name for g in plan_groups(Declared(), OffloadPolicy(strategy="layerwise", **CPU)) if g.is_block]
    assert names == ["single.0", "single.1", "single.2"]
    policy = OffloadPolicy(strategy="layerwise", blocks_attr=("double", "single"), **CPU)
    assert len([g for g in plan_groups(TwoLists(), policy) if g.is_block]) == 4


def test_model_without_blocks_names_the_attribute():
    with pytest.raises(ValueError, match="_layerwise_offload_blocks_attr.*Plain.*\\['a', 'b'\\]"):
        plan_groups(Plain(), OffloadPolicy(strategy="layerwise", **CPU))


def test_attribute_pointing_at_nothing():
    class Broken(Plain):
        _layerwise_offload_blocks_attr = "layers"
    with pytest.raises(ValueError, match="'layers'.*points at nothing.*\\['a', 'b'\\]"):
        plan_groups(Broken(), OffloadPolicy(strategy="layerwise", **CPU))
    with pytest.raises(ValueError, match="must point at the module holding the blocks"):
        plan_groups(Plain(), OffloadPolicy(strategy="layerwise", blocks_attr="a.weight", **CPU))


def test_sequential_groups_by_owning_module():
    groups = plan_groups(Plain(), OffloadPolicy(strategy="sequential", **CPU))
    assert [g.name for g in groups] == ["a", "b"] and all(g.streamed for g in groups)


def test_none_keeps_everything_resident():
    assert not any(g.streamed for g in plan_groups(model(), OffloadPolicy(strategy="none", **CPU)))


def test_budget_streams_whole_blocks_front_to_back_then_largest_others():
    m = model(4)
    block = plan_groups(m, OffloadPolicy(strategy="layerwise", **CPU))[0].nbytes
    for n_blocks in range(5):
        groups = plan_groups(m, OffloadPolicy(strategy="budget", offload_gb=n_blocks * block / 2**30, **CPU))
        streamed = [g.name for g in groups if g.streamed]
        assert streamed == [f"blocks.{i}" for i in range(n_blocks)]
    # one byte more than two blocks streams a third whole block (at least the budget, whole groups)
    groups = plan_groups(m, OffloadPolicy(strategy="budget", offload_gb=(2 * block + 1) / 2**30, **CPU))
    assert [g.name for g in groups if g.streamed] == ["blocks.0", "blocks.1", "blocks.2"]
    # past the blocks: the largest other group next
    groups = plan_groups(m, OffloadPolicy(strategy="budget", offload_gb=(4 * block + 1) / 2**30, **CPU))
    others = sorted((g for g in groups if not g.is_block), key=lambda g: -g.nbytes)
    assert [g.name for g in groups if g.streamed and not g.is_block] == [others[0].name]


def test_budget_larger_than_model_streams_everything():
    groups = plan_groups(model(), OffloadPolicy(strategy="budget", offload_gb=100, **CPU))
    assert all(g.streamed for g in groups)


def test_budget_is_deterministic():
    policy = OffloadPolicy(strategy="budget", offload_gb=3e-6, **CPU)
    first = [(g.name, g.streamed) for g in plan_groups(model(), policy)]
    assert all(first == [(g.name, g.streamed) for g in plan_groups(model(), policy)] for _ in range(3))


class WithAnEmptyPart(nn.Module):
    """Three blocks, a head, and a part whose only weight has no elements: a group of 0 bytes."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.empty = nn.Module()
        self.empty.w = nn.Parameter(torch.empty(0))
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x) + self.empty.w.sum()


@pytest.mark.parametrize("strategy", ["layerwise", "sequential"])
def test_a_group_of_no_bytes_is_never_fetched_nor_shown_as_streamed(strategy):
    """A group of 0 bytes was streamed: a fetch in the plan, the verifier and the ledger that moved nothing."""
    from offload_compiler import describe_plan, offload_compile, offload_stats, reset_offload_stats
    from offload_compiler.offloaded import state_of
    x = torch.randn(2, 8)
    plain = WithAnEmptyPart()
    expected = plain(x)
    (empty,) = [g for g in plan_groups(plain, OffloadPolicy(strategy=strategy, **CPU)) if g.nbytes == 0]
    assert not empty.streamed
    m = offload_compile(plain, OffloadPolicy(strategy=strategy, **CPU))
    with torch.no_grad():
        m(x)
        reset_offload_stats(m)
        assert torch.equal(m(x), expected)
    runtime = state_of(m).runtime
    streamed = [g for g in runtime.groups if g.streamed]
    assert all(g.nbytes > 0 for g in streamed) and len(streamed) == len(runtime.groups) - 1
    (plan,) = runtime.graph_plans
    assert offload_stats(m).fetch_count == plan.verified.fetches == len(streamed)
    (row,) = [line for line in describe_plan(m).splitlines() if " empty " in line]
    assert "0 B" in row and "streamed" not in row and "never fetched" in row


def test_a_small_group_shows_its_bytes_not_zero_mib():
    from offload_compiler import describe_plan, offload_compile
    m = offload_compile(WithAnEmptyPart(), OffloadPolicy(strategy="layerwise", **CPU))
    (row,) = [line for line in describe_plan(m).splitlines() if " head " in line]
    assert "288 B  streamed" in row and "0.000 MiB" not in row
