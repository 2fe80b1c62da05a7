"""Every route a user can take to call an offloaded model streams exactly the verified plan's bytes and
fetches, or refuses with the fix named. One state per model, reached one way, whichever entry made it."""

import contextvars
import copy
import functools
import gc
import resource
import warnings

import pytest
from devices import host_and
import torch
from torch import nn

from offload_compiler import (OffloadedModule, OffloadPolicy, describe_plan, inject_fault, offload_compile,
                              offload_groups, offload_plan, offload_stats, remove_offload, reset_offload_stats)
from offload_compiler.testing.models import _diffusion_parts, denoise_and_decode, diffusion_pipeline, llama, unet
from offload_compiler.testing import assert_traffic_matches_plan, routed_only_groups
from offload_compiler.policy import REGIONS_TAKE_OFFLOADED_WEIGHTS

# torch 2.11 and 2.12 (the GPU image has 2.11) cannot pass offloaded weights into a nested compile region
needs_regions = pytest.mark.skipif(not REGIONS_TAKE_OFFLOADED_WEIGHTS,
                                   reason="regional=True is refused on this torch (see the refusal's test)")
users_regions_fail_on_this_torch = pytest.mark.xfail(
    not REGIONS_TAKE_OFFLOADED_WEIGHTS, strict=True,
    reason="torch < 2.13: a block the user marked as a nested compile region cannot take offloaded weights")

# inductor: every route compiled, ~30 s; also in CI's runs on the other torch versions, whose inductor changes
COMPILERS = ["eager", pytest.param("inductor", marks=[pytest.mark.slow, pytest.mark.newest_torch])]


def _llama():
    model, inputs = llama(layers=2)
    return model, inputs, copy.deepcopy(model)


def _assert_same(got, expected, compiler, what=""):
    if compiler == "eager" or not got.is_floating_point():
        assert torch.equal(got, expected), what
    else:  # inductor's kernels round differently from eager's
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4, msg=lambda m: f"{what}: {m}")


def _tokens(model, ids):
    return model.generate(ids, max_new_tokens=3, do_sample=False)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_every_route_of_a_language_model_streams_the_plan(compiler):
    model, inputs, plain = _llama()
    with torch.no_grad():
        expected = plain(**inputs).logits
        expected_tokens = _tokens(plain, inputs["input_ids"])
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu", compiler=compiler))
    assert m is model and isinstance(m, OffloadedModule) and isinstance(m, type(plain))

    routes = {
        "direct call": lambda: m(**inputs).logits,
        "generate": lambda: _tokens(m, inputs["input_ids"]),
        "the decoder stack called on its own": lambda: m.model(input_ids=inputs["input_ids"]).last_hidden_state,
        "the user's torch.compile around the model": lambda: torch.compile(m)(**inputs).logits,
        "a compiled function calling the model": lambda: torch.compile(lambda: m(**inputs).logits * 1)(),
    }
    with torch.no_grad():
        direct_hidden = plain.model(input_ids=inputs["input_ids"]).last_hidden_state
        wanted = {"direct call": expected, "generate": expected_tokens,
                  "the decoder stack called on its own": direct_hidden,
                  "the user's torch.compile around the model": expected,
                  "a compiled function calling the model": expected}
    for name, route in routes.items():
        reset_offload_stats(m)
        with torch.no_grad():
            got = route()
        _assert_same(got, wanted[name], compiler, name)
        stats = assert_traffic_matches_plan(m)  # exactly the plans' bytes and fetches, for every graph that ran
        assert stats.live_device_bytes == 0, name


@pytest.mark.slow
@pytest.mark.newest_torch
def test_every_part_called_from_python_runs_its_own_offloaded_graph():
    """Modules holding offloaded weights, called outside the model's call -- by hand, through an accessor, or by
    the model's forward reached around its instance attribute -- each fetch what they read, as planned."""
    model, inputs, plain = _llama()
    ids = inputs["input_ids"]
    with torch.no_grad():
        embedded = plain.get_input_embeddings()(ids)
        position = torch.arange(ids.shape[1])[None]
        rotary = plain.model.rotary_emb(embedded, position)
        wanted = {"the input embeddings": embedded,
                  "a decoder layer": plain.model.layers[0](embedded, position_embeddings=rotary)[0],
                  "a layer's MLP": plain.model.layers[1].mlp(embedded),
                  "the LM head": plain.lm_head(embedded),
                  "the class's forward": plain(**inputs).logits}
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu"))
    routes = {"the input embeddings": (lambda: m.get_input_embeddings()(ids), ["model.embed_tokens"]),
              "a decoder layer": (lambda: m.model.layers[0](embedded, position_embeddings=rotary)[0],
                                  ["model.layers.0"]),
              "a layer's MLP": (lambda: m.model.layers[1].mlp(embedded), ["model.layers.1"]),
              "the LM head": (lambda: m.lm_head(embedded), ["lm_head"]),
              "the class's forward": (lambda: type(m).forward(m, **inputs).logits, None)}
    groups = {g.index: g.name for g in m._offload_runtime.groups}
    for name, (route, fetched) in routes.items():
        reset_offload_stats(m)
        m._offload_runtime.used_groups.clear()
        with torch.no_grad():
            got = route()
        assert torch.equal(got, wanted[name]), name
        stats = assert_traffic_matches_plan(m)
        assert stats.live_device_bytes == 0, name
        if fetched is not None:
            assert sorted(groups[i] for i in m._offload_runtime.used_groups) == fetched, name
        else:  # the decoder stack and the head each ran their own graph: every group, once (whole, or the
            assert stats.fetch_count == len(groups) - len(routed_only_groups(m)), name  # embedding's rows)
    with torch.no_grad():
        assert torch.equal(m(**inputs).logits, wanted["the class's forward"])


