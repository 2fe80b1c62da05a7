"""Routes found by trying the library on models and calls its other tests had not seen: hooks that a model's
own forward installs (transformers' output capture), models that ask for their own hidden states, and
``torch.compile(backend="omni_offload")`` in a process where other offloaded models already ran."""

import copy
import inspect

import pytest
import torch
from torch import nn

from offload_compiler import (InfeasibleBudgetError, OffloadedModule, OffloadPolicy, offload_compile, offload_stats, plan_offload,
                              remove_offload, reset_offload_stats)
from offload_compiler.host_masters import HostMaster
from offload_compiler.testing import assert_traffic_matches_plan, routed_only_groups, tensors_of


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x)


class Stack(nn.Module):
    _layerwise_offload_blocks_attr = "blocks"

    def __init__(self, register_hook_at_first_call: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.register_hook_at_first_call = register_hook_at_first_call
        self.seen = []

    def forward(self, x: torch.Tensor, scale: float | None = None, shift: torch.Tensor | None = None) -> torch.Tensor:
        if self.register_hook_at_first_call and not self.seen:  # a model that installs its own hooks lazily
            self.seen.append(True)
            self.blocks[1].register_forward_hook(lambda module, args, out: out * 2)
        for block in self.blocks:
            x = block(x)
        x = x if scale is None else x * scale
        return x if shift is None else x + shift


def _stack(**kwargs):
    torch.manual_seed(0)
    return Stack(**kwargs).eval()


def test_hooks_the_forward_itself_registers_are_the_models():
    """A hook registered by the model's own forward during an offloaded call is part of what that call's graph
    traced; it is adopted (graphs captured before it are captured again), not refused like a user's hook
    registered after offloading. Before the fix every call after the first was refused."""
    model = _stack(register_hook_at_first_call=True)
    plain = copy.deepcopy(model)
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu", debug_poison=True))
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(m(x), plain(x))
    stats = assert_traffic_matches_plan(m)
    assert stats.fetch_count == 3 * 3
    handle = m.blocks[0].register_forward_hook(lambda *args: None)
    with pytest.raises(RuntimeError, match="hook registered now"):
        m(x)
    handle.remove()
    with torch.no_grad():
        assert torch.equal(m(x), plain(x))


@pytest.mark.slow
@pytest.mark.newest_torch
def test_the_backend_offloads_after_other_offloaded_models_of_its_class_ran():
    """Offloaded models keep their graphs on a code object of their own. Before the fix they filled the cache of
    their class's forward, and a later torch.compile(backend="omni_offload") of another instance met dynamo's
    recompile limit (8) there at its first call and ran un-offloaded, silently."""
    x = torch.randn(2, 8)
    for _ in range(3):
        other = offload_compile(_stack(), OffloadPolicy(strategy="layerwise", device="cpu"))
        with torch.no_grad():  # three signatures each: 9 graphs of Stack.forward in all
            other(x), other(x, 2.0), other(x, shift=x)
    model = _stack()
    plain = copy.deepcopy(model)
    compiled = torch.compile(model, backend="omni_offload", options={"strategy": "layerwise", "device": "cpu"})
    with torch.no_grad():
        assert torch.equal(compiled(x), plain(x))
    stats = offload_stats(compiled)  # raised "not offloaded" before the fix: the backend never ran
    assert stats.fetch_count == 3 and stats.bytes_transferred == stats.streamed_bytes > 0


class SkippedFrame(nn.Module):
    """A model whose own frame dynamo skips (as it does past its recompile limit on that code): dynamo compiles
    the frames it calls instead, and the backend is handed a submodule's graph."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _stack()

    @torch.compiler.disable(recursive=False)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_the_backend_handed_a_submodules_graph_offloads_the_compiled_model():
    """Dynamo skips the model's own frame and hands the backend its part's graph. The model offloaded is the
    one given to torch.compile (found by the identity of the graph's weights, not from the part's graph), and
    every later call, through the wrapper or the model itself, streams its verified plan."""
    model = SkippedFrame().eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    compiled = torch.compile(model, backend="omni_offload", options={"strategy": "layerwise", "device": "cpu"})
    with torch.no_grad():
        assert torch.equal(compiled(x), expected)
    assert isinstance(model, SkippedFrame) and isinstance(model, OffloadedModule)
    assert offload_stats(model).fetch_count == 3  # counted on by the runtime with masters (`use_runtime_with_masters`)
    assert all(isinstance(p, HostMaster) for p in model.parameters())
    for call in (compiled, model):
        reset_offload_stats(model)
        with torch.no_grad():
            assert torch.equal(call(x), expected)
        assert assert_traffic_matches_plan(model).fetch_count == 3


transformers = pytest.importorskip("transformers")


def _qwen2(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return transformers.Qwen2ForCausalLM(config).eval(), torch.randint(3, 64, (1, 6))


def test_output_hidden_states_after_offloading_streams_the_plan():
    """transformers installs its output-capturing hooks at the first call with output_hidden_states=True, under
    a lock dynamo cannot trace; offloading installs them first, so the graphs are captured with them. Before the
    fix every call after the first output_hidden_states=True call was refused ("a hook registered now")."""
    model, ids = _qwen2()
    m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="layerwise", device="cpu", debug_poison=True))
    with torch.no_grad():
        got = tensors_of(m(input_ids=ids, use_cache=False, output_hidden_states=True))
        expected = tensors_of(model(input_ids=ids, use_cache=False, output_hidden_states=True))
        assert len(got) == len(expected) == 4 and all(torch.equal(g, e) for g, e in zip(got, expected))
        reset_offload_stats(m)
        assert torch.equal(m(input_ids=ids, use_cache=False).logits, model(input_ids=ids, use_cache=False).logits)
    stats = assert_traffic_matches_plan(m)
    # every group once: whole, or the token embedding's rows looked up
    assert stats.fetch_count == len(m._offload_runtime.groups) - len(routed_only_groups(m))
    assert stats.routed_fetches == 1


@pytest.mark.slow
@pytest.mark.newest_torch
def test_output_attentions_on_sdpa_attention_runs_as_the_plain_model_does():
    """sdpa attention asked for attentions logs a warning_once from inside the layer loop. Dynamo cannot trace a
    logging call: a graph break inside the loop, the frame ran without a graph, and the call -- and every later
    one -- was refused with an error that named neither cause. Our captures trace logging calls as no-ops."""
    model, ids = _qwen2()
    m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="layerwise", device="cpu", debug_poison=True))
    with torch.no_grad():
        for _ in range(2):
            reset_offload_stats(m)
            got = m(input_ids=ids, use_cache=False, output_attentions=True)
            expected = model(input_ids=ids, use_cache=False, output_attentions=True)
            assert torch.equal(got.logits, expected.logits)
            assert [a is None for a in got.attentions or ()] == [a is None for a in expected.attentions or ()]
            assert assert_traffic_matches_plan(m).fetch_count == len(m._offload_runtime.groups) - len(
                routed_only_groups(m))  # every group once: whole, or the token embedding's rows looked up
        assert torch.equal(m(input_ids=ids, use_cache=False).logits, model(input_ids=ids, use_cache=False).logits)


@pytest.mark.slow
@pytest.mark.newest_torch
def test_hidden_states_of_a_model_whose_inner_model_was_called_before_offloading_are_not_doubled():
    """CLIPTextModelWithProjection holds a CLIPTextModel. Once called with output_hidden_states=True (before
    offloading), the inner model has its capturing hooks; installing on the outer model then installed a second
    set on the inner one, and every layer's hidden state was recorded twice: 11 hidden states for 5 layers, the
    penultimate one (what SD3 reads) wrong. Silent, eager and inductor alike."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection
    torch.manual_seed(0)
    config = CLIPTextConfig(vocab_size=100, hidden_size=32, intermediate_size=37, num_hidden_layers=5,
                            num_attention_heads=4, projection_dim=16, bos_token_id=0, eos_token_id=1)
    model = CLIPTextModelWithProjection(config).eval()
    ids = torch.randint(2, 100, (1, 12))
    with torch.no_grad():
        expected = model(ids, output_hidden_states=True)  # the inner model's hooks are installed now
        m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="layerwise", device="cpu",
                                                                blocks_attr="text_model.encoder.layers"))
        reset_offload_stats(m)
        got = m(ids, output_hidden_states=True)
    assert len(got.hidden_states) == len(expected.hidden_states) == 6
    assert all(torch.equal(g, e) for g, e in zip(got.hidden_states, expected.hidden_states))
    assert torch.equal(got.text_embeds, expected.text_embeds)
    stats = assert_traffic_matches_plan(m)
    # every group once: whole, or (the token and position tables, groups of their own) the rows looked up
    assert len(m._offload_runtime.groups) > 5 and len(routed_only_groups(m)) == 2
    assert stats.fetch_count == len(m._offload_runtime.groups) - 2 and stats.routed_fetches == 2


