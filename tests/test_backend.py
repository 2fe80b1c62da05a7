"""Both entry points: `torch.compile(backend="omni_offload")` and `offload_compile`."""

import copy
import functools
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from offload_compiler import OffloadedModule, OffloadPolicy, offload_compile, offload_stats, reset_offload_stats
from offload_compiler.testing.models import llama
from offload_compiler.testing import BlockSpec, ModelSpec, assert_offload_equivalent, assert_traffic_matches_plan, \
    build_block_model


@pytest.mark.slow  # a Llama captured whole by the user's compile, then its offloaded graph
@pytest.mark.newest_torch
def test_fullgraph_llama_one_graph_no_breaks_no_recompiles():
    model, kwargs = llama()
    with torch.no_grad():
        expected = model(**kwargs).logits
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend="omni_offload", fullgraph=True,
                             options={"strategy": "layerwise", "device": "cpu", "prefetch": 1})
    with torch.no_grad():
        out = compiled(**kwargs).logits  # runs the graph torch.compile captured; the model is then offloaded in place
        # every group once: 6 whole, and the token embedding's rows looked up
        assert isinstance(model, OffloadedModule) and offload_stats(model).fetch_count == 6
        compiled(**kwargs)  # from now on every route runs the model's own offloaded graph, captured once
        with torch._dynamo.config.patch(error_on_recompile=True):
            for _ in range(3):
                again = compiled(**kwargs).logits
    assert torch.equal(out, expected) and torch.equal(again, expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert not torch._dynamo.utils.counters["graph_break"]
    stats = offload_stats(compiled)
    table = model.get_input_embeddings().weight.nbytes
    assert stats.fetch_count == 5 * 6 and stats.routed_fetches == 5
    assert stats.bytes_transferred - stats.routed_bytes == 5 * (stats.total_bytes - table)
    assert stats.peak_resident_bytes < stats.total_bytes
    assert assert_traffic_matches_plan(compiled).calls == 5  # the first graph's call counted by its own plan


def test_the_plans_account_for_the_first_call_too():
    """The first call runs the graph torch.compile captured (on a runtime later replaced by one with host
    masters); the stats count on across the change, and so do the plans that `assert_traffic_matches_plan` reads."""
    model, x = build_block_model(ModelSpec(8, (BlockSpec("mlp", 8),) * 3, False, True, 2, 1))
    compiled = torch.compile(model, backend="omni_offload", options={"strategy": "layerwise", "device": "cpu"})
    with torch.no_grad():
        compiled(x)
        compiled(x)
    stats = assert_traffic_matches_plan(compiled)
    assert stats.calls == 2 and stats.bytes_transferred == 2 * stats.total_bytes
    reset_offload_stats(compiled)
    with torch.no_grad():
        compiled(x)
    assert assert_traffic_matches_plan(compiled).calls == 1


def test_options_may_carry_a_policy_and_stats_reset():
    model, x = build_block_model(ModelSpec(8, (BlockSpec("mlp", 8),) * 2, False, True, 2, 1))
    policy = OffloadPolicy(strategy="sequential", device="cpu", prefetch=0)
    compiled = torch.compile(model, backend="omni_offload", options={"policy": policy})
    with torch.no_grad():
        compiled(x)
    assert offload_stats(compiled).fetch_count > 0
    reset_offload_stats(compiled)
    assert offload_stats(compiled).fetch_count == 0 and offload_stats(compiled).bytes_transferred == 0


def test_options_may_be_the_policy_itself():
    """``options=policy`` (torch hands options over unchecked) failed with "'OffloadPolicy' object is not iterable"."""
    model, x = build_block_model(ModelSpec(8, (BlockSpec("mlp", 8),) * 2, False, True, 2, 1))
    policy = OffloadPolicy(strategy="sequential", device="cpu", prefetch=0)
    compiled = torch.compile(model, backend="omni_offload", options=policy)
    with torch.no_grad():
        compiled(x)
    assert isinstance(model, OffloadedModule) and offload_stats(compiled).fetch_count > 0


def test_both_routes_go_through_the_same_phases():
    """One state machine (`Phase`): attached once a route offloaded the model, detached by remove_offload, after
    which the old state refuses every use."""
    from offload_compiler import remove_offload
    from offload_compiler.errors import OffloadRefusal
    from offload_compiler.offloaded import state_of
    from offload_compiler.offloaded.state import Phase
    for route in ("offload_compile", "omni_offload"):
        model, x = build_block_model(ModelSpec(8, (BlockSpec("mlp", 8),) * 2, False, True, 2, 1))
        options = {"strategy": "layerwise", "device": "cpu"}
        if route == "offload_compile":
            m = offload_compile(model, OffloadPolicy(**options))
        else:
            m = torch.compile(model, backend="omni_offload", options=options)
        with torch.no_grad():
            m(x)
        state = state_of(model)
        assert state.phase is Phase.ATTACHED and isinstance(model, OffloadedModule), route
        remove_offload(model)
        assert state.phase is Phase.DETACHED and state_of(model) is None and not isinstance(model, OffloadedModule)
        with pytest.raises(OffloadRefusal, match="this offload has ended"):
            state.check_usable()


class _Stack(nn.Module):
    """A model of its own class (dynamo's cache is per code object: no other test's graphs are reused here)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _streams_its_plan(model: nn.Module, plain: nn.Module, call, x: torch.Tensor) -> None:
    if isinstance(model, OffloadedModule):
        reset_offload_stats(model)
    with torch.no_grad():
        assert torch.equal(call(x), plain(x))
    stats = assert_traffic_matches_plan(model)
    assert isinstance(model, OffloadedModule) and stats.calls == 1 and stats.fetch_count == 4
    assert stats.bytes_transferred == stats.total_bytes and stats.peak_resident_bytes < stats.total_bytes


@pytest.mark.parametrize("how", ["the wrapper again", "compiled again", "compiled again in place"])
def test_after_remove_offload_the_backend_route_offloads_the_model_again(how):
    """Dynamo keeps the graphs the backend compiled in the cache of the model's code, and calls them again where
    the plain model's guards hold: after remove_offload, for the old wrapper and for a new compile with the same
    options alike. Each such graph finds the model not offloaded, and offloads it again, as its first call did."""
    from offload_compiler import remove_offload
    options = {"strategy": "layerwise", "device": "cpu", "prefetch": 1}
    model = _Stack(0)
    plain = copy.deepcopy(model)
    if how == "compiled again in place":
        model.compile(backend="omni_offload", options=options)
        call = model
    else:
        call = torch.compile(model, backend="omni_offload", options=options)
    _streams_its_plan(model, plain, call, torch.randn(2, 16))
    before = {name: t.clone() for name, t in model.state_dict().items()}
    remove_offload(model)
    assert not isinstance(model, OffloadedModule)
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())
    if how == "compiled again":
        call = torch.compile(model, backend="omni_offload", options=options)
    elif how == "compiled again in place":
        model.compile(backend="omni_offload", options=options)
    _streams_its_plan(model, plain, call, torch.randn(2, 16))


def test_another_model_of_the_class_compiled_with_the_same_options_is_offloaded_too():
    """The backend's graph is reused by dynamo for a second instance of the class compiled alike; that graph
    offloads the model whose weights it is given, each with its own runtime, and removing one leaves the other
    offloaded."""
    from offload_compiler import remove_offload
    options = {"strategy": "layerwise", "device": "cpu", "prefetch": 1}
    first, second = _Stack(1), _Stack(2)
    plains = copy.deepcopy(first), copy.deepcopy(second)
    calls = [torch.compile(first, backend="omni_offload", options=options),
             torch.compile(second, backend="omni_offload", options=options)]
    for _ in range(2):
        for model, plain, call in zip((first, second), plains, calls):
            _streams_its_plan(model, plain, call, torch.randn(2, 16))
    remove_offload(first)
    _streams_its_plan(second, plains[1], calls[1], torch.randn(2, 16))
    with torch.no_grad():
        x = torch.randn(2, 16)
        assert torch.equal(first(x), plains[0](x)) and not isinstance(first, OffloadedModule)


@pytest.mark.slow  # a fresh interpreter
@pytest.mark.newest_torch
def test_backend_is_found_without_importing_the_package():
    script = textwrap.dedent("""
        import sys, torch
        from torch import nn
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval()
        x = torch.randn(2, 8)
        with torch.no_grad():
            expected = model(x)
            got = torch.compile(model, backend="omni_offload", options={"strategy": "layerwise", "device": "cpu"})(x)
        assert "offload_compiler" in sys.modules, "the entry point did not load the backend"
        stats = sys.modules["offload_compiler"].offload_stats(model)
        assert torch.equal(got, expected) and stats.fetch_count == 3, stats
        print("OK", stats.bytes_transferred)
    """)
    assert "offload_compiler" not in script.split("omni_offload")[0]
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("OK")


class Broken(nn.Module):
    """Blocks with a graph break between them: every captured graph is scheduled on its own."""
    _layerwise_offload_blocks_attr = "blocks"

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        x = torch.relu(self.blocks[1](torch.relu(self.blocks[0](x))))
        torch._dynamo.graph_break()
        return torch.relu(self.blocks[3](torch.relu(self.blocks[2](x))))


class BreakInLoop(Broken):
    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
            torch._dynamo.graph_break()  # dynamo then runs the whole frame without a graph
        return x


def test_a_model_frame_dynamo_skips_streams_its_blocks_each_as_a_graph():
    """Dynamo runs the model's own frame without a graph: its blocks run as their own offloaded graphs (it was
    refused before: "ran without its offloaded graph")."""
    model = BreakInLoop().requires_grad_(False)
    x = torch.randn(2, 16)
    with torch.no_grad():
        expected = model(x)
    m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="layerwise", device="cpu"))
    with pytest.warns(UserWarning, match="part of BreakInLoop's forward ran .*without a graph"), torch.no_grad():
        assert torch.equal(m(x), expected)
    assert_traffic_matches_plan(m)


@pytest.mark.parametrize("compiler", ["eager",
                                      pytest.param("inductor", marks=[pytest.mark.slow, pytest.mark.newest_torch])])
def test_graph_breaks_each_graph_scheduled(compiler):
    policy = OffloadPolicy(strategy="layerwise", device="cpu", compiler=compiler, debug_poison=True)
    assert_offload_equivalent(Broken(), policy, torch.randn(2, 16))
    m = offload_compile(Broken(), policy)
    m(torch.randn(2, 16))
    assert len(m._offload_runtime.graph_plans) == 2
    assert [sum(1 for _ in p.schedule.instances) for p in m._offload_runtime.graph_plans] == [2, 2]


def test_fullgraph_policy_rejects_graph_breaks():
    m = offload_compile(Broken(), OffloadPolicy(strategy="layerwise", device="cpu", fullgraph=True))
    with pytest.raises(Exception, match="graph_break|graph break"):
        m(torch.randn(2, 16))


def test_module_surface_is_the_original():
    model, x = build_block_model(ModelSpec(8, (BlockSpec("mlp", 8),) * 2, False, True, 2, 1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu"))
    m(x)
    after = m.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(before[k], after[k]) for k in before)  # bit-for-bit
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert m.blocks is model.blocks  # attribute access reaches the model
    with pytest.raises(ValueError, match="assign=True"):
        m.load_state_dict(before, assign=True)


def test_stats_on_a_plain_module_say_what_to_do():
    with pytest.raises(ValueError, match="offload_compile"):
        offload_stats(nn.Linear(2, 2))


@pytest.mark.slow  # twelve models captured
@pytest.mark.newest_torch
def test_many_models_of_one_class_never_fall_back_silently():
    spec = ModelSpec(8, (BlockSpec("mlp", 8),), False, False, 2, 1)
    for seed in range(12):  # more than dynamo's default recompile limit of 8
        model, x = build_block_model(spec, seed)
        m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu"))
        assert torch.equal(m(x), model(x).detach())
        assert offload_stats(m).fetch_count > 0


class BreakInsideBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        x = torch.relu(self.a(x))
        torch._dynamo.graph_break()  # dynamo captures this forward once and calls it for every block
        return torch.relu(self.b(x))


class ReusedGraphs(nn.Module):
    _layerwise_offload_blocks_attr = "blocks"

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(BreakInsideBlock() for _ in range(4))

    def forward(self, x):  # dynamo runs this frame without a graph (a graph break inside the loop)
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("compiler", ["eager",
                                      pytest.param("inductor", marks=[pytest.mark.slow, pytest.mark.newest_torch])])
@pytest.mark.parametrize("strategy", ["layerwise", "sequential", "none"])
def test_a_graph_dynamo_reuses_for_other_weights_reads_those_weights(strategy, compiler):
    model = ReusedGraphs()
    policy = OffloadPolicy(strategy=strategy, device="cpu", compiler=compiler, debug_poison=True)
    report = assert_offload_equivalent(model, policy, torch.randn(2, 16))
    assert report.bytes_transferred > 0  # and the ledger matched the plan: each block read its own weights


class _PostNormBlock(nn.Module):
    """Gemma's post-norm pattern: a pointwise reader of a weight (1 + w) feeds the residual stream, which the
    block's last residual add, after the block's evict, would re-compute from the weight under inductor."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = nn.Linear(d, d, bias=False)
        self.post_norm = nn.Parameter(torch.randn(d) * 0.1)
        self.mlp = nn.Linear(d, d, bias=False)

    def forward(self, h):
        h = h + self.attn(h) * (1.0 + self.post_norm)
        return h + self.mlp(torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * h)


