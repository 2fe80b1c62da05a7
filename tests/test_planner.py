"""strategy="auto": the solver is optimal on synthetic cost tables (brute force, hypothesis), its predicted
weight peak is what the engine verifies and the ledger measures, and an infeasible budget fails up front."""

import copy
import json
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from offload_compiler import (InfeasibleBudgetError, OffloadPolicy, offload_compile, offload_plan, offload_stats,
                              remove_offload, reset_offload_stats,
                              plan_offload)
from offload_compiler.testing.models import llama
from offload_compiler.runtime.stats import held_device_weight_bytes
from offload_compiler.passes.schedule import Use
from offload_compiler.planning.planner import (Choice, CostTable, GroupCost, minimum_budget, predict, solve,
                                               solve_brute_force)
from offload_compiler.testing import BlockSpec, ModelSpec, assert_offload_equivalent, assert_traffic_matches_plan, \
    build_block_model


@st.composite
def cost_tables(draw, max_groups=5, max_uses=9):
    """Random tables: groups of random size read in a random order (repeats: tied weights, a table read in
    every block), random compute per position, bandwidth, fetch overhead, inline or overlapped copies."""
    n = draw(st.integers(1, max_groups))
    sizes = draw(st.lists(st.integers(1, 100), min_size=n, max_size=n))
    order = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=max_uses))
    uses = [Use(g, p, p + draw(st.integers(0, 1))) for p, g in enumerate(order)]
    seconds = draw(st.lists(st.floats(0, 10), min_size=len(order) + 1, max_size=len(order) + 1))
    return CostTable(tuple(GroupCost(f"g{i}", b) for i, b in enumerate(sizes)), tuple(uses), tuple(seconds),
                     bandwidth=draw(st.sampled_from([1.0, 5.0, 20.0, 100.0])),
                     activation_bytes=draw(st.integers(0, 50)), fetch_overhead_s=draw(st.sampled_from([0.0, 1.0])),
                     overlap=draw(st.booleans()), carry=draw(st.booleans()),
                     call_overhead_s=draw(st.sampled_from([0.0, 2.0])))


@settings(max_examples=300)
@given(cost_tables(), st.integers(0, 600), st.integers(0, 3))
def test_solve_matches_brute_force(table, budget, max_prefetch):
    try:
        best = solve_brute_force(table, budget, max_prefetch)
    except InfeasibleBudgetError as brute_error:
        with pytest.raises(InfeasibleBudgetError) as err:
            solve(table, budget, max_prefetch)
        assert err.value.needed_bytes == brute_error.needed_bytes > budget
        return
    found = solve(table, budget, max_prefetch)
    assert found.optimal and found.prediction.peak_bytes <= budget
    assert math.isclose(found.prediction.time_s, best.prediction.time_s, rel_tol=1e-9, abs_tol=1e-12)


@settings(max_examples=150)
@given(cost_tables(max_groups=4))
def test_minimum_budget_is_the_smallest_peak_of_any_plan(table):
    import itertools
    used = table.used_groups
    peaks = [predict(table, Choice(frozenset(r), d)).peak_bytes
             for d in range(3) for k in range(len(used) + 1) for r in itertools.combinations(used, k)]
    needed, _ = minimum_budget(table)
    assert needed == min(peaks)
    solve(table, needed)  # the minimum itself is feasible
    with pytest.raises(InfeasibleBudgetError):
        solve(table, needed - 1)


@settings(max_examples=150)
@given(cost_tables(), st.data())
def test_search_bounds_hold_for_every_completion(table, data):
    """What the search prunes with; note that keeping more groups resident is not always faster."""
    import itertools
    from offload_compiler.planning.planner import _inline_bound, _overlap_bound
    used = table.used_groups
    streamed = set(data.draw(st.sets(st.sampled_from(used)))) if used else set()
    for k in range(len(used) + 1):
        for extra in itertools.combinations(sorted(set(used) - streamed), k):
            resident = frozenset(used) - streamed - set(extra)
            for depth in range(3):
                time_s = predict(table, Choice(resident, depth)).time_s
                if not table.carry:  # wrap-around: a deeper carry can land after the last compute, uncovered
                    assert predict(table, Choice(resident, depth + 1)).time_s <= time_s + 1e-9
                if table.overlap:
                    assert _overlap_bound(table, streamed) <= time_s + 1e-9
                else:
                    order = sorted(streamed) + sorted(set(used) - streamed)
                    assert _inline_bound(table, order, len(streamed), frozenset(), 10**9, 0) <= time_s + 1e-9


