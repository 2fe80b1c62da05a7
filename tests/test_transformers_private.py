"""transformers' private surface, as `offload_compiler._transformers_private` lists it: one test per touch point,
each doing what the package relies on, so that a transformers release that removes or changes one fails here,
by name; that without it the package does what it did before (never an error); and no use anywhere else in the
package."""

from __future__ import annotations

import contextlib
import copy
import os
import re
import threading

import pytest
import torch

from offload_compiler import OffloadPolicy, _transformers_private as private, offload_compile, offload_groups, \
    offload_stats, reset_offload_stats
from offload_compiler.testing.models import llama

output_capturing = pytest.importorskip("transformers.utils.output_capturing")

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "offload_compiler")
PRIVATE = re.compile(r"output_capturing|\b_active_collector\b|maybe_install_capturing_hooks|global_var\b|"
                     r"CompileableContextVar|conversion_mapping|core_model_loading|rename_source_key|"
                     r"MergeModulelist|WeightConverter")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def layer_and_inputs():
    """A tiny Llama and a decoder layer's inputs as the model makes them. Eager attention returns its weights:
    the hook recording them is on the layer's attention, inside the layer's traced forward (the layer's own
    hook, recording hidden states, runs after that forward, in Python)."""
    model, inputs = llama(layers=2)
    model.set_attn_implementation("eager")
    ids = inputs["input_ids"]
    with torch.no_grad():
        embedded = model.get_input_embeddings()(ids)
        rotary = model.model.rotary_emb(embedded, torch.arange(ids.shape[1])[None])
    return model, embedded, rotary


def test_no_private_transformers_outside_this_module():
    found = []
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(directory, name)
            if not name.endswith(".py") or path == os.path.join(PACKAGE, "_transformers_private.py"):
                continue
            with open(path, encoding="utf-8") as source:
                found += [f"{os.path.relpath(path, PACKAGE)}:{number}: {line.strip()}"
                          for number, line in enumerate(source, 1) if PRIVATE.search(line)]
    assert not found, "private transformers outside _transformers_private.py:\n" + "\n".join(found)


# 1
def test_hooks_are_installed_once_and_marked(layer_and_inputs):
    """Every decoder layer gets one forward hook, the model is marked, and installing again adds none."""
    model = layer_and_inputs[0]
    layer = model.model.layers[0]
    assert not private.capturing_hooks_installed(model) and not layer._forward_hooks
    private.install_capturing_hooks(model)
    assert private.capturing_hooks_installed(model) and len(layer._forward_hooks) == 1
    private.install_capturing_hooks(model)
    assert len(layer._forward_hooks) == 1


def test_without_the_installer_nothing_is_installed(layer_and_inputs, monkeypatch):
    model = layer_and_inputs[0]
    monkeypatch.delattr(output_capturing, "maybe_install_capturing_hooks")
    private.install_capturing_hooks(model)
    assert not private.capturing_hooks_installed(model) and not model.model.layers[0]._forward_hooks


def _recording(var, layer, embedded, rotary, show=contextlib.nullcontext):
    """``layer`` called with a collector of hidden states and attention weights active: its output and what
    was recorded."""
    collected = {"hidden_states": [], "attentions": []}
    token = var.set(collected)
    try:
        with torch.no_grad(), show():
            return layer(embedded, position_embeddings=rotary), collected
    finally:
        var.reset(token)


def _same(got, expected):
    return len(got) == len(expected) and all(map(torch.equal, got, expected))


# 2
def test_traced_hooks_read_the_collector_without_a_graph_break(layer_and_inputs):
    """A hooked layer's forward compiled with fullgraph=True breaks at its attention hook's ContextVar read on
    torch 2.13 and before (what the touch point works around; torch 2.14 traces the read); inside
    `hooks_see_the_active_collector` it is one graph on every torch, records into the collector active in
    Python, and with none active records nothing. The state is restored."""
    model, embedded, rotary = layer_and_inputs
    private.install_capturing_hooks(model)
    layer = model.model.layers[0]
    var = output_capturing._active_collector
    expected, recorded = _recording(var, layer, embedded, rotary)
    assert len(recorded["attentions"]) == 1 and len(recorded["hidden_states"]) == 2
    compiled = torch.compile(layer.forward, backend="eager", fullgraph=True)  # the layer's own hook: not traced
    with torch.no_grad():
        try:
            assert torch.equal(compiled(embedded, position_embeddings=rotary), expected)  # torch 2.14+
        except Exception as error:
            assert "ContextVar" in str(error)
        torch._dynamo.reset()
        with private.hooks_see_the_active_collector():
            assert torch.equal(compiled(embedded, position_embeddings=rotary), expected)  # none active
    got, recorded_traced = _recording(var, compiled, embedded, rotary, private.hooks_see_the_active_collector)
    assert torch.equal(got, expected) and _same(recorded_traced["attentions"], recorded["attentions"])
    assert (var.compiling, var.global_var, var.get()) == (False, None, None)