class _PostNormStack(nn.Module):
    _layerwise_offload_blocks_attr = "blocks"

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_PostNormBlock(d) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.slow  # inductor; tests/test_hot_path.py compiles the same post-norm stack in the fast subset
@pytest.mark.newest_torch
def test_inductor_never_recomputes_a_weight_reader_after_its_evict():
    from capture import capture
    from offload_compiler.backend import rewrite_graph
    from offload_compiler.grouping import plan_groups
    from offload_compiler.runtime import OffloadRuntime
    torch.manual_seed(0)
    model = _PostNormStack().eval()
    policy = OffloadPolicy(strategy="layerwise", device="cpu", compiler="inductor", debug_poison=True)
    assert_offload_equivalent(model, policy, torch.randn(1, 4, 16))  # NaN (poisoned weights) if it did
    gm, inputs = capture(model, torch.randn(1, 4, 16))
    new_gm, _, _ = rewrite_graph(gm, inputs, OffloadRuntime(policy, plan_groups(model, policy), pack_now=False))
    # every reader is copied (which ops inductor re-computes in a later kernel is its choice) or is our opaque
    # linear (an extern kernel's result, a buffer of its own), and each evict follows them
    ops = torch.ops.offload_compiler
    evicted_after = [i for n in new_gm.graph.nodes if n.target is ops.evict.default for i in n.args[4]]
    assert evicted_after and all(i.target in (ops.materialize.default, ops.linear.default) for i in evicted_after)
    assert {i.target for i in evicted_after} == {ops.materialize.default, ops.linear.default}


