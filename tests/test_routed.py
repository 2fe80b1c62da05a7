"""Routed fetch (issue 27): an expert weight read only by router indices (transformers' ``batched_mm`` experts)
moves the experts the router named, bounded by a slot sized from the graph's shapes; a graph whose bound is
every expert (prefill) fetches them whole. Outputs equal the plain model's and the traffic is checked against
the plan's bound."""

import copy

import pytest
import torch
from torch import nn

from offload_compiler import OffloadPolicy, offload_compile, offload_groups
from offload_compiler.api import describe_plan, offload_stats, reset_offload_stats
from offload_compiler.testing import assert_traffic_matches_plan

E, TOP_K, H, I = 16, 2, 32, 16


class Experts(nn.Module):
    """Fused experts as transformers 5 keeps them, computed as its ``batched_mm`` implementation does."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H) / H ** 0.5)
        self.down_proj = nn.Parameter(torch.randn(E, H, I) / I ** 0.5)

    def forward(self, x, top_k_index, top_k_weights):
        ids = top_k_index.reshape(-1)
        xs = x.repeat_interleave(TOP_K, dim=0)
        gate, up = torch.bmm(self.gate_up_proj[ids], xs.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
        out = torch.bmm(self.down_proj[ids], (torch.nn.functional.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        return (out * top_k_weights.reshape(-1, 1)).view(x.shape[0], TOP_K, H).sum(1)


class GroupedExperts(Experts):
    """The same experts computed as transformers' ``grouped_mm`` implementation does: tokens sorted by expert,
    the whole 3-D weight (transposed) read by ``grouped_mm`` with each expert's cumulative token count."""

    def forward(self, x, top_k_index, top_k_weights):
        ids, order = torch.sort(top_k_index.reshape(-1))
        xs = x[order // TOP_K]
        offs = torch.cumsum(torch.histc(ids.float(), bins=E, min=0, max=E - 1), dim=0, dtype=torch.int32)
        gate, up = torch.nn.functional.grouped_mm(xs, self.gate_up_proj.transpose(-2, -1), offs=offs).chunk(2, -1)
        out = torch.nn.functional.grouped_mm(torch.nn.functional.silu(gate) * up,
                                             self.down_proj.transpose(-2, -1), offs=offs)
        out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, order // TOP_K, out)


class Block(nn.Module):
    def __init__(self, experts=Experts) -> None:
        super().__init__()
        self.proj = nn.Linear(H, H)
        self.router = nn.Linear(H, E, bias=False)
        self.experts = experts()

    def forward(self, x):
        x = x + self.proj(x)
        weights, index = torch.topk(self.router(x).softmax(-1), TOP_K, dim=-1)
        return x + self.experts(x, index, weights)


class TinyMoE(nn.Module):
    def __init__(self, layers: int = 2, experts=Experts) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block(experts) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _policy(**kw):
    kw.setdefault("device", "cpu")
    return OffloadPolicy(strategy="layerwise", debug_poison=True, **kw)


def test_decode_fetches_only_routed_experts_prefill_fetches_whole():
    model = TinyMoE()
    plain = copy.deepcopy(model)
    m = offload_compile(model, _policy())
    expert_bytes = sum(p.numel() * 4 for n, p in plain.named_parameters() if "experts" in n)
    other_bytes = sum(p.numel() * 4 for n, p in plain.named_parameters() if "experts" not in n)

    one = torch.randn(1, H)  # decode: 1 token x top_k 2 = 2 of 16 experts at most
    with torch.no_grad():
        assert torch.equal(m(one), plain(one))
    reset_offload_stats(m)
    with torch.no_grad():
        assert torch.equal(m(one), plain(one))
    stats = assert_traffic_matches_plan(m)
    decode_plan = m._offload_runtime.graph_plans[0]
    assert stats.peak_resident_bytes == decode_plan.verified.streamed_peak_bytes  # the slot counted as verified
    assert 0 < stats.routed_bytes <= TOP_K / E * expert_bytes
    assert stats.bytes_transferred == other_bytes + stats.routed_bytes
    assert stats.routed_fetches == 2 * len(plain.layers)
    assert stats.calls == 1 and stats.expert_bytes_per_call == stats.expert_bytes == stats.routed_bytes
    plan = describe_plan(m)
    assert f"routed layers.0.experts.gate_up_proj: at most {TOP_K} of {E} experts" in plan
    assert f"routed layers.1.experts.down_proj: at most {TOP_K} of {E} experts" in plan

    many = torch.randn(8, H)  # prefill: 8 tokens x 2 >= 16 experts: fetched whole
    reset_offload_stats(m)
    with torch.no_grad():
        assert torch.equal(m(many), plain(many))
    stats = assert_traffic_matches_plan(m)
    assert stats.routed_fetches == 0 and stats.bytes_transferred == expert_bytes + other_bytes
    assert stats.expert_bytes_per_call == expert_bytes
    assert "whole layers.0.experts" in describe_plan(m)


def test_grouped_mm_decode_fetches_only_experts_with_tokens_offsets_remapped():
    """``grouped_mm`` experts: the graph reads the whole (transposed) weight with offsets; a call whose rows
    (tokens x top_k) are fewer than the experts copies the experts with tokens into that many rows and remaps
    the offsets (experts without tokens become empty groups). 3 tokens: at most 6 of 16 experts, the groups
    between them empty. (bf16: what a compiled ``F.grouped_mm`` takes.)"""
    plain = TinyMoE(experts=GroupedExperts).to(torch.bfloat16)
    expert_bytes = sum(p.numel() * 2 for n, p in plain.named_parameters() if "experts" in n)
    other_bytes = sum(p.numel() * 2 for n, p in plain.named_parameters() if "experts" not in n)
    per_expert = expert_bytes // (E * len(plain.layers))
    m = offload_compile(copy.deepcopy(plain), _policy())
    for tokens in (3, 1):  # (3 first: a later count but 1 would recompile with a symbolic one, fetched whole)
        x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens), dtype=torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(m(x), plain(x))  # (the first call compiles)
            reset_offload_stats(m)
            assert torch.equal(m(x), plain(x))
        stats = assert_traffic_matches_plan(m)
        with torch.no_grad():  # the experts the router picks, layer by layer
            h, named = x, 0
            for layer in plain.layers:
                h = h + layer.proj(h)
                named += torch.topk(layer.router(h).softmax(-1), TOP_K, dim=-1).indices.unique().numel()
                h = h + layer.experts(h, *torch.topk(layer.router(h).softmax(-1), TOP_K, dim=-1)[::-1])
        assert stats.routed_bytes == named * per_expert  # exactly the experts with tokens, each once
        assert stats.bytes_transferred == other_bytes + stats.routed_bytes
        assert stats.routed_fetches == 2 * len(plain.layers)
        assert f"at most {tokens * TOP_K} of {E} experts per call" in describe_plan(m)
    assert "offsets remapped" in describe_plan(m)  # (a prefill fetching whole: the transformers models' test)


