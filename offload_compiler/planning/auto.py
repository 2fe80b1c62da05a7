"""``strategy="auto"``: capture the graph once (nothing runs), build cost tables, solve, then offload with the
chosen residency, prefetch depth and ``blocks_per_group``. The plan is public: `offload_plan(m)`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from typing import Any, Iterator

import torch
from torch import nn

from ..backend import build_runtime
from .capture import capture_graph
from .calibrate import device_rates
from .costmodel import DeviceRates, build_table, calibration_bytes
from ..grouping import GroupSpec, plan_groups
from .planner import GIB, CostTable, InfeasibleBudgetError, Solution, solve
from ..policy import OffloadPolicy
from ..runtime import OffloadRuntime, synchronize, tracing_on
from ..runtime.disk import read_bandwidth
from ..runtime.stats import readable_bytes

BLOCKS_PER_GROUP_CANDIDATES = (1, 2, 4)
WARMUP_CALLS = 2  # the first compiles, the second still pays lazy initialisation
MEASURED_CALLS = 3  # calls timed after the warm-up, for predicted vs measured


# -- budget -----------------------------------------------------------------------------------------------

def free_device_bytes(device: torch.device) -> int:
    """Free memory of the device now: the device module's ``mem_get_info`` (``cudaMemGetInfo`` on CUDA) on an
    accelerator, available RAM on the CPU."""
    if device.type != "cpu" and hasattr(torch.get_device_module(device), "mem_get_info"):
        return int(torch.get_device_module(device).mem_get_info(device)[0])
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil is optional
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def resolve_budget(policy: OffloadPolicy) -> tuple[int, str]:
    if policy.device_budget_gb != "free":
        return int(policy.device_budget_gb * GIB), f"device_budget_gb={policy.device_budget_gb:g}"
    free = free_device_bytes(policy.torch_device)
    budget = free - int(policy.budget_margin_gb * GIB)
    if budget <= 0:
        raise InfeasibleBudgetError(
            f"device_budget_gb='free': {policy.device} has {free / GIB:.3f} GiB free, not more than "
            f"budget_margin_gb={policy.budget_margin_gb:g}; free memory on the device or lower budget_margin_gb",
            needed_bytes=int(policy.budget_margin_gb * GIB), budget_bytes=budget)
    return budget, f"free {free / GIB:.3f} GiB - margin {policy.budget_margin_gb:g} GiB"


# -- capture ----------------------------------------------------------------------------------------------

# -- the plan ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class OffloadPlan:
    """What the planner chose and why; `str()` for people, `to_dict()` / `to_json()` for tools."""
    model_name: str
    device: str
    budget_bytes: int
    budget_source: str
    table: CostTable
    solution: Solution
    rates: DeviceRates
    candidates: dict[int, float | None]  # blocks_per_group -> predicted time (None: infeasible)
    measured_s: list[float] = dataclasses.field(default_factory=list)
    measured_peak_bytes: int | None = None
    calls: int = 0

    @contextlib.contextmanager
    def measure(self, runtime: OffloadRuntime) -> Iterator[None]:
        """Around each call of the planned model: the calls after the warm-up are timed (predicted vs
        measured), then the device's compute estimates are refined; the ledger's peak is recorded."""
        self.calls += 1
        timed = WARMUP_CALLS < self.calls <= WARMUP_CALLS + MEASURED_CALLS
        sync = (lambda: synchronize(runtime.device)) if timed else (lambda: None)
        sync()
        start = time.perf_counter()
        yield
        sync()
        if timed:
            self.measured_s.append(time.perf_counter() - start)
            if self.calls == WARMUP_CALLS + MEASURED_CALLS:
                refine_rates(self)
        self.measured_peak_bytes = runtime.ledger.peak

    def as_component(self, path: str, pipeline: str, policy: OffloadPolicy) -> None:
        """Name this plan as component ``path`` of ``pipeline`` (offloaded with ``policy``), planned within its
        share of the pipeline's budget: the budget it prints is that share, not the user's ``device_budget_gb``."""
        self.model_name = f"{pipeline}.{path}"
        user = policy.device_budget_gb
        whole = (f"device_budget_gb={user:g} ({user * GIB / 2**20:.3f} MiB)" if user != "free"
                 else "device_budget_gb='free'")
        self.budget_source = (f"{path}'s share of {pipeline}'s {whole}: what the components kept on the device "
                              f"and the other streamed components' window leave")

    @property
    def prefetch(self) -> int:
        return self.solution.choice.prefetch

    @property
    def blocks_per_group(self) -> int:
        return self.table.blocks_per_group

    @property
    def resident(self) -> frozenset[int]:
        return self.solution.choice.resident

    @property
    def predicted_s(self) -> float:
        return self.solution.prediction.time_s

    @property
    def predicted_peak_bytes(self) -> int:
        return self.solution.prediction.peak_bytes

    @property
    def predicted_weights_peak_bytes(self) -> int:
        return self.solution.prediction.weights_peak_bytes

    def rows(self) -> list[dict[str, Any]]:
        used = set(self.table.used_groups)
        fetches = [i.group for i in self.solution.prediction.schedule.instances]
        compute = self.table.group_compute_s()
        disk = self.solution.prediction.disk
        return [{"group": g.name, "bytes": g.nbytes, "block": g.is_block,
                 "residency": "unused" if i not in used else "resident" if i in self.resident else
                 "disk" if i in disk else "streamed",
                 "fetches": fetches.count(i),
                 "transfer_s": fetches.count(i) * self.table.transfer_s(i, i in disk) if i in used else 0.0,
                 "compute_s": compute.get(i, 0.0)}
                for i, g in enumerate(self.table.groups)]

    @property
    def measured_median_s(self) -> float | None:
        return sorted(self.measured_s)[len(self.measured_s) // 2] if self.measured_s else None

    def to_dict(self) -> dict[str, Any]:
        p = self.solution.prediction
        return {
            "model": self.model_name, "device": self.device, "strategy": "auto",
            "budget_bytes": self.budget_bytes, "budget_source": self.budget_source,
            "prefetch": self.prefetch, "blocks_per_group": self.blocks_per_group,
            "groups": self.rows(),
            "predicted": {"time_s": p.time_s, "compute_s": p.compute_s, "transfer_s": p.transfer_s,
                          "stall_s": p.stall_s, "call_s": p.call_s,
                          "dispatch_s": self.table.dispatch_s, "peak_bytes": p.peak_bytes,
                          "weights_peak_bytes": p.weights_peak_bytes, "resident_bytes": p.resident_bytes,
                          "activation_bytes": p.activation_bytes, "fetches": p.fetches},
            "measured": {"median_time_s": self.measured_median_s, "calls": len(self.measured_s),
                         "times_s": list(self.measured_s),
                         "calibration_spread": None if self.rates is None else self.rates.call_spread,
                         "weights_peak_bytes": self.measured_peak_bytes},
            "search": {"optimal": self.solution.optimal, "nodes": self.solution.nodes,
                       "blocks_per_group_candidates": {str(k): v for k, v in self.candidates.items()}},
            "rates": self.rates.to_dict(),
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        mib = lambda n: f"{n / 2**20:9.3f} MiB"  # noqa: E731
        ms = lambda s: f"{s * 1e3:9.3f} ms"  # noqa: E731
        p = self.solution.prediction
        lines = [f"auto offload plan for {self.model_name} on {self.device}: budget {mib(self.budget_bytes)} "
                 f"({self.budget_source}); prefetch={self.prefetch} blocks_per_group={self.blocks_per_group}"
                 f"{'' if self.solution.optimal else ' (search stopped early: best found, not proven optimal)'}",
                 f"  {'group':<36s} {'bytes':>13s}  {'residency':<9s} {'fetches':>7s} {'transfer':>12s} "
                 f"{'compute':>12s}"]
        for row in self.rows():
            lines.append(f"  {row['group']:<36s} {readable_bytes(row['bytes']):>13s}  {row['residency']:<9s} "
                         f"{row['fetches']:7d} "
                         f"{ms(row['transfer_s'])}  {ms(row['compute_s'])}")
        if self.table.host_budget is not None:
            disk = sum(self.table.groups[g].nbytes for g in p.disk)
            lines.append(f"  host budget {mib(self.table.host_budget)}: {mib(disk)} of streamed groups read from disk "
                         f"(residency 'disk') at {self.table.disk_bandwidth / 1e9:.2f} GB/s, measured")
        lines.append(f"  predicted peak {mib(p.peak_bytes)} = weights {mib(p.weights_peak_bytes)} "
                     f"({mib(p.resident_bytes)} resident) + activations {mib(p.activation_bytes)}")
        lines.append(f"  predicted time {ms(p.time_s)} = call {ms(p.call_s)} + compute {ms(p.compute_s)} "
                     f"({ms(self.table.dispatch_s)} of op dispatch) + stalls {ms(p.stall_s)} "
                     f"({ms(p.transfer_s)} of transfers, {p.fetches} fetches)")
        if self.rates is not None:
            lines.append(f"  how far to trust it: the calibration's calls varied by {self.rates.call_spread:.0%} "
                         f"(interquartile range / median; a few % on a quiet machine). A load on the machine while "
                         f"calibrating or calling moves measured / predicted by about as much or more; the timed "
                         f"calls below say how far, and refine the compute rates for later plans")
        if self.measured_s:
            ratio = self.measured_median_s / p.time_s if p.time_s else float("nan")
            low, high = min(self.measured_s), max(self.measured_s)
            lines.append(f"  measured time  {ms(self.measured_median_s)} (median of {len(self.measured_s)} calls, "
                         f"{ms(low).strip()} to {ms(high).strip()}) (measured / predicted = {ratio:.2f})")
        if self.measured_peak_bytes is not None:
            lines.append(f"  measured copies in flight at most {mib(self.measured_peak_bytes)} (the ledger's peak, "
                         f"within the device slots the predicted weights count)")
        return "\n".join(lines)

    def save_plots(self, directory: str) -> list[str]:
        from .plots import save_plan_plots  # matplotlib is optional
        return save_plan_plots(self, directory)


def _predicted_times(table: CostTable, budget: int) -> Solution | None:
    try:
        return solve(table, budget)
    except InfeasibleBudgetError:
        return None


def plan_offload(model: nn.Module, policy: OffloadPolicy, *args: Any, **kwargs: Any) -> OffloadPlan:
    """Plan ``strategy="auto"`` for ``model`` called with ``args``/``kwargs``: nothing runs and no weight
    moves. Raises `InfeasibleBudgetError` (a ValueError) naming the smallest budget that works."""
    if policy.strategy != "auto":
        raise ValueError(f"plan_offload plans strategy='auto'; got strategy={policy.strategy!r}")
    budget, source = resolve_budget(policy)
    with tracing_on(policy.torch_device):  # host weights, device inputs (the model's; calibration's probes)
        # the forward the model runs: a forward set on the instance is the model's (an offloaded model is planned
        # while its installed forwards trace through to it)
        gm, example_inputs = capture_graph(model.forward, args, kwargs, type(model).__name__)
        # calibration's probes fit in a share of the budget: the device may have no more free than that
        rates = device_rates(policy.torch_device, policy.compiler, calibration_bytes(policy.torch_device, budget))
    n_blocks = sum(1 for g in plan_groups(model, policy.replace(blocks_per_group=1)) if g.is_block)
    best: tuple[CostTable, Solution] | None = None
    candidates: dict[int, float | None] = {}
    first_table = None
    for per in BLOCKS_PER_GROUP_CANDIDATES:
        if per > 1 and per > n_blocks:
            break
        specs = plan_groups(model, policy.replace(blocks_per_group=per))
        table = build_table(gm, example_inputs, specs, rates, per, carry=policy.prefetch_next_call)
        if policy.host_budget_gb is not None:  # the disk tier: what the host store will read from disk, and how fast
            table = dataclasses.replace(table, host_budget=policy.host_budget_bytes,
                                        disk_bandwidth=read_bandwidth(policy.disk_dir))
        first_table = first_table or table
        solution = _predicted_times(table, budget)
        candidates[per] = solution.prediction.time_s if solution else None
        if solution and (best is None or solution.prediction.time_s < best[1].prediction.time_s):
            best = (table, solution)
    if best is None:
        solve(first_table, budget)  # raises the error for the finest grouping, whose minimum is the smallest
    return OffloadPlan(type(model).__name__, policy.device, budget, source, best[0], best[1], rates, candidates)


def planned_specs(model: nn.Module, policy: OffloadPolicy, plan: OffloadPlan) -> list[GroupSpec]:
    specs = plan_groups(model, policy.replace(blocks_per_group=plan.blocks_per_group))
    return [dataclasses.replace(s, streamed=i not in plan.resident and s.nbytes > 0) for i, s in enumerate(specs)]


# -- the runtime ------------------------------------------------------------------------------------------

def planned_runtime(model: nn.Module, policy: OffloadPolicy, plan: OffloadPlan) -> OffloadRuntime:
    """The runtime that carries out ``plan``: built like every other runtime (`build_runtime`), with the
    planner's groups, residency and prefetch depth."""
    concrete = policy.replace(prefetch=plan.prefetch, blocks_per_group=plan.blocks_per_group,
                              prefetch_next_call=policy.prefetch_next_call and plan.prefetch > 0)
    return build_runtime(model, concrete, specs=planned_specs(model, policy, plan))


def refine_rates(plan: OffloadPlan) -> None:
    """Scale the device's work estimates (FLOPs, bytes) by what the timed calls showed, for the plans that
    follow. The overheads (per call, per op, per fetch) and the transfers were measured directly: they are
    taken out first (transfers only where they run inline), and are not rescaled."""
    prediction, table = plan.solution.prediction, plan.table
    work = prediction.compute_s - table.dispatch_s
    if not plan.measured_s or work <= 0:
        return
    fixed = prediction.call_s + table.dispatch_s + (0.0 if table.overlap else prediction.transfer_s)
    observed = max(plan.measured_median_s - fixed, 0.0) / work
    plan.rates.compute_scale = min(max(plan.rates.compute_scale * observed, 0.1), 10.0)


__all__ = ["OffloadPlan", "plan_offload", "planned_runtime", "capture_graph", "resolve_budget"]
