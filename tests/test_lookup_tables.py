"""Tables read by lookup: a token embedding needs the rows of the tokens in the call, not the vocabulary. A
streamed group read only by ``F.embedding`` moves the distinct rows looked up (a routed fetch into a slot sized
by the graph's index), from host memory or from its file on disk; a table read whole anywhere (tied to the
output projection) is fetched whole. Outputs equal the plain model's; bytes and fetches equal the plan."""

import copy

import pytest
from devices import host_and
import torch

from offload_compiler import OffloadPolicy, describe_plan, offload_compile, offload_stats, reset_offload_stats
from offload_compiler.testing import assert_traffic_matches_plan, simulated_device
from offload_compiler.testing.models import llama

from capture import ancestors

VOCAB, HIDDEN, ROW = 128, 64, 64 * 4  # float32 rows


def _llama():
    model, inputs = llama(layers=2, hidden=HIDDEN, vocab=VOCAB, seq=12)
    ids = inputs["input_ids"].clone()
    ids[0, 6:] = ids[0, :6]  # repeated tokens: a row looked up twice moves once
    return model.eval().requires_grad_(False), ids


def _device(name):
    return simulated_device() if name == "sim" else "cpu"


def _steady_call_equals_plain(m, plain, ids, device):
    """A call after the one that captured the graph gives the plain model's logits (bit for bit on the CPU); its
    traffic, checked against the plan."""
    with torch.no_grad():
        expected = plain(input_ids=ids).logits
        m(input_ids=ids.to(device))
        reset_offload_stats(m)
        got = m(input_ids=ids.to(device)).logits.cpu()
    exact = device == "cpu"
    torch.testing.assert_close(got, expected, atol=0 if exact else 1e-5, rtol=0 if exact else 1e-5)
    return assert_traffic_matches_plan(m)


@pytest.mark.parametrize("device", host_and("sim"))
def test_a_token_embedding_moves_the_rows_looked_up(device):
    plain, ids = _llama()
    device = _device(device)
    m = offload_compile(copy.deepcopy(plain), OffloadPolicy(strategy="layerwise", device=device, debug_poison=True))
    table = plain.get_input_embeddings().weight
    stats = _steady_call_equals_plain(m, plain, ids, device)
    groups = m._offload_runtime.groups
    assert stats.routed_fetches == 1 and stats.fetch_count == len(groups) - 1
    assert stats.routed_bytes == ids.unique().numel() * ROW < table.nbytes
    assert stats.bytes_transferred - stats.routed_bytes == stats.total_bytes - table.nbytes
    (plan,) = m._offload_runtime.graph_plans
    (read,) = plan.routed
    assert (read.experts, read.bound, read.expert_bytes) == (VOCAB, ids.numel(), ROW)
    assert f"routed model.embed_tokens.weight: at most {ids.numel()} of {VOCAB} rows per call" in describe_plan(m)


def test_a_table_tied_to_the_output_projection_is_fetched_whole():
    plain, ids = _llama()
    plain.lm_head.weight = plain.get_input_embeddings().weight  # read by the head's matmul too
    m = offload_compile(copy.deepcopy(plain), OffloadPolicy(strategy="layerwise", device="cpu", debug_poison=True))
    with torch.no_grad():
        expected = plain(input_ids=ids).logits
        m(input_ids=ids)
        reset_offload_stats(m)
        assert torch.equal(m(input_ids=ids).logits, expected)
    stats = assert_traffic_matches_plan(m)
    # whole: for the lookup, and again for the head at the end of the call (evicted in between)
    table = plain.get_input_embeddings().weight.nbytes
    assert stats.routed_fetches == 0 and stats.bytes_transferred == stats.total_bytes + table


def test_an_index_past_the_table_is_an_index_error_and_the_model_runs_on():
    plain, ids = _llama()
    m = offload_compile(copy.deepcopy(plain), OffloadPolicy(strategy="layerwise", device="cpu", debug_poison=True))
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    with torch.no_grad():
        m(input_ids=ids)  # captured with valid ids
        bad = ids.clone()
        bad[0, 3] = VOCAB
        with pytest.raises(IndexError, match="index out of range"):
            plain(input_ids=bad)
        with pytest.raises(IndexError, match=f"model.embed_tokens.weight has {VOCAB} rows, an index named {VOCAB}"):
            m(input_ids=bad)
        assert torch.equal(m(input_ids=ids).logits, plain(input_ids=ids).logits)
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    assert offload_stats(m).live_device_bytes == 0  # the failed call left no copy behind


@pytest.mark.parametrize("device", host_and("sim"))
def test_a_table_on_disk_reads_only_the_rows_looked_up(tmp_path, device):
    plain, ids = _llama()
    device = _device(device)
    policy = OffloadPolicy(strategy="layerwise", device=device, debug_poison=True, host_budget_gb=0.0,
                           disk_dir=str(tmp_path))
    m = offload_compile(copy.deepcopy(plain), policy)
    runtime = m._offload_runtime
    assert all(g.on_disk for g in runtime.groups if g.nbytes)
    table = plain.get_input_embeddings().weight
    stats = _steady_call_equals_plain(m, plain, ids, device)
    rows = ids.unique().numel() * ROW
    assert stats.routed_bytes == rows
    assert stats.disk_bytes_read == stats.total_bytes - table.nbytes + rows


