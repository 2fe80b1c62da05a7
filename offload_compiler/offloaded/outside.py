"""What one offloaded call read outside its own graphs (code dynamo ran without a graph), measured."""

from __future__ import annotations

from torch import nn

from ..runtime import OffloadRuntime


class Outside:
    """What one offloaded call read outside its own graphs, measured: the bytes that parts called from Python
    (from code dynamo ran without a graph) fetched as their own graphs, and what host masters fetched on demand
    (`host_masters.OnDemand`) -- no count of dynamo's is read."""

    def __init__(self, runtime: OffloadRuntime, module: nn.Module, method: str) -> None:
        self.runtime = runtime
        self.module, self.method = module, method  # what the user called (named in the warning only)
        demand = runtime.on_demand
        self._start = (demand.bytes, demand.ops, len(demand.weights))
        self.part: nn.Module | None = None  # the first part called from Python during the call
        self.part_bytes = 0
        self.on_demand_bytes = self.on_demand_ops = self.on_demand_weights = 0

    def add_part(self, module: nn.Module, nbytes: int) -> None:
        self.part = self.part if self.part is not None else module
        self.part_bytes += nbytes

    def end(self) -> "Outside":
        demand = self.runtime.on_demand
        self.on_demand_bytes, self.on_demand_ops, self.on_demand_weights = (
            max(now - then, 0) for now, then in zip((demand.bytes, demand.ops, len(demand.weights)), self._start))
        return self

    def __bool__(self) -> bool:
        return self.part is not None or self.on_demand_ops > 0


def size_text(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes} B"

