"""A module shared by several blocks (one object, or modules whose weights are all tied: Zamba2's shared
attention) is a group of its own: each block fetches its own weights and the shared group where it calls it,
the estimate before the first call is what the plan holds, and the saving warning never suggests the plan in
effect."""

import copy
import warnings

import pytest
from devices import host_and
import torch
from torch import nn

from offload_compiler import OffloadPolicy, OffloadSavingWarning, offload_compile, plan_summary, reset_offload_stats
from offload_compiler.grouping import Block, plan_groups, shared_modules
from offload_compiler.testing import (BlockSpec, ModelSpec, assert_offload_equivalent, assert_traffic_matches_plan,
                                      build_block_model, simulated_device)

H = 32


class Layer(nn.Module):
    def __init__(self, shared: nn.Module | None):
        super().__init__()
        self.own = nn.Linear(H, H)
        self.extra = nn.Linear(H, H)  # a layer is a block of several layers (what the stack discovery wants)
        if shared is not None:
            self.shared = shared  # the same object in every layer that calls it

    def forward(self, x):
        if hasattr(self, "shared"):
            x = x + self.shared(x)
        return self.extra(torch.relu(self.own(x)))


class SharedModel(nn.Module):
    """Eight layers; one MLP object, as large as three layers, called by the layers in ``users``."""

    def __init__(self, users=(1, 5)):
        super().__init__()
        shared = nn.Sequential(nn.Linear(H, 3 * H), nn.ReLU(), nn.Linear(3 * H, H))
        self.layers = nn.ModuleList(Layer(shared if i in users else None) for i in range(8))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _model(users=(1, 5)):
    torch.manual_seed(0)
    return SharedModel(users).eval(), torch.randn(2, H)


def _nbytes(module):
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _offloaded(model, device="cpu", **fields):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="layerwise", device=device, compiler="eager",
                                                                prefetch=1, **fields))
    return m, [str(w.message) for w in caught if issubclass(w.category, OffloadSavingWarning)]


def test_a_shared_module_is_its_own_group_named_by_its_first_path():
    model, _ = _model()
    groups = {g.name: g for g in plan_groups(model, OffloadPolicy(strategy="layerwise", device="cpu"))}
    shared = groups["layers.1.shared"]
    assert shared.nbytes == _nbytes(model.layers[1].shared) and shared.users == ("layers.1", "layers.5")
    assert groups["layers.1"].nbytes == _nbytes(model.layers[1]) - shared.nbytes
    assert groups["layers.5"].nbytes == _nbytes(model.layers[5]) - shared.nbytes  # named under layers.1 only


@pytest.mark.parametrize("device", host_and(simulated_device()))
def test_each_block_fetches_its_own_weights_and_the_shared_group_where_it_calls_it(device):
    model, x = _model()
    total = _nbytes(model)
    shared = _nbytes(model.layers[1].shared)
    m, said = _offloaded(model, device)
    estimate = plan_summary(m)["saving"]
    assert not estimate["verified"]
    with torch.no_grad():
        expected = model(x)
        assert torch.equal(m(x.to(device)).cpu(), expected)
        reset_offload_stats(m)
        assert torch.equal(m(x.to(device)).cpu(), expected)
    stats = assert_traffic_matches_plan(m)
    assert (stats.bytes_transferred, stats.fetch_count) == (total + shared, 10)  # eight layers, the shared group twice
    planned = plan_summary(m)["saving"]
    assert planned["verified"] and planned["share_of_model"] <= 0.5
    # before the first call the estimate (and so the warning) is what the plan holds
    assert estimate["device_weight_peak_bytes"] == planned["device_weight_peak_bytes"]
    assert not said
    policy = OffloadPolicy(strategy="layerwise", device=device, compiler="eager", prefetch=1)
    assert_offload_equivalent(model, policy, x, atol=0, rtol=0)  # the ledger's peak is the verified one