@pytest.mark.slow  # about 5 s: a hundred blocks planned
def test_hundred_blocks_plan_quickly():
    import time
    groups = (GroupCost("embed", 400),) + tuple(GroupCost(f"b{i}", 100, True) for i in range(100)) + (
        GroupCost("head", 400),)
    uses = tuple(Use(g, p, p) for p, g in enumerate(range(102)))
    for overlap in (False, True):
        table = CostTable(groups, uses, (1.0,) * 102, bandwidth=150.0, overlap=overlap, activation_bytes=50)
        start = time.perf_counter()
        found = solve(table, 5400)
        assert time.perf_counter() - start < 10 and found.prediction.peak_bytes <= 5400


# -- real models ----------------------------------------------------------------------------------------

def _bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.slow  # a Llama planned, captured and run per budget; the fast subset plans a block stack below
@pytest.mark.parametrize("fraction", [0.45, 0.8, 3.0])
def test_llama_under_a_budget_matches_and_stays_within_it(fraction):
    model, kwargs = llama()
    budget_gb = fraction * _bytes(model) / 2**30
    policy = OffloadPolicy(strategy="auto", device="cpu", device_budget_gb=budget_gb, debug_poison=True)
    m = offload_compile(model, policy)
    plan = m.plan(**kwargs)
    # planning ran nothing and moved nothing
    assert offload_stats(m).fetch_count == 0 and offload_stats(m).bytes_transferred == 0
    with torch.no_grad():
        expected = model(**kwargs).logits
    assert torch.equal(m(**kwargs).logits, expected)
    stats = offload_stats(m)
    runtime = m._offload_runtime
    verified = runtime.graph_plans[0].verified.peak_bytes
    # the copies in flight are the verified ones, within the device slots and resident groups the plan holds,
    # which are what it predicted
    held = held_device_weight_bytes(runtime) - runtime.unmanaged_bytes
    assert stats.peak_resident_bytes == verified <= plan.predicted_weights_peak_bytes == held
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert stats.peak_resident_bytes <= plan.budget_bytes - plan.table.activation_bytes
    if fraction >= 3.0:
        assert stats.streamed_bytes == 0  # everything fits: nothing is streamed
    else:
        assert 0 < stats.streamed_bytes and stats.peak_resident_bytes < _bytes(model)


def test_auto_through_the_equivalence_check():
    model, x = build_block_model(ModelSpec(16, (BlockSpec("mlp", 16), BlockSpec("attention", 2),
                                                BlockSpec("mlp", 8)), True, True, 4, 2), 7)
    roomy = plan_offload(model, OffloadPolicy(strategy="auto", device="cpu", device_budget_gb=1.0), x)
    needed, _ = minimum_budget(roomy.table)
    budget = needed + (roomy.predicted_peak_bytes - needed) // 3  # between streaming and keeping everything
    policy = OffloadPolicy(strategy="auto", device="cpu", device_budget_gb=budget / 2**30, debug_poison=True)
    report = assert_offload_equivalent(model, policy, x)
    assert 0 < report.streamed_bytes and report.peak_resident_bytes <= budget - roomy.table.activation_bytes