def _layer_inputs(plain, ids):
    """A decoder layer's inputs, as the model makes them: the embedded tokens and the rotary embeddings."""
    with torch.no_grad():
        embedded = plain.get_input_embeddings()(ids)
        return embedded, plain.model.rotary_emb(embedded, torch.arange(ids.shape[1])[None])


@pytest.mark.slow
@pytest.mark.newest_torch
def test_a_decoder_layer_by_hand_is_one_graph_fetching_its_group_once_and_hidden_states_still_collect():
    """The output-capturing hooks transformers puts on every decoder layer (installed at offloading) read their
    collector from a ContextVar, which dynamo cannot trace: called by hand, with no model call around it, a
    layer broke into a graph per hooked module, each fetching the layer's group (3 fetches a call). It is one
    graph fetching its group once per call; the model's own output_hidden_states=True call still collects every
    hidden state, before and after."""
    model, inputs, plain = _llama()
    embedded, rotary = _layer_inputs(plain, inputs["input_ids"])
    with torch.no_grad():
        expected_layer = plain.model.layers[0](embedded, position_embeddings=rotary)
        expected_hidden = plain(**inputs, output_hidden_states=True).hidden_states
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu"))
    layer_bytes = {g.name: g.nbytes for g in offload_groups(m)}["model.layers.0"]

    def hidden_states_match():
        with torch.no_grad():
            got = m(**inputs, output_hidden_states=True).hidden_states
        return len(got) == len(expected_hidden) and all(map(torch.equal, got, expected_hidden))

    assert hidden_states_match()
    for call in range(2):  # the first compiles the layer's graph; the second is a steady call
        reset_offload_stats(m)
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = m.model.layers[0](embedded, position_embeddings=rotary)
        assert torch.equal(got, expected_layer), call
        stats = assert_traffic_matches_plan(m)
        assert (stats.calls, stats.fetch_count, stats.bytes_transferred) == (1, 1, layer_bytes), call
        assert not [w for w in caught if "outside its offloaded graphs" in str(w.message)], call
    assert hidden_states_match()


def test_fullgraph_around_an_offloaded_model_names_the_boundary():
    model, inputs, plain = _llama()
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu"))
    with pytest.raises(Exception, match="an offloaded model runs its own offloaded graph.*compiler='inductor'"):
        torch.compile(lambda: m(**inputs).logits + 1, fullgraph=True)()
    with torch.no_grad():  # and nothing was lost
        assert torch.equal(m(**inputs).logits, plain(**inputs).logits)


class _Prefix(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 8)

    def forward(self, x):
        h = self.embed(x)
        if h.sum().item() > -1e9:  # Tensor.item(): a graph break, as PaliGemma's input check has
            h = h + 1
        return h


class _BrokenForward(nn.Module):
    """A graph break in the root's forward (``in_root``) or in a submodule it calls first (PaliGemma's model, whose
    vision tower and embeddings ran eagerly under the user's fullgraph=True: a silent read of host weights)."""

    def __init__(self, in_root: bool):
        super().__init__()
        self.in_root = in_root
        self.prefix = _Prefix()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        h = self.prefix(x)
        if self.in_root and h.sum().item() > -1e9:
            h = h * 2
        for block in self.blocks:
            h = block(h)
        return h


@pytest.mark.parametrize("in_root", [True, False], ids=["break_in_root", "break_in_submodule"])
def test_the_users_fullgraph_compile_around_a_model_with_a_graph_break_streams_the_plan(in_root):
    """torch.compile(m, fullgraph=True) runs m's offloaded graphs as a direct call does. Under the user's fullgraph
    region torch runs every frame called from compiled code without dynamo: before the fix, the frames after our
    graph break ran eagerly -- the root's resume (refused: "ran without its offloaded graph") or the submodule
    holding the break (its weights read from host memory, silently; 2 of the 3 groups fetched)."""
    torch.manual_seed(0)
    model, x = _BrokenForward(in_root).eval(), torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="layerwise", device="cpu"))
    runtime = m._offload_runtime
    for route in (lambda: m(x), lambda: torch.compile(m, fullgraph=True)(x), lambda: m(x)):
        reset_offload_stats(m)
        runtime.used_groups.clear()
        with torch.no_grad():
            assert torch.equal(route(), expected)
        assert_traffic_matches_plan(m)
        assert sorted(runtime.used_groups) == [g.index for g in runtime.groups]  # every group read by a graph


# a Llama captured through the backend, then generating
@pytest.mark.parametrize("compiler", [pytest.param("eager", marks=[pytest.mark.slow, pytest.mark.newest_torch]),
                                      pytest.param("inductor", marks=[pytest.mark.slow, pytest.mark.trial])])
def test_the_backend_offloads_in_place_so_generate_streams_too(compiler):
    model, inputs, plain = _llama()
    c = torch.compile(model, backend="omni_offload", options={"strategy": "layerwise", "device": "cpu",
                                                              "compiler": compiler})
    with pytest.raises(ValueError, match="not offloaded.*after its first call"):
        offload_stats(c)  # torch.compile cannot tell its backend about the model before the first call
    with torch.no_grad():
        _assert_same(c(**inputs).logits, plain(**inputs).logits, compiler)
        assert isinstance(model, OffloadedModule)
        reset_offload_stats(c)
        assert torch.equal(_tokens(c, inputs["input_ids"]), _tokens(plain, inputs["input_ids"]))
    assert_traffic_matches_plan(model)  # one state: the wrapper and the model report the same
    assert offload_stats(c) == offload_stats(model)