def test_the_collector_state_is_restored_on_error_nested_and_across_threads():
    var = output_capturing._active_collector
    outer, inner = {"hidden_states": []}, {"attentions": []}
    token = var.set(outer)
    try:
        with pytest.raises(RuntimeError, match="inside"):
            with private.hooks_see_the_active_collector():
                assert (var.compiling, var.global_var) == (True, outer)
                inner_token = var.context_var.set(inner)  # what the ContextVar holds no longer matters inside
                try:
                    with private.hooks_see_the_active_collector():
                        assert var.global_var is outer  # an enclosing block's collector, as `get` reads it
                    assert (var.compiling, var.global_var) == (True, outer)
                finally:
                    var.context_var.reset(inner_token)
                raise RuntimeError("inside")
        assert (var.compiling, var.global_var, var.get()) == (False, None, outer)
    finally:
        var.reset(token)

    def show_many_times():
        for _ in range(200):
            with private.hooks_see_the_active_collector():
                assert var.compiling and var.global_var is None  # each thread's own (no) collector

    threads = [threading.Thread(target=show_many_times) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert (var.compiling, var.global_var) == (False, None)


@pytest.mark.parametrize("change", ["removed", "renamed"])
def test_without_the_collector_attributes_nothing_is_shown(monkeypatch, change):
    """A transformers release without ``_active_collector``, or with other attributes: the block runs as
    before (the hooks' graph breaks), and nothing is changed."""
    if change == "removed":
        monkeypatch.delattr(output_capturing, "_active_collector")
        with private.hooks_see_the_active_collector():
            pass
        return

    class Renamed:
        is_compiling = False

        def get(self):
            return None

    replaced = Renamed()
    monkeypatch.setattr(output_capturing, "_active_collector", replaced)
    with private.hooks_see_the_active_collector():
        assert vars(replaced) == {}
    assert vars(replaced) == {}


def test_a_part_by_hand_records_into_the_active_collector(layer_and_inputs):
    """An offloaded decoder layer called by hand while a collector is active records into it as the plain layer
    does (the attention weights from inside its graph, its graph compiled again for the collector), fetching
    its group once per call; with none active it records nothing and still fetches once."""
    model, embedded, rotary = layer_and_inputs
    plain = copy.deepcopy(model)
    private.install_capturing_hooks(plain)
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu"))
    layer_bytes = {g.name: g.nbytes for g in offload_groups(m)}["model.layers.0"]
    var = output_capturing._active_collector
    expected, recorded = _recording(var, plain.model.layers[0], embedded, rotary)
    for call in range(2):
        with torch.no_grad():
            assert torch.equal(m.model.layers[0](embedded, position_embeddings=rotary), expected)  # none active
        reset_offload_stats(m)
        got, recorded_offloaded = _recording(var, m.model.layers[0], embedded, rotary)
        assert torch.equal(got, expected), call
        assert all(_same(recorded_offloaded[key], recorded[key]) for key in recorded), call
        stats = offload_stats(m)
        assert (stats.fetch_count, stats.bytes_transferred) == (1, layer_bytes), call
    assert (var.compiling, var.global_var, var.get()) == (False, None, None)


# 3
def test_checkpoint_names_follow_from_pretrained(tmp_path):
    """What save_pretrained writes for a Mixtral (its router under the old module name, each expert's w1/w3/w2)
    maps to the model's names as from_pretrained loads them: the router renamed, the experts' pieces merged into
    the fused weights (w1 then w3 into gate_up_proj, part 0 and 1 of 2); names the model holds are left out."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                                     num_experts_per_tok=1, max_position_embeddings=16)
    model = transformers.MixtralForCausalLM(cfg)
    names = list(model.state_dict())
    if "model.layers.0.mlp.experts.gate_up_proj" not in names:
        pytest.skip("this transformers keeps its experts as separate modules")
    moe = "model.layers.0.block_sparse_moe."
    keys = [moe + "gate.weight", moe + "experts.1.w1.weight", moe + "experts.1.w3.weight", moe + "experts.0.w2.weight",
            "model.embed_tokens.weight"]
    mapped = private.checkpoint_names(model, keys, names)
    fused = "model.layers.0.mlp.experts."
    assert mapped == {keys[0]: ("model.layers.0.mlp.gate.weight", None),
                      keys[1]: (fused + "gate_up_proj", private.Merged(0, 2)),
                      keys[2]: (fused + "gate_up_proj", private.Merged(1, 2)),
                      keys[3]: (fused + "down_proj", private.Merged(0, 1))}
    assert private.checkpoint_names(torch.nn.Linear(2, 2), keys, names) == {}  # not a transformers model


def test_without_the_conversion_functions_no_name_is_mapped(monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(private, "_conversion", lambda: None)
    cfg = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                                     num_experts_per_tok=1, max_position_embeddings=16)
    model = transformers.MixtralForCausalLM(cfg)
    assert private.checkpoint_names(model, ["model.layers.0.block_sparse_moe.gate.weight"], model.state_dict()) == {}
