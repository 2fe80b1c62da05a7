"""Components: named submodules that move as a unit (stages, encoders), found by name, dotted path or glob."""

from __future__ import annotations

import difflib
import fnmatch
import warnings
from typing import Any, Iterable

from torch import nn

STAGES = ("thinker", "talker", "code2wav", "token2wav")
SUB_COMPONENTS = ("visual", "audio_tower", "language_model")
# the vision towers and projectors of vision-language models, found where a ``language_model`` is beside them
# (transformers 5: LLaVA, PaliGemma, Gemma 3, Mllama, InternVL, Mistral 3, Qwen2-Audio, Voxtral, BLIP-2, Janus,
# DeepSeek-VL). Found only there: alone the names are generic, and CLIP's ``vision_model`` is most of CLIPModel and
# all of CLIPVisionModel, which stream module by module where no component is found
VISION_PARTS = ("vision_tower", "vision_model", "multi_modal_projector", "qformer", "language_projection", "aligner")
LANGUAGE_MODEL = "language_model"
# the denoisers of diffusers pipelines (DiT or UNet, Wuerstchen/Kandinsky's prior) and of omni DiT stages
DIT_MODULES = ("transformer", "transformer_2", "unet", "unet_2", "prior", "dit", "language_model", "transformer_blocks")
ENCODER_MODULES = ("text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder")
# methods other than ``forward`` that callers use to run a component (diffusers VAEs, CLIP-style encoders): an
# offloaded module that has them runs them through its offloaded graphs as it runs ``forward``
ENTRY_METHODS = ("encode", "decode", "get_text_features", "get_image_features")


# the path of the model itself as its one component (``model.get_submodule("")`` is the model)
WHOLE_MODEL = ""


class PipelineModules(nn.Module):
    """The nn.Module attributes of a pipeline object (diffusers-style), seen as one model."""

    def __init__(self, pipeline: Any) -> None:
        super().__init__()
        found = {name: value for name, value in vars(pipeline).items() if isinstance(value, nn.Module)}
        if not found:
            raise TypeError(f"offload_compile takes an nn.Module or a pipeline whose components are nn.Module "
                            f"attributes; {type(pipeline).__name__} has none")
        for name, module in found.items():
            self.add_module(name, module)


