"""The forward hooks of an offloaded model, watched: its graphs were captured with the hooks it had then."""

from __future__ import annotations

from torch import nn
from torch.utils.hooks import RemovableHandle

HOOKS_REFUSED = ("{model} is offloaded: its graphs were captured with the hooks it had then, so a hook {action} now "
                 "would be silently ignored. Change hooks before offloading: m = remove_offload(m), change the "
                 "hook, then offload_compile(m, policy)")

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks")


class HookWatch:
    """The forward hooks of every module of an offloaded model, as they were when its graphs were captured
    (dynamo does not guard module hooks: a hook changed later would be silently ignored). Checked at every
    call without touching the dicts, which stay the modules' own plain dicts (a dict of another type makes
    dynamo guard each one in Python at every call): while no hook handle was made anywhere since the last
    check and no dict shrank, nothing changed; otherwise the keys are compared."""

    def __init__(self) -> None:
        self.dicts: list[dict] = []
        self.keys: list[tuple] = []
        self.size = 0
        self.handles = RemovableHandle.next_id

    def add(self, module: nn.Module) -> None:
        for attr in _HOOK_DICTS:
            hooks = module.__dict__[attr]
            self.dicts.append(hooks)
            self.keys.append(tuple(hooks))
            self.size += len(hooks)
        self.handles = RemovableHandle.next_id

    def change(self) -> str | None:
        """None while every hook dict holds the hooks it held at offloading; else "registered" or "removed"."""
        if RemovableHandle.next_id == self.handles and sum(map(len, self.dicts)) == self.size:
            return None
        for hooks, keys in zip(self.dicts, self.keys):
            if tuple(hooks) != keys:
                return "registered" if set(hooks) - set(keys) else "removed"
        self.handles = RemovableHandle.next_id  # handles made elsewhere (another model): nothing here changed
        return None

    def accept(self) -> None:
        """The hooks as they are now are the model's (`OffloadState.adopt_hooks`)."""
        self.keys = [tuple(hooks) for hooks in self.dicts]
        self.size = sum(map(len, self.dicts))
        self.handles = RemovableHandle.next_id