@pytest.mark.newest_torch
@pytest.mark.parametrize("how", ["model.compile", "model.forward = torch.compile(model.forward)"])
def test_a_model_compiled_in_place_with_the_backend_streams_generate_from_its_first_call(how):
    """torch's in-place idioms (``nn.Module.compile``, and transformers' ``model.forward = torch.compile(...)``)
    compile the calls that ``generate`` makes: the first graph offloads the model, and every call streams the plan."""
    model, inputs, plain = _llama()
    ids = inputs["input_ids"]
    options = {"strategy": "layerwise", "device": "cpu"}
    own_forward = None
    if how == "model.compile":
        model.compile(backend="omni_offload", options=options)
    else:
        own_forward = model.forward = torch.compile(model.forward, backend="omni_offload", options=options)
    with torch.no_grad():
        assert torch.equal(_tokens(model, ids), _tokens(plain, ids))
    assert isinstance(model, OffloadedModule)
    stats = assert_traffic_matches_plan(model)  # the first call (the graph torch captured) by its own plan too
    table = model.get_input_embeddings().weight.nbytes  # looked up by rows: those rows move, not the table
    assert stats.calls == stats.routed_fetches == 3
    assert stats.bytes_transferred - stats.routed_bytes == 3 * (stats.total_bytes - table)
    assert stats.peak_resident_bytes < stats.total_bytes
    remove_offload(model)
    assert model.__dict__.get("forward") is own_forward  # the user's compiled forward, given back


@pytest.mark.parametrize("device", host_and("sim"))
def test_a_forward_set_on_the_instance_before_offloading_is_what_the_model_runs(device):
    """A wrapper set as ``model.forward`` (by the user or a library) is part of what the model computes: the
    offloaded graph runs it, and ``remove_offload`` gives it back."""
    from offload_compiler.testing import simulated_device
    device = simulated_device() if device == "sim" else device
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval()
    class_forward = model.forward
    model.forward = wrapper = lambda x: class_forward(x) * 2 + 1  # noqa: E731
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
        m = offload_compile(model, OffloadPolicy(strategy="layerwise", device=device))
        got = m(x.to(device)).cpu()
    assert torch.equal(got, expected)
    assert assert_traffic_matches_plan(m).fetch_count == 3
    assert remove_offload(m).__dict__["forward"] is wrapper


# the simulated device (not the host) keeps the case in the fast subset
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.slow), "sim"])
def test_auto_whose_plan_fails_keeps_streaming_its_parts(device):
    """The whole call cannot plan (the budget is too small): the error names the budget, the weights are unchanged,
    and a part called after it streams again (on a runtime of its own), as before the failed plan."""
    from offload_compiler.testing import simulated_device
    device = simulated_device() if device == "sim" else device
    model, inputs, plain = _llama()
    ids = inputs["input_ids"].to(device)
    m = offload_compile(model, OffloadPolicy(strategy="auto", device=device, device_budget_gb=1e-7))
    with torch.no_grad():
        expected = plain.model(input_ids=inputs["input_ids"]).last_hidden_state
        torch.testing.assert_close(m.model(input_ids=ids).last_hidden_state.cpu(), expected)
        with pytest.raises(ValueError, match="device_budget_gb"):
            m(input_ids=ids)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(m.state_dict().values(), plain.state_dict().values()))
        reset_offload_stats(m)
        torch.testing.assert_close(m.model(input_ids=ids).last_hidden_state.cpu(), expected)
    assert assert_traffic_matches_plan(m).fetch_count > 0


def test_auto_plans_the_forward_set_on_the_instance(monkeypatch):
    """``auto`` plans (and runs) what the model's forward is: a wrapper set on the instance included."""
    from offload_compiler.planning import auto
    planned = []
    capture = auto.capture_graph

    def recording(*args, **kwargs):
        gm, example_inputs = capture(*args, **kwargs)
        planned.append(gm)
        return gm, example_inputs
    monkeypatch.setattr(auto, "capture_graph", recording)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval()
    class_forward = model.forward
    model.forward = lambda x: class_forward(x).softmax(-1) * 3  # noqa: E731
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
        m = offload_compile(model, OffloadPolicy(strategy="auto", device="cpu", device_budget_gb="free"))
        assert torch.equal(m(x), expected)
    assert planned and all(any("softmax" in str(n.target) for n in gm.graph.nodes) for gm in planned)


@pytest.mark.slow
@pytest.mark.newest_torch
def test_auto_plans_at_whatever_call_comes_first():
    model, inputs, plain = _llama()
    m = offload_compile(model, OffloadPolicy(strategy="auto", device="cpu", device_budget_gb="free"))
    assert offload_stats(m).fetch_count == 0  # nothing planned, nothing moved: no error either
    reset_offload_stats(m)
    with torch.no_grad():
        tokens = _tokens(m, inputs["input_ids"])  # generate() is the first use: it plans from its first call
        assert torch.equal(tokens, _tokens(plain, inputs["input_ids"]))
    assert m._offload_runtime is not None and offload_stats(m).fetch_count > 0


@pytest.mark.slow
@pytest.mark.newest_torch
def test_auto_streams_a_part_called_before_the_whole_model_then_plans_at_its_first_whole_call():
    """An encoder-decoder's ``generate`` calls its encoder before the model: until a whole call plans, parts stream
    one block at a time (every group, exactly as the verified plans say); the whole call then plans, and the stats
    count on across the change of runtime."""
    model, inputs, plain = _llama()
    ids = inputs["input_ids"]
    m = offload_compile(model, OffloadPolicy(strategy="auto", device="cpu", device_budget_gb="free"))
    with torch.no_grad():
        assert torch.equal(m.model(input_ids=ids).last_hidden_state, plain.model(input_ids=ids).last_hidden_state)
    before = assert_traffic_matches_plan(m)  # the part's graph fetched every group of its blocks, once each
    assert before.fetch_count > 0 and before.peak_resident_bytes < before.total_bytes
    streaming = offload_groups(m)  # until the plan: the block-by-block groups the part streamed
    assert "not planned yet" in describe_plan(m) and streaming and all(g.streamed for g in streaming if g.nbytes)
    with pytest.raises(ValueError, match="no auto offload plan"):
        offload_plan(m)
    with torch.no_grad():
        assert torch.equal(m(**inputs).logits, plain(**inputs).logits)  # the first whole call plans
    assert offload_plan(m).prefetch >= 0 and offload_groups(m)
    after = offload_stats(m)
    assert after.bytes_transferred > before.bytes_transferred and after.calls == before.calls + 1
    with torch.no_grad():
        assert torch.equal(m.model(input_ids=ids).last_hidden_state, plain.model(input_ids=ids).last_hidden_state)