def _wrapped(forward):
    """A decorator of the kind transformers 5 puts on ``forward``: dynamo then sees the module as ``args[0]``."""
    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        return forward(*args, **kwargs)
    return wrapper


class WrappedForward(nn.Module):
    _layerwise_offload_blocks_attr = "blocks"

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    @_wrapped
    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


def test_the_backend_finds_a_model_with_a_wrapped_forward_by_its_weights():
    model = WrappedForward().eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
        compiled = torch.compile(model, backend="omni_offload", options={"strategy": "layerwise", "device": "cpu"})
        assert torch.equal(compiled(x), expected)
        reset_offload_stats(model)
        assert torch.equal(compiled(x), expected)
    stats = offload_stats(model)
    assert isinstance(model, OffloadedModule) and stats.fetch_count == 3
    assert stats.bytes_transferred == stats.streamed_bytes == stats.total_bytes > 0


def test_the_backend_refuses_a_compiled_function_naming_offload_compile():
    model = WrappedForward().eval()
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    compiled = torch.compile(lambda x: model(x), backend="omni_offload", options={"strategy": "layerwise",
                                                                                   "device": "cpu"})
    with pytest.raises(Exception, match=r"found none holding them.*offload_compile\(model, policy\)"):
        with torch.no_grad():
            compiled(torch.randn(2, 8))
    assert type(model) is WrappedForward
    assert all(torch.equal(v, snapshot[k]) for k, v in model.state_dict().items())


class _HoldsBreakInLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList([BreakInLoop(), nn.Linear(16, 16)])

    def forward(self, x):
        return self.stages[1](self.stages[0](x))


def test_the_warning_of_code_run_without_a_graph_names_the_part_the_user_called():
    """A part called by hand whose own frame dynamo runs without a graph: the warning names that part's forward,
    not the model's."""
    model = _HoldsBreakInLoop().requires_grad_(False)
    x = torch.randn(2, 16)
    with torch.no_grad():
        expected = model.stages[0](x)
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu", blocks_attr="stages.0.blocks"))
    with pytest.warns(UserWarning, match=r"part of _HoldsBreakInLoop\.stages\.0's forward ran .*without a graph"), \
            torch.no_grad():
        assert torch.equal(m.stages[0](x), expected)