class _Positions(torch.nn.Module):
    """A position table looked up by a slice of a ``position_ids`` buffer (BERT and ALBERT's embeddings): the
    lookup's index is a view of a weight of another group, which must stay fetched until the lookup has run."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.positions = torch.nn.Embedding(64, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.register_buffer("position_ids", torch.arange(64).expand(1, -1), persistent=False)

    def forward(self, x):
        return self.norm(x + self.positions(self.position_ids[:, : x.shape[1]]))


@pytest.mark.parametrize("device", host_and("sim"))
def test_a_lookup_whose_index_is_a_view_of_another_group_keeps_that_group_until_it_runs(device):
    plain = _Positions().eval()
    device = _device(device)
    m = offload_compile(copy.deepcopy(plain), OffloadPolicy(strategy="sequential", device=device, debug_poison=True))
    groups = {g.name for g in m._offload_runtime.groups}
    assert {"positions", "norm"} <= groups and len(groups) == 3  # the buffer in the root's group
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        m(x.to(device))
        reset_offload_stats(m)
        torch.testing.assert_close(m(x.to(device)).cpu(), plain(x))
    stats = assert_traffic_matches_plan(m)
    assert stats.routed_fetches == 1 and stats.routed_bytes == 5 * 8 * 4


class _TokensAndPositions(torch.nn.Module):
    """GPT-2's inputs: a token table and a position table, both looked up, then a stack of blocks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens = torch.nn.Embedding(VOCAB, 32)
        self.positions = torch.nn.Embedding(64, 32)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))

    def forward(self, ids):
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = x + torch.relu(block(x))
        return x


@pytest.mark.slow  # an inductor compile (~10 s)
def test_under_inductor_the_lookups_are_ordered_as_the_verified_graph_says(monkeypatch):
    """Inductor orders extern calls by their data alone (in GPT-2 it ran the next layer's prefetch before the
    position lookup: a row slot over the verified peak). In the fused graph (`passes.fuse`) each lookup depends on
    what came before it (evicts included) and the next transfer on it; the ledger's peak is the verified one."""
    from offload_compiler import lowering
    from offload_compiler.passes.fuse import fuse_transfers
    from offload_compiler.testing import assert_offload_equivalent
    fused = []

    def keep_fused(*args, **kwargs):
        fused.append(fuse_transfers(*args, **kwargs))
        return fused[-1]
    monkeypatch.setattr(lowering, "fuse_transfers", keep_fused)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    policy = OffloadPolicy(strategy="layerwise", device="cpu", compiler="inductor", debug_poison=True)
    report = assert_offload_equivalent(_TokensAndPositions().eval(), policy, ids)  # ledger peak == verified peak
    assert report.routed_fetches == 2 * 2 and report.routed_group_bytes == (VOCAB + 64) * 32 * 4
    (graph,) = {id(gm.graph): gm.graph for gm in fused}.values()
    nodes = list(graph.nodes)
    name = lambda n: n.target.name() if hasattr(n.target, "name") else ""  # noqa: E731
    lookups = [n for n in nodes if name(n) == "offload_compiler::routed"]
    assert len(lookups) == 2
    for lookup in lookups:
        before = nodes[:nodes.index(lookup)]
        after = nodes[nodes.index(lookup):]
        evicts = [n for n in before if name(n) == "offload_compiler::evict"]
        assert set(evicts) <= ancestors(lookup)  # the evicts before it run before it
        following = next(n for n in after if name(n) == "offload_compiler::transfer")
        assert lookup in ancestors(following)  # and the next transfer after it



@pytest.mark.parametrize("device", host_and("sim"))
@pytest.mark.parametrize("tied", [False, True], ids=["routed", "fetched_whole"])
@pytest.mark.parametrize("index", [-200, VOCAB + 372], ids=["negative", "past_the_end"])
def test_an_index_outside_the_table_names_it_routed_or_fetched_whole(device, tied, index):
    """Routed, the lookup names its table; fetched whole (tied to the output projection), torch's kernel fails
    with "index out of range in self" alone, which the runner completes with the table's name. A negative index
    alike: F.embedding takes none."""
    plain, ids = _llama()
    if tied:
        plain.lm_head.weight = plain.get_input_embeddings().weight
    device = _device(device)
    m = offload_compile(copy.deepcopy(plain), OffloadPolicy(strategy="layerwise", device=device, debug_poison=True))
    with torch.no_grad():
        m(input_ids=ids.to(device))
        bad = ids.clone()
        bad[0, 3] = index
        with pytest.raises(IndexError, match=f"model.embed_tokens.weight has {VOCAB} rows, an index named {index}"):
            m(input_ids=bad.to(device))
        torch.testing.assert_close(m(input_ids=ids.to(device)).logits.cpu(), plain(input_ids=ids).logits)
    assert offload_stats(m).live_device_bytes == 0


