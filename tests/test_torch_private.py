"""Torch's private surface, as `offload_compiler._torch_private` lists it: one test per touch point, each doing
what the package relies on (not only that a name exists), so that a torch release that removes or changes one
fails here, by name, rather than as a slow or wrong offloaded call somewhere else. And no private use anywhere
else in the package."""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import os
import re

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

import offload_compiler.ops  # noqa: F401  (defines the transfer ops)
from offload_compiler import _torch_private as private

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "offload_compiler")
# `testing/simulated.py` registers the simulated accelerator the tests run on (see the module's docstring)
OUTSIDE_THE_RULE = {os.path.join(PACKAGE, "_torch_private.py"), os.path.join(PACKAGE, "testing", "simulated.py")}
PRIVATE = re.compile(r"torch\._[A-Za-z]|_C\.|_pytree|getLogger\(\s*[\"']torch\.|\._schema\b|_orig_mod\b")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_no_private_torch_outside_this_module():
    found = []
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(directory, name)
            if not name.endswith(".py") or path in OUTSIDE_THE_RULE:
                continue
            with open(path, encoding="utf-8") as source:
                found += [f"{os.path.relpath(path, PACKAGE)}:{number}: {line.strip()}"
                          for number, line in enumerate(source, 1) if PRIVATE.search(line)]
    assert not found, "private torch outside _torch_private.py:\n" + "\n".join(found)


# 1
def test_optimized_module_wraps_the_model():
    model = nn.Linear(2, 2)
    wrapper = torch.compile(model)  # nothing compiled until called
    assert private.compiled_module_of(wrapper) is model and private.compiled_module_of(model) is model
    assert any(found is model for found in private.compiled_models())
    in_place, by_forward, plain = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    in_place.compile()  # nn.Module.compile: torch.compile of its _call_impl, kept in _compiled_call_impl
    by_forward.forward = torch.compile(by_forward.forward)  # functools.wraps: __wrapped__ is the module's forward
    hooked = nn.Linear(2, 2)
    hooked.forward = functools.wraps(hooked.forward)(lambda x: x)  # a wrapper, as accelerate's hooks make: not compiled
    found = private.compiled_models()
    assert any(m is in_place for m in found) and any(m is by_forward for m in found)
    assert not any(m is plain or m is hooked for m in found)


# 2
def test_frame_converter_runs_our_compiles_under_config():
    """Our config is in force while dynamo compiles the function's frames, and only then: a steady call enters
    nothing, and torch's defaults hold around it."""
    limits = []

    def backend(gm, example_inputs):
        limits.append(torch.compiler.config.recompile_limit)
        return gm.forward

    compiled = private.compile_under_config(lambda x: x + 1, backend=backend)
    patch = private.capture_config()
    assert private.config_for_call(compiled, patch) is not patch  # the structure was recognized
    assert compiled(torch.ones(2)).tolist() == [2.0, 2.0]
    assert limits == [private.RECOMPILE_LIMIT] and torch.compiler.config.recompile_limit != private.RECOMPILE_LIMIT


# 3
def test_skip_code_inlines_but_never_compiles_the_frame():
    def doubled(x):
        return x * 2

    inlined = private.inlined_only(doubled)
    counter = CompileCounter()
    assert torch.compile(inlined, backend=counter)(torch.ones(2)).tolist() == [2.0, 2.0]
    assert counter.frame_count == 0  # its own frame: never compiled
    assert torch.compile(lambda x: inlined(x) + 1, backend=counter)(torch.ones(2)).tolist() == [3.0, 3.0]
    assert counter.frame_count == 1 and counter.op_count == 2  # traced into the caller's graph


# 4
def _fullgraph_user_compiling_a_call_with_a_graph_break(leave: bool) -> int:
    """The frames compiled by an offloaded-like call (a graph break in it) made from the user's
    ``torch.compile(m, fullgraph=True)``; without leaving the region, the resume after the break runs eagerly."""
    counter = CompileCounter()

    def with_a_break(x):
        x = x * 2
        torch._dynamo.graph_break()
        return x + 1

    own = torch.compile(with_a_break, backend=counter)

    class Boundary:
        def _call(self, x):
            prior = private.leave_fullgraph_region() if leave else None
            try:
                return own(x)
            finally:
                private.restore_fullgraph_region(prior)

        __call__ = torch.compiler.disable(_call)

    model = nn.Module()
    model.forward = Boundary()
    assert torch.compile(model, fullgraph=True, backend="eager")(torch.ones(2)).tolist() == [3.0, 3.0]
    return counter.frame_count


def test_leaving_the_fullgraph_region_compiles_nested_frames():
    assert _fullgraph_user_compiling_a_call_with_a_graph_break(leave=False) == 1
    torch._dynamo.reset()
    assert _fullgraph_user_compiling_a_call_with_a_graph_break(leave=True) == 2


# 5
def _wrong_shape(x):
    return x @ torch.ones(3, 3)