@pytest.mark.slow  # a Llama planned twice
def test_infeasible_budget_errors_before_anything_runs_with_the_needed_figure():
    model, kwargs = llama()
    m = offload_compile(model, OffloadPolicy(strategy="auto", device="cpu", device_budget_gb=1e-5))
    with pytest.raises(InfeasibleBudgetError, match=r"too small.*needs .*GiB.*model\.layers\.\d.*device_budget_gb >=") as err:
        m(**kwargs)
    assert err.value.needed_bytes > 1e-5 * 2**30
    assert isinstance(err.value, ValueError)
    # the figure is right: that budget works
    ok = offload_compile(remove_offload(m), OffloadPolicy(strategy="auto", device="cpu",
                                              device_budget_gb=err.value.needed_bytes / 2**30))
    ok(**kwargs)
    assert offload_stats(ok).peak_resident_bytes + offload_plan(ok).table.activation_bytes <= err.value.needed_bytes


@pytest.mark.slow  # a Llama run six times, then planned again
def test_plan_table_text_and_json():
    model, kwargs = llama(layers=2)
    policy = OffloadPolicy(strategy="auto", device="cpu", device_budget_gb=0.6 * _bytes(model) / 2**30)
    m = offload_compile(model, policy)
    for _ in range(6):  # compile, warm up, then the timed calls
        m(**kwargs)
    plan = offload_plan(m)
    data = json.loads(plan.to_json())
    assert data == json.loads(json.dumps(data))
    assert {r["group"] for r in data["groups"]} >= {"model.layers.0", "model.layers.1", "lm_head"}
    assert {r["residency"] for r in data["groups"]} <= {"resident", "streamed", "unused"}
    assert data["predicted"]["peak_bytes"] <= data["budget_bytes"]
    assert data["measured"]["calls"] == 3 and data["measured"]["median_time_s"] > 0
    assert len(data["measured"]["times_s"]) == 3 and data["measured"]["calibration_spread"] >= 0
    assert data["measured"]["weights_peak_bytes"] == offload_stats(m).peak_resident_bytes
    text = str(plan)
    assert "model.layers.0" in text and "predicted peak" in text and "measured / predicted" in text
    assert "how far to trust it" in text and f"varied by {plan.rates.call_spread:.0%}" in text
    again = plan_offload(model, policy, **kwargs)  # planned with compute refined by the timed calls
    assert [(r["group"], r["bytes"]) for r in again.rows()] == [(r["group"], r["bytes"]) for r in data["groups"]]
    assert again.rates.compute_scale == plan.rates.compute_scale != 1.0


def test_relative_spread_is_zero_for_steady_calls_and_grows_with_a_load():
    from offload_compiler.planning.calibrate import relative_spread
    assert relative_spread([1.0] * 9) == 0.0
    assert relative_spread([1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]) > 0.5
    assert relative_spread([1.0, 2.0]) == 0.0  # too few calls to say


def test_free_budget_form():
    model, kwargs = llama(layers=1)
    plan = plan_offload(model, OffloadPolicy(strategy="auto", device="cpu", device_budget_gb="free",
                                             budget_margin_gb=0.25), **kwargs)
    assert "free" in plan.budget_source and plan.resident == frozenset(plan.table.used_groups)


def test_offload_plan_of_a_module_without_one():
    with pytest.raises(ValueError, match="no auto offload plan"):
        offload_plan(torch.nn.Linear(2, 2))
    with pytest.raises(Exception, match="strategy='auto' plans before compiling"):  # dynamo wraps it
        torch.compile(torch.nn.Linear(2, 2), backend="omni_offload",
                      options={"strategy": "auto", "device": "cpu", "device_budget_gb": 1})(torch.ones(2))


class _DataDependentRouting(torch.nn.Module):
    """Routes by counts read from tensor data, as a mixture of experts does (diffusers' HiDream `moe_infer`)."""
    _layerwise_offload_blocks_attr = "blocks"

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        counts = (x > 0).sum(-1).bincount(minlength=3).cpu().numpy().cumsum(0)
        for block, end in zip(self.blocks, counts):
            if end:
                x = block(x)
        return x


