"""Which modules of an offloaded model get an offloaded forward of their own, and which a routed part."""

from __future__ import annotations

import inspect
import itertools

from torch import nn

from ..components import ENTRY_METHODS
from ..grouping import plan_groups, repeated_blocks
from ..policy import COMPONENT_STRATEGIES
from .state import OffloadState


def modules_with_forwards(model: nn.Module, state: OffloadState) -> list[nn.Module]:
    """The model itself (unless it is a pipeline's stand-in), its groups' containers (a VLM's ``m.model``, whose
    ``get_image_features`` ``generate`` calls on its own), and its components (`_component_names`)."""
    wanted = [model] if model is state.owner else []
    wanted += [model.get_submodule(n) for n in _containers_of_groups(model, _group_names(state, model))]
    wanted += [model.get_submodule(n) for n in _component_names(state, model)]
    return wanted


def _group_names(state: OffloadState, model: nn.Module) -> list[str]:
    if state.runtime is not None:
        return [g.name for g in state.runtime.groups]
    return [spec.name for spec in plan_groups(model, state.policy.replace(blocks_per_group=1))]


def _containers_of_groups(model: nn.Module, names: list[str]) -> list[str]:
    """Modules strictly between the model and its groups that have a forward of their own (``encoder``,
    ``model.decoder``; not the blocks, not module lists)."""
    prefixes: dict[str, None] = {}
    for name in names:
        parts = name.split(".") if name not in ("", "(root)") else []
        for end in range(1, len(parts)):
            prefixes[".".join(parts[:end])] = None
    return [name for name in prefixes if _has_forward(model, name)]


def _has_forward(model: nn.Module, name: str) -> bool:
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return False
    return type(module).forward is not nn.Module.forward  # ModuleList/ModuleDict have none


def _component_names(state: OffloadState, model: nn.Module) -> list[str]:
    """Components are called on their own (a thinker's output feeds a talker, a pipeline calls its text
    encoder, then its denoiser, then its VAE's ``decode``): each runs a graph of its own. A pipeline's
    components are those holding groups; a model's, those of the component strategies (alternating, model,
    sequential over named components)."""
    policy = state.policy
    if state.runtime is None:
        return []
    if state.owner is not model:  # a pipeline
        holding = {g.name.split(".", 1)[0] for g in state.runtime.groups}
        return [name for name, _ in model.named_children() if name in holding and _has_forward(model, name)]
    if not (policy.strategy in COMPONENT_STRATEGIES or (policy.strategy == "sequential" and policy.components is not None)):
        return []
    return [g.name for g in state.runtime.groups if g.name not in ("", "(root)") and _has_forward(model, g.name)]


def entry_methods(module: nn.Module) -> tuple[str, ...]:
    return tuple(name for name in ENTRY_METHODS if inspect.isfunction(inspect.getattr_static(type(module), name, None)))



def weight_holders(state: OffloadState, model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` holding a weight of a group, and those containing them (the model itself not
    included); under ``auto`` before planning, every module holding a weight."""
    if state.runtime is not None:
        offloaded = {id(slot.tensor) for group in state.runtime.groups for slot in group.slots}
    else:
        offloaded = {id(t) for t in itertools.chain(model.parameters(), model.buffers())}
    by_path = dict(model.named_modules(remove_duplicate=False))
    holders: dict[nn.Module, None] = {}
    for path, module in by_path.items():
        own = itertools.chain(module._parameters.values(), module._buffers.values())
        if path and any(id(t) in offloaded for t in own if t is not None):
            names = path.split(".")
            holders.update((by_path[".".join(names[:end])], None) for end in range(1, len(names) + 1))
    return list(holders)


REGION_STRATEGIES = ("layerwise", "budget", "auto")


def region_blocks(state: OffloadState, model: nn.Module) -> dict[nn.Module, tuple]:
    """``regional``: the blocks traced as nested compile regions, each with its `block_structure` -- the repeated
    blocks of the model's stacks whose offloaded weights are all in one group, under the strategies that stream
    whole blocks. A region's weights are fetched together before it runs, so a block split across groups (a
    dominant block streamed by its parts, an MoE layer's experts fetched routed) or the finer groups of
    ``sequential`` are traced inline instead."""
    runtime = state.runtime
    if not (state.policy.regional and state.regions and runtime is not None
            and state.policy.strategy in REGION_STRATEGIES):
        return {}
    def one_group(block: nn.Module) -> bool:
        return len({runtime.group_of[id(t)][0] for t in itertools.chain(block.parameters(), block.buffers())
                    if id(t) in runtime.group_of}) == 1
    return {block: block_structure(block) for block in repeated_blocks(model, state.policy, keep=one_group)}


def block_structure(block: nn.Module) -> tuple:
    """What a block is built of: its submodules' names and classes (by name: a routed part keeps its class's), its
    parameters' and buffers' names, shapes and dtypes. Dynamo reuses a traced region for a block whatever its
    submodules are (a ModernBERT layer whose ``attn_norm`` is an ``nn.Identity``, the others' a LayerNorm, ran
    the first layer's graph): blocks built otherwise are regions of their own."""
    modules = tuple((name, type(m).__module__, type(m).__qualname__) for name, m in block.named_modules())
    parameters, buffers = ((tuple((name, tuple(t.shape), t.dtype) for name, t in named))
                           for named in (block.named_parameters(), block.named_buffers()))
    return modules, parameters, buffers
