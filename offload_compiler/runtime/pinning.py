"""Pinned host memory, behind one seam: whether the runtime's device can pin host memory (`can_pin`), pinning
a filled buffer in place at its exact size (`pin_exact`: ``cudaHostRegister`` on CUDA, else a
``pin_memory()`` copy), and the registrations to undo before that memory is freed (`HostRegistrations`).
"""

from __future__ import annotations

import functools
import logging

import torch

from .device import is_accelerator

log = logging.getLogger("offload_compiler")


class PinningUnavailable(RuntimeError):
    pass


def can_pin(device: torch.device) -> bool:
    """Whether host memory can be pinned for ``device``: CUDA (and ROCm, which torch calls cuda) through
    ``cudaHostRegister``; another accelerator through ``pin_memory()`` where it is torch's current accelerator
    (XPU, NPU, MPS builds). Elsewhere (a simulated device) host buffers stay pageable."""
    if device.type == "cuda":
        return True
    if not is_accelerator(device) or not hasattr(torch, "accelerator"):
        return False
    current = torch.accelerator.current_accelerator()
    return current is not None and current.type == device.type and _pin_memory_works(device.type)


@functools.cache
def _pin_memory_works(device_type: str) -> bool:
    """Tried once per device type: a backend may register as the accelerator without pinned memory."""
    try:
        return torch.empty(1).pin_memory().is_pinned()
    except RuntimeError:
        return False


class HostRegistrations:
    """Host buffers pinned in place with ``cudaHostRegister``. Each is unregistered while its memory is still
    allocated: explicitly when the runtime unpacks, else when the runtime is collected (this object holds the
    buffers, so they cannot be freed first)."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device and context, not only the current one

    @classmethod
    def for_device(cls, device: torch.device) -> "HostRegistrations | None":
        """Registrations where the device pins in place (CUDA); None elsewhere, where `pin_exact` copies."""
        return cls() if device.type == "cuda" else None

    def register(self, host: torch.Tensor) -> bool:
        nbytes = host.untyped_storage().nbytes()
        if nbytes == 0:  # cudaHostRegister(NULL, 0) fails; an empty buffer has nothing to copy anyway
            return False
        try:
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(host.data_ptr(), nbytes, self.PORTABLE)
        except Exception as exc:
            log.debug("cudaHostRegister unavailable (%s); using pin_memory()", exc)
            return False
        if int(getattr(err, "value", err)) != 0:
            # torch's binding leaves the error set: cleared, or the next kernel launch would report it
            getattr(cudart, "cudaGetLastError", lambda: None)()
            return False
        self.buffers.append(host)
        return True

    def unregister_all(self) -> None:
        buffers, self.buffers = self.buffers, []
        for host in buffers:
            try:
                cudart = torch.cuda.cudart()
                err = cudart.cudaHostUnregister(host.data_ptr())
                if int(getattr(err, "value", err)) != 0:
                    getattr(cudart, "cudaGetLastError", lambda: None)()
                    log.debug("cudaHostUnregister failed (%s)", err)
            except Exception as exc:  # interpreter shutdown: the process is ending anyway
                log.debug("cudaHostUnregister failed (%s)", exc)


def pin_exact(host: torch.Tensor, registrations: HostRegistrations | None = None) -> torch.Tensor:
    """Pin an already-filled host buffer in place at its exact size (no power-of-two rounding of the
    caching host allocator) where ``registrations`` can (CUDA); else a pinned copy (``pin_memory()``: the
    current accelerator's pinned memory)."""
    if registrations is not None and registrations.register(host):
        return host
    try:
        return host.pin_memory()
    except RuntimeError as exc:
        raise PinningUnavailable(str(exc).splitlines()[0]) from None

