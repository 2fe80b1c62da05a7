"""Optional plots of an auto plan (needs matplotlib): the predicted timeline of transfers vs compute, and the
device residency curve along the graph."""

from __future__ import annotations

import os

from .planner import timeline


def save_plan_plots(plan, directory: str) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - optional extra
        raise ImportError("plots need matplotlib: pip install matplotlib") from exc
    os.makedirs(directory, exist_ok=True)
    table, choice = plan.table, plan.solution.choice
    paths = []

    fig, ax = plt.subplots(figsize=(10, 2.5))
    for kind, group, start, end in timeline(table, choice):
        row = 0 if kind == "compute" else 1
        ax.barh(row, (end - start) * 1e3, left=start * 1e3, color="tab:blue" if row == 0 else "tab:orange")
        if kind == "transfer" and end > start:
            ax.text((start + end) / 2 * 1e3, 1, table.groups[group].name, ha="center", va="center", fontsize=6,
                    rotation=90)
    ax.set_yticks([0, 1], ["compute", "transfers"])
    ax.set_xlabel("predicted time (ms)")
    ax.set_title(f"{plan.model_name}: prefetch={plan.prefetch}, blocks_per_group={plan.blocks_per_group}")
    paths.append(os.path.join(directory, "timeline.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    schedule = plan.solution.prediction.schedule
    resident = plan.solution.prediction.resident_bytes
    n = len(table.node_seconds)
    live = [resident] * (n + 1)
    for inst in schedule.instances:
        fetched_at = schedule.instances[schedule.prefetch_at[inst.index]].start
        for p in range(fetched_at, inst.end + 1):
            live[p] += table.groups[inst.group].nbytes
    fig, ax = plt.subplots(figsize=(10, 3))
    ax.step(range(n + 1), [b / 2**20 for b in live], where="post", label="device weights (predicted)")
    ax.axhline((plan.budget_bytes - table.activation_bytes) / 2**20, color="tab:red", linestyle="--",
               label="budget minus activations")
    ax.set_xlabel("graph position")
    ax.set_ylabel("MiB")
    ax.legend(loc="upper right")
    paths.append(os.path.join(directory, "residency.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
