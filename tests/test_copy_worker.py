"""Reads of groups on disk on the worker thread where the device has no copy stream (the CPU, issue 29): a
prefetched group is read while the calling thread computes; the wait for a group waits for its read, a host
write waits for the reads of its buffer, and a read's error reaches the call that waits for it."""

import copy
import threading
import time

import pytest
import torch
from torch import nn

from offload_compiler import OffloadPolicy, offload_compile, offload_stats
from offload_compiler.offloaded import state_of
from offload_compiler.runtime import transfers


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


@pytest.fixture
def fills(monkeypatch):
    """(thread name, group name, start, end) of every fill."""
    seen = []
    real = transfers._copy_group

    def recorded(buffers, group):
        start = time.perf_counter()
        real(buffers, group)
        seen.append((threading.current_thread().name, group.name, start, time.perf_counter()))
    monkeypatch.setattr(transfers, "_copy_group", recorded)
    return seen


def test_prefetched_groups_are_read_on_the_worker_thread_and_outputs_are_exact(fills, on_disk):
    model = _model()
    reference = copy.deepcopy(model)
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", prefetch=1, **on_disk))
    x = torch.randn(4, 512)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(m(x), reference(x))
    assert len(fills) == 3 * 5 and all(name.startswith("offload-copy") for name, *_ in fills)
    assert offload_stats(m).fetch_count == 3 * 5 and offload_stats(m).disk_bytes_read == 3 * 5 * BLOCK


def test_groups_in_host_memory_are_copied_inline(fills):
    m = offload_compile(_model(), OffloadPolicy(strategy="layerwise"))
    with torch.no_grad():
        m(torch.randn(2, 512))
    assert len(fills) == 5 and all(name == threading.current_thread().name for name, *_ in fills)


def test_a_weight_written_while_a_carried_read_may_still_fill_it_waits_for_that_read(fills, monkeypatch, on_disk):
    """The last group of a call prefetches the first group of the next (prefetch_next_call); writing that
    group's weight right after the call must wait for the fill that reads its buffer, and the next call reads
    the new values."""
    slow = transfers._copy_group

    def slowly(buffers, group):
        time.sleep(0.05)
        slow(buffers, group)
    monkeypatch.setattr(transfers, "_copy_group", slowly)
    model, reference = _model(1), _model(1)
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", prefetch=1, prefetch_next_call=True, **on_disk))
    x = torch.randn(2, 512)
    with torch.no_grad():
        m(x)
        delta = torch.randn(512, 512)
        m.blocks[0].weight.add_(delta)  # the host buffer a carried fill reads
        reference.blocks[0].weight.add_(delta)
        assert torch.equal(m(x), reference(x))


def test_a_failing_read_on_the_worker_reaches_the_caller_and_the_model_runs_after(monkeypatch, on_disk):
    model, reference = _model(2), _model(2)
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", prefetch=1, **on_disk))
    x = torch.randn(2, 512)
    real = transfers._copy_group
    calls = []

    def failing(buffers, group):
        calls.append(group.name)
        if len(calls) == 3:
            raise OSError("read failed")
        real(buffers, group)
    monkeypatch.setattr(transfers, "_copy_group", failing)
    with pytest.raises(OSError, match="read failed"), torch.no_grad():
        m(x)
    monkeypatch.setattr(transfers, "_copy_group", real)
    runtime = state_of(m).runtime
    assert runtime.ledger.live == 0 and not runtime.transfers.copier.in_flight
    with torch.no_grad():
        assert torch.equal(m(x), reference(x))


def test_the_call_goes_on_while_the_next_group_is_read(fills, on_disk, monkeypatch):
    """With prefetch=1 the read of group k+1 is issued before the wait for group k: the wait returns (and the
    calling thread computes group k) while that read is still under way."""
    real = transfers._copy_group

    def slow(buffers, group):
        time.sleep(0.05)
        real(buffers, group)
    model = _model(3)
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", prefetch=1, **on_disk))
    with torch.no_grad():
        m(torch.randn(2, 512))
    reads, waited = {}, {}
    monkeypatch.setattr(transfers, "_copy_group", lambda buffers, group: (
        slow(buffers, group), reads.__setitem__(group.index, time.perf_counter())))
    ready = transfers.TransferEngine._ready

    def recorded(self, slot):
        out = ready(self, slot)
        waited[slot.group] = time.perf_counter()
        return out
    monkeypatch.setattr(transfers.TransferEngine, "_ready", recorded)
    with torch.no_grad():
        m(torch.randn(2, 512))
    assert sorted(reads) == sorted(waited) == list(range(5))
    assert all(waited[k] < reads[k + 1] for k in range(4))  # group k computed while group k+1 was read
