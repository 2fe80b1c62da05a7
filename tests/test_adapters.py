"""LoRA adapters (peft) and offloading, in the orders users take: adapters first, then offload; merge or switch
an adapter off on an offloaded model; an adapter added to an already offloaded model."""

import copy

import pytest
import torch

from offload_compiler import OffloadPolicy, OffloadRefusal, offload_compile, offload_stats, remove_offload, \
    reset_offload_stats
from offload_compiler.testing import assert_traffic_matches_plan, routed_only_bytes
from offload_compiler.testing.models import llama

peft = pytest.importorskip("peft")

POLICY = OffloadPolicy(strategy="layerwise", device="cpu")


def _lora(model):
    torch.manual_seed(1)  # init_lora_weights=False: random B, so an adapter changes the outputs
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))


def _llama():
    model, inputs = llama(layers=2, hidden=64, vocab=128, seq=8)
    return model, inputs["input_ids"]


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _streams_the_plan(m, ids) -> None:
    reset_offload_stats(m)
    _logits(m, ids)
    stats = assert_traffic_matches_plan(m)
    whole = stats.bytes_transferred - stats.routed_bytes  # the token embedding moves the rows looked up
    assert stats.fetch_count >= 2 and whole >= stats.streamed_bytes - routed_only_bytes(m) > 0


@pytest.mark.slow  # a tiny Llama with LoRA adapters captured (peft)
def test_a_lora_model_streams_its_adapters_with_its_layers_and_the_adapter_switches_off():
    base, ids = _llama()
    plain_base = copy.deepcopy(base)
    plain = _lora(copy.deepcopy(base))
    m = offload_compile(_lora(base), POLICY)
    assert torch.equal(_logits(m, ids), _logits(plain, ids))
    _streams_the_plan(m, ids)
    lora_bytes = sum(p.nbytes for n, p in plain.named_parameters() if "lora_" in n)
    stats = offload_stats(m)
    weights = [*plain.parameters(), *plain.buffers()]
    assert lora_bytes and stats.total_bytes == sum(t.nbytes for t in weights)  # the adapters are offloaded too
    with m.disable_adapter():
        assert torch.equal(_logits(m, ids), _logits(plain_base, ids))
        _streams_the_plan(m, ids)
    assert torch.equal(_logits(m, ids), _logits(plain, ids))


@pytest.mark.slow  # a tiny Llama with LoRA adapters captured (peft)
def test_merging_an_adapter_into_an_offloaded_model_changes_the_weights_it_streams():
    """``merge_adapter`` adds the adapter's product to the base weights in place; the next fetch streams them."""
    base, ids = _llama()
    plain = _lora(copy.deepcopy(base))
    m = offload_compile(_lora(base), POLICY)
    _logits(m, ids)
    for model in (m, plain):
        model.merge_adapter()
    assert torch.equal(_logits(m, ids), _logits(plain, ids))
    _streams_the_plan(m, ids)
    for model in (m, plain):
        model.unmerge_adapter()
    assert torch.equal(_logits(m, ids), _logits(plain, ids))


@pytest.mark.slow  # a tiny Llama with LoRA adapters captured (peft)
def test_an_adapter_added_after_offloading_is_refused_and_offloading_the_adapted_model_works():
    """Adapter weights injected after offloading would be read from wherever they are, un-offloaded: refused
    with the fix (the refusal itself, not dynamo's compile-failure report), which works as named."""
    base, ids = _llama()
    plain = _lora(copy.deepcopy(base))
    m = offload_compile(base, POLICY)
    _logits(m, ids)
    adapted = _lora(m)
    with pytest.raises(OffloadRefusal, match=r"lora_A.*which offloading does not hold.*module added.*"
                                             r"remove_offload\(m\)"):
        _logits(adapted, ids)
    remove_offload(m)
    again = offload_compile(adapted, POLICY)
    assert torch.equal(_logits(again, ids), _logits(plain, ids))
    _streams_the_plan(again, ids)
