"""What every module holding offloaded weights refuses or ignores, the model and each of its parts alike: a
conversion of its tensors (``.half()``, ``.to(dtype)``, ``.to(device)``, ``.cpu()``, ``to_empty()``,
``share_memory()``). ``nn.Module._apply`` replaces a parameter whose converted tensor it cannot swap in with a new
plain one: on a part (``m.model.layers[0].to("cpu")``, ``.half()`` on an accelerator) the weights would silently
leave their host buffers, and ``.to("meta")`` would drop their values."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from ..errors import OffloadRefusal
from ..policy import validate_device


class KeptWeights(nn.Module):
    """Base of the offloaded model's class and of every routed part's: its weights stay where offloading put them.
    ``_compute_device`` is the device its offloaded graphs compute on."""

    def _compute_device(self) -> torch.device:
        raise NotImplementedError

    def to(self, *args: Any, **kwargs: Any) -> "KeptWeights":
        device, dtype = _to_target(*args, **kwargs)
        if dtype is not None:  # a no-op where every weight has that dtype already, as for a plain module
            self._apply(_dtype_conversion(dtype))
        memory_format = kwargs.get("memory_format")
        if memory_format not in (None, torch.preserve_format):  # as nn.Module.to: 4-d and 5-d tensors take it
            self._apply(lambda t: t.contiguous(memory_format=memory_format) if t.dim() in (4, 5) else t)
        if device is not None:
            here = self._compute_device()
            try:  # a device this machine does not have is an error, as it is for a plain module
                device = validate_device(device)
            except ValueError as error:
                raise RuntimeError(f"{type(self).__name__}.to({device}): {error}. The model is unchanged: it keeps "
                                   f"its weights in host memory and computes on {here}") from None
            if device != here:
                warnings.warn(f"offload_compiler: .to({device}) ignored: this module keeps its weights in host "
                              f"memory and computes on {here}. To compute elsewhere: "
                              f"offload_compile(remove_offload(m), policy.replace(device=...))", UserWarning,
                              stacklevel=2)
        return self

    def cuda(self, device: Any = None) -> "KeptWeights":
        return self.to(torch.device("cuda") if device is None else torch.device("cuda", device)
                       if isinstance(device, int) else device)

    def cpu(self) -> "KeptWeights":
        return self.to("cpu")

    def _apply(self, fn: Any, recurse: bool = True) -> "KeptWeights":
        # what .float(), .half(), .type(), .to(dtype), to_empty() call: one that changes no tensor (.float() of a
        # float32 model) is the no-op it is for a plain module; one that would is refused before it changes any
        # (the whole subtree is looked at first: a parent that is no part converts its children one by one)
        tensors = [*self.parameters(recurse=recurse), *self.buffers(recurse=recurse)]
        if all(_unchanged_by(fn, t) for t in tensors):
            return self
        raise OffloadRefusal(f"changing the dtype, device, layout or storage of an offloaded module's weights "
                             f"({self._offload_where()}: .half(), .to(dtype), .to(memory_format=...), .to_empty(), "
                             f"...) would detach them from their host buffers; nothing was changed. Convert the whole "
                             f"model first, m being the offloaded {self._offload_root_name()}: "
                             f"offload_compile(remove_offload(m).to(dtype), policy)")

    def _owning_offload(self) -> Any:
        """The offload state of the model this module is, or is a part of (None where it is neither)."""
        return None

    def _offload_root_name(self) -> str:
        state = self._owning_offload()
        return state.name if state is not None else "model"

    def _offload_where(self) -> str:
        """This module as its refusals name it: the model itself, or a part at its path in the model (``m.model.
        layers.0.mlp, a GraniteMLP``), since the fix converts the model and not the part."""
        state = self._owning_offload()
        path = state.path_of(self) if state is not None else ""
        if not path:
            return f"m, the offloaded {type(self).__name__}"
        return f"m.{path}, a {type(self).__name__} in the offloaded {state.name} m"

    def share_memory(self) -> "KeptWeights":
        # share_memory() readies a model to be sent to other processes, which an offloaded model cannot be (it
        # does not pickle): moving its packed host buffers, which the runtime streams from, would gain nothing
        raise OffloadRefusal("share_memory() readies a model to be sent to other processes, and an offloaded model "
                             "cannot be sent (its weights live in this process's packed host buffers); nothing was "
                             "changed. Share the plain model and offload it in the process that runs it: "
                             "remove_offload(m).share_memory(), then offload_compile(model, policy) there")


def _dtype_conversion(dtype: torch.dtype) -> Any:
    """What ``nn.Module.to(dtype)`` applies to each tensor: floating and complex ones take ``dtype``, the others
    keep theirs; a dtype of neither kind is refused as a plain module refuses it."""
    if not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"nn.Module.to only accepts floating point or complex dtypes, but got desired dtype={dtype}")
    return lambda t: t.to(dtype) if t.is_floating_point() or t.is_complex() else t


def _unchanged_by(fn: Any, tensor: torch.Tensor) -> bool:
    """Whether ``fn`` (an ``_apply`` conversion) returns its tensor itself, as ``t.float()`` does for
    a float32 ``t``. Tried on a meta tensor of its layout: no bytes are read or copied, and a conversion that
    moves data (``.cpu()``, ``share_memory_``) fails there, so counts as a change."""
    probe = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
    try:
        return fn(probe) is probe
    except Exception:  # whatever a conversion raises on the probe, it is not a no-op
        return False


def _to_target(*args: Any, device: Any = None, dtype: torch.dtype | None = None, **_: Any) \
        -> tuple[torch.device | None, torch.dtype | None]:
    """The device and dtype that ``module.to(*args, **kwargs)`` names, in the forms ``Tensor.to`` documents:
    ``to(device, dtype)``, ``to(dtype)``, ``to(tensor)``, by keyword too (``non_blocking``, ``copy`` and
    ``memory_format`` say nothing of either). Not validated: a device this machine lacks is the caller's error."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0].device, args[0].dtype
    if args and isinstance(args[0], torch.dtype):
        dtype = args[0]
    elif args:
        device = args[0]
        if len(args) > 1 and isinstance(args[1], torch.dtype):
            dtype = args[1]
    return (None if device is None else torch.device(device)), dtype
