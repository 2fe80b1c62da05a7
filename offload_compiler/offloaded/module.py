"""The offloaded model's class: a subclass of `OffloadedModule` and of its own class, with its name, carrying the
guards (``.to``, dtype changes, copy, pickle, ``load_state_dict(assign=True)``)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from ..errors import OffloadRefusal
from ..planning.auto import OffloadPlan
from ..policy import OffloadPolicy, validate_device
from ..runtime import OffloadRuntime
from .forwards import plan_now
from .state import STATE_ATTR, OffloadState


class OffloadedModule(nn.Module):
    """Base of every offloaded model's class: ``offload_compile(model, policy)`` returns ``model`` itself, its
    class swapped for a subclass of ``(OffloadedModule, Class)`` named like ``Class``. Parameters, buffers and ``state_dict`` are
    the model's own (host masters); it runs inference only; `remove_offload` restores the class."""

    @property
    def _offload(self) -> OffloadState:
        return self.__dict__[STATE_ATTR]

    @property
    def offload_policy(self) -> OffloadPolicy:
        state = self._offload
        return state.policy if state.awaits_plan else state.runtime.policy

    @property
    def _offload_runtime(self) -> OffloadRuntime | None:
        return self._offload.runtime

    @property
    def device(self) -> torch.device:
        """The compute device (the weights' home is host memory)."""
        return self._offload.policy.torch_device

    def plan(self, *args: Any, **kwargs: Any) -> OffloadPlan:
        """``strategy="auto"``: plan for these inputs now (nothing runs); later calls use that plan."""
        state = self._offload
        if state.policy.strategy != "auto":
            raise ValueError(f"plan() is for strategy='auto'; this model is offloaded with strategy="
                             f"{state.policy.strategy!r} (describe_plan(m) shows its plan)")
        state.check_usable()
        with state.lock:
            return plan_now(state, args, kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        raise TypeError("an offloaded module cannot be copied (its weights live in shared host buffers): copy the "
                        "model first and offload the copy, offload_compile(copy.deepcopy(remove_offload(m)), policy), "
                        "or save m.state_dict()")

    def __reduce_ex__(self, protocol: int) -> Any:
        raise TypeError("an offloaded module cannot be pickled or torch.save()d: save m.state_dict() (the original "
                        "parameter names), or the model returned by remove_offload(m)")

    def to(self, *args: Any, **kwargs: Any) -> "OffloadedModule":
        device, dtype = _to_target(*args, **kwargs)
        if dtype is not None:  # a no-op where every weight has that dtype already, as for a plain module
            self._apply(_dtype_conversion(dtype))
        if device is not None:
            try:  # a device this machine does not have is an error, as it is for a plain module
                device = validate_device(device)
            except ValueError as error:
                raise RuntimeError(f"{type(self).__name__}.to({device}): {error}. The model is unchanged: it keeps "
                                   f"its weights in host memory and computes on {self.device}") from None
            if device != self.device:
                warnings.warn(f"offload_compiler: .to({device}) ignored: this module keeps its weights in host "
                              f"memory and computes on {self.device}. To compute elsewhere: "
                              f"offload_compile(remove_offload(m), policy.replace(device=...))", UserWarning,
                              stacklevel=2)
        return self

    def cuda(self, device: Any = None) -> "OffloadedModule":
        return self.to(torch.device("cuda") if device is None else torch.device("cuda", device)
                       if isinstance(device, int) else device)

    def cpu(self) -> "OffloadedModule":
        return self.to("cpu")

    def _apply(self, fn: Any, recurse: bool = True) -> "OffloadedModule":
        # what .float(), .half(), .type(), .to(dtype) call: one that changes no weight (.float() of a float32
        # model) is the no-op it is for a plain module; one that would is refused before it changes any
        tensors = [*self.parameters(recurse=recurse), *self.buffers(recurse=recurse)]
        if all(_unchanged_by(fn, t) for t in tensors):
            return self
        raise OffloadRefusal("changing the dtype or storage of an offloaded module's weights (.half(), .to(dtype), "
                             "...) would detach them from their host buffers; nothing was changed. Convert first: "
                             "offload_compile(remove_offload(m).to(dtype), policy)")

    def share_memory(self) -> "OffloadedModule":
        # share_memory() readies a model to be sent to other processes, which an offloaded model cannot be (it
        # does not pickle): moving its packed host buffers, which the runtime streams from, would gain nothing
        raise OffloadRefusal("share_memory() readies a model to be sent to other processes, and an offloaded model "
                             "cannot be sent (its weights live in this process's packed host buffers); nothing was "
                             "changed. Share the plain model and offload it in the process that runs it: "
                             "remove_offload(m).share_memory(), then offload_compile(model, policy) there")

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the offloaded weights' host masters; "
                             "use assign=False (the default), which copies into them")
        if self._offload.runtime is not None:  # copies still queued may read the host buffers written here
            self._offload.runtime.wait_for_copies()
        return super().load_state_dict(state_dict, strict=strict)


_CLASSES: dict[type, type] = {}


def offloaded_class(cls: type) -> type:
    """The class an offloaded ``cls`` instance gets: one per class, made once."""
    if cls not in _CLASSES:
        # the model's own names: in messages, plans and repr, and for libraries that key what they know of a
        # class on its name (transformers' output capture looks up str(model.__class__): under another name an
        # offloaded BertModel returned no hidden states). isinstance(m, OffloadedModule) tells it is offloaded
        namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        _CLASSES[cls] = type(cls.__name__, (OffloadedModule, cls), namespace)
    return _CLASSES[cls]



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