class HeadAfterLoop(nn.Module):
    """A data-dependent check inside the block loop: dynamo runs ``run_blocks`` without a graph."""
    _layerwise_offload_blocks_attr = "blocks"

    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(16, 16), nn.Linear(16, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def run_blocks(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
            if float(x.sum()) > 1e9:
                x = x * 0
        return x

    def forward(self, x):
        return self.head(self.run_blocks(self.proj(x)))


def test_modules_called_where_dynamo_runs_no_graph_stream_on_every_call():
    """The blocks are called from a frame that dynamo runs without a graph: each runs as its own offloaded graph
    (they were read from host memory, and the model refused, before)."""
    model = HeadAfterLoop().eval().requires_grad_(False)
    x = torch.randn(2, 16)
    with torch.no_grad():
        expected = model(x)
    m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="layerwise", device="cpu"))
    with pytest.warns(UserWarning, match=r"without a graph.*blocks\.0.*own offloaded graph \(\d+ B fetched\).*hook-based offloader"):
        for _ in range(2):  # dynamo skips the frame silently from the second call on: streamed the same way
            reset_offload_stats(m)
            with torch.no_grad():
                assert torch.equal(m(x), expected)
            assert_traffic_matches_plan(m)
            assert m._offload_runtime.used_groups == {g.index for g in m._offload_runtime.groups}


class Stack(nn.Module):
    _layerwise_offload_blocks_attr = "blocks"

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


def test_hooks_changed_after_offloading_are_refused_and_nothing_changes():
    model = Stack().eval()
    x = torch.randn(2, 8)
    early = model.blocks[0].register_forward_hook(lambda mod, args, out: out * 2)  # before: captured
    with torch.no_grad():
        expected = model(x)
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu"))
    assert torch.equal(m(x), expected)
    for register in (lambda: m.blocks[1].register_forward_hook(lambda mod, args, out: out + 1),
                     lambda: m.register_forward_pre_hook(lambda mod, args: None)):
        late = register()  # refused at the next call, until the hook is gone again
        with pytest.raises(RuntimeError, match="a hook registered now would be silently ignored.*remove_offload"):
            m(x)
        late.remove()
    other = Stack()
    other.register_forward_hook(lambda mod, args, out: out)  # another model's hooks are none of its business
    reset_offload_stats(m)
    assert torch.equal(m(x), expected)
    assert_traffic_matches_plan(m)
    early.remove()  # through a handle from before offloading: noticed at the next call
    with pytest.raises(RuntimeError, match="a hook removed now would be silently ignored"):
        m(x)
    plain = remove_offload(m)  # hooks can change again once the model is given back
    assert not plain.blocks[0]._forward_hooks and torch.equal(plain(x), torch.relu(torch.relu(torch.relu(
        plain.blocks[0](x)) @ plain.blocks[1].weight.T + plain.blocks[1].bias) @ plain.blocks[2].weight.T
        + plain.blocks[2].bias))
    plain.blocks[1].register_forward_hook(lambda mod, args, out: out + 1)


def _sd_pipeline():
    from diffusers import DDIMScheduler, StableDiffusionPipeline
    text_encoder, _, vae, _ = _diffusion_parts(0)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=None, unet=unet(0)[0],
                                   scheduler=DDIMScheduler(clip_sample=False), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _denoise(pipe, embeddings):
    return pipe(prompt_embeds=embeddings, negative_prompt_embeds=torch.zeros_like(embeddings), height=8, width=8,
                num_inference_steps=2, output_type="pt", generator=torch.Generator().manual_seed(1)).images


@pytest.mark.slow
@pytest.mark.newest_torch
def test_model_level_offload_of_a_unet_pipeline_streams_the_unet_on_every_call():
    pipe = _sd_pipeline()
    embeddings = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(0))
    expected = _denoise(pipe, embeddings)
    offload_compile(pipe, OffloadPolicy(strategy="model", device="cpu", keep_after_use=False))
    names = {g.name: g for g in pipe._offload_state.runtime.groups}
    assert set(names) == {"unet", "text_encoder"}  # the UNet is the denoiser, not its inner block lists
    for _ in range(2):
        reset_offload_stats(pipe)
        assert torch.equal(_denoise(pipe, embeddings), expected)
        stats = assert_traffic_matches_plan(pipe)
        assert stats.bytes_transferred == 2 * names["unet"].nbytes  # 2 steps (conditional and unconditional batched)
    inject_fault(pipe, "fetch", "unet")
    with pytest.raises(RuntimeError, match="injected fault"):
        _denoise(pipe, embeddings)
    assert torch.equal(_denoise(pipe, embeddings), expected)


@pytest.mark.slow
@pytest.mark.newest_torch
def test_ten_thousand_forwards_leave_the_context_and_memory_where_they_were():
    model = Stack().eval()
    x = torch.randn(1, 8)
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu"))
    for _ in range(50):
        m(x)
    gc.collect()
    context = len(contextvars.copy_context())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, the high-water mark
    for _ in range(10_000):
        m(x)
    gc.collect()
    assert len(contextvars.copy_context()) == context
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 20 * 1024  # < 20 MiB over 10,000 calls


class Layouts(nn.Module):
    _layerwise_offload_blocks_attr = "blocks"

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Conv2d(4, 4, 3, padding=1), nn.Linear(8, 8)])
        self.blocks[0].weight.data = self.blocks[0].weight.data.to(memory_format=torch.channels_last)
        self.blocks[1].weight.data = torch.randn(8, 8).t()  # a transposed view's layout

    def forward(self, x):
        return self.blocks[1](self.blocks[0](x))