@pytest.mark.slow  # the auto planner: about 10 s on a shared 2-core machine
def test_auto_plans_a_model_that_asks_for_its_own_hidden_states():
    """Segformer's segmentation head calls its encoder with output_hidden_states=True: before the fix the hooks'
    lock broke the first call's graph and strategy='auto' refused the model."""
    config = transformers.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
                                          num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2],
                                          mlp_ratios=[2, 2], decoder_hidden_size=16, num_labels=3)
    torch.manual_seed(0)
    model = transformers.SegformerForSemanticSegmentation(config).eval()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    policy = OffloadPolicy(strategy="auto", device="cpu", device_budget_gb=0.5 * weights / 2**30)
    with pytest.raises(InfeasibleBudgetError) as too_small:  # refused by the planner, not by a graph break
        plan_offload(model, policy, pixel_values=x)
    m = offload_compile(copy.deepcopy(model), policy.replace(device_budget_gb=too_small.value.needed_bytes / 2**30))
    with torch.no_grad():
        assert torch.equal(m(pixel_values=x).logits, model(pixel_values=x).logits)
        reset_offload_stats(m)
        assert torch.equal(m(pixel_values=x).logits, model(pixel_values=x).logits)
    assert len(m._offload_runtime.graph_plans) == 1
    stats = assert_traffic_matches_plan(m, resident_filled=True)
    assert stats.streamed_bytes > 0



