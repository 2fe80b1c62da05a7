"""The runtime of an offloaded model: host buffers, device slots, the live-bytes ledger, the transfers between
them and the stats. Everything that changes while a model runs lives in an `OffloadRuntime`; the graph's
transfer ops (`offload_compiler.ops`) call into it by integer id.

Its modules, each importing only those above it in this list:

- `device`: the device seam (`stream_module`, `is_capturing`, `synchronize`, `DeviceStreams`): every stream,
  event and synchronize call goes through the device module of the runtime's device;
- `layout`: where each weight's plain tensors sit in their group's flat host buffers (`Group`, `layout_group`);
- `slots`: the device slots copies land in (`DeviceSlot`, `DevicePool`, `size_class`) and the `Ledger`;
- `pinning`: pinned host memory (`can_pin`, `pin_exact`, `HostRegistrations`);
- `host`: the host store (`HostStore`): packing, refreshing a changed weight, unpacking;
- `stats`: `OffloadStats` and `describe`;
- `transfers`: the transfer engine (`TransferEngine`): prefetch, wait, evict, resident, carry, park, remap,
  a failed call's release, fault injection;
- `facade`: `OffloadRuntime`, composing them.
"""

from ..passes.schedule import ADOPT, CARRY, FETCH
from .device import DeviceStreams, is_accelerator, is_capturing, stream_module, synchronize, tracing_on
from .facade import OffloadRuntime
from .host import HostStore, pack_group
from .layout import Bucket, Group, Leaf, Slot, contiguous_stride, dense_layout, layout_group, overlapping
from .pinning import HostRegistrations, PinningUnavailable, can_pin, pin_exact
from .slots import DevicePool, DeviceSlot, Ledger, size_class
from .stats import OffloadStats
from .transfers import CARRY_MISSES_TO_STOP, Carried, Fault, TransferEngine, TransferPlan

__all__ = [
    "ADOPT", "CARRY", "CARRY_MISSES_TO_STOP", "FETCH", "Bucket", "Carried", "DevicePool", "DeviceSlot", "DeviceStreams",
    "Fault", "Group", "HostRegistrations", "HostStore", "Leaf", "Ledger", "OffloadRuntime", "OffloadStats",
    "PinningUnavailable", "Slot", "TransferEngine", "TransferPlan", "can_pin", "contiguous_stride", "dense_layout",
    "is_accelerator", "is_capturing", "layout_group", "overlapping", "pack_group", "pin_exact", "size_class",
    "stream_module", "synchronize", "tracing_on",
]