def test_remove_offload_gives_every_weight_its_strides_back():
    model = Layouts().eval()
    x = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        expected = model(x)
    strides = {name: p.stride() for name, p in model.named_parameters()}
    values = {name: p.detach().clone() for name, p in model.named_parameters()}
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu"))
    torch.testing.assert_close(m(x), expected)  # the fetched copies are contiguous: other kernels, other rounding
    plain = remove_offload(m)
    assert {name: p.stride() for name, p in plain.named_parameters()} == strides
    assert plain.blocks[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert all(torch.equal(p, values[name]) for name, p in plain.named_parameters())


class _WithOwnMethod(nn.Module):
    _layerwise_offload_blocks_attr = "blocks"

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.proj = nn.Linear(8, 4)

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.proj(x)

    def project(self, x):  # reads a weight directly, not through a module call
        return torch.relu(self.blocks[0](x)) @ self.proj.weight.T


def test_a_registered_method_runs_as_one_offloaded_graph_fetching_what_it_reads():
    from offload_compiler import register_offload_method
    model = _WithOwnMethod().eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model.project(x)
    m = offload_compile(model, OffloadPolicy(strategy="sequential", device="cpu", prefetch=0))
    register_offload_method(m, "project")
    reset_offload_stats(m)
    with torch.no_grad():
        assert torch.equal(m.project(x), expected)
    stats = offload_stats(m)
    held = {g.name: g.nbytes for g in m._offload_runtime.groups}
    assert stats.bytes_transferred == held["blocks.0"] + held["proj"]  # proj.weight fetched, read as a tensor
    with pytest.raises(ValueError, match="not a method"):
        register_offload_method(m, "blocks")
    with pytest.raises(ValueError, match="no part 'nothing'"):
        register_offload_method(m, "nothing.forward")


class _PlainBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _RegionBlock(_PlainBlock):
    @torch.compiler.nested_compile_region  # the user's regional compilation: one block traced, reused for each
    def forward(self, x):
        return super().forward(x)


class _SplitBlock(_PlainBlock):
    def forward(self, x):  # two views of one tensor, as Flux's single blocks return: dynamo refuses such a region
        h = super().forward(x)
        return h[..., :8], h[..., 8:]


class _Blocks(nn.Module):
    def __init__(self, block: type, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(depth))
        self.head = nn.Linear(16, 16)

    def forward(self, x):
        for block in self.blocks:
            out = block(x)
            x = torch.cat(out, -1) if isinstance(out, tuple) else out
        return self.head(x)


@users_regions_fail_on_this_torch
@pytest.mark.parametrize("device", host_and("sim"))
def test_blocks_marked_as_a_nested_compile_region_each_run_on_their_own_weights(device):
    """Dynamo reuses a marked region's graph for every block, passing each block's weights in. Before routing was
    a class's, each weight holder's forward was an object of its own: dynamo reused the first block's graph *with
    the first block's weights* for all four (a silent wrong output, off by about 1)."""
    from offload_compiler.testing import simulated_device
    device = simulated_device() if device == "sim" else device
    model = _Blocks(_RegionBlock).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        expected = model(x)
        m = offload_compile(model, OffloadPolicy(strategy="layerwise", device=device, debug_poison=True))
        got = m(x.to(device)).cpu()
    torch.testing.assert_close(got, expected)  # the simulated device's kernels round differently
    stats = assert_traffic_matches_plan(m)
    assert stats.fetch_count == 5 and stats.bytes_transferred == sum(p.numel() * 4 for p in m.parameters())


@users_regions_fail_on_this_torch
@pytest.mark.parametrize("regional", [False, pytest.param(True, marks=needs_regions)])
def test_a_part_whose_instance_set_its_own_forward_runs_it_and_gets_it_back(regional):
    """A block whose ``forward`` was set on the instance (a wrapper of the user's) runs that wrapper, traced inside
    the model's graph (also where its stack's other blocks are regions) and when called by hand; `remove_offload`
    gives it back, and the block its own class."""
    base = _PlainBlock if regional else _RegionBlock
    model = _Blocks(base, depth=2).eval()
    block = model.blocks[1]
    block.forward = wrapper = lambda x: base.forward(block, x) * 2  # noqa: E731
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        expected, expected_block = model(x), block(x)
        m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu", regional=regional))
        assert torch.equal(m(x), expected)
        assert type(m.blocks[1]) is not base and isinstance(m.blocks[1], base)
        reset_offload_stats(m)
        assert torch.equal(m.blocks[1](x), expected_block)  # by hand: the block's own offloaded graph
        assert offload_stats(m).bytes_transferred == sum(p.numel() * 4 for p in block.parameters())
    plain = remove_offload(m)
    assert type(plain.blocks[1]) is base and plain.blocks[1].__dict__["forward"] is wrapper


def _captured_regions(monkeypatch) -> list:
    """(calls of a traced block region, distinct region graphs) of each graph the backend is given."""
    import offload_compiler.backend as backend
    seen, compile_graph = [], backend.compile_graph

    def recording(gm, example_inputs, runtime):
        regions = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph]
        seen.append((len(regions), len({n.args[1] for n in regions})))
        return compile_graph(gm, example_inputs, runtime)
    monkeypatch.setattr(backend, "compile_graph", recording)
    return seen


def test_regional_on_a_torch_without_regions_over_offloaded_weights_is_refused_naming_the_fix(monkeypatch):
    """Torch 2.11 and 2.12 fail inside dynamo (an assertion on the region's operands) for a region over host
    masters: ``regional=True`` is refused when the policy is made, naming both ways out."""
    import offload_compiler.policy as policy
    monkeypatch.setattr(policy, "REGIONS_TAKE_OFFLOADED_WEIGHTS", False)
    with pytest.raises(ValueError, match=r"regional=True needs torch >= 2.13.*Use regional=False.*or upgrade torch"):
        OffloadPolicy(strategy="layerwise", regional=True)
    assert OffloadPolicy(strategy="layerwise").regional is False


