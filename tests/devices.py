"""The devices a test runs on, where it runs on two."""

import pytest


def host_and(device):
    """``device`` (the simulated accelerator, a device that is not the host) in the fast subset, and the CPU, where
    the device is the host, in the full suite and in CI's runs on the other torch versions (``newest_torch``): a
    bug that shows only where host = device is caught by neither, so the fast subset runs the device that
    shows more."""
    return [pytest.param("cpu", id="cpu", marks=[pytest.mark.slow, pytest.mark.newest_torch]), device]
