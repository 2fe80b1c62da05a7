"""``strategy="auto"``: planned from the first call (nothing runs), of the whole model or of a pipeline's denoiser."""

from __future__ import annotations

import dataclasses
import math

from ..planning.auto import plan_offload, resolve_budget
from ..planning.planner import GIB, InfeasibleBudgetError
from .pipeline import within
from .state import OffloadState


def plan_model(state: OffloadState, args: tuple, kwargs: dict) -> None:
    """Plan the whole model from this call and build its runtime (its forwards are the caller's to install)."""
    before = state.release_runtime_before_plan()
    try:
        with state.tracing_through():
            plan = plan_offload(state.owner, state.policy, *args, **kwargs)
    except BaseException as error:  # every later call plans again, with the same budget
        if before is not None:
            state.recompile()  # the parts compiled on the runtime just released stream on a new one at their next call
        if isinstance(error, InfeasibleBudgetError):
            error.add_note(f"{state.name} is offloaded with this budget and stays unplanned (nothing moved, its "
                           f"weights are unchanged); to change the budget: offload_compile(remove_offload(m), "
                           f"policy.replace(device_budget_gb=...))")
        raise
    state.planned(plan, before)


def plan_component(state: OffloadState, path: str, args: tuple, kwargs: dict) -> None:
    """A pipeline's denoiser ``path``: plan it from this, its first call, within its share of the budget
    (`component_budget`), then rebuild the runtime with the planned groups (`OffloadState.component_planned`)."""
    module = state.modules.get_submodule(path)
    share = component_budget(state)
    policy = within(state.policy, path).replace(device_budget_gb=share.bytes / GIB)
    try:
        with state.tracing_through():
            plan = plan_offload(module, policy, *args, **kwargs)
    except InfeasibleBudgetError as error:
        raise share.too_small(path, error) from error
    plan.as_component(path, state.name, state.policy)  # its budget printed as path's share of the user's
    state.component_planned(path, plan)


@dataclasses.dataclass(frozen=True)
class ComponentShare:
    """A denoiser's share of a pipeline's ``device_budget_gb`` and what the rest of the budget holds."""
    name: str  # the pipeline's
    source: str  # the budget as the user gave it (``device_budget_gb=...``)
    budget: int  # the whole budget, bytes
    kept: int  # the components kept on the device
    window: int  # the other streamed components' streaming window
    denoisers: int
    bytes: int  # this denoiser's share

    def too_small(self, path: str, error: InfeasibleBudgetError) -> InfeasibleBudgetError:
        """The planner's refusal of the share, said of the pipeline's budget: the figure to set is the
        pipeline's, not the share (which is below what the user gave)."""
        needed = self.kept + self.window + self.denoisers * error.needed_bytes
        return InfeasibleBudgetError(
            f"{self.source} ({self.budget} B) is too small for {self.name}: its {path}'s smallest plan needs "
            f"{error.needed_bytes} B on the device (activations and the weights live at its peak), beside "
            f"{self.kept} B kept on the device (the VAE and other components kept) and {self.window} B of the other "
            f"streamed components' window"
            f"{f', for each of its {self.denoisers} denoisers' if self.denoisers > 1 else ''}: {needed} B in all. "
            f"Set device_budget_gb >= {math.ceil(needed / GIB * 1e6) / 1e6}, or shrink what is live (blocks_per_group=1, "
            f"a smaller image or a shorter prompt)",
            needed, self.budget)


def component_budget(state: OffloadState) -> ComponentShare:
    """A denoiser's share of ``device_budget_gb``: what the components kept on the device (the VAE unless
    ``components=`` names it) and the streaming window of the other streamed components (encoders, a named VAE)
    leave, split between the denoisers."""
    policy, runtime = state.policy, state.runtime
    budget, source = resolve_budget(policy)
    kept = 0 if policy.device_budget_gb == "free" else runtime.unmanaged_bytes  # "free" counts them already
    denoisers = [p for p in state.plans] + state.unplanned
    others = [g.nbytes for g in runtime.groups if g.name.split(".", 1)[0] not in denoisers]  # encoders, a named VAE
    window = (policy.prefetch + 1) * max(others, default=0)
    share = (budget - kept - window) // max(len(denoisers), 1)
    if share <= 0:
        raise InfeasibleBudgetError(
            f"{source} leaves nothing for {state.name}'s denoisers: {kept} B stay on the device (the VAE and other "
            f"components) and the other streamed components stream {window} B at a time; raise device_budget_gb",
            needed_bytes=kept + window + 1, budget_bytes=budget)
    return ComponentShare(state.name, source, budget, kept, window, max(len(denoisers), 1), share)
