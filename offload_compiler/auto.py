"""``strategy="auto"``: capture the graph once (nothing runs), build cost tables, solve, then offload with the
chosen residency, prefetch depth and ``blocks_per_group``. The plan is public: `offload_plan(m)`."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from . import backend
from .api import RECOMPILE_LIMIT, OffloadedModule, offload_forwards
from .planning.costmodel import DeviceRates, build_table, device_rates
from .grouping import GroupSpec, plan_groups
from .planning.planner import GIB, CostTable, InfeasibleBudgetError, Solution, solve
from .policy import OffloadPolicy
from .runtime import OffloadRuntime

BLOCKS_PER_GROUP_CANDIDATES = (1, 2, 4)
WARMUP_CALLS = 2  # the first compiles, the second still pays lazy initialisation
MEASURED_CALLS = 3  # calls timed after the warm-up, for predicted vs measured


# -- budget -----------------------------------------------------------------------------------------------

def free_device_bytes(device: torch.device) -> int:
    """Free memory of the device now: ``cudaMemGetInfo`` on CUDA, available RAM on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
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

class _Captured(Exception):
    pass


def capture_graph(model: nn.Module, args: tuple, kwargs: dict) -> tuple[fx.GraphModule, list]:
    """The model's graph and example inputs, from dynamo, without running it: the backend returns a callable
    that aborts the call."""
    captured = []

    def recorder(gm: fx.GraphModule, example_inputs: list, **_: Any):
        captured.append((gm, list(example_inputs)))

        def abort(*_: Any) -> None:
            raise _Captured()
        return abort

    try:  # one cache entry per model of a class, as for the offloaded graphs (api.RECOMPILE_LIMIT)
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT,
                                                         accumulated_recompile_limit=RECOMPILE_LIMIT):
            torch.compile(model, backend=recorder, fullgraph=True)(*args, **kwargs)
    except _Captured:
        pass
    except Exception as exc:
        if "graph break" in str(exc).lower() or type(exc).__name__ == "Unsupported":
            raise ValueError(f"strategy='auto' plans from one captured graph, but dynamo breaks the graph of "
                             f"{type(model).__name__} ({exc}); fix the graph break (TORCH_LOGS=graph_breaks) "
                             f"or use strategy='layerwise' or 'budget'") from exc
        raise
    if not captured:
        raise RuntimeError(f"dynamo captured no graph from {type(model).__name__}; strategy='auto' cannot plan it")
    return captured[0]


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
        return [{"group": g.name, "bytes": g.nbytes, "block": g.is_block,
                 "residency": "unused" if i not in used else "resident" if i in self.resident else "streamed",
                 "fetches": fetches.count(i),
                 "transfer_s": fetches.count(i) * self.table.transfer_s(i) if i in used else 0.0,
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
                          "stall_s": p.stall_s, "peak_bytes": p.peak_bytes,
                          "weights_peak_bytes": p.weights_peak_bytes, "resident_bytes": p.resident_bytes,
                          "activation_bytes": p.activation_bytes, "fetches": p.fetches},
            "measured": {"median_time_s": self.measured_median_s, "calls": len(self.measured_s),
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
            lines.append(f"  {row['group']:<36s} {mib(row['bytes'])}  {row['residency']:<9s} {row['fetches']:7d} "
                         f"{ms(row['transfer_s'])}  {ms(row['compute_s'])}")
        lines.append(f"  predicted peak {mib(p.peak_bytes)} = weights {mib(p.weights_peak_bytes)} "
                     f"({mib(p.resident_bytes)} resident) + activations {mib(p.activation_bytes)}")
        lines.append(f"  predicted time {ms(p.time_s)} = compute {ms(p.compute_s)} + stalls {ms(p.stall_s)} "
                     f"({ms(p.transfer_s)} of transfers, {p.fetches} fetches)")
        if self.measured_s:
            ratio = self.measured_median_s / p.time_s if p.time_s else float("nan")
            lines.append(f"  measured time  {ms(self.measured_median_s)} (median of {len(self.measured_s)} calls) "
                         f"(measured / predicted = {ratio:.2f})")
        if self.measured_peak_bytes is not None:
            lines.append(f"  measured weights peak {mib(self.measured_peak_bytes)} (ledger)")
        return "\n".join(lines)

    def save_plots(self, directory: str) -> list[str]:
        from .planning.plots import save_plan_plots  # matplotlib is optional
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
    gm, example_inputs = capture_graph(model, args, kwargs)
    rates = device_rates(policy.torch_device)
    n_blocks = sum(1 for g in plan_groups(model, policy.replace(blocks_per_group=1)) if g.is_block)
    best: tuple[CostTable, Solution] | None = None
    candidates: dict[int, float | None] = {}
    first_table = None
    for per in BLOCKS_PER_GROUP_CANDIDATES:
        if per > 1 and per > n_blocks:
            break
        specs = plan_groups(model, policy.replace(blocks_per_group=per))
        table = build_table(gm, example_inputs, specs, rates, per, carry=policy.prefetch_next_call)
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
    return [dataclasses.replace(s, streamed=i not in plan.resident) for i, s in enumerate(specs)]


# -- the module -------------------------------------------------------------------------------------------

class AutoOffloadedModule(OffloadedModule):
    """`offload_compile(model, OffloadPolicy(strategy="auto", ...))`: plans at the first call (or at
    `plan(*args, **kwargs)`), before anything runs, then runs as an `OffloadedModule` with the chosen
    residency. The first calls after compiling are timed, so the plan reports predicted vs measured."""

    def __init__(self, model: nn.Module, policy: OffloadPolicy) -> None:
        nn.Module.__init__(self)
        self._orig_mod = model
        object.__setattr__(self, "_auto_policy", policy)
        object.__setattr__(self, "_offload_runtime", None)
        object.__setattr__(self, "_offload_plan", None)
        object.__setattr__(self, "_calls", 0)

    @property
    def offload_policy(self) -> OffloadPolicy:
        runtime = self._offload_runtime
        return self._auto_policy if runtime is None else runtime.policy

    @property
    def offload_plan(self) -> OffloadPlan | None:
        return self._offload_plan

    def plan(self, *args: Any, **kwargs: Any) -> OffloadPlan:
        if self._offload_plan is not None:
            return self._offload_plan
        policy, model = self._auto_policy, self._orig_mod
        plan = plan_offload(model, policy, *args, **kwargs)
        concrete = policy.replace(prefetch=plan.prefetch, blocks_per_group=plan.blocks_per_group,
                                  prefetch_next_call=policy.prefetch_next_call and plan.prefetch > 0)
        runtime = OffloadRuntime(concrete, planned_specs(model, policy, plan), type(model).__name__)
        backend._MODULE_RUNTIMES[model] = runtime
        object.__setattr__(self, "_offload_runtime", runtime)
        offload_forwards(model, runtime)
        object.__setattr__(self, "_offload_plan", plan)
        return plan

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        plan = self.plan(*args, **kwargs)
        object.__setattr__(self, "_calls", self._calls + 1)
        timed = WARMUP_CALLS < self._calls <= WARMUP_CALLS + MEASURED_CALLS
        sync = torch.cuda.synchronize if timed and self._offload_runtime.device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        out = super().forward(*args, **kwargs)
        sync()
        if timed:
            plan.measured_s.append(time.perf_counter() - start)
            if self._calls == WARMUP_CALLS + MEASURED_CALLS:
                refine_rates(plan)
        plan.measured_peak_bytes = self._offload_runtime.ledger.peak
        return out


def refine_rates(plan: OffloadPlan) -> None:
    """Scale the device's compute estimates by what the timed calls showed, for the plans that follow (the
    transfers were measured directly; where they run inline, their predicted time is taken out first)."""
    prediction = plan.solution.prediction
    if not plan.measured_s or prediction.compute_s <= 0:
        return
    inline = 0.0 if plan.table.overlap else prediction.transfer_s
    observed = max(plan.measured_median_s - inline, 0.0) / prediction.compute_s
    plan.rates.compute_scale = min(max(plan.rates.compute_scale * observed, 0.1), 10.0)


def offload_plan(module: Any) -> OffloadPlan:
    """The plan of a ``strategy="auto"`` module (made at its first call or by ``module.plan(...)``)."""
    plan = getattr(module, "_offload_plan", None) if isinstance(module, AutoOffloadedModule) else None
    if plan is None:
        raise ValueError(f"{type(module).__name__} has no auto offload plan: pass the result of "
                         f"offload_compile(model, OffloadPolicy(strategy='auto', device_budget_gb=...)) after its "
                         f"first call, or call module.plan(*inputs) first")
    return plan


__all__ = ["AutoOffloadedModule", "OffloadPlan", "offload_plan", "plan_offload", "capture_graph", "resolve_budget"]
