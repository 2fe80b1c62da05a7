"""A pipeline object (diffusers-style) seen as one model, and its runtime under the block strategies."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..backend import build_runtime
from ..components import PipelineModules, pipeline_streamed
from ..grouping import blocks_attr_within, component_block_groups
from ..planning.auto import OffloadPlan, planned_specs
from ..policy import OffloadPolicy
from ..runtime import OffloadRuntime
from ..storage import FilledBuckets




def pipeline_runtime(modules: nn.Module, policy: OffloadPolicy, name: str, plans: dict[str, OffloadPlan],
                     filled: FilledBuckets | None = None) -> OffloadRuntime:
    """The runtime of a pipeline under the block strategies: the components streamed (`pipeline_streamed`: those
    ``policy.components`` names, else encoders, then denoisers), grouped block by block
    (`component_block_groups`), each denoiser that ``auto`` planned as its plan says; the other components
    on the compute device. With plans, the prefetch depth is the smallest they chose."""
    paths = pipeline_streamed(modules, name, policy.components)
    planned = {path: planned_specs(modules.get_submodule(path), within(policy, path), plan)
               for path, plan in plans.items()}
    if plans:
        prefetch = min(plan.prefetch for plan in plans.values())
        policy = policy.replace(prefetch=prefetch, prefetch_next_call=policy.prefetch_next_call and prefetch > 0)
    return build_runtime(modules, policy, specs=component_block_groups(modules, paths, policy, planned), name=name,
                         filled=filled)


def within(policy: OffloadPolicy, path: str) -> OffloadPolicy:
    """``policy`` as seen by the component at ``path``, grouped as a model of its own: its ``blocks_attr``
    relative to it, and no ``components`` (those named the pipeline's)."""
    return policy.replace(blocks_attr=blocks_attr_within(policy.blocks_attr, path), components=None)

