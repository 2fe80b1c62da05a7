"""Offloading in place: a model (`offload_module`) or a pipeline object (`offload_pipeline`) gets its state, its
classes swapped and its forwards installed."""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from ..backend import build_runtime
from ..components import DIT_MODULES, pipeline_streamed
from ..policy import OffloadPolicy
from ..storage import FilledBuckets
from .forwards import install_forwards
from .module import offloaded_class
from .pipeline import PipelineModules, pipeline_runtime
from .state import OffloadState


def attach(state: OffloadState, modules: list[nn.Module]) -> None:
    """Swap the classes of ``modules`` (the model, or a pipeline's components) and watch every hook dict."""
    state.publish()
    for module in modules:
        install_output_capture(module)
        state.attach_module(module, offloaded_class(type(module)))


def install_output_capture(model: nn.Module) -> None:
    """Install transformers' output-capturing forward hooks now, as its first call with ``output_hidden_states``
    or ``output_attentions`` would (they stay inactive unless a call asks for those outputs). Installed lazily,
    from inside the first such call -- which many models make themselves (a segmentation or detection head, a
    vision-language model reading its vision tower's hidden states) -- they are taken under a threading lock,
    which dynamo cannot trace: that call's graph breaks (``strategy="auto"``, which plans from one graph, is
    refused), and the hooks appear after the graphs were captured. Installed before offloading, the graphs are
    captured with them from the start.

    Installing on a model also installs on every model nested in it, whether or not that one has its hooks
    already (it has once it was called with ``output_hidden_states``: CLIPTextModel inside
    CLIPTextModelWithProjection, before offloading). A second set would record every layer twice: so a model
    gets them only when none inside it has any, else its submodules are looked at in turn."""
    if "transformers" not in sys.modules:  # then no module here is a transformers model
        return
    try:
        from transformers import PreTrainedModel
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # a transformers version without lazy output capture
        return

    def hooked(module: nn.Module) -> bool:
        return getattr(module, "_output_capturing_hooks_installed", False)

    def install(module: nn.Module) -> None:
        if isinstance(module, PreTrainedModel) and not any(hooked(sub) for sub in module.modules()):
            maybe_install_capturing_hooks(module)
            return
        for child in module.children():
            install(child)

    install(model)


def offload_module(model: nn.Module, policy: OffloadPolicy, filled: FilledBuckets | None = None) -> OffloadState:
    """Offload ``model`` in place (``filled``: what a checkpoint was read into, packed as it is). Nothing is
    attached before the runtime exists (a refused policy leaves the model untouched); ``auto`` builds its
    runtime at its first call, and packs by copying."""
    runtime = None if policy.strategy == "auto" else build_runtime(model, policy, filled=filled)
    state = OffloadState(model, policy, runtime)
    attach(state, [model])
    install_forwards(model, state)
    return state


BLOCK_STRATEGIES = ("layerwise", "budget", "auto")


def offload_pipeline(pipeline: Any, policy: OffloadPolicy, filled: FilledBuckets | None = None) -> OffloadState:
    """A pipeline object: under the block strategies its encoders and denoisers are streamed block by block
    and the other components (the VAE) live on the compute device (`pipeline_runtime`); ``auto`` plans each
    denoiser at its first call. Under the component strategies and ``sequential``, its components are grouped
    as one model's."""
    modules = PipelineModules(pipeline)
    name = type(pipeline).__name__
    unplanned = []
    if policy.strategy in BLOCK_STRATEGIES:
        runtime = pipeline_runtime(modules, policy, name, {}, filled)
        if policy.strategy == "auto":
            unplanned = [path for path in pipeline_streamed(modules, name) if path in DIT_MODULES]
    else:
        runtime = build_runtime(modules, policy, name=name, filled=filled)
    state = OffloadState(pipeline, policy, runtime, modules=modules, unplanned=unplanned)
    attach(state, list(modules.children()))
    install_forwards(modules, state)
    return state