@needs_regions
@pytest.mark.parametrize("device", host_and("sim"))
def test_regional_traces_a_stacks_block_once_and_each_block_streams_its_own_weights(device, monkeypatch):
    """``regional=True``: the four blocks are one traced region called four times, each with its own block's
    weights, fetched as the plan says; without it, each block is traced inline."""
    from offload_compiler.testing import simulated_device
    device = simulated_device() if device == "sim" else device
    seen = _captured_regions(monkeypatch)
    model = _Blocks(_PlainBlock).eval()
    plain = copy.deepcopy(model)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        expected = model(x)
        m = offload_compile(model, OffloadPolicy(strategy="layerwise", device=device, regional=True, debug_poison=True))
        torch.testing.assert_close(m(x.to(device)).cpu(), expected)
        assert seen == [(4, 1)]
        stats = assert_traffic_matches_plan(m)
        assert stats.fetch_count == 5 and stats.bytes_transferred == sum(p.numel() * 4 for p in m.parameters())
        inline = offload_compile(plain, OffloadPolicy(strategy="layerwise", device=device))
        torch.testing.assert_close(inline(x.to(device)).cpu(), expected)
        assert seen[1:] == [(0, 0)]


@needs_regions
def test_a_blocks_region_is_called_from_its_routed_forward_itself():
    """Under ``regional=True`` the routed forward calls the block's nested compile region itself, with the
    block's ``*args, **kwargs`` as its call gave them: a frame of ours in between (passing them on again) made
    dynamo's first call of a tiny DiT 5 ms slower per block, in the region's input fingerprint
    (benchmarks/regional_phases.py). The choice of region or inline code stays the forward's own."""
    from offload_compiler.offloaded.forwards import routed_class
    routed = routed_class(_PlainBlock, region=True)
    forward = routed.__dict__["forward"]
    closure = dict(zip(forward.__code__.co_freevars, (cell.cell_contents for cell in forward.__closure__)))
    assert closure["region"] is routed._offload_region is not None
    assert closure["traced"] is _PlainBlock.forward  # inline, where dynamo could not reuse the region
    assert routed_class(_PlainBlock).__dict__["forward"].__code__ is forward.__code__  # one code object


_BODY_TRACES = []


@torch.compiler.assume_constant_result  # run by dynamo each time it traces the code that calls it, not per call
def _body_traced() -> bool:
    _BODY_TRACES.append(1)
    return True


class _Cache:
    """Stands in for a KV cache: an object a block is given and writes into (an object dynamo cannot fingerprint)."""

    def __init__(self) -> None:
        self.seen = []


class _CachingBlock(_PlainBlock):
    def forward(self, x, cache=None, scale=1.0):
        if _body_traced() and cache is not None:
            cache.seen.append(x.shape[-1])  # a write into the call's object, as a decoder layer's cache update
        return super().forward(x) * scale


class _CachingBlocks(_Blocks):
    def forward(self, x, use_cache=True):
        cache = _Cache() if use_cache else None
        for block in self.blocks:
            x = block(x, cache=cache, scale=0.5)
        return self.head(x), len(cache.seen) if cache is not None else 0


@needs_regions
@pytest.mark.parametrize("use_cache", [False, True])
def test_regional_traces_a_block_once_unless_its_call_takes_an_object_dynamo_cannot_reuse_it_for(use_cache,
                                                                                                 monkeypatch):
    """Without the cache, the four blocks' body is traced once, one region called four times. Called with an object
    (as a decoder layer with its KV cache), dynamo would trace the region again for every block (it fingerprints
    only tensors, numbers, strings, None and modules, and the block writes into the object): the blocks are
    traced inline, once each, without the region's own costs. Outputs and traffic as the plain model's."""
    seen = _captured_regions(monkeypatch)
    model = _CachingBlocks(_CachingBlock).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        expected = model(x, use_cache=use_cache)
        m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu", regional=True))
        _BODY_TRACES.clear()
        got = m(x, use_cache=use_cache)
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1] == (4 if use_cache else 0)
    assert seen == ([(0, 0)] if use_cache else [(4, 1)])
    assert len(_BODY_TRACES) == (4 if use_cache else 1)
    stats = assert_traffic_matches_plan(m)
    assert stats.fetch_count == 5 and stats.bytes_transferred == sum(p.numel() * 4 for p in m.parameters())


@needs_regions
@pytest.mark.parametrize("use_cache", [False, True])
def test_regional_llama_layers_are_one_region_without_the_kv_cache_and_inline_with_it(use_cache, monkeypatch):
    """A Llama's decoder layers: one region for all three without the KV cache; with it (each layer is given the
    cache object and writes into it) they are traced inline. Logits equal the plain model's either way."""
    seen = _captured_regions(monkeypatch)
    model, inputs = llama(layers=3)
    plain = copy.deepcopy(model)
    inputs = {**inputs, "use_cache": use_cache}
    with torch.no_grad():
        expected = plain(**inputs).logits
        m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu", regional=True))
        assert torch.equal(m(**inputs).logits, expected)
    assert seen == ([(0, 0)] if use_cache else [(3, 1)])
    assert_traffic_matches_plan(m)


@needs_regions
@pytest.mark.parametrize("device", host_and("sim"))
def test_regional_refused_by_dynamo_captures_the_model_whole_with_one_warning(device, monkeypatch):
    """A block returning two views of one tensor cannot be a nested compile region (dynamo: aliasing in a higher
    order op); the call is made again with the blocks traced inline, and says so once."""
    from offload_compiler.testing import simulated_device
    device = simulated_device() if device == "sim" else device
    seen = _captured_regions(monkeypatch)
    model = _Blocks(_SplitBlock).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        expected = model(x)
        m = offload_compile(model, OffloadPolicy(strategy="layerwise", device=device, regional=True))
        with pytest.warns(UserWarning, match=r"regional compilation is off for _Blocks.*traced inline") as caught:
            got = m(x.to(device)).cpu()
        torch.testing.assert_close(got, expected)
        assert seen[-1] == (0, 0)
        assert [w.filename for w in caught if "regional" in str(w.message)] == [__file__]  # the user's line
        assert_traffic_matches_plan(m)
        reset_offload_stats(m)
        torch.testing.assert_close(m(x.to(device)).cpu(), expected)
        stats = assert_traffic_matches_plan(m)
        assert stats.fetch_count == 5 and stats.bytes_transferred == sum(p.numel() * 4 for p in m.parameters())


