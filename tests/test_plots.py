"""The plots' data, checked where it is computed (`timeline_layout`, `runtime_residency`), not in pixels: the
timeline's title is the printed plan's time, transfers are visible, labels stay within the axis; the residency
of an offloaded model labels each box with its group and counts the weights kept on the device."""

import re

import pytest
import torch

from offload_compiler import OffloadPolicy, describe_plan, offload_compile, offload_stats
from offload_compiler.offloaded import state_of
from offload_compiler.passes.schedule import Use
from offload_compiler.planning.auto import OffloadPlan
from offload_compiler.planning.planner import CostTable, GroupCost, solve
from offload_compiler.planning.plots import (CHAR_WIDTH_PX, MIN_BAR_PX, TIMELINE_AXIS_PX, runtime_residency,
                                             timeline_layout)


def _plan(call_overhead_s=0.17, bandwidth=1e9) -> OffloadPlan:
    """An auto plan over a made-up table: three 1 MB blocks computing 300 ms each, copies of 1 ms, a call of
    fixed cost ``call_overhead_s`` (what the timeline left out: 1032 ms in its title, 1202 ms printed)."""
    groups = tuple(GroupCost(f"model.layers.{i}", 10**6, True) for i in range(3))
    uses = tuple(Use(i, 1 + 2 * i, 2 + 2 * i) for i in range(3))
    table = CostTable(groups, uses, (0.02, 0.3, 0.0, 0.3, 0.0, 0.3, 0.0, 0.01), bandwidth=bandwidth,
                      fetch_overhead_s=0.0, call_overhead_s=call_overhead_s)
    solution = solve(table, 2 * 10**6)  # two blocks at once: the third is streamed, or all three with prefetch
    return OffloadPlan("Tiny", "cpu", 2 * 10**6, "device_budget_gb=test", table, solution, rates=None,
                       candidates={1: solution.prediction.time_s})


def test_the_timeline_title_is_the_printed_plans_time_per_forward():
    plan = _plan()
    layout = timeline_layout(plan)
    printed = re.search(r"predicted time\s+([\d.]+) ms", str(plan)).group(1)
    assert f"predicted {float(printed):.3f} ms per forward" in layout.title
    assert layout.total_ms == pytest.approx(plan.predicted_s * 1e3)
    assert max(b.end_ms for b in layout.bars) == pytest.approx(layout.total_ms)  # the call's fixed cost drawn
    (call,) = [b for b in layout.bars if b.label == "call overhead"]
    assert call.start_ms == 0 and call.end_ms == pytest.approx(170.0)


def test_transfers_are_drawn_at_least_a_few_pixels_wide():
    layout = timeline_layout(_plan())
    transfers = [b for b in layout.bars if b.lane == "transfers"]
    assert transfers and all(b.end_ms - b.start_ms < 2 for b in transfers)  # 1 ms copies on a ~1100 ms axis
    px_per_ms = TIMELINE_AXIS_PX / (layout.total_ms * 1.01)
    assert all((b.drawn_end_ms - b.start_ms) * px_per_ms >= MIN_BAR_PX - 1e-9 for b in transfers)
    assert all(b.drawn_end_ms == b.end_ms for b in layout.bars if b.lane == "compute")  # long enough already


def test_labels_stay_within_the_axis():
    """The first compute label ("before layers.0" over a short first compute) was centred and clipped."""
    layout = timeline_layout(_plan(call_overhead_s=0.0))
    first = layout.bars[0]
    assert first.label == "before layers.0" and first.label_at == "above"
    px_per_ms = TIMELINE_AXIS_PX / (layout.total_ms * 1.01)
    for bar in layout.bars:
        if bar.label_at != "above":
            continue
        width_px = len(bar.label) * CHAR_WIDTH_PX + 4
        left = {"left": bar.label_x * px_per_ms, "center": bar.label_x * px_per_ms - width_px / 2,
                "right": bar.label_x * px_per_ms - width_px}[bar.label_ha]
        assert 0 <= left and left + width_px <= TIMELINE_AXIS_PX, bar