def test_auto_refuses_a_data_dependent_forward_with_the_fix_and_nothing_is_lost():
    """Dynamo's data-dependent error (``UserError``: "Could not extract specialized integer from data-dependent
    expression") escaped raw, with dynamo's full report, at every call; it is auto's refusal now."""
    torch.manual_seed(0)
    model, x = _DataDependentRouting().eval(), torch.randn(4, 8)
    with torch.no_grad():
        expected = model(x)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    m = offload_compile(model, OffloadPolicy(strategy="auto", device="cpu", device_budget_gb=1e-6))
    for _ in range(2):  # refused the same way at every call
        with pytest.raises(ValueError, match=r"cannot capture _DataDependentRouting as one \(.*data-dependent.*"
                                             r"strategy='layerwise' or 'budget'"):
            with torch.no_grad():
                m(x)
    plain = remove_offload(m)
    assert all(torch.equal(v, snapshot[k]) for k, v in plain.state_dict().items())
    with torch.no_grad():
        assert torch.equal(plain(x), expected)


def test_layerwise_runs_a_data_dependent_forward_as_the_plain_model():
    """Layerwise on the same model: dynamo breaks the graph at the data-dependent counts and runs part of the
    frame without a graph. The call was refused before (the blocks no token was routed to were fetched by no
    graph, which looked like a read from host memory); it runs as the plain model, streaming what it uses."""
    model, x = _DataDependentRouting().eval().requires_grad_(False), torch.randn(4, 8)
    with torch.no_grad():
        expected = model(x)
    m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="layerwise", device="cpu"))
    for _ in range(2):
        reset_offload_stats(m)
        with torch.no_grad():
            assert torch.equal(m(x), expected)
        assert_traffic_matches_plan(m)