def test_groups_split_the_experts_from_their_block():
    from offload_compiler.grouping import plan_groups
    names = [g.name for g in plan_groups(TinyMoE(), _policy())]
    assert names == ["layers.0", "layers.0.experts", "layers.1", "layers.1.experts"]


@pytest.mark.parametrize("strategy, on_sim", [("budget", False), ("budget", True),
                                               pytest.param("auto", False, marks=pytest.mark.slow)])  # auto: ~10 s
def test_budget_and_auto_route_the_experts_they_stream(strategy, on_sim):
    """``budget`` and ``auto`` split each block's experts into a group of their own as ``layerwise`` does: the
    expert groups they stream are fetched routed at decode (top_k of E experts), so a decode moves less than
    the streamed groups whole, and the slot held for them is the routed bound."""
    model = TinyMoE(layers=4)
    plain = copy.deepcopy(model)
    model_bytes = sum(p.numel() * 4 for p in plain.parameters())
    expert_bytes = sum(p.numel() * 4 for n, p in plain.named_parameters() if "experts" in n)
    budget = {"budget": dict(offload_gb=0.5 * model_bytes / 2**30),
              "auto": dict(device_budget_gb=0.5 * model_bytes / 2**30)}[strategy]
    from offload_compiler.testing import simulated_device
    device = simulated_device() if on_sim else "cpu"
    m = offload_compile(model, OffloadPolicy(strategy=strategy, device=device, debug_poison=True, **budget))
    one = torch.randn(1, H)
    for _ in range(2):  # auto plans at its first calls
        with torch.no_grad():
            m(one.to(device))
    groups = offload_groups(m)
    assert [g.name for g in groups if g.name.endswith("experts")] == [f"layers.{i}.experts" for i in range(4)]
    streamed_experts = sum(g.nbytes for g in groups if g.name.endswith("experts") and g.streamed)
    assert streamed_experts > 0
    reset_offload_stats(m)
    with torch.no_grad():
        assert torch.equal(m(one.to(device)).cpu(), plain(one))
    stats = assert_traffic_matches_plan(m, resident_filled=True)  # resident groups were filled at call 1
    assert 0 < stats.routed_bytes <= TOP_K / E * streamed_experts
    assert stats.expert_bytes == stats.routed_bytes < streamed_experts <= expert_bytes


