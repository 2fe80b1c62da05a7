"""Dynamo's config while an offloaded model compiles and while it runs: raised recompile limits and logging calls
traced as no-ops (`_torch_private.capture_config`) are in force exactly while dynamo compiles the frames of an offloaded
call (`_torch_private.compile_under_config`); a steady call enters no config patch, and code the user compiles keeps
torch's defaults."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from offload_compiler import OffloadPolicy, offload_compile, offload_stats, reset_offload_stats
from offload_compiler._torch_private import _ConfigDuringCompile, capture_config, compile_under_config, config_for_call
from offload_compiler.testing import assert_traffic_matches_plan
from test_trial_routes import Block

def graph_breaks() -> dict[str, int]:
    """How often dynamo met each graph-break reason so far (its counters: a test's probe, not the package's)."""
    return dict(torch._dynamo.utils.counters["graph_break"])


CPU = OffloadPolicy(strategy="layerwise", device="cpu")
log = logging.getLogger(__name__)
seen: list[tuple[int, int, frozenset]] = []


def _config() -> tuple[int, int, frozenset]:
    config = torch._dynamo.config
    return config.recompile_limit, config.accumulated_recompile_limit, frozenset(config.ignore_logging_functions)


@torch.compiler.disable
def _observe() -> None:
    """Runs in Python in the middle of an offloaded call (dynamo calls it between the call's graphs)."""
    seen.append(_config())


class Stack(nn.Module):
    _layerwise_offload_blocks_attr = "blocks"

    def __init__(self, observe: bool = False, break_graph: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.observe, self.break_graph = observe, break_graph

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            log.warning("block %d", i)  # a graph break inside the loop, unless traced as a no-op
            x = block(x)
        if self.observe:
            _observe()
        if self.break_graph:
            torch._dynamo.graph_break()  # dynamo compiles this forward as a frame of its own, per model
        return x


def test_logging_in_a_block_loop_compiles_to_one_graph_and_steady_calls_run_under_torchs_defaults():
    defaults = _config()
    torch.manual_seed(0)
    model = Stack().eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
        m = offload_compile(model, CPU)
        breaks = graph_breaks()
        for _ in range(2):  # the first call compiles, the second is steady
            reset_offload_stats(m)
            calls = m._offload_runtime.graph_calls
            assert torch.equal(m(x), expected)
            assert m._offload_runtime.graph_calls == calls + 1  # one graph: the loop's logging calls are no-ops
            assert assert_traffic_matches_plan(m).fetch_count == len(m._offload_runtime.groups) == 3
        # no break: one graph fetched all three groups per call; a frame dynamo declined elsewhere in the process
        # (the counter is process-wide and earlier tests leave frames of their own) is no longer this call's
        assert graph_breaks() == breaks
    assert _config() == defaults


def _two_observed_calls() -> None:
    """A model that records dynamo's config from inside each call, offloaded and called twice (compiling, then
    steady); each call equal to the plain model and moving exactly the plan's bytes and fetches."""
    torch.manual_seed(0)
    model = Stack(observe=True).eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
        m = offload_compile(model, CPU)
        seen.clear()
        for _ in range(2):
            reset_offload_stats(m)
            assert torch.equal(m(x), expected)
            assert assert_traffic_matches_plan(m).fetch_count == 3


def test_a_steady_call_enters_no_config_patch_and_torchs_defaults_hold_inside_it():
    """Observed from Python code that the offloaded call runs between its graphs (a ``torch.compiler.disable``d
    function): torch's defaults, at the first call (compiling) and at the steady one."""
    defaults = _config()
    _two_observed_calls()
    assert seen == [defaults] * 2
    assert _config() == defaults


@pytest.mark.slow
@pytest.mark.newest_torch
def test_many_models_of_one_class_compile_past_dynamos_recompile_limit():
    """A graph break in a model's forward: dynamo compiles the class's forward as a frame of its own, one cache
    entry per model on that one code object. Past the recompile limit (8) dynamo ran the ninth model's forward
    without a graph, and the call was refused; under our compiles' raised limit, every model is offloaded."""
    x = torch.randn(2, 8)
    for seed in range(10):
        torch.manual_seed(seed)
        model = Stack(break_graph=True).eval()
        with torch.no_grad():
            expected = model(x)
            m = offload_compile(model, CPU)
            assert torch.equal(m(x), expected) and torch.equal(m(x), expected)
        assert offload_stats(m).fetch_count == 2 * 3
    assert torch._dynamo.config.recompile_limit == 8  # torch's default, outside the calls


def test_the_users_own_compiles_keep_torchs_defaults():
    """After an offloaded model compiled, the user's torch.compile of other code sees torch's config: its backend
    runs under the default recompile limit, and a logging call breaks its graph as torch decides."""
    torch.manual_seed(0)
    model = Stack().eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        m = offload_compile(model, CPU)
        m(x)
    limits = []

    def backend(gm, example_inputs):
        limits.append(_config())
        return gm

    def user_code(y):
        log.warning("user code")
        return y * 2

    breaks = graph_breaks()
    torch.compile(user_code, backend=backend)(x)
    assert limits and all(limit == limits[0] for limit in limits) and limits[0][0] == 8
    assert logging.Logger.warning not in limits[0][2]
    assert graph_breaks() != breaks  # the logging call: torch's own default, not our no-op


def test_a_torch_whose_structure_is_not_recognized_gets_the_patch_around_every_call(monkeypatch):
    """Where dynamo's frame converters are not the ones `_torch_private.compile_under_config` knows, the function is
    compiled as torch.compile makes it and every offloaded call enters the config patch: slower, and correct."""
    from offload_compiler import _torch_private
    monkeypatch.setattr(_torch_private, "_CONVERTERS", ())
    _two_observed_calls()
    assert [limit for limit, _, _ in seen] == [_torch_private.RECOMPILE_LIMIT] * 2  # the patch, around the call
    assert torch._dynamo.config.recompile_limit == 8


def test_a_stance_that_replaces_the_callback_falls_back_to_the_patch_around_the_call():
    compiled = compile_under_config(lambda y: y + 1, backend="eager")
    patch = capture_config()
    assert config_for_call(compiled, patch) is not patch
    with torch.compiler.set_stance("force_eager"):
        assert config_for_call(compiled, patch) is patch
    assert config_for_call(torch.compile(lambda y: y + 1, backend="eager"), patch) is patch  # not ours


def test_torch_2_11s_failing_config_record_is_the_only_metrics_error_dropped():
    """torch 2.11 sorts the config's sets when it records a compile's metrics, and fails on our logging functions
    (a traceback on stderr at every compile; 2.13 leaves that set out). That failure's log record is dropped;
    any other error of the metrics logger still shows."""
    def _get_dynamo_config_for_logging():  # the name of torch 2.11's function that sorts the sets
        return sorted({logging.Logger.warning, logging.Logger.info})

    def other_metrics_code():
        return sorted({logging.Logger.warning, logging.Logger.info})

    class Kept(logging.Handler):
        records: list = []

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(record)

    metrics_log = logging.getLogger("torch._dynamo.metrics_context")  # torch's loggers do not propagate to root
    kept = Kept(logging.ERROR)
    metrics_log.addHandler(kept)
    try:
        for failing in (_get_dynamo_config_for_logging, other_metrics_code):
            try:
                failing()
            except TypeError:
                metrics_log.exception("Unexpected exception logging compilation metrics")
    finally:
        metrics_log.removeHandler(kept)
    assert [r.exc_info[2].tb_next.tb_frame.f_code.co_name for r in kept.records] == ["other_metrics_code"]


def test_the_wrapped_converter_answers_for_dynamos_converter():
    """Dynamo reads attributes of the converter it installed (``_clone_with_backend`` for DDPOptimizer's backend,
    ``_inner_convert``, ``_hooks``): the wrapper answers with the converter's, and a clone is wrapped too."""
    compiled = compile_under_config(lambda x: x + 1, backend="eager")
    cells = dict(zip(compiled.__code__.co_freevars, compiled.__closure__))
    wrapped = cells["callback"].cell_contents._torchdynamo_orig_backend
    assert isinstance(wrapped, _ConfigDuringCompile)
    converter = wrapped._converter
    for name in ("_inner_convert", "_hooks"):
        assert getattr(wrapped, name) is getattr(converter, name)
    assert isinstance(wrapped._clone_with_backend(lambda gm, inputs: gm), _ConfigDuringCompile)
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))