def _holds_weights(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _outermost(paths: Iterable[str]) -> list[str]:
    kept: list[str] = []
    for path in sorted(set(paths), key=lambda p: (p.count("."), p)):
        if not any(path.startswith(k + ".") for k in kept):
            kept.append(path)
    return kept


def module_paths(model: nn.Module) -> list[str]:
    return [path for path, module in model.named_modules() if path and _holds_weights(module)]


def discover(model: nn.Module, names: Iterable[str] | None = None) -> list[str]:
    """Paths of known components, outermost first (``thinker`` hides ``thinker.visual`` until it is named); with
    the default names, also the `VISION_PARTS` beside a ``language_model`` (LLaVA's ``model.vision_tower``)."""
    wanted = set(STAGES + SUB_COMPONENTS if names is None else names)
    paths = module_paths(model)
    found = [p for p in paths if p.rsplit(".", 1)[-1] in wanted]
    if names is None:
        beside = {_parent(p) for p in paths if p.rsplit(".", 1)[-1] == LANGUAGE_MODEL}
        found += [p for p in paths if p.rsplit(".", 1)[-1] in VISION_PARTS and _parent(p) in beside]
    return _outermost(found)


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


KNOWN_COMPONENTS = STAGES + SUB_COMPONENTS + VISION_PARTS


def _matches(path: str, name: str) -> bool:
    parts = path.split(".")
    suffixes = [".".join(parts[i:]) for i in range(len(parts))]
    return any(s == name or fnmatch.fnmatchcase(s, name) for s in suffixes)


def resolve(model: nn.Module, names: Iterable[str] | None, whole: bool = True) -> list[str]:
    """Module paths of the named components. A name is a module name (``visual`` finds ``thinker.visual``),
    a dotted path, or a glob (``visual.*``: each child of ``visual``); ``None`` is every discovered component,
    and where ``model`` has none of the known names, ``model`` itself (`WHOLE_MODEL`): a stage model (a
    code2wav or token2wav vocoder, loaded on its own) is the one component it holds. ``whole=False`` (a
    pipeline object, whose components are called one by one and never as one model) refuses that instead."""
    paths = module_paths(model)
    if names is None:
        found = discover(model)
        if found:
            return found
        if whole:
            return [WHOLE_MODEL]
        raise ValueError(f"{type(model).__name__} has none of the known components {list(KNOWN_COMPONENTS)}; "
                         f"name them with components=[...]; its modules are {_top(model)}")
    chosen: list[str] = []
    for name in names:
        hits = _outermost(p for p in paths if _matches(p, name))
        if not hits:
            known = discover(model)
            raise ValueError(f"unknown component {name!r} in {type(model).__name__}{_did_you_mean(name, paths)}; "
                             f"components that exist: {known or 'none of the known names'}; top-level modules: "
                             f"{_top(model)}. Name those (components=[...], cpu_offload_components in engine args), "
                             f"or leave components unset: every component found, or, where there are none, the "
                             f"whole model as one")
        chosen.extend(h for h in hits if h not in chosen)
    return chosen


def _did_you_mean(name: str, paths: list[str]) -> str:
    """`` (did you mean 'blocks'?)`` for the module name or path closest to a misspelt ``name``, else ``""``."""
    candidates = sorted({path.rsplit(".", 1)[-1] for path in paths} | set(paths))
    close = difflib.get_close_matches(name, candidates, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _top(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_children() if _holds_weights(m)]


def model_level(model: nn.Module) -> tuple[list[str], list[str]]:
    """Diffusion model-level offload: the DiT modules and the encoders, outermost matches of the names the
    seed guide lists. Either missing: warn as the guide does and offload nothing."""
    dits = discover(model, DIT_MODULES)
    encoders = [e for e in discover(model, ENCODER_MODULES) if not any(e.startswith(d + ".") for d in dits)]
    dits = [d for d in dits if not any(d.startswith(e + ".") for e in encoders)]
    if not dits:
        warnings.warn("No DiT/transformer modules found, skipping model-level offloading: strategy='model' "
                      "alternates a diffusion model's denoiser and its encoders. For a language model (or any "
                      "model built from a stack of layers) use strategy='layerwise', which streams its layers "
                      "block by block", UserWarning, stacklevel=3)
        return [], []
    if not encoders:
        warnings.warn("No encoder modules found, skipping model-level offloading", UserWarning, stacklevel=3)
        return [], []
    return dits, encoders


def component_of(name: str, components: list[str]) -> str | None:
    """The innermost component holding weight ``name``."""
    best = None
    for path in components:
        if (path == WHOLE_MODEL or name.startswith(path + ".")) and (best is None or len(path) > len(best)):
            best = path
    return best


def pipeline_components(model: nn.Module) -> list[str]:
    """The components of a pipeline (``model``: its `PipelineModules`): its children that hold weights."""
    return [name for name, module in model.named_children() if _holds_weights(module)]


def default_streamed(children: Iterable[str]) -> list[str]:
    """What the block strategies stream of a pipeline whose ``components`` are not named: its encoders, then its
    denoisers."""
    children = list(children)
    return [n for n in children if n in ENCODER_MODULES] + [n for n in children if n in DIT_MODULES]


def pipeline_streamed(model: nn.Module, name: str, chosen: Iterable[str] | None = None) -> list[str]:
    """The components of a pipeline (the children of ``model``) streamed under the block strategies (layerwise,
    budget, auto): those ``chosen`` (``OffloadPolicy.components``), in that order, else its encoders, then its
    denoisers. Every other component (the VAE unless chosen, a safety checker) stays on the compute device. A
    chosen name that is no component holding weights, or none found: an error listing the components."""
    children = pipeline_components(model)
    if chosen is not None:
        unknown = [c for c in chosen if c not in children]
        if unknown:
            raise ValueError(f"components={list(chosen)!r}: {unknown} {'is' if len(unknown) == 1 else 'are'} no "
                             f"component of {name}{_did_you_mean(unknown[0], children)}; on a pipeline, components= "
                             f"names its components holding weights: {children}")
        return list(dict.fromkeys(chosen))
    streamed = default_streamed(children)
    if not streamed:
        raise ValueError(f"{name} has none of the denoisers {list(DIT_MODULES)} or encoders "
                         f"{list(ENCODER_MODULES)} that the block strategies stream; its components are {children}. "
                         f"Name those to stream, OffloadPolicy(strategy='layerwise', components={children!r}), or "
                         f"offload a component on its own: offload_compile(pipe.<component>, policy)")
    return streamed


def with_component(streamed: Iterable[str], name: str) -> list[str]:
    """``streamed`` with component ``name`` added last (once)."""
    streamed = list(streamed)
    return streamed if name in streamed else streamed + [name]