def test_dynamo_errors_carry_the_model_error_and_its_line():
    compiled = torch.compile(_wrong_shape, backend="eager")
    compiled(torch.ones(2, 3)), compiled(torch.ones(4, 3))  # another size: traced again with symbolic sizes
    with pytest.raises(Exception) as caught:
        compiled(torch.ones(5, 5))
    assert private.is_tracing_error(caught.value)
    error = private.model_error(caught.value)
    assert isinstance(error, RuntimeError) and private.symbolic_sizes(str(error)), error
    assert private.user_frame(caught.value).startswith("test_torch_private.py:")
    assert private.user_frame(caught.value).endswith("return x @ torch.ones(3, 3)")

    def breaks(x):
        torch._dynamo.graph_break()
        return x

    with pytest.raises(Exception) as caught:
        torch.compile(breaks, backend="eager", fullgraph=True)(torch.ones(2))
    assert isinstance(caught.value, torch._dynamo.exc.Unsupported)  # the class, not the text, says it
    assert private.cannot_capture_in_one_graph(caught.value)
    assert "\n" not in private.short_reason(str(caught.value))
    assert private.model_raised(caught.value) is None

    def refuses(x=None):
        if x is None:
            raise ValueError("You have to specify x")
        return x

    with pytest.raises(Exception) as caught:
        torch.compile(refuses, backend="eager", fullgraph=True)()
    assert private.model_raised(caught.value) is not None  # its text is dynamo's (2.11: no message): not read
    assert private.user_frame(caught.value).endswith('raise ValueError("You have to specify x")')


# 6
def test_private_config_flags_do_what_captures_rely_on(capfd):
    log = logging.getLogger("offload_compiler.test_torch_private")

    def logs_between_ops(x):
        x = x + 1
        log.warning("between ops")
        return x * 2

    counters = []
    for config in (private.capture_config(), private._NOTHING):
        torch._dynamo.reset()
        counters.append(CompileCounter())
        with config:
            assert torch.compile(logs_between_ops, backend=counters[-1])(torch.ones(2)).tolist() == [4.0, 4.0]
    assert [c.frame_count for c in counters] == [1, 2]  # a no-op under our config; torch's default: a break
    assert "Unexpected exception" not in capfd.readouterr().err  # the metrics record of the first compile

    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        host, device = torch.empty(2), torch.empty(2, device="cuda")  # fake: no CUDA needed
        with pytest.raises(RuntimeError):
            host + device
        with private.prefer_device_while_tracing("cuda"):
            assert (host + device).device.type == "cuda"


# 7
def test_inductor_entry_points_take_what_we_pass():
    """What `lowering` calls, with the arguments it passes, and the graph state it writes (a compile takes
    seconds: tests/test_hot_path.py compiles our transfer op with this lowering and checks its code)."""
    from torch._inductor import ir
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.graph import GraphLowering
    from torch._inductor.lowering import fallback_handler, register_lowering
    assert "config_patches" in inspect.signature(compile_fx).parameters
    assert "type_promotion_kind" in inspect.signature(register_lowering).parameters
    assert "add_to_fallback_set" in inspect.signature(fallback_handler).parameters
    assert {"never_reuse_buffers", "unaligned_buffers", "cpp_wrapper"} <= set(GraphLowering.__init__.__code__.co_names)
    assert isinstance(ir.FallbackKernel.codegen, type(lambda: None))
    assert "python_kernel_name" in inspect.getsource(ir.ExternKernel)
    with pytest.raises(AttributeError):  # no graph is being lowered: V.graph says so
        private.inductor_graph().never_reuse_buffers


def test_inductor_knows_which_devices_it_generates_code_for():
    """The CPU and CUDA have inductor's code generators (whether or not a GPU is here); the simulated device,
    torch's PrivateUse1 renamed, has none, so a compile for it fails inside inductor at every call."""
    from offload_compiler.testing import simulated_device
    assert private.inductor_generates_code_for("cpu") and private.inductor_generates_code_for("cuda")
    assert not private.inductor_generates_code_for(torch.device(simulated_device()).type)


class _NormLinear(nn.Module):
    def __init__(self, width=16, blocks=3):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width)) for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


@pytest.mark.slow
@pytest.mark.newest_torch
def test_inductor_calls_our_builtins_on_this_torch(monkeypatch):
    """Under inductor the generated code calls torch's linear itself for each linear (`lowering._call_directly`,
    which finds the extern kernel of the op's output in inductor's IR: a ``MultiOutput`` in torch 2.13, the
    kernel itself in 2.14), and the outputs are the plain model's."""
    from offload_compiler import OffloadPolicy, offload_compile, ops, reset_offload_stats
    from offload_compiler.testing import assert_traffic_matches_plan
    calls = []
    builtin = ops.direct_linear
    monkeypatch.setattr(ops, "direct_linear", lambda *args: calls.append(len(args)) or builtin(*args))
    torch.manual_seed(0)
    model = _NormLinear().eval()
    x = torch.randn(2, 16)
    with torch.no_grad():
        expected = model(x)
        m = offload_compile(model, OffloadPolicy(strategy="layerwise", compiler="inductor"))
        torch.testing.assert_close(m(x), expected)
        reset_offload_stats(m)
        torch.testing.assert_close(m(x), expected)
    assert len(calls) == 2 * 3 and all(n == 3 for n in calls)  # input, weight, bias: each linear, nothing else
    assert assert_traffic_matches_plan(m).fetch_count == 3  # each block streamed, as planned