@pytest.mark.parametrize("device", host_and("sim"))
def test_an_embedding_called_with_a_new_shape_names_its_table_for_a_negative_index(device):
    """An nn.Embedding of its own group; the bad call's index has another shape (a graph of its own)."""
    device = _device(device)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)).eval()
    m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="layerwise", device=device))
    with torch.no_grad():
        m(torch.randint(0, 50, (2, 5)).to(device))
        with pytest.raises(IndexError, match=r"0.weight has 50 rows, an index named -1"):
            m(torch.tensor([[1, -1, 3]]).to(device))


class _ScaledEmbedding(torch.nn.Embedding):
    """A table with a scale buffer beside it, as Gemma 3n/4's per-layer embedding holds."""

    def __init__(self, rows, dim):
        super().__init__(rows, dim)
        self.register_buffer("embed_scale", torch.tensor(dim ** 0.5), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale


class _TableLM(torch.nn.Module):
    """A model whose weights are almost all one table read by lookup: streaming it whole saves nothing."""

    def __init__(self, rows=4096, dim=32):
        super().__init__()
        self.embed = _ScaledEmbedding(rows, dim)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(3))
        self.head = torch.nn.Linear(dim, 8)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.head(h)


@pytest.mark.parametrize("device", host_and("sim"))
def test_a_table_beside_a_scale_buffer_is_a_group_of_its_own_and_moves_the_rows_looked_up(device):
    """A routed fetch applies where every weight of a group is read by indices; a table grouped with its module's
    scale buffer was fetched whole at every call (99.7% of a tiny Gemma 4 on the device). The table is now a group
    of its own: the estimate before the first call, the verified plan and the traffic all count its rows looked
    up, and no saving warning is raised."""
    import warnings
    from offload_compiler import OffloadSavingWarning, plan_summary
    torch.manual_seed(0)
    plain = _TableLM().eval().requires_grad_(False)
    ids = torch.tensor([[5, 9, 5, 4000, 17, 9]])
    device = _device(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = offload_compile(copy.deepcopy(plain), OffloadPolicy(strategy="layerwise", device=device,
                                                                compiler="eager", debug_poison=True))
    assert not [w for w in caught if issubclass(w.category, OffloadSavingWarning)]
    table = plain.embed.weight
    names = [g["name"] for g in plan_summary(m)["groups"]]
    assert "embed.weight" in names and "embed" in names  # the table, then its scale buffer
    estimate = plan_summary(m)["saving"]
    assert not estimate["verified"] and estimate["device_weight_peak_bytes"] < table.nbytes / 10
    with torch.no_grad():
        expected = plain(ids)
        m(ids.to(device))
        reset_offload_stats(m)
        got = m(ids.to(device)).cpu()
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    stats = assert_traffic_matches_plan(m)
    row = table[0].nbytes
    assert stats.routed_fetches == 1 and stats.routed_bytes == ids.unique().numel() * row
    assert stats.bytes_transferred - stats.routed_bytes == stats.total_bytes - table.nbytes
    planned = plan_summary(m)["saving"]
    assert planned["verified"] and planned["share_of_model"] < 0.1
    assert planned["device_weight_peak_bytes"] - estimate["device_weight_peak_bytes"] == ids.numel() * row


def test_the_tables_of_an_embedding_module_stream_apart_from_its_norm():
    """BERT-style embeddings (word, position and token-type tables with a LayerNorm in one module): the word and
    position tables are groups of their own, fetched as the rows looked up; the two-row token-type table stays
    with the norm (`grouping.MIN_LOOKUP_ROWS`)."""
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    plain = BertModel(BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, max_position_embeddings=128)).eval().requires_grad_(False)
    ids = torch.randint(0, 1000, (1, 10), generator=torch.Generator().manual_seed(1))
    device = simulated_device()
    m = offload_compile(copy.deepcopy(plain), OffloadPolicy(strategy="layerwise", device=device, compiler="eager"))
    groups = {g.name: g for g in m._offload_runtime.groups}
    assert {"embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight"} <= set(groups)
    rest = {s.name for s in groups["embeddings"].slots}  # with the module's index buffers
    assert {"embeddings.token_type_embeddings.weight", "embeddings.LayerNorm.weight"} <= rest
    assert not any(name.startswith(("embeddings.word_", "embeddings.position_embeddings")) for name in rest)
    with torch.no_grad():
        expected = plain(input_ids=ids).last_hidden_state
        m(input_ids=ids.to(device))
        reset_offload_stats(m)
        got = m(input_ids=ids.to(device)).last_hidden_state.cpu()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    stats = assert_traffic_matches_plan(m)
    rows = plain.embeddings.word_embeddings.weight[0].nbytes
    assert stats.routed_fetches == 2
    assert stats.routed_bytes == (ids.unique().numel() + ids.numel()) * rows  # the tokens' rows, 10 positions
