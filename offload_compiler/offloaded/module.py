"""The offloaded model's class: a subclass of `OffloadedModule` and of its own class, with its name, carrying the
guards (copy, pickle, ``load_state_dict(assign=True)``; ``.to`` and dtype changes: `kept`)."""

from __future__ import annotations

from typing import Any

import torch

from ..planning.auto import OffloadPlan
from ..policy import OffloadPolicy
from ..runtime import OffloadRuntime
from .forwards import plan_now
from .kept import KeptWeights
from .state import STATE_ATTR, OffloadState


class OffloadedModule(KeptWeights):
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

    def _compute_device(self) -> torch.device:
        return self.device

    def _owning_offload(self) -> Any:
        return self._offload

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
        name = type(self).__name__
        raise TypeError(f"an offloaded module cannot be copied (its weights live in shared host buffers). To copy "
                        f"it while m stays offloaded: build a new {name} and copy the weights in, "
                        f"copy_.load_state_dict(m.state_dict()), then offload_compile(copy_, policy). Or un-offload "
                        f"m first, knowing that remove_offload(m) makes m the plain model again: "
                        f"plain = remove_offload(m); copy_ = copy.deepcopy(plain); then offload_compile(plain, "
                        f"policy) offloads it again")

    def __reduce_ex__(self, protocol: int) -> Any:
        raise TypeError("an offloaded module cannot be pickled or torch.save()d: save m.state_dict() (the original "
                        "parameter names), or the model returned by remove_offload(m)")

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