_LM = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
           max_position_embeddings=128)
# tiny random-weight MoE decoders, 16 experts: (config class, model class, fields naming the experts and top_k)
MOE_MODELS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  lambda k: dict(head_dim=16, num_experts=16, num_experts_per_tok=k, moe_intermediate_size=32,
                                 decoder_sparse_step=1)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", lambda k: dict(num_experts=16, num_experts_per_tok=k)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", lambda k: dict(num_local_experts=16, num_experts_per_tok=k)),
}


def _moe(name: str, top_k: int, layers: int = 2, implementation: str = "batched_mm"):
    transformers = pytest.importorskip("transformers")
    config_class, model_class, fields = MOE_MODELS[name]
    config = getattr(transformers, config_class)(**_LM, num_hidden_layers=layers, **fields(top_k))
    # batched_mm: experts gathered by router indices; grouped_mm: read with offsets (both route)
    config._experts_implementation = implementation
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config).eval()


def decode_bytes(m, ids: torch.Tensor, plain=None) -> tuple[int, object]:
    """Bytes one decode token moves (batch 1, after a prefill of ``ids``), and the stats of that call; with
    ``plain``, the token's logits equal the plain model's."""
    with torch.no_grad():
        out = m(input_ids=ids, use_cache=True)
        reset_offload_stats(m)
        token = out.logits[:, -1:].argmax(-1)
        got = m(input_ids=token, past_key_values=out.past_key_values, use_cache=True).logits
        if plain is not None:
            before = plain(input_ids=ids, use_cache=True)
            expected = plain(input_ids=token, past_key_values=before.past_key_values, use_cache=True).logits
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    stats = assert_traffic_matches_plan(m)
    return stats.bytes_transferred, stats


@pytest.mark.slow
@pytest.mark.parametrize("name, top_k, compiler, implementation", [
    ("qwen3_moe", 2, "eager", "batched_mm"), ("qwen3_moe", 4, "eager", "batched_mm"),
    ("olmoe", 2, "eager", "batched_mm"), ("mixtral", 2, "eager", "batched_mm"),
    pytest.param("qwen3_moe", 2, "inductor", "batched_mm", marks=pytest.mark.trial),
    ("qwen3_moe", 2, "eager", "grouped_mm"), ("olmoe", 2, "eager", "grouped_mm"),
    ("mixtral", 2, "eager", "grouped_mm"),
    pytest.param("qwen3_moe", 2, "inductor", "grouped_mm", marks=pytest.mark.trial)])
