"""Errors and warnings raised on purpose. Everything else that reaches a caller is the model's own error or a bug."""


class OffloadRefusal(RuntimeError):
    """Offloading refuses to run this call: it would read weights from host memory un-offloaded, or change
    them. The message says why and names the fix, and nothing was changed: the model still runs as before.
    Raised to the caller as itself, never under dynamo's ``BackendCompilerFailed`` report."""


class OffloadSavingWarning(UserWarning):
    """An offload plan that saves little device memory: layerwise holds more than half the model on the device
    at once, or ``budget`` streams far more than ``offload_gb``, because the groups are too coarse. Warned
    before the model runs; the message names the largest group and the fix."""
