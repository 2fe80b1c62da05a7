"""Optional plots (need matplotlib). For an auto plan: the predicted timeline of transfers against compute, and
the device residency along the graph against the budget. For any offloaded model: the residency of each
verified graph plan, with the ledger's measured peak."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

from .planner import timeline

MIB = 2**20
COMPUTE_COLOR, TRANSFER_COLOR = "tab:blue", "tab:orange"
LABEL_FONTSIZE = 8
CHAR_WIDTH_PX = 6  # about one character at LABEL_FONTSIZE
TIMELINE_AXIS_PX = 900  # width of the timeline's data area at its size and dpi


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - optional extra
        raise ImportError("plots need matplotlib: pip install matplotlib") from exc
    return plt


def _short(name: str) -> str:
    """The last two parts of a dotted module path: ``model.layers.0`` -> ``layers.0``."""
    return ".".join(name.split(".")[-2:]) or "(root)"


def _legend_outside_and_save(fig, ax, path: str, **legend: Any) -> str:
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=LABEL_FONTSIZE + 1, frameon=False, **legend)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def live_bytes(schedule: Any, group_bytes: Sequence[int], resident_bytes: int, nodes: int) -> list[int]:
    """Device weight bytes at each graph position 0..nodes: the resident groups, plus each streamed copy from
    the wait its prefetch is issued at to its last use."""
    live = [resident_bytes] * (nodes + 1)
    for inst in schedule.instances:
        fetched_at = schedule.instances[schedule.prefetch_at[inst.index]].start
        for position in range(fetched_at, inst.end + 1):
            live[position] += group_bytes[inst.group]
    return live


# -- labels ---------------------------------------------------------------------------------------------

def _place_label(start: float, end: float, label: str, px_per_unit: float, axis_end: float,
                 taken_px: dict[int, float], row: int) -> tuple[str, float, str]:
    """Where ``label`` of a bar or box from ``start`` to ``end`` goes: (``"inside"``, x, ha) when it fits inside,
    else (``"above"``, x, ha) when it does not run into the previous label above the ``row``, else
    (``""``, 0, "") (left out: a crowded row stays readable). A label above is kept within the axis: near its
    left edge it starts at the bar (left-aligned) instead of being centred and clipped, near its right edge it
    ends at the bar."""
    if not label:
        return "", 0.0, ""
    text_px = len(label) * CHAR_WIDTH_PX + 4
    middle = (start + end) / 2
    if (end - start) * px_per_unit >= text_px:
        return "inside", middle, "center"
    left_px, ha, x = middle * px_per_unit - text_px / 2, "center", middle
    if left_px < 0:
        left_px, ha, x = max(start, 0.0) * px_per_unit, "left", max(start, 0.0)
    elif left_px + text_px > axis_end * px_per_unit:
        left_px, ha, x = min(end, axis_end) * px_per_unit - text_px, "right", min(end, axis_end)
    if left_px < taken_px.get(row, -1e9):
        return "", 0.0, ""
    taken_px[row] = left_px + text_px
    return "above", x, ha


# -- auto plan ------------------------------------------------------------------------------------------

MIN_BAR_PX = 4  # a transfer of 1 ms on a 1000 ms axis is drawn this wide, not as an invisible sliver


@dataclasses.dataclass(frozen=True)
class TimelineBar:
    lane: str  # "compute" or "transfers"
    start_ms: float  # predicted, from the start of the call
    end_ms: float
    drawn_end_ms: float  # end_ms, or later where the bar would be under MIN_BAR_PX wide
    label: str
    label_at: str  # "inside", "above" or "" (left out)
    label_x: float
    label_ha: str


@dataclasses.dataclass(frozen=True)
class TimelineLayout:
    bars: list[TimelineBar]
    total_ms: float  # the plan's predicted time per forward: the same number its text prints
    title: str


def _compute_labels(plan) -> list[str]:
    """The compute between two waits runs the group waited for first: ``before <first>``, then each group."""
    names = [_short(plan.table.groups[inst.group].name) for inst in plan.solution.prediction.schedule.instances]
    return [f"before {names[0]}" if names else "compute"] + names


def timeline_layout(plan) -> TimelineLayout:
    """What ``timeline.png`` draws, as data: the call's fixed cost, then the replayed compute and transfers
    (shifted after it), so the last bar ends at the plan's predicted time — the number its text prints; each
    bar at least `MIN_BAR_PX` wide, its label placed within the axis."""
    call_ms = plan.solution.prediction.call_s * 1e3
    events = [("compute", -1, 0.0, call_ms, "call overhead")] if call_ms > 0 else []
    labels = iter(_compute_labels(plan))
    for kind, group, start, end in timeline(plan.table, plan.solution.choice):
        label = next(labels, "") if kind == "compute" else _short(plan.table.groups[group].name)
        events.append((kind, group, call_ms + start * 1e3, call_ms + end * 1e3, label))
    total_ms = plan.predicted_s * 1e3
    axis_end = total_ms * 1.01 or 1.0
    px_per_ms = TIMELINE_AXIS_PX / axis_end
    taken: dict[int, float] = {}
    bars = []
    for kind, _, start, end, label in events:
        row = 0 if kind == "compute" else 1
        drawn_end = max(end, start + MIN_BAR_PX / px_per_ms)
        at, x, ha = _place_label(start, drawn_end, label, px_per_ms, axis_end, taken, row)
        bars.append(TimelineBar("compute" if row == 0 else "transfers", start, end, drawn_end, label, at, x, ha))
    measured = plan.measured_median_s
    title = (f"{plan.model_name}: prefetch={plan.prefetch}, blocks_per_group={plan.blocks_per_group}; "
             f"predicted {total_ms:.3f} ms per forward"
             + (f", measured {measured * 1e3:.3f} ms" if measured is not None else ""))
    return TimelineLayout(bars, total_ms, title)


def _save_timeline(plt, plan, path: str) -> str:
    from matplotlib.patches import Patch
    layout = timeline_layout(plan)
    fig, ax = plt.subplots(figsize=(11, 2.8))
    for bar in layout.bars:
        row = 0 if bar.lane == "compute" else 1
        color = COMPUTE_COLOR if row == 0 else TRANSFER_COLOR
        ax.barh(row, bar.drawn_end_ms - bar.start_ms, left=bar.start_ms, color=color, edgecolor="white",
                height=0.5, linewidth=0.5 if row == 0 else 0)
        if bar.label_at == "inside":
            ax.text(bar.label_x, row, bar.label, ha="center", va="center", fontsize=LABEL_FONTSIZE, color="white")
        elif bar.label_at == "above":
            ax.text(bar.label_x, row + 0.28, bar.label, ha=bar.label_ha, va="bottom", fontsize=LABEL_FONTSIZE)
    legend = [Patch(color=COMPUTE_COLOR, label="compute (labelled with the group it runs)"),
              Patch(color=TRANSFER_COLOR, label="host → device copy of a group")]
    ax.set_yticks([0, 1], ["compute", "transfers"])
    ax.set_ylim(-0.5, 1.9)
    ax.set_xlim(0, layout.total_ms * 1.01 or 1)
    ax.set_xlabel(f"time within one forward (ms, predicted by the cost model; a copy is drawn at least "
                  f"{MIN_BAR_PX} px wide)")
    ax.set_title(layout.title, fontsize=10, loc="left")
    return _legend_outside_and_save(fig, ax, path, handles=legend)


def _save_plan_residency(plt, plan, path: str) -> str:
    table, prediction = plan.table, plan.solution.prediction
    nodes = len(table.node_seconds)
    live = live_bytes(prediction.schedule, [g.nbytes for g in table.groups], prediction.resident_bytes, nodes)
    weights_budget = plan.budget_bytes - table.activation_bytes
    fig, ax = plt.subplots(figsize=(11, 3.2))
    ax.step(range(nodes + 1), [b / MIB for b in live], where="post", color=COMPUTE_COLOR,
            label="device weights (predicted)")
    ax.axhline(prediction.resident_bytes / MIB, color="gray", linestyle=":",
               label=f"resident weights ({prediction.resident_bytes / MIB:.3f} MiB)")
    ax.axhline(weights_budget / MIB, color="tab:red", linestyle="--",
               label=f"budget minus activation peak ({weights_budget / MIB:.3f} MiB)")
    ax.axhline(plan.budget_bytes / MIB, color="tab:red", linestyle="-", linewidth=1,
               label=f"device budget ({plan.budget_bytes / MIB:.3f} MiB)")
    if plan.measured_peak_bytes is not None:
        ax.axhline(plan.measured_peak_bytes / MIB, color="black", linestyle="-.", linewidth=1,
                   label=f"measured copies in flight, ledger ({plan.measured_peak_bytes / MIB:.3f} MiB)")
    _residency_axes(ax, nodes, max(live + [plan.budget_bytes]),
                    f"{plan.model_name}: device memory along the forward (auto plan)")
    return _legend_outside_and_save(fig, ax, path)


def _residency_axes(ax, nodes: int, highest_bytes: int, title: str) -> None:
    ax.set_xlim(0, max(nodes, 1))
    ax.set_ylim(0, highest_bytes / MIB * 1.15 or 1)
    ax.set_xlabel(f"graph node, in execution order (of {nodes})")
    ax.set_ylabel("device memory (MiB)")
    ax.set_title(title, fontsize=10)


def save_plan_plots(plan, directory: str) -> list[str]:
    """``timeline.png`` and ``residency.png`` of an auto plan in ``directory``."""
    plt = _pyplot()
    os.makedirs(directory, exist_ok=True)
    return [_save_timeline(plt, plan, os.path.join(directory, "timeline.png")),
            _save_plan_residency(plt, plan, os.path.join(directory, "residency.png"))]


# -- any offloaded model: the verified graph plans ------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ResidencyBox:
    """One streamed group's stay on the device in a graph: from the wait its prefetch is issued at to its last
    use, labelled with its name."""
    group: str
    start: int
    end: int
    nbytes: int
    top_bytes: int  # the device weights at the box's highest point: where its label sits
    label_at: str  # "inside" (centred over it), "above" (beside it, within the axis) or "" (left out)
    label_x: float
    label_ha: str


@dataclasses.dataclass(frozen=True)
class GraphResidency:
    index: int
    nodes: int
    live: list[int]  # device weight bytes at each position: kept outside the groups + resident + streamed copies
    peak: int  # the verified peak plus the weights kept on the device outside the groups
    boxes: list[ResidencyBox]


@dataclasses.dataclass(frozen=True)
class RuntimeResidency:
    graphs: list[GraphResidency]
    kept_bytes: int  # weights outside every group, on the device throughout (a pipeline's VAE, a language model
    # beside its alternating encoders)
    measured_peak: int  # the ledger's peak plus kept_bytes: every weight on the device at once, measured
    longest: int
    resident_bytes: int = 0  # the resident groups' bytes (on the device from their first fetch on)


def runtime_residency(runtime) -> RuntimeResidency:
    """What ``residency.png`` of an offloaded model draws, as data: each verified graph's device weights along
    its nodes (the weights kept on the device and the resident groups included, so its peak is the device
    weight peak `describe_plan` prints), and a box per streamed copy, labelled with its group."""
    groups = runtime.groups
    kept = runtime.unmanaged_bytes
    longest = max([1] + [plan.num_nodes for plan in runtime.graph_plans])
    lives = [[kept + b for b in live_bytes(plan.schedule, [g.nbytes for g in groups], plan.verified.resident_bytes,
                                           plan.num_nodes)] for plan in runtime.graph_plans]
    highest = max([runtime.ledger.peak + kept] + [max(live) for live in lives])
    # a label's height in bytes, on an axis RESIDENCY_AXIS_PX high up to 1.15 x highest
    band = highest * 1.15 * LABEL_HEIGHT_PX / RESIDENCY_AXIS_PX
    placed: list[tuple[float, float, float]] = []  # (left px, right px, bottom bytes) of each label placed
    graphs = []
    for index, (plan, live) in enumerate(zip(runtime.graph_plans, lives)):
        schedule = plan.schedule
        boxes = []
        for inst in schedule.instances:
            start = schedule.instances[schedule.prefetch_at[inst.index]].start
            group = groups[inst.group]
            top = max(live[start:inst.end + 1])
            at, x, ha = _place_box_label(start, inst.end, _short(group.name), longest, top, band, placed)
            boxes.append(ResidencyBox(group.name, start, inst.end, group.nbytes, top, at, x, ha))
        graphs.append(GraphResidency(index, plan.num_nodes, live, plan.verified.peak_bytes + kept, boxes))
    resident = sum(g.nbytes for g in groups if not g.streamed)
    return RuntimeResidency(graphs, kept, runtime.ledger.peak + kept, longest, resident)


RESIDENCY_AXIS_PX = 270  # height of the residency plot's data area at its size and dpi
RESIDENCY_AXIS_WIDTH_PX = 700  # its width, less than the timeline's: its legend's lines are longer
LABEL_HEIGHT_PX = 12


def _place_box_label(start: int, end: int, label: str, longest: int, top: int, band: float,
                     placed: list[tuple[float, float, float]]) -> tuple[str, float, str]:
    """A box's label sits on its top, centred over it (``"inside"`` when the box is as wide as the label, else
    ``"above"``), kept within the axis; left out where it would overlap a label already placed (a crowded plot
    stays readable)."""
    px_per_node = RESIDENCY_AXIS_WIDTH_PX / longest
    text_px = len(label) * CHAR_WIDTH_PX + 4
    middle = (start + end) / 2
    left, ha, x = middle * px_per_node - text_px / 2, "center", middle
    if left < 0:
        left, ha, x = start * px_per_node, "left", float(start)
    elif left + text_px > RESIDENCY_AXIS_WIDTH_PX:
        left, ha, x = end * px_per_node - text_px, "right", float(end)
    if any(left < right and other_left < left + text_px and abs(top - bottom) < band
           for other_left, right, bottom in placed):
        return "", 0.0, ""
    placed.append((left, left + text_px, top))
    return ("inside" if (end - start) * px_per_node >= text_px else "above"), x, ha


def save_runtime_plots(runtime, directory: str) -> list[str]:
    """``residency.png``: for each graph the runtime verified, the device weight bytes along its nodes (as the
    schedule places fetches and evicts; the weights kept on the device included), each streamed copy labelled
    with its group, its verified peak, and the ledger's measured peak."""
    plt = _pyplot()
    os.makedirs(directory, exist_ok=True)
    data = runtime_residency(runtime)
    fig, ax = plt.subplots(figsize=(11, 3.2))
    highest = data.measured_peak
    for graph in data.graphs:
        line, = ax.step(range(graph.nodes + 1), [b / MIB for b in graph.live], where="post",
                        label=f"graph {graph.index}: device weights, verified peak {graph.peak / MIB:.3f} MiB")
        for box in graph.boxes:
            if box.label_at:
                ax.text(box.label_x, box.top_bytes / MIB, _short(box.group), ha=box.label_ha, va="bottom",
                        fontsize=LABEL_FONTSIZE, color=line.get_color())
        highest = max([highest, graph.peak] + graph.live)
    if data.kept_bytes or data.resident_bytes:
        what = " + ".join(([f"resident groups {data.resident_bytes / MIB:.3f} MiB"] if data.resident_bytes else [])
                          + ([f"kept outside the groups {data.kept_bytes / MIB:.3f} MiB"] if data.kept_bytes else []))
        ax.axhline((data.kept_bytes + data.resident_bytes) / MIB, color="gray", linestyle=":", linewidth=1,
                   label=f"on the device throughout: {what}")
    ax.axhline(data.measured_peak / MIB, color="black", linestyle="-.", linewidth=1,
               label=f"measured copies in flight, ledger{' + kept' if data.kept_bytes else ''} "
                     f"({data.measured_peak / MIB:.3f} MiB)")
    policy = runtime.policy
    _residency_axes(ax, data.longest, highest, f"{runtime.model_name}: device weights along each graph "
                                               f"(strategy={policy.strategy}, prefetch={policy.prefetch})")
    return [_legend_outside_and_save(fig, ax, os.path.join(directory, "residency.png"))]