def test_moe_decode_moves_top_k_experts_and_generates_the_same_tokens(name, top_k, compiler, implementation):
    model = _moe(name, top_k, implementation=implementation)
    plain = copy.deepcopy(model)
    expert_bytes = sum(p.numel() * 4 for n, p in plain.named_parameters() if ".experts." in n)
    other_bytes = sum(p.numel() * 4 for n, p in plain.named_parameters() if ".experts." not in n)
    assert expert_bytes > 0
    m = offload_compile(model, _policy(compiler=compiler))
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))

    with torch.no_grad():  # prefill (12 tokens x top_k >= 16 experts): whole fetches, same logits
        got, expected = m(input_ids=ids).logits, plain(input_ids=ids).logits
    if compiler == "eager":
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    assert "    whole model.layers.0." in describe_plan(m)

    moved, stats = decode_bytes(m, ids, plain)
    target = other_bytes + top_k / 16 * expert_bytes
    assert moved <= 1.1 * target, f"decode moved {moved} B per token, target {target:.0f} B"
    # two expert weights per layer, and the token embedding's one row (a lookup: `test_lookup_tables.py`)
    row = plain.get_input_embeddings().weight[0].nbytes
    assert stats.routed_fetches == 2 * 2 + 1 and row < stats.routed_bytes <= top_k / 16 * expert_bytes + row
    assert 0 < stats.expert_bytes <= top_k / 16 * expert_bytes
    assert f"at most {top_k} of 16 experts per call" in describe_plan(m)

    if (name, top_k) == ("qwen3_moe", 2):  # many decode steps, once per expert kernel (about 5 s each)
        with torch.no_grad():
            expected = plain.generate(ids, max_new_tokens=6, do_sample=False)
            assert torch.equal(m.generate(ids, max_new_tokens=6, do_sample=False), expected)


@pytest.mark.slow  # two inductor compiles
def test_inductor_routes_decode_and_fetches_prefill_whole():
    """Under inductor too: the routed op is an extern call whose result is a fresh tensor, and the prefill's
    gathered expert weights feed bmm, which inductor may decompose (so their gather is materialized)."""
    model = TinyMoE()
    plain = copy.deepcopy(model)
    m = offload_compile(model, _policy(compiler="inductor"))
    for tokens, routed in [(8, 0), (1, 2 * len(plain.layers))]:
        x = torch.randn(tokens, H)
        reset_offload_stats(m)
        with torch.no_grad():
            torch.testing.assert_close(m(x), plain(x))
        assert assert_traffic_matches_plan(m).routed_fetches == routed


def test_routed_fetch_on_the_simulated_accelerator():
    """On a device that is not the host (its checker enforces the stream rules): the router's indices are read
    back to the host, the experts named copied into the device slot, and a host tensor never meets the op."""
    from offload_compiler.testing import simulated_device
    device = simulated_device()
    model = TinyMoE()
    plain = copy.deepcopy(model)
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device=device, debug_poison=True))
    for tokens, routed in [(1, 4), (1, 4), (8, 0)]:
        x = torch.randn(tokens, H)
        reset_offload_stats(m)
        with torch.no_grad():
            torch.testing.assert_close(m(x.to(device)).cpu(), plain(x), atol=0, rtol=0)
        assert assert_traffic_matches_plan(m).routed_fetches == routed


def test_grouped_mm_routed_fetch_on_the_simulated_accelerator():
    """``grouped_mm`` experts on a device that is not the host: the offsets are read back to the host, the
    experts with tokens copied into the device rows and the remapped offsets handed back on the device."""
    from offload_compiler.testing import simulated_device
    device = simulated_device()
    plain = TinyMoE(experts=GroupedExperts).to(torch.bfloat16)
    m = offload_compile(copy.deepcopy(plain), OffloadPolicy(strategy="layerwise", device=device, debug_poison=True))
    for tokens in (3, 1):
        x = torch.randn(tokens, H, dtype=torch.bfloat16)
        reset_offload_stats(m)
        with torch.no_grad():
            assert torch.equal(m(x.to(device)).cpu(), plain(x))
        assert assert_traffic_matches_plan(m).routed_fetches == 2 * len(plain.layers)


