"""What an offloaded call takes and gives back: its tensor inputs found and moved to the compute device, its
inputs described in a short error, its outputs marked inference-only."""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any, Iterator

import torch

from .._torch_private import pytree
from ..errors import OffloadRefusal

_ATOMS = (bool, int, float, str, type(None))
_LIBRARIES = ("torch", __package__.rsplit(".", 1)[0], "transformers", "diffusers")  # between the user and a call


def user_stacklevel() -> int:
    """The ``stacklevel`` of a warning given by the caller of this function that names the user's line: the
    first frame outside this package and the libraries that call models (a model called directly, a part
    called by hand, from ``generate`` or a pipeline, through ``torch.compile``'s wrapper: each adds frames)."""
    libraries = tuple(os.path.dirname(sys.modules[name].__file__) + os.sep for name in _LIBRARIES
                      if getattr(sys.modules.get(name), "__file__", None))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(libraries):
        frame, level = frame.f_back, level + 1
    return level


def tensor_leaves(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors among a call's arguments, as ``pytree.tree_leaves`` finds them: plain tuples, lists and
    dicts are walked here (this runs at every call, and pytree's generic walk costs tens of µs on a
    decode step's arguments), any other value by pytree."""
    stack = [tree]
    while stack:
        value = stack.pop()
        kind = type(value)
        if kind is tuple or kind is list:
            stack.extend(value)
        elif kind is dict:
            stack.extend(value.values())
        elif isinstance(value, torch.Tensor):
            yield value
        elif kind not in _ATOMS:
            yield from (leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor))



def moved_to(device: torch.device, args: tuple, kwargs: dict) -> tuple[tuple, dict, list[str]]:
    """``args`` and ``kwargs`` with every tensor elsewhere than ``device`` moved there, and the devices they were
    on; data-less (meta) inputs are refused."""
    moved = []

    def place(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.device == device:
            return value
        if value.is_meta:
            raise ValueError(f"an input is on the meta device, so it has no data to compute on; pass real "
                             f"tensors (on {device})")
        moved.append(str(value.device))
        return value.to(device)

    args, kwargs = pytree.tree_map(place, (args, kwargs))
    return args, kwargs, moved


def describe_inputs(function: Any, args: tuple, kwargs: dict) -> str:
    """``x=Tensor[2, 5] float32, scale=2.0``: the inputs of a failed call, by parameter name where known."""
    try:
        named = dict(inspect.signature(function).bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        named = {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}

    def show(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"Tensor[{', '.join(map(str, value.shape))}] {str(value.dtype).replace('torch.', '')}"
        tensors = [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
        if tensors:
            return f"{type(value).__name__} of {len(tensors)} tensors ({', '.join(show(t) for t in tensors[:3])}" \
                   f"{', ...' if len(tensors) > 3 else ''})"
        text = repr(value)
        return text if len(text) <= 40 else f"{type(value).__name__}(...)"
    return ", ".join(f"{name}={show(value)}" for name, value in named.items() if value is not None)


INFERENCE_ONLY = ("offload_compiler runs inference only: there is no backward through an offloaded model (its "
                  "weights are streamed, not kept for autograd). Call it under torch.no_grad() or "
                  "torch.inference_mode(), or train the model un-offloaded: remove_offload(m)")


class _InferenceOnlyOutput(torch.autograd.Function):
    """An offloaded model's output where the plain model's would require grad: the same values, with a
    backward that says why there is none."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value.detach()  # the same storage, not a view: in-place changes stay allowed

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        raise OffloadRefusal(INFERENCE_ONLY)


_ANCHOR = torch.zeros((), requires_grad=True)  # gives the outputs a grad_fn; never receives a gradient


def inference_only(out: Any) -> Any:
    """``out`` with each floating tensor's backward raising `INFERENCE_ONLY` (where the plain model's would run)."""
    def mark(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
            return _InferenceOnlyOutput.apply(_ANCHOR, value)
        return value
    return pytree.tree_map(mark, out)