def test_an_infeasible_auto_budget_names_how_to_change_it_and_changes_nothing():
    model = _stack()
    plain = copy.deepcopy(model)
    m = offload_compile(model, OffloadPolicy(strategy="auto", device="cpu", device_budget_gb=1e-9))
    x = torch.randn(2, 8)
    for _ in range(2):  # every call plans again, with the same budget
        with pytest.raises(InfeasibleBudgetError) as error, torch.no_grad():
            m(x)
        assert "offload_compile(remove_offload(m), policy.replace(device_budget_gb=...))" in "\n".join(
            getattr(error.value, "__notes__", []))
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), plain.state_dict().values()))
    m = offload_compile(remove_offload(m), OffloadPolicy(strategy="auto", device="cpu",
                                                         device_budget_gb=error.value.needed_bytes / 2**30))
    with torch.no_grad():
        assert torch.equal(m(x), plain(x))


def test_an_offloaded_forward_has_the_methods_signature():
    """transformers' generate checks its kwargs against inspect.signature(model.forward): before the fix it saw
    (*args, **kwargs) and refused pixel_values ("model_kwargs are not used by the model")."""
    model = _stack()
    expected = inspect.signature(model.forward)
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu"))
    assert inspect.signature(m.forward) == expected


def _llava():
    torch.manual_seed(0)
    vision = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=8, patch_size=4, projection_dim=16)
    text = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=60,
                                      vision_feature_layer=-2, vision_feature_select_strategy="default",
                                      image_seq_length=4)
    ids = torch.randint(3, 59, (1, 10), generator=torch.Generator().manual_seed(0))
    ids[0, 2:6] = 60  # the image's 4 patches
    pixels = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    return transformers.LlavaForConditionalGeneration(config).eval(), ids, pixels


@pytest.mark.slow  # a vision tower and a language model captured for the prefill and the decoding steps
def test_generate_of_a_vision_language_model_streams_the_plan():
    """generate() calls the image encoder on its own (m.model.get_image_features, on a container of groups):
    routed through its own offloaded graph. Before the fix it was refused (run from Python, host weights)."""
    model, ids, pixels = _llava()
    m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="layerwise", device="cpu", debug_poison=True))
    with torch.no_grad():
        expected = model.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=3, do_sample=False)
        assert torch.equal(m.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=3, do_sample=False),
                           expected)
    assert_traffic_matches_plan(m)
    runtime = m._offload_runtime
    fetched = {runtime.groups[i.group].name for p in runtime.graph_plans for i in p.schedule.instances}
    assert {g.name for g in runtime.groups if g.name.startswith("model.vision_tower.encoder")} <= fetched


@pytest.mark.parametrize("compiler", ["eager", "omni_offload"])
def test_first_call_in_inference_mode_then_no_grad(compiler):
    """The first call allocates the device slots (and, through omni_offload, packs the host buffers): made as
    ordinary tensors, a later call outside inference mode refills them."""
    from offload_compiler.testing import BlockSpec, ModelSpec, build_block_model
    model, x = build_block_model(ModelSpec(16, (BlockSpec("mlp", 32),) * 3, False, True, 4, 2), 2)
    plain = copy.deepcopy(model)
    if compiler == "eager":
        m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu"))
    else:
        m = torch.compile(model, backend="omni_offload", options={"strategy": "layerwise", "device": "cpu"})
    with torch.inference_mode():
        torch.testing.assert_close(m(x), plain(x), rtol=0, atol=0)
    target = m if compiler == "eager" else model
    reset_offload_stats(target)
    for _ in range(2):
        with torch.no_grad():
            torch.testing.assert_close(m(x), plain(x), rtol=0, atol=0)
    assert_traffic_matches_plan(target)  # offloading happened outside inference mode, as planned