class EncoderDenoiserVae(torch.nn.Module):
    """Two components that alternate on the device and a VAE kept there (outside the groups)."""

    def __init__(self):
        super().__init__()
        self.text_encoder = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
        self.transformer = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 16))
        self.vae = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.vae(self.transformer(self.text_encoder(x)))


def test_the_residency_of_alternating_labels_each_box_and_counts_what_stays_on_the_device():
    m = offload_compile(EncoderDenoiserVae(), OffloadPolicy(strategy="alternating",
                                                            components=["text_encoder", "transformer"], device="cpu"))
    with torch.no_grad():
        m(torch.randn(2, 16))
    data = runtime_residency(state_of(m).runtime)
    (graph,) = data.graphs
    assert [box.group for box in graph.boxes] == ["text_encoder", "transformer"]
    assert all(box.label_at for box in graph.boxes)  # each box says which component it is
    kept = offload_stats(m).unmanaged_bytes
    assert kept == 17 * 16 * 4 and data.kept_bytes == kept  # the VAE, on the device throughout
    assert min(graph.live) == kept and max(graph.live) == graph.peak
    shown = re.search(r"device weight peak ([\d.]+) MiB", describe_plan(m)).group(1)
    assert f"{graph.peak / 2**20:.3f}" == shown  # the plot's peak is the one describe_plan prints
    assert data.measured_peak == offload_stats(m).peak_device_weight_bytes


class Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.head = torch.nn.Linear(16, 16)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_the_residency_of_budget_starts_at_the_resident_groups():
    layer = 17 * 16 * 4
    m = offload_compile(Blocks(), OffloadPolicy(strategy="budget", offload_gb=2 * layer / 2**30, device="cpu"))
    with torch.no_grad():
        m(torch.randn(2, 16))
    runtime = state_of(m).runtime
    data = runtime_residency(runtime)
    assert [g.name for g in runtime.groups if g.streamed] == ["layers.0", "layers.1"]
    assert data.resident_bytes == 3 * layer  # layers.2, layers.3 and the head
    (graph,) = data.graphs
    assert graph.live[0] == 3 * layer and graph.peak == runtime.graph_plans[0].verified.peak_bytes
    assert graph.peak == max(graph.live) > 3 * layer
    assert [box.group for box in graph.boxes] == ["layers.0", "layers.1"]


def test_residency_labels_do_not_overlap_and_stay_within_the_axis():
    """Boxes of one graph overlap where a copy is prefetched beside the one computing: their labels were drawn
    on top of each other."""
    from offload_compiler.planning.plots import (CHAR_WIDTH_PX, LABEL_HEIGHT_PX, RESIDENCY_AXIS_PX,
                                                 RESIDENCY_AXIS_WIDTH_PX)
    m = offload_compile(Blocks(), OffloadPolicy(strategy="layerwise", device="cpu", prefetch=2))
    with torch.no_grad():
        m(torch.randn(2, 16))
    data = runtime_residency(state_of(m).runtime)
    (graph,) = data.graphs
    px_per_node = RESIDENCY_AXIS_WIDTH_PX / data.longest
    band = max(graph.live) * 1.15 * LABEL_HEIGHT_PX / RESIDENCY_AXIS_PX
    rects = []
    for box in graph.boxes:
        if not box.label_at:
            continue
        width = len(box.group) * CHAR_WIDTH_PX + 4
        left = {"left": box.label_x * px_per_node, "center": box.label_x * px_per_node - width / 2,
                "right": box.label_x * px_per_node - width}[box.label_ha]
        assert 0 <= left and left + width <= RESIDENCY_AXIS_WIDTH_PX + 1e-9, box
        rects.append((left, left + width, box.top_bytes))
    assert len(rects) >= 2  # some labelled, none on another
    assert not [(a, b) for i, a in enumerate(rects) for b in rects[i + 1:]
                if a[0] < b[1] and b[0] < a[1] and abs(a[2] - b[2]) < band]