class _NormedBlock(nn.Module):
    """A block whose norm is an ``nn.Identity`` where ``plain`` (ModernBERT's first layer), a LayerNorm elsewhere."""

    def __init__(self, plain: bool = False) -> None:
        super().__init__()
        self.norm = nn.Identity() if plain else nn.LayerNorm(16)
        self.fc = nn.Linear(16, 16)
        if not plain:
            nn.init.uniform_(self.norm.weight, 2.0, 3.0)

    def forward(self, x):
        return x + self.fc(self.norm(x))


@needs_regions
@pytest.mark.parametrize("device", host_and("sim"))
def test_regional_blocks_of_one_class_built_otherwise_are_regions_of_their_own(device, monkeypatch):
    """Dynamo reuses a block's traced region for any later block of the class whose inputs match, whatever its
    submodules: the LayerNorm blocks ran the first block's graph, which has no norm (off by about 1). Blocks are
    regions by class and structure: the plain model's outputs."""
    from offload_compiler.testing import simulated_device
    device = simulated_device() if device == "sim" else device
    seen = _captured_regions(monkeypatch)
    torch.manual_seed(0)
    model = _Blocks(_NormedBlock).eval()
    model.blocks[0] = _NormedBlock(plain=True)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        expected = model(x)
        m = offload_compile(model, OffloadPolicy(strategy="layerwise", device=device, regional=True))
        torch.testing.assert_close(m(x.to(device)).cpu(), expected)
    # the three LayerNorm blocks run one region graph; the other block is inline or a region graph of its own
    assert seen[-1] in ((3, 1), (4, 2))
    assert_traffic_matches_plan(m)


class _ScaledBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, scale):
        return x + self.fc(x) * scale


class _ScaledBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ScaledBlock() for _ in range(4))

    def forward(self, x, scale):
        for block in self.blocks:
            x = block(x, scale)
        return x


@needs_regions
@pytest.mark.parametrize("device", host_and("sim"))
def test_regional_blocks_given_a_float_that_changes_are_traced_inline_with_one_warning(device):
    """A float that changes between calls is traced as a symbol from the second call on, and torch's region call
    takes none (an assertion at every call after that). Such a graph is captured again with the blocks inline,
    said once; the outputs and traffic are the plain model's and the plan's."""
    from offload_compiler.testing import simulated_device
    device = simulated_device() if device == "sim" else device
    torch.manual_seed(0)
    model = _ScaledBlocks().eval()
    x = torch.randn(2, 16)
    with torch.no_grad():
        m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="layerwise", device=device, regional=True))
        torch.testing.assert_close(m(x.to(device), 1.0).cpu(), model(x, 1.0))
        with pytest.warns(UserWarning, match=r"regional compilation is off for _ScaledBlocks.*a float that changed"):
            got = m(x.to(device), 2.0).cpu()
        torch.testing.assert_close(got, model(x, 2.0))
        reset_offload_stats(m)
        torch.testing.assert_close(m(x.to(device), 3.0).cpu(), model(x, 3.0))
    assert assert_traffic_matches_plan(m).fetch_count == 4


def _one_wrapper(forward):
    """A decorator many classes share (transformers wraps its models' forwards in one ``wrapper``)."""
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        return forward(self, *args, **kwargs)
    return wrapper


class _FactorBlock(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.factor = factor

    def forward(self, x):
        return x + self.fc(x) * self.factor


class _ModelA(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_FactorBlock(factor) for _ in range(3))

    @_one_wrapper
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class _ModelB(_ModelA):
    @_one_wrapper
    def forward(self, x):
        for block in self.blocks:
            x = block(x) * 2
        return x


@needs_regions
@pytest.mark.parametrize("device", host_and("sim"))
def test_regional_models_offloaded_one_after_another_trace_as_if_each_were_alone(device, monkeypatch):
    """What dynamo learns of a frame's inputs (a float that differed between compiles becomes a symbol) is kept by
    the frame's code file, line, name and the code it closes over; our frames' names are their own, so a second
    model (another class, its forward wrapped by the same decorator, its blocks' factor another float) is traced
    as if alone: its blocks one region, no fallback, the plain model's outputs."""
    from offload_compiler.testing import simulated_device
    device = simulated_device() if device == "sim" else device
    seen = _captured_regions(monkeypatch)
    x = torch.randn(2, 16)
    for cls, factor in ((_ModelA, 0.5), (_ModelB, 0.25)):
        torch.manual_seed(0)
        model = cls(factor).eval()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*regional compilation is off")
            m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="layerwise", device=device,
                                                                    regional=True))
            torch.testing.assert_close(m(x.to(device)).cpu(), model(x))
        assert seen[-1] == (3, 1)
        assert_traffic_matches_plan(m)


