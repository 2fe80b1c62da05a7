"""Offloading in place: a model (`offload_module`) or a pipeline object (`offload_pipeline`) gets its state, its
classes swapped and its forwards installed."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn

from .._transformers_private import install_capturing_hooks
from ..backend import build_runtime
from ..host_masters import HostMaster
from ..components import DIT_MODULES, default_streamed, pipeline_components, pipeline_streamed, with_component
from ..grouping import refuse_components_of_a_model
from ..policy import OffloadPolicy, spelled
from ..storage import FilledBuckets
from .forwards import install_forwards
from .module import offloaded_class
from .pipeline import PipelineModules, pipeline_runtime
from .state import PART_OF, STATE_ATTR, OffloadState


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
    captured with them from the start. Nested models are hooked once (`install_capturing_hooks`)."""
    install_capturing_hooks(model)


def refuse_other_offloaders(model: Any, policy: OffloadPolicy | None = None) -> None:
    """Another offloader's hooks move the weights around each call of the modules they wrap; under ours they would
    move host masters inside our graphs (on an accelerator: torch's "incompatible tensor type" at the first call).
    Refused before anything changes, naming how to remove them: accelerate's (``module._hf_hook``: ``cpu_offload``,
    ``dispatch_model`` with offloading, a pipeline's ``enable_model_cpu_offload``/``enable_sequential_cpu_offload``)
    and diffusers' group offloading (a hook registry holding an offloading hook: ``enable_group_offload``).
    ``policy``: the one ``model`` is about to be offloaded with, for the fix a refusal names."""
    roots = [("", model)] if isinstance(model, nn.Module) else [
        (f"{name}.", value) for name, value in vars(model).items() if isinstance(value, nn.Module)]
    for prefix, root in roots:
        for path, module in root.named_modules():
            where = f"{prefix}{path}".rstrip(".") or type(model).__name__
            _refuse_offloaded_inside(model, module, where, policy)
            if getattr(module, "_hf_hook", None) is not None:
                raise ValueError(
                    f"{type(model).__name__} carries accelerate's hooks ({where}): accelerate's cpu_offload or "
                    f"dispatch_model, or a pipeline's enable_model_cpu_offload / enable_sequential_cpu_offload, "
                    f"which move weights or activations between devices at every call: offloading does that itself. Remove them "
                    f"first: accelerate.hooks.remove_hook_from_module(model, recurse=True) (a pipeline: "
                    f"pipe.remove_all_hooks()), then offload_compile; the model is unchanged")
            hooks = getattr(module.__dict__.get("_diffusers_hook"), "hooks", {})
            if any("offload" in name for name in hooks):
                raise ValueError(
                    f"{type(model).__name__} has diffusers' group offloading enabled ({where}: enable_group_offload), "
                    f"which moves the weights at every call, as offload_compile does itself. Load the model again "
                    f"without enable_group_offload, then offload_compile; the model is unchanged")


def _refuse_offloaded_inside(model: Any, module: nn.Module, where: str, policy: OffloadPolicy | None) -> None:
    """A model is offloaded once, as a whole: ``module`` (inside ``model``, or ``model`` itself) must not be, or be
    part of, a model offloaded already -- its weights are that model's host masters, its class that model's.
    Refused before anything changes, naming the model to give back first (and, for a pipeline's component
    offloaded on its own, the policy that streams it with the pipeline)."""
    state = module.__dict__.get(STATE_ATTR) or module.__dict__.get(PART_OF)
    masters = state is None and any(isinstance(t, HostMaster) for t in [*module._parameters.values(),
                                                                          *module._buffers.values()])
    if state is None and not masters:
        return
    owner = state.name if state is not None else "another model"
    alone = state is not None and state.owner is module  # offloaded on its own, not as a part of another
    if policy is not None and alone and not isinstance(model, nn.Module) and where in vars(model):
        raise ValueError(_component_offloaded_alone(model, where, owner, policy))
    raise ValueError(f"{where} belongs to {owner}, which is offloaded already: a model is offloaded once, as a "
                     f"whole. Give it back first (remove_offload on the model you offloaded), then offload "
                     f"{type(model).__name__} alone (it streams what it contains); nothing was changed")


def _component_offloaded_alone(pipeline: Any, name: str, owner: str, policy: OffloadPolicy) -> str:
    """The refusal for a pipeline whose component ``name`` was offloaded on its own: the fix gives it back and
    offloads the pipeline with ``name`` among the components it streams."""
    pipe = type(pipeline).__name__
    chosen = policy.components
    if chosen is None:
        chosen = default_streamed(pipeline_components(PipelineModules(pipeline)))
    # ``model`` finds its components itself; ``alternating`` takes them named
    strategy = "alternating" if policy.strategy == "model" else policy.strategy
    fix = spelled(policy, strategy=strategy, components=with_component(chosen, name))
    return (f"{name} belongs to {owner}, which is offloaded already, on its own: a model is offloaded once, as a "
            f"whole, and {pipe} would take its weights again. To stream {name} with {pipe}: give it back, then "
            f"offload the pipeline with {name} among its components: remove_offload(pipe.{name}); "
            f"offload_compile(pipe, {fix}); nothing was changed")


def offload_module(model: nn.Module, policy: OffloadPolicy, filled: FilledBuckets | None = None) -> OffloadState:
    """Offload ``model`` in place (``filled``: what a checkpoint was read into, packed as it is). Nothing is
    attached before the runtime exists (a refused policy leaves the model untouched); ``auto`` builds its
    runtime at its first call, and packs by copying."""
    refuse_components_of_a_model(model, policy)  # ``auto`` groups at its first call: refused now, before anything
    runtime = None if policy.strategy == "auto" else build_runtime(model, policy, filled=filled)
    state = OffloadState(model, policy, runtime)
    with _undone_on_failure(state, copy_back=filled is None):
        attach(state, [model])
        install_forwards(model, state)
    return state


@contextlib.contextmanager
def _undone_on_failure(state: OffloadState, copy_back: bool = True) -> Iterator[None]:
    """Offloading is one transaction (README, "Reliability"): a failure between the runtime's building and the
    state's being complete (attaching, installing the forwards) is undone by `OffloadState.detach`, which gives
    back what was changed so far, so the model runs as before and a retry is not refused as offloaded already."""
    try:
        yield
    except BaseException:
        state.detach(copy_back)
        raise


BLOCK_STRATEGIES = ("layerwise", "budget", "auto")


def offload_pipeline(pipeline: Any, policy: OffloadPolicy, filled: FilledBuckets | None = None) -> OffloadState:
    """A pipeline object: under the block strategies the components ``policy.components`` names (None: its
    encoders and denoisers) are streamed block by block and the other components (the VAE unless named) live
    on the compute device (`pipeline_runtime`); ``auto`` plans each denoiser at its first call. Under the
    component strategies and ``sequential``, its components are grouped as one model's."""
    modules = PipelineModules(pipeline)
    name = type(pipeline).__name__
    unplanned = []
    if policy.strategy in BLOCK_STRATEGIES:
        runtime = pipeline_runtime(modules, policy, name, {}, filled)
        if policy.strategy == "auto":
            unplanned = [path for path in pipeline_streamed(modules, name, policy.components) if path in DIT_MODULES]
    else:
        runtime = build_runtime(modules, policy, name=name, filled=filled)
    state = OffloadState(pipeline, policy, runtime, modules=modules, unplanned=unplanned)
    with _undone_on_failure(state, copy_back=filled is None):
        attach(state, list(modules.children()))
        install_forwards(modules, state)
    return state
