"""Reads of groups on disk on the worker thread (issue 29), on the CPU (straight into the slot) and on a device
that is not the host (into the slot's staging buffers, copied to the device once read): a prefetched group is read
while the calling thread computes; the wait for a group waits for its read, a host write waits for the reads of
its buffer, and a read's error reaches the call that waits for it."""

import copy
import threading
import time

import pytest
from devices import host_and
import torch
from torch import nn

from offload_compiler import OffloadPolicy, offload_compile, offload_stats
from offload_compiler.offloaded import state_of
from offload_compiler.runtime import transfers
from offload_compiler.testing import assert_traffic_matches_plan, simulated_device


class Stack(nn.Module):
    def __init__(self, d=512, n=5):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def _model(seed=0):
    torch.manual_seed(seed)
    return Stack().eval().requires_grad_(False)


BLOCK = (512 * 512 + 512) * 4


@pytest.fixture
def on_disk(tmp_path):
    """Policy fields that put every block on disk."""
    return {"host_budget_gb": 0.0, "disk_dir": str(tmp_path)}


@pytest.fixture(params=host_and("sim"))
def device(request):
    return simulated_device() if request.param == "sim" else "cpu"


def _read(device) -> str:
    """The function of `transfers` that reads a group's files on ``device``: into the slot on the CPU, into its
    staging buffers elsewhere."""
    return "_copy_group" if device == "cpu" else "_read_staged"


def _patch_reads(monkeypatch, device, wrap):
    """Every read of a group's files on ``device`` goes through ``wrap(real, buffers, group)``."""
    real = getattr(transfers, _read(device))
    monkeypatch.setattr(transfers, _read(device), lambda buffers, group: wrap(real, buffers, group))


def _call(m, x, device):
    with torch.no_grad():
        return m(x.to(device)).cpu()


@pytest.fixture
def fills(monkeypatch):
    """(thread name, group name, start, end) of every fill (CPU)."""
    seen = []
    real = transfers._copy_group

    def recorded(buffers, group):
        start = time.perf_counter()
        real(buffers, group)
        seen.append((threading.current_thread().name, group.name, start, time.perf_counter()))
    monkeypatch.setattr(transfers, "_copy_group", recorded)
    return seen


def test_prefetched_groups_are_read_on_the_worker_thread_and_outputs_are_exact(monkeypatch, on_disk, device):
    readers = []

    def recorded(real, buffers, group):
        real(buffers, group)
        readers.append(threading.current_thread().name)
    _patch_reads(monkeypatch, device, recorded)
    model = _model()
    reference = copy.deepcopy(model)
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", prefetch=1, device=device, debug_poison=True,
                                             **on_disk))
    x = torch.randn(4, 512)
    with torch.no_grad():
        expected = reference(x)
    for _ in range(3):
        torch.testing.assert_close(_call(m, x, device), expected, rtol=0, atol=0)
    assert len(readers) == 3 * 5 and all(name.startswith("offload-copy") for name in readers)
    assert offload_stats(m).fetch_count == 3 * 5 and offload_stats(m).disk_bytes_read == 3 * 5 * BLOCK
    assert_traffic_matches_plan(m)  # three calls, each as planned


def test_groups_in_host_memory_are_copied_inline(fills):
    m = offload_compile(_model(), OffloadPolicy(strategy="layerwise"))
    with torch.no_grad():
        m(torch.randn(2, 512))
    assert len(fills) == 5 and all(name == threading.current_thread().name for name, *_ in fills)


def test_a_weight_written_while_a_carried_read_may_still_fill_it_waits_for_that_read(monkeypatch, on_disk, device):
    """The last group of a call prefetches the first group of the next (prefetch_next_call); writing that
    group's weight right after the call must wait for the read of its file, and the next call reads the new
    values."""
    _patch_reads(monkeypatch, device, lambda real, buffers, group: (time.sleep(0.05), real(buffers, group)))
    model, reference = _model(1), _model(1)
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", prefetch=1, prefetch_next_call=True,
                                             device=device, **on_disk))
    x = torch.randn(2, 512)
    _call(m, x, device)
    with torch.no_grad():
        delta = torch.randn(512, 512)
        m.blocks[0].weight.add_(delta)  # the file a carried read reads
        reference.blocks[0].weight.add_(delta)
        expected = reference(x)
    torch.testing.assert_close(_call(m, x, device), expected, rtol=0, atol=0)


def test_a_failing_read_on_the_worker_reaches_the_caller_and_the_model_runs_after(monkeypatch, on_disk, device):
    model, reference = _model(2), _model(2)
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", prefetch=1, device=device, **on_disk))
    x = torch.randn(2, 512)
    calls = []

    def failing(real, buffers, group):
        calls.append(group.name)
        if len(calls) == 3:
            raise OSError("read failed")
        real(buffers, group)
    _patch_reads(monkeypatch, device, failing)
    with pytest.raises(OSError, match="read failed"):
        _call(m, x, device)
    monkeypatch.undo()
    runtime = state_of(m).runtime
    assert runtime.ledger.live == 0 and not runtime.transfers.copier.in_flight
    assert all(slot.unsent is None for slots in runtime.transfers.pool.slots.values() for slot in slots)
    with torch.no_grad():
        expected = reference(x)
    torch.testing.assert_close(_call(m, x, device), expected, rtol=0, atol=0)


def test_the_call_goes_on_while_the_next_group_is_read(on_disk, monkeypatch, device):
    """With prefetch=1 the read of group k+1 is issued before the wait for group k: the wait returns (and the
    calling thread computes group k) while that read is still under way."""
    m = offload_compile(_model(3), OffloadPolicy(strategy="layerwise", prefetch=1, device=device, **on_disk))
    _call(m, torch.randn(2, 512), device)
    reads, waited = {}, {}

    def slow(real, buffers, group):
        time.sleep(0.05)
        real(buffers, group)
        reads[group.index] = time.perf_counter()
    _patch_reads(monkeypatch, device, slow)
    ready = transfers.TransferEngine._ready

    def recorded(self, slot):
        out = ready(self, slot)
        waited[slot.group] = time.perf_counter()
        return out
    monkeypatch.setattr(transfers.TransferEngine, "_ready", recorded)
    _call(m, torch.randn(2, 512), device)
    assert sorted(reads) == sorted(waited) == list(range(5))
    assert all(waited[k] < reads[k + 1] for k in range(4))  # group k computed while group k+1 was read