@pytest.mark.parametrize("on_sim", [False, True])
@pytest.mark.parametrize("from_checkpoint", [False, True])
def test_routed_experts_on_disk_are_read_expert_by_expert(tmp_path, from_checkpoint, on_sim):
    """With the expert groups on disk (host_budget_gb), a decode step reads only the named experts' bytes from
    the file (a group in its own file, or the checkpoint's own extents), never the whole group."""
    from safetensors.torch import save_file
    from offload_compiler import empty_weights
    plain = TinyMoE()
    expert_group = sum(p.numel() * 4 for n, p in plain.layers[0].named_parameters() if "experts" in n)
    budget = sum(p.numel() * 4 for p in plain.parameters()) - 2 * expert_group  # both expert groups on disk
    from offload_compiler.testing import simulated_device
    device = simulated_device() if on_sim else "cpu"
    policy = _policy(host_budget_gb=budget / 2**30, disk_dir=str(tmp_path), device=device)
    if from_checkpoint:
        save_file(plain.state_dict(), str(tmp_path / "moe.safetensors"))
        with empty_weights():
            model = TinyMoE()
        m = offload_compile(model, policy, checkpoint=tmp_path / "moe.safetensors")
    else:
        m = offload_compile(copy.deepcopy(plain), policy)
    runtime = m._offload_runtime
    assert sorted(g.name for g in runtime.groups if g.on_disk) == ["layers.0.experts", "layers.1.experts"]
    one = torch.randn(1, H)
    with torch.no_grad():
        expected = plain.requires_grad_(False)(one)
        torch.testing.assert_close(m(one.to(device)).cpu(), expected)
        reset_offload_stats(m)
        got = m(one.to(device)).cpu()
        assert torch.equal(got, expected) if not on_sim else torch.allclose(got, expected, atol=1e-6)
    stats = offload_stats(m)
    per_expert = (2 * I * H + H * I) * 4
    assert stats.disk_bytes_read == stats.routed_bytes <= 2 * TOP_K * per_expert  # 2 layers x top_k experts
    assert stats.routed_bytes > 0


@pytest.mark.slow  # eager ~15 s, inductor ~50 s: a prefill, a decode step and two 6-token generates
@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.trial)])
def test_qwen3_omni_moe_thinker_decode_routes_its_text_experts(compiler):
    """The Qwen3-Omni-MoE thinker (audio and vision encoders, a mixture-of-experts text model of 16 experts,
    top_k 2): under layerwise a decode token at batch 1 moves the text model's non-expert weights and the
    experts the router named, within 1.1 x the target; ``generate`` gives the plain model's tokens."""
    pytest.importorskip("transformers")
    from offload_compiler.testing.omni_models import omni_moe_thinker
    model = omni_moe_thinker(experts=16, top_k=2)
    plain = copy.deepcopy(model)
    # the text model: thinker.model.language_model from transformers 5.21, thinker.model before (the encoders
    # then sit beside it on the thinker)
    lm = "model.language_model." if hasattr(plain.model, "language_model") else "model."
    text = {n: p.numel() * 4 for n, p in plain.named_parameters()
            if n.startswith((lm, "lm_head."))}  # what text decode reads (no encoder)
    expert_bytes = sum(b for n, b in text.items() if ".mlp.experts." in n)
    other_bytes = sum(b for n, b in text.items() if ".mlp.experts." not in n)
    assert expert_bytes > other_bytes
    m = offload_compile(model, _policy(compiler=compiler))
    ids = torch.randint(128, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, expected = m(input_ids=ids).logits, plain(input_ids=ids).logits
    if compiler == "eager":
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)

    moved, stats = decode_bytes(m, ids)
    target = other_bytes + 2 / 16 * expert_bytes
    assert moved <= 1.1 * target, f"decode moved {moved} B per token, target {target:.0f} B"
    assert moved < other_bytes + expert_bytes / 2  # (every expert fetched whole would move 3.3x the target)
    # two expert weights per layer, and the token embedding's one row (a lookup: `test_lookup_tables.py`)
    assert stats.routed_fetches == 2 * 2 + 1 and 0 < stats.expert_bytes <= 2 / 16 * expert_bytes
    assert f"routed {lm}layers.0.mlp.experts.gate_up_proj: at most 2 of 16" in describe_plan(m)

    with torch.no_grad():
        expected = plain.generate(ids, max_new_tokens=6, do_sample=False)
        assert torch.equal(m.generate(ids, max_new_tokens=6, do_sample=False), expected)


class ExpertMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        self.w2 = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class ListMoE(nn.Module):
    """Experts as a ``ModuleList`` of modules, called in a loop over the experts with tokens (transformers 4's
    ``MixtralSparseMoeBlock``): the ``continue`` is data-dependent, dynamo runs the loop without a graph."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(ExpertMLP() for _ in range(E))

    def forward(self, x):
        weights, selected = torch.topk(self.gate(x).softmax(-1), TOP_K, dim=-1)
        out = torch.zeros_like(x)
        mask = torch.nn.functional.one_hot(selected, E).permute(2, 1, 0)
        for e in range(E):
            k, token = torch.where(mask[e])
            if token.shape[0] == 0:
                continue
            out.index_add_(0, token, self.experts[e](x[token]) * weights[token, k, None])
        return out


class ListBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(H, H)
        self.moe = ListMoE()

    def forward(self, x):
        x = x + self.proj(x)
        return x + self.moe(x)


class ListModel(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(ListBlock() for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_module_list_experts_are_groups_of_their_own():
    from offload_compiler.grouping import plan_groups
    names = [g.name for g in plan_groups(ListModel(), _policy())]
    assert names[:4] == ["layers.0", "layers.0.moe", "layers.0.moe.experts.0", "layers.0.moe.experts.1"]
    assert names[2 + E] == "layers.1" and len(names) == 4 * (2 + E)


@pytest.mark.slow  # ~20 s: each expert called compiles a graph of its own, for 1 and 3 tokens
@pytest.mark.filterwarnings("ignore:offload_compiler. dynamo runs part")  # the loop's graph break, expected
def test_module_list_experts_fetch_each_called_expert_alone():
    """A ``ModuleList`` of experts: each expert is a group, and so is the rest of the block holding them (the
    router). The loop over experts with tokens runs without a graph, and each expert it calls fetches its own
    group: a decode token moves the non-expert weights once and the top_k experts of each layer, exactly.
    (Before, each called expert fetched its whole block: at 4 layers 22x these bytes, 4x the whole model.)"""
    plain = ListModel()
    m = offload_compile(copy.deepcopy(plain), _policy())
    per_expert = sum(p.numel() * 4 for p in plain.layers[0].moe.experts[0].parameters())
    other_bytes = sum(p.numel() * 4 for n, p in plain.named_parameters() if ".experts." not in n)
    for tokens in (1, 3):
        x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad():
            assert torch.equal(m(x), plain(x))
            reset_offload_stats(m)
            assert torch.equal(m(x), plain(x))
        stats = offload_stats(m)
        with torch.no_grad():  # the experts each layer's router picks
            h, called = x, 0
            for layer in plain.layers:
                h = h + layer.proj(h)
                called += torch.topk(layer.moe.gate(h), TOP_K, dim=-1).indices.unique().numel()
                h = h + layer.moe(h)
        assert stats.bytes_transferred == other_bytes + called * per_expert
        if tokens == 1:
            assert called == TOP_K * len(plain.layers)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_the_estimate_of_a_moe_block_plan_before_its_first_call_is_its_plan(name):
    """A block's fused expert weights are a group of their own right after the rest of the block: the two
    alternate, and the prefetch window never holds two of either. The estimate made before anything runs (and
    the saving warning it decides) is the pool the backend then makes, up to the routed slot of the token
    embedding's lookups; counting each size class at its full window said Mixtral's layerwise plan kept 82%
    of the model on the device, and warned, where it keeps 47%."""
    import warnings
    pytest.importorskip("transformers")
    from offload_compiler import OffloadSavingWarning, plan_summary
    from offload_compiler.testing.models import ARCHITECTURES
    model, kwargs = ARCHITECTURES[name]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu", compiler="eager"))
    estimate = plan_summary(m)["saving"]
    assert not estimate["verified"]
    assert not [w for w in caught if issubclass(w.category, OffloadSavingWarning)]
    with torch.no_grad():
        m(**kwargs)
    planned = plan_summary(m)["saving"]
    routed = m._offload_runtime.transfers.routed_slot_bytes
    assert planned["verified"] and planned["share_of_model"] < 0.5
    assert planned["device_weight_peak_bytes"] - routed == estimate["device_weight_peak_bytes"]