def test_a_module_three_blocks_call_is_held_across_them_and_the_estimate_counts_it():
    model, x = _model(users=(0, 3, 6))
    m, _ = _offloaded(model)
    estimate = plan_summary(m)["saving"]["device_weight_peak_bytes"]
    with torch.no_grad():
        assert torch.equal(m(x), model(x))
        reset_offload_stats(m)
        m(x)
    stats = assert_traffic_matches_plan(m)
    assert (stats.bytes_transferred, stats.fetch_count) == (_nbytes(model), 9)  # fetched once, held over its span
    assert plan_summary(m)["saving"]["device_weight_peak_bytes"] == estimate


def test_tied_weights_are_no_shared_module():
    model, _ = build_block_model(ModelSpec(8, (BlockSpec("mlp", 16), BlockSpec("mlp", 16)), tied_head=True, parent_table=False,
                                           seq=3, batch=1))
    stack = next(name for name, module in model.named_modules() if isinstance(module, nn.ModuleList))
    blocks = [Block(f"{stack}.{name}", stack) for name, _ in model.get_submodule(stack).named_children()]
    assert shared_modules(model, blocks) == {}


class Dominant(nn.Module):
    """Two blocks; the second mostly its own weight, and a list of two small sub-blocks that the plan splits
    along already: what is left of it stays over half the model."""

    class Big(nn.Module):
        def __init__(self):
            super().__init__()
            self.wide = nn.Linear(H, 16 * H)
            self.narrow = nn.Linear(16 * H, H)
            self.inner = nn.ModuleList(nn.Sequential(nn.Linear(H, H), nn.Linear(H, H)) for _ in range(2))

        def forward(self, x):
            for sub in self.inner:
                x = sub(x)
            return self.narrow(torch.relu(self.wide(x)))

    class Small(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(H, H), nn.Linear(H, H)

        def forward(self, x):
            return self.b(self.a(x))

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([self.Small(), self.Big()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_the_saving_warning_never_suggests_the_plan_in_effect():
    torch.manual_seed(0)
    model = Dominant().eval()
    policy = OffloadPolicy(strategy="layerwise", device="cpu")
    names = [g.name for g in plan_groups(model, policy)]
    assert "blocks.1.inner.0" in names  # split along the list already
    _, said = _offloaded(model)
    assert len(said) == 1
    assert "blocks_attr=(" not in said[0] and "blocks.1.inner apart already" in said[0]


def _zamba2():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Zamba2Config"):
        pytest.skip("this transformers has no Zamba2")
    torch.manual_seed(0)
    cfg = transformers.Zamba2Config(
        vocab_size=128, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4,
        mamba_d_state=8, mamba_headdim=16, n_mamba_heads=8, mamba_ngroups=1, intermediate_size=128,
        hybrid_layer_ids=[1, 4], layers_block_type=["linear_attention", "hybrid", "linear_attention",
                                                     "linear_attention", "hybrid", "linear_attention"],
        chunk_size=8, use_mem_rope=True, max_position_embeddings=128, num_mem_blocks=1, adapter_rank=8,
        mamba_d_conv=4, mamba_expand=2)
    return transformers.Zamba2ForCausalLM(cfg).eval(), torch.randint(3, 128, (1, 10))


def test_zamba2_shared_attention_streams_once_per_hybrid_layer_and_saves_what_it_says():
    model, ids = _zamba2()
    shared = model.model.layers[1].shared_transformer
    m, said = _offloaded(model)
    estimate = plan_summary(m)["saving"]["device_weight_peak_bytes"]
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        assert torch.equal(m(ids, use_cache=False).logits, expected)
        reset_offload_stats(m)
        assert torch.equal(m(ids, use_cache=False).logits, expected)
    stats = assert_traffic_matches_plan(m)
    groups = {g["name"]: g for g in plan_summary(m)["groups"]}
    assert groups["model.layers.1.shared_transformer"]["bytes"] == _nbytes(shared)
    total = sum(g["bytes"] for g in groups.values())
    # every weight once, the shared block once more (its second hybrid layer), the tied embedding once more (head)
    assert stats.bytes_transferred == total + _nbytes(shared) + groups["model.embed_tokens"]["bytes"]
    planned = plan_summary(m)["saving"]
    assert planned["share_of_model"] <= 0.5 and planned["device_weight_peak_bytes"] == estimate
    assert not said