@needs_regions
@pytest.mark.slow  # an inductor compile and an auto plan, about 30 s
def test_regional_under_inductor_and_auto_streams_the_plan(monkeypatch):
    """A language model's decoder layers as one region: under inductor (poisoned evictions: a read after its
    evict shows as NaN) and under ``auto``, whose blocks become regions once it planned."""
    seen = _captured_regions(monkeypatch)
    model, inputs, plain = _llama()
    inputs = {**inputs, "use_cache": False}  # with its KV cache, the layers are traced inline (the test above)
    with torch.no_grad():
        expected = plain(**inputs).logits
        m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu", compiler="inductor",
                                                 regional=True, debug_poison=True))
        _assert_same(m(**inputs).logits, expected, "inductor")
        assert seen[-1] == (2, 1)
        assert_traffic_matches_plan(m)
        seen.clear()
        auto = offload_compile(remove_offload(m), OffloadPolicy(strategy="auto", device="cpu", regional=True,
                                                                device_budget_gb=0.0002))
        assert torch.equal(auto(**inputs).logits, expected)
        assert seen[-1] == (2, 1)
        reset_offload_stats(auto)  # the first call copied the resident groups; a steady call streams the rest
        assert torch.equal(auto(**inputs).logits, expected)
        assert assert_traffic_matches_plan(auto, resident_filled=True).fetch_count > 0


class _BreakingHead(_Blocks):
    def forward(self, x):
        x = super().forward(x)
        print("", end="")  # a graph break: under fullgraph=True dynamo's error, whatever regional says
        return x


@needs_regions
def test_regional_keeps_an_error_that_is_not_the_regions_and_says_nothing_of_them():
    """The call fails in dynamo for another reason than a region (a graph break under ``fullgraph=True``): it is
    made again with the blocks inline, fails the same way, and that error is the call's -- no word of regions."""
    model = _BreakingHead(_PlainBlock).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        expected = model(x)
        m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu", regional=True, fullgraph=True))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(Exception, match="(?i)graph break|print"):
                m(x)
        assert not [w for w in caught if "regional" in str(w.message)]
        plain = remove_offload(m)
        assert torch.equal(plain(x), expected)


@pytest.mark.slow
@pytest.mark.newest_torch
@needs_regions
def test_regional_on_a_pipeline_streams_every_component_and_falls_back_where_a_block_is_refused():
    """A pipeline object (CLIP text encoder, Flux transformer, VAE) under ``regional=True``: its Flux blocks are
    refused as regions (two views of one tensor), so the pipeline's blocks are traced inline, with one warning,
    and the image equals the plain pipeline's."""
    pipe, inputs = diffusion_pipeline()
    plain = copy.deepcopy(pipe)
    with torch.no_grad():
        expected = denoise_and_decode(plain.text_encoder, plain.transformer, plain.vae, inputs["input_ids"],
                                      inputs["latents"], 2)
        p = offload_compile(pipe, OffloadPolicy(strategy="layerwise", device="cpu", regional=True))
        with pytest.warns(UserWarning, match="regional compilation is off for DiffusionPipeline"):
            got = denoise_and_decode(p.text_encoder, p.transformer, p.vae, inputs["input_ids"], inputs["latents"], 2)
        assert torch.equal(got, expected)
        reset_offload_stats(p)  # the first calls copied the resident VAE; steady calls stream the rest as planned
        again = denoise_and_decode(p.text_encoder, p.transformer, p.vae, inputs["input_ids"], inputs["latents"], 2)
    assert torch.equal(again, expected)
    assert assert_traffic_matches_plan(p, resident_filled=True).fetch_count > 0


def _guards_kept(monkeypatch, depth: int) -> tuple[int, int]:
    """(guards of the plain model's ``torch.compile``, guards our capture of the offloaded model keeps), a
    `_Blocks` stack of ``depth`` plain blocks, counted through the ``guard_filter_fn`` option both compiles take."""
    import offload_compiler.offloaded.forwards as forwards
    from offload_compiler.host_masters import keep_guards
    counts = {"plain": 0, "ours": 0}

    def counting(name, keep):
        def guard_filter(entries):
            kept = keep(entries)
            counts[name] += sum(kept)
            return kept
        return guard_filter
    model, x = _Blocks(_PlainBlock, depth=depth).eval(), torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.compile(copy.deepcopy(model), backend="eager",
                      options={"guard_filter_fn": counting("plain", lambda entries: [True] * len(entries))})(x)
        monkeypatch.setattr(forwards, "_PART_GUARD_OPTIONS", {"guard_filter_fn": counting("ours", keep_guards)})
        offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu"))(x)
    return counts["plain"], counts["ours"]


@pytest.mark.skipif(torch.__version__ < "2.13", reason="guard filters take effect from torch 2.13 (host_masters)")
def test_routing_a_part_guards_nothing_per_module_beyond_the_plain_models_graph(monkeypatch):
    """Every weight holder of an offloaded model is a routed part; where dynamo traces an offloaded call, the part's
    forward chooses what it traces into by its class alone, so the graph guards no more per module than the plain
    model's: the guards our capture keeps exceed the plain compile's by the same count at any depth."""
    plain_2, ours_2 = _guards_kept(monkeypatch, 2)
    plain_6, ours_6 = _guards_kept(monkeypatch, 6)
    assert plain_6 > plain_2  # guards per block: what the comparison is about
    assert ours_6 - plain_6 == ours_2 - plain_2


def test_auto_warns_once_where_an_entry_method_runs_before_any_forward_planned():
    """A VAE used only through ``decode`` under auto: no forward comes to plan from, so its groups stream one block
    at a time, unplanned; one warning says so and names ``m.plan``, which then plans."""
    pytest.importorskip("diffusers")
    from offload_compiler.testing.pipelines import _vae
    vae = _vae(4)
    plain = copy.deepcopy(vae)
    latents = torch.randn(1, 4, 8, 8)
    m = offload_compile(vae, OffloadPolicy(strategy="auto", device_budget_gb=1.0, device="cpu"))
    with pytest.warns(UserWarning, match=r"plans from AutoencoderKL's forward; its decode runs before any plan.*"
                                         r"m\.plan\(<forward's inputs>\)"):
        with torch.no_grad():
            assert torch.equal(m.decode(latents).sample, plain.decode(latents).sample)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            m.decode(latents)  # warned once
    from offload_compiler import plan_summary
    assert offload_stats(m).bytes_transferred > 0 and not plan_summary(m)["planned"]
    m.plan(torch.randn(1, 3, 8, 8))
    assert plan_summary(m)["planned"]