_CACHED_COMPILE = """
import sys, torch
from torch import nn
from torch._dynamo.utils import counters
from offload_compiler import OffloadPolicy, lowering, offload_compile
from offload_compiler._torch_private import inductor_cache_salt
if len(sys.argv) > 1:  # another version of the package: another lowering
    lowering._INDUCTOR_CONFIG = {**lowering._INDUCTOR_CONFIG, **inductor_cache_salt(sys.argv[1])}
torch.manual_seed(0)
model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 16)).eval()
with torch.no_grad():
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", compiler="inductor"))
    torch.testing.assert_close(m(torch.ones(2, 16)), model(torch.ones(2, 16)))
print(counters["inductor"]["fxgraph_cache_hit"], counters["aot_autograd"]["autograd_cache_hit"])
"""


@pytest.mark.slow
def test_inductor_cache_holds_our_lowering_in_its_key(tmp_path):
    """A second process compiling the same offloaded model takes its graph from inductor's caches; one whose
    lowering differs (another version of this package, whose generated code calls what its lowering named)
    does not."""
    import subprocess
    import sys
    script = tmp_path / "compile.py"
    script.write_text(_CACHED_COMPILE)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)

    def hits(*args):
        out = subprocess.run([sys.executable, str(script), *args], check=True, capture_output=True, text=True, env=env)
        return [int(word) for word in out.stdout.split()]
    assert hits() == [0, 0]
    assert sum(hits()) > 0  # the same lowering: from the cache
    assert hits("another lowering") == [0, 0]


# 8
def test_pytree_walks_registered_containers():
    Pair = collections.namedtuple("Pair", "a b")

    class Box:
        def __init__(self, value):
            self.value = value

    private.pytree.register_pytree_node(Box, lambda b: ([b.value], None), lambda values, _: Box(values[0]))
    tree = {"x": [torch.ones(1), (torch.zeros(1), 3)], "pair": Pair(torch.ones(2), None), "box": Box(torch.ones(3))}
    doubled = private.tree_map(lambda v: v * 2 if isinstance(v, torch.Tensor) else v, tree)
    assert doubled["x"][0].item() == 2 and doubled["x"][1][1] == 3 and isinstance(doubled["pair"], Pair)
    assert isinstance(doubled["box"], Box) and doubled["box"].value.tolist() == [2.0, 2.0, 2.0]
    assert sum(isinstance(v, torch.Tensor) for v in private.pytree.tree_leaves(tree)) == 4


# 9
def test_op_overloads_and_their_schema():
    aten = torch.ops.aten
    assert isinstance(aten.mm.default, private.OpOverload) and not isinstance(aten.mm, private.OpOverload)
    add = private.op_schema(aten.add.Tensor)
    assert [(a.name, a.default_value if a.has_default_value() else None) for a in add.arguments] == [
        ("self", None), ("other", None), ("alpha", 1)]
    assert private.op_schema(aten.add_.Tensor).is_mutable and not add.is_mutable  # host_masters' write check
    written = [a.name for a in private.op_schema(aten.add_.Tensor).arguments if a.alias_info and a.alias_info.is_write]
    assert written == ["self"]  # what `passes.analysis` reads of an in-place op
    assert private.op_schema(torch.ops.offload_compiler.wait.default).name == "offload_compiler::wait"
    assert private.op_schema(torch.ops.offload_compiler.wait.default).overload_name == ""
    assert private.qualified_op_name(aten.mm) == private.qualified_op_name(aten.mm.default) == "aten::mm"
    assert private.op_schema(len) is None and private.qualified_op_name(len) is None
    if private.GROUPED_MM is not None:  # recognized by identity in graphs: what models call
        assert callable(private.GROUPED_MM)


# 10
def test_profiler_enabled_follows_the_profiler():
    assert not private.profiler_enabled()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert private.profiler_enabled()
    assert not private.profiler_enabled()


# 11
def test_fake_tensor_failures_are_logged_where_we_filter():
    dropped = []

    class Drop(logging.Filter):
        def filter(self, record):
            dropped.append(record.getMessage())
            return False

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    drop = Drop()
    private.filter_fake_tensor_log(drop)
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode(), pytest.raises(RuntimeError):
            torch.mm(torch.empty(2, 3), torch.empty(4, 5))
    finally:
        logger.removeFilter(drop)
    assert dropped and "mm" in dropped[0]
