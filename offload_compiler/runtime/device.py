"""The device seam: every stream, event and synchronize call of the runtime goes through here, to the device
module of the runtime's own device (``torch.cuda``, ``torch.xpu``, ``torch.npu``, a simulated device's...), never
``torch.cuda`` for another device. Nothing here knows about weights or groups.
"""

from __future__ import annotations

import logging

import torch

from .._torch_private import prefer_device_while_tracing

log = logging.getLogger("offload_compiler")


def is_accelerator(device: torch.device) -> bool:
    """A compute device that is not the host: its memory is not host memory, copies to it are transfers."""
    return device.type != "cpu"


def stream_module(device: torch.device):
    """The device module (``torch.cuda``, ``torch.xpu``, ``torch.npu``, a simulated device's...) whose streams and
    events the runtime's copies use, or None where the device has none (the CPU; MPS, which has no streams):
    copies are then issued in order on the one queue."""
    if not is_accelerator(device):
        return None
    try:
        module = torch.get_device_module(device)
    except (RuntimeError, AttributeError):
        return None
    needed = ("Stream", "Event", "current_stream", "stream")
    return module if all(hasattr(module, name) for name in needed) else None


def is_capturing(module) -> bool:
    """Whether the current stream is being captured into a graph (CUDA graphs and their likes)."""
    check = getattr(module, "is_current_stream_capturing", None)
    return bool(check is not None and check())


def synchronize(device: torch.device) -> None:
    """The host waits for the device's work (timing a call): through the device's own module, never
    ``torch.cuda`` for another device; nothing on the CPU, and nothing inside a graph capture, where a host
    synchronisation is illegal (the capture's work runs at replay)."""
    module = stream_module(device)
    if module is not None and hasattr(module, "synchronize") and not is_capturing(module):
        module.synchronize(device)


def tracing_on(device: torch.device):
    """Entered while dynamo captures an offloaded model outside `_torch_private.compile_under_config` (``auto``'s
    planning capture): see `_torch_private.prefer_device_while_tracing`."""
    return prefer_device_while_tracing(device.type)


class DeviceStreams:
    """The streams of one runtime's device: the compute stream (whatever stream the caller made current), one
    copy stream of the runtime's own (made at its first copy), and events. Made only for a device that has
    streams (`of`); elsewhere the runtime holds None and copies run in order on the one queue."""

    def __init__(self, device: torch.device, module) -> None:
        self.device = device
        self.module = module
        # a list, not an attribute, so the runtime's finalizer can hold it without holding this object's owner
        self.copy_streams: list = []

    @classmethod
    def of(cls, device: torch.device) -> "DeviceStreams | None":
        module = stream_module(device)
        return None if module is None else cls(device, module)

    def capturing(self) -> bool:
        """The compute stream is being captured into a graph: host synchronisation is illegal, events recorded
        now are nodes of the graph rather than records."""
        return is_capturing(self.module)

    def compute(self):
        """The stream compute runs on: the caller's current stream on the runtime's device."""
        return self.module.current_stream(self.device)

    def copy(self):
        """The runtime's copy stream, made at the first copy (planning touches no device)."""
        if not self.copy_streams:
            self.copy_streams.append(self.module.Stream(self.device))
        return self.copy_streams[0]

    @property
    def copy_stream(self):
        """The copy stream if one was made, else None (no copy was ever issued)."""
        return self.copy_streams[0] if self.copy_streams else None

    def event(self):
        return self.module.Event()

    def on(self, stream):
        """A context in which ``stream`` is the current stream (the device module's own ``stream``)."""
        return self.module.stream(stream)

    def wait_for_copies(self) -> None:
        """The host waits for every copy issued so far; never inside a graph capture (illegal there, and a
        capture's copies read host memory at replay, not now)."""
        stream = self.copy_stream
        if stream is not None and not self.capturing():
            stream.synchronize()

    def order_compute_after_copies(self) -> None:
        """The compute stream waits for the copy stream: memory the allocator hands out again on the compute
        stream is then reused only after every copy into it."""
        stream = self.copy_stream
        if stream is not None:
            self.compute().wait_stream(stream)


def synchronize_streams(streams: list) -> None:
    """The host waits for each of ``streams`` (a collected runtime's copies in flight), ignoring failures: at
    interpreter shutdown or inside a capture there is nothing left to order."""
    for stream in streams:
        try:
            stream.synchronize()
        except Exception as exc:
            log.debug("copy stream synchronize at collection failed (%s)", exc)
