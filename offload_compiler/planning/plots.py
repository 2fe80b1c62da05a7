"""Optional plots (need matplotlib). For an auto plan: the predicted timeline of transfers against compute, and
the device residency along the graph against the budget. For any offloaded model: the residency of each
verified graph plan, with the ledger's measured peak."""

from __future__ import annotations

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


# -- auto plan ------------------------------------------------------------------------------------------

class _TimelineBars:
    """Draws timeline bars with horizontal labels: inside a bar when it fits, else just above it when that
    does not run into the previous label of the row, else left out (a crowded timeline stays readable)."""

    def __init__(self, ax, total_ms: float) -> None:
        self.ax, self.px_per_ms = ax, TIMELINE_AXIS_PX / max(total_ms, 1e-12)
        self.label_end_px: dict[int, float] = {}

    def draw(self, row: int, start_ms: float, end_ms: float, color: str, label: str) -> None:
        self.ax.barh(row, end_ms - start_ms, left=start_ms, color=color, edgecolor="white", height=0.5)
        text_px = len(label) * CHAR_WIDTH_PX + 4
        middle = (start_ms + end_ms) / 2
        if (end_ms - start_ms) * self.px_per_ms >= text_px:
            self.ax.text(middle, row, label, ha="center", va="center", fontsize=LABEL_FONTSIZE, color="white")
        elif label and middle * self.px_per_ms - text_px / 2 >= self.label_end_px.get(row, -1e9):
            self.ax.text(middle, row + 0.28, label, ha="center", va="bottom", fontsize=LABEL_FONTSIZE)
            self.label_end_px[row] = middle * self.px_per_ms + text_px / 2


def _compute_labels(plan) -> list[str]:
    """The compute between two waits runs the group waited for first: ``before <first>``, then each group."""
    names = [_short(plan.table.groups[inst.group].name) for inst in plan.solution.prediction.schedule.instances]
    return [f"before {names[0]}" if names else "compute"] + names


def _save_timeline(plt, plan, path: str) -> str:
    from matplotlib.patches import Patch
    events = timeline(plan.table, plan.solution.choice)
    total_ms = max((end for _, _, _, end in events), default=0.0) * 1e3
    labels = iter(_compute_labels(plan))
    fig, ax = plt.subplots(figsize=(11, 2.8))
    bars = _TimelineBars(ax, total_ms)
    for kind, group, start, end in events:
        if kind == "compute":
            bars.draw(0, start * 1e3, end * 1e3, COMPUTE_COLOR, next(labels, ""))
        else:
            bars.draw(1, start * 1e3, end * 1e3, TRANSFER_COLOR, _short(plan.table.groups[group].name))
    legend = [Patch(color=COMPUTE_COLOR, label="compute (labelled with the group it runs)"),
              Patch(color=TRANSFER_COLOR, label="host → device copy of a group")]
    ax.set_yticks([0, 1], ["compute", "transfers"])
    ax.set_ylim(-0.5, 1.9)
    ax.set_xlim(0, total_ms * 1.01 or 1)
    ax.set_xlabel("time within one forward (ms, predicted by the cost model)")
    measured = plan.measured_median_s
    ax.set_title(f"{plan.model_name}: prefetch={plan.prefetch}, blocks_per_group={plan.blocks_per_group}; "
                 f"predicted {total_ms:.3f} ms per forward"
                 + (f", measured {measured * 1e3:.3f} ms" if measured is not None else ""), fontsize=10)
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
                   label=f"measured weights peak, ledger ({plan.measured_peak_bytes / MIB:.3f} MiB)")
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

def save_runtime_plots(runtime, directory: str) -> list[str]:
    """``residency.png``: for each graph the runtime verified, the device weight bytes along its nodes (as the
    schedule places fetches and evicts), its verified peak, and the ledger's measured peak."""
    plt = _pyplot()
    os.makedirs(directory, exist_ok=True)
    group_bytes = [g.nbytes for g in runtime.groups]
    fig, ax = plt.subplots(figsize=(11, 3.2))
    highest, longest = runtime.ledger.peak, 1
    for index, plan in enumerate(runtime.graph_plans):
        live = live_bytes(plan.schedule, group_bytes, plan.verified.resident_bytes, plan.num_nodes)
        ax.step(range(plan.num_nodes + 1), [b / MIB for b in live], where="post",
                label=f"graph {index}: device weights, verified peak {plan.verified.peak_bytes / MIB:.3f} MiB")
        highest, longest = max([highest, plan.verified.peak_bytes] + live), max(longest, plan.num_nodes)
    ax.axhline(runtime.ledger.peak / MIB, color="black", linestyle="-.", linewidth=1,
               label=f"measured weights peak, ledger ({runtime.ledger.peak / MIB:.3f} MiB)")
    _residency_axes(ax, longest, highest, f"{runtime.model_name}: device weights along each graph "
                                          f"(strategy={runtime.policy.strategy}, prefetch={runtime.policy.prefetch})")
    return [_legend_outside_and_save(fig, ax, os.path.join(directory, "residency.png"))]