@pytest.mark.slow  # the CLI plans and runs a Llama six times, then plots
def test_cli_prints_the_plan_and_saves_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from offload_compiler.cli import main
    assert main(["run", "--model", "llama", "--device", "cpu", "--device-budget-gb", "0.0003", "--calls", "6",
                 "--json", "--plots", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    data = report["plan"]
    assert data["predicted"]["peak_bytes"] <= data["budget_bytes"] and report["equivalence"]["equal"]
    assert (tmp_path / "timeline.png").stat().st_size > 0 and (tmp_path / "residency.png").stat().st_size > 0
    assert main(["plan", "--model", "llama", "--device", "cpu", "--device-budget-gb", "0.00001"]) == 2
    assert "device_budget_gb >=" in capsys.readouterr().err


# -- calibration: predicted against measured time ------------------------------------------------------

def _first_plan_ratio(name: str) -> float:
    """predicted / measured forward time of the first plan (before `refine_rates` rescales anything)."""
    from offload_compiler.testing import models
    model, kwargs = getattr(models, name)()
    m = offload_compile(model, OffloadPolicy(strategy="auto", device="cpu",
                                             device_budget_gb=0.6 * _bytes(model) / 2**30))
    with torch.no_grad():
        for _ in range(6):  # compile, warm up, then the timed calls
            m(**kwargs)
    plan = offload_plan(m)
    plan.rates.compute_scale = 1.0  # the next try predicts from the calibrated rates again
    return plan.predicted_s / plan.measured_median_s


@pytest.mark.slow  # four models, each planned and timed over six calls, up to three times
@pytest.mark.trial  # timings: run where no second test process shares the cores
@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2", "dit"])
def test_the_prediction_counts_host_overheads(name):
    """The host overheads (per op, per fetch, per call), measured once per device and compiler on a probe model
    (`planning/calibrate.py`), are part of every prediction. Without them the first plan was predicted 4-14x
    too fast (0.07-0.26 of the measured time); with them it lands within 30% on an idle machine, which is
    measured by `benchmarks/auto_calibration.py` (results/auto_calibration.json), not here: a shared machine
    moves timings by tens of %. This test only asks for the right order of magnitude, with up to three tries,
    each calibrating afresh."""
    from offload_compiler.planning import calibrate
    ratios = []
    for _ in range(3):
        ratios.append(_first_plan_ratio(name))
        if 1 / 3 <= ratios[-1] <= 3:
            break
        calibrate._RATES.clear()  # calibrate again too: the load may have changed since
    assert 1 / 3 <= ratios[-1] <= 3, ratios


def test_refine_rates_leaves_the_measured_overheads_alone():
    """refine_rates rescales only the work (FLOPs, bytes): call, dispatch and inline transfers are taken out
    first, so a measurement equal to the prediction leaves the scale at 1."""
    from offload_compiler.planning.auto import refine_rates
    model, kwargs = llama(layers=1)
    plan = plan_offload(model, OffloadPolicy(strategy="auto", device="cpu", device_budget_gb=1), **kwargs)
    plan.rates.compute_scale = 1.0
    assert plan.table.call_overhead_s > 0 and 0 < plan.table.dispatch_s < plan.table.compute_s
    plan.measured_s = [plan.predicted_s] * 3
    refine_rates(plan)
    assert plan.rates.compute_scale == pytest.approx(1.0)
    plan.measured_s = [plan.predicted_s + (plan.table.compute_s - plan.table.dispatch_s)] * 3  # work twice over
    refine_rates(plan)
    assert plan.rates.compute_scale == pytest.approx(2.0)
    plan.rates.compute_scale = 1.0


def test_stalls_are_never_negative_from_rounding():
    """The replay adds the compute up in pieces, the table in one sum: what is left over is rounding, once
    printed as "stalls -0.000 ms"."""
    from offload_compiler.planning.planner import Prediction
    pieces = 0.1 + 0.2 + 0.3  # 0.6000000000000001
    p = Prediction(time_s=0.6, compute_s=pieces, transfer_s=0.0, weights_peak_bytes=0, resident_bytes=0,
                   activation_bytes=0, fetches=0, schedule=None)
    assert p.stall_s == 0.0 and f"{p.stall_s * 1e3:9.3f}".strip() == "0.000"
    late = Prediction(time_s=1.0, compute_s=0.25, transfer_s=0.5, weights_peak_bytes=0, resident_bytes=0,
                      activation_bytes=0, fetches=1, schedule=None, call_s=0.25)
    assert late.stall_s == 0.5


def test_the_auto_plan_shows_a_small_groups_bytes_not_zero_mib():
    from offload_compiler.planning.auto import OffloadPlan
    table = CostTable((GroupCost("model.layers.0", 2**20, True), GroupCost("model.rotary_emb", 64)),
                      (Use(0, 1, 1), Use(1, 2, 2)), (0.001, 0.001, 0.001, 0.001), bandwidth=1e9)
    solution = solve(table, 2**21)
    text = str(OffloadPlan("Tiny", "cpu", 2**21, "device_budget_gb=test", table, solution, None, {}))
    (row,) = [line for line in text.splitlines() if "model.rotary_emb" in line]
    assert " 64 B  " in row and "0.000 MiB" not in row
    (row,) = [line for line in text.splitlines() if "model.layers.0" in line]
    assert "1.000 MiB" in row


def test_auto_keeps_no_second_host_copy_of_the_weights_after_planning():
    """The capture ``auto`` plans from holds the model's parameters as its example inputs: nothing of it may
    outlive the plan (dynamo keeps the capture's backend for the life of the process), or every original
    parameter object, with its bytes, stays alive beside the packed host buffers (a second host copy)."""
    import gc
    import weakref
    model, x = build_block_model(ModelSpec(16, (BlockSpec("mlp", 16), BlockSpec("attention", 2),
                                                BlockSpec("mlp", 8)), True, True, 4, 2), 7)
    # weak references (no strong one): the model alone holds the originals, so they go once it no longer does
    originals = [weakref.ref(p) for p in model.parameters()]
    m = offload_compile(model, OffloadPolicy(strategy="auto", device="cpu", device_budget_gb=1.0))
    with torch.no_grad():
        expected = m(x)
    gc.collect()
    alive = [ref() for ref in originals if ref() is not None]
    assert not alive, f"{len(alive)} original parameters outlive planning: {[tuple(p.shape) for p in alive[:4]]}"
    with torch.no_grad():
        assert torch.equal(m(x), expected)
