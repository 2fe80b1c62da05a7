"""The analysis, insert and verify passes on a weight that a forward writes into its activations
(``x[mask] = weight``: wav2vec2's masked_spec_embed) or into a buffer (refused), and on a weight passed
through an op that returns it unchanged at run time though its traced value is a new tensor (eval-mode
dropout: DeBERTa's relative embeddings)."""

import copy
import operator

import pytest
import torch
from torch import nn

from offload_compiler import OffloadPolicy, offload_compile
from offload_compiler.testing import assert_traffic_matches_plan
from test_trial_routes import Block  # noqa: E402  (tests/ is on the path, as for capture.py)


class MaskedInput(nn.Module):
    """wav2vec2's masking: ``h[mask] = self.masked_spec_embed`` writes a weight into the activations (operator.setitem,
    whose graph node has no result)."""
    _layerwise_offload_blocks_attr = "blocks"

    def __init__(self, write_buffer: bool = False) -> None:
        super().__init__()
        self.masked_embed = nn.Parameter(torch.randn(8))
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.register_buffer("history", torch.zeros(4, 8))
        self.write_buffer = write_buffer

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = x.clone()
        h[mask] = self.masked_embed.to(h.dtype)
        for block in self.blocks:
            h = block(h)
        if self.write_buffer:  # a buffer written in place by the forward: must stay resident
            self.history[0] = h[0, 0]
        return h + self.history.sum()


@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_weight_written_into_the_activations_is_read_inside_its_fetch(compiler):
    """Before the fix the analysis pass crashed on the setitem node (its value is None: AttributeError 'cdata'),
    so wav2vec2 called with mask_time_indices could not be offloaded."""
    torch.manual_seed(0)
    model = MaskedInput().eval()
    plain = copy.deepcopy(model)
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu", debug_poison=True, compiler=compiler))
    x, mask = torch.randn(2, 5, 8), torch.tensor([[True, False, False, True, False]] * 2)
    with torch.no_grad():
        for _ in range(2):
            got, expected = m(x, mask), plain(x, mask)
            assert torch.equal(got, expected) if compiler == "eager" else torch.allclose(got, expected, atol=1e-6)
    stats = assert_traffic_matches_plan(m)
    assert stats.fetch_count >= 2 * len(m._offload_runtime.groups)  # the root group (masked_embed) included


def test_a_buffer_written_by_setitem_is_refused_and_the_model_is_unchanged():
    torch.manual_seed(0)
    model = MaskedInput(write_buffer=True).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu"))
    x, mask = torch.randn(2, 5, 8), torch.zeros(2, 5, dtype=torch.bool)
    with pytest.raises(Exception, match="modifies weight .*history.* in place.*offload_buffers=False"):
        with torch.no_grad():
            m(x, mask)
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


class SharedRelative(nn.Module):
    """A weight read by every block through an op that hands it back unchanged: eval-mode dropout and a slice,
    as DeBERTa reads its relative embeddings (at run time ``F.dropout(w, training=False)`` is ``w`` itself),
    the same with the input passed by keyword, or a zero-width pad (which inductor lowers to a view)."""
    _layerwise_offload_blocks_attr = "blocks"

    def __init__(self, how: str = "dropout") -> None:
        super().__init__()
        self.rel = nn.Embedding(16, 16)  # as large as each block: the next block's fetch may take its slot
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.ModuleList(nn.Linear(16, 16, bias=False) for _ in range(3))
        self.how = how

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weight = self.rel.weight
        if self.how == "dropout":
            rel = self.drop(weight)[:16]
        elif self.how == "dropout keyword":
            rel = torch.nn.functional.dropout(input=weight, p=0.1, training=self.training)
        else:  # "zero pad"
            rel = torch.nn.functional.pad(weight, (0, 0))
        for block in self.blocks:
            h = h + block(h) @ rel
        return h


@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("how, poison", [("dropout", False), ("dropout", True), ("dropout keyword", True),
                                         ("zero pad", True)])
def test_a_weight_an_op_returns_unchanged_stays_until_its_last_reader(compiler, how, poison):
    """Before the fix the weight was evicted right after the dropout node, and its slot refilled by the next
    block while the blocks still read it: off by up to 51 (NaN with debug_poison), eager and inductor alike.
    Inductor lowers the zero pad to a view of the weight: its copy is what the evict must follow."""
    torch.manual_seed(0)
    model = SharedRelative(how).eval()
    plain = copy.deepcopy(model)
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu", debug_poison=poison,
                                             compiler=compiler))
    x = torch.randn(4, 16)
    with torch.no_grad():
        for _ in range(2):
            got, expected = m(x), plain(x)
            assert torch.equal(got, expected) if compiler == "eager" else torch.allclose(got, expected, atol=1e-5)
    stats = assert_traffic_matches_plan(m)
    assert stats.fetch_count == 2 * len(m._offload_runtime.groups)


def test_readers_follow_a_result_that_may_be_the_weight_itself():
    """The analysis, on the captured graph: the dropout's users (the slice, then each block's matmul) are
    readers of the weight; an op with a result of another layout (the blocks' linear) ends the chain."""
    from offload_compiler.passes.analysis import readers
    captured = {}

    def backend(gm, example_inputs):
        captured["gm"] = gm
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(SharedRelative().eval(), backend=backend)(torch.randn(4, 16))
    gm = captured["gm"]
    weight = next(n for n in gm.graph.nodes if n.op == "placeholder" and "rel" in n.name)
    (dropout,) = weight.users
    found = readers(weight, dropout, weight.name).leaves
    matmuls = [n for n in gm.graph.nodes if n.target in (operator.matmul, torch.matmul)]
    assert len(matmuls) == 3 and set(matmuls) <= set(found), [n.format_node() for n in found]
