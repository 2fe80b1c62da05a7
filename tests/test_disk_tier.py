"""The disk tier (issue 29): with ``host_budget_gb`` the streamed groups beyond it live in files under
``disk_dir``, are read at each of their fetches straight into the slot (a staging buffer on an accelerator), and
the traffic, the outputs and every way of changing a weight stay as for groups in host memory."""

import copy
import dataclasses
import gc
import os
import platform
import unittest.mock as mock

import pytest
from devices import host_and
import torch
from torch import nn

from offload_compiler import (OffloadPolicy, describe_plan, empty_weights, inject_fault,
                              offload_compile, offload_stats, plan_summary, remove_offload, reset_offload_stats)
from offload_compiler.offloaded import state_of
from fresh_process import BLOCK_BYTES, run, stack_script


class Stack(nn.Module):
    def __init__(self, d=64, n=6):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = torch.relu(block(h)) + h
        return self.out(h)


BLOCK = (64 * 64 + 64) * 4  # bytes of one block


def _model(seed=0):
    torch.manual_seed(seed)
    return Stack().eval().requires_grad_(False)


def _policy(tmp_path, blocks_in_memory=2, **fields):
    fields.setdefault("strategy", "layerwise")
    small = (8 * 64 + 64 + 64 * 4 + 4) * 4  # inp and out
    return OffloadPolicy(host_budget_gb=(blocks_in_memory * BLOCK + small) / 2**30, disk_dir=str(tmp_path), **fields)


def _runtime(model):
    return state_of(model).runtime


def test_policy_needs_both_fields_an_existing_directory_and_a_streaming_strategy(tmp_path):
    with pytest.raises(ValueError, match="go together"):
        OffloadPolicy(host_budget_gb=1)
    with pytest.raises(ValueError, match="go together"):
        OffloadPolicy(disk_dir=str(tmp_path))
    with pytest.raises(ValueError, match="existing directory"):
        OffloadPolicy(host_budget_gb=1, disk_dir=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=">= 0"):
        OffloadPolicy(host_budget_gb=-1, disk_dir=str(tmp_path))
    with pytest.raises(ValueError, match="strategies"):
        OffloadPolicy(strategy="alternating", host_budget_gb=1, disk_dir=str(tmp_path))


def test_groups_beyond_the_budget_are_read_from_disk_at_each_fetch_and_outputs_are_exact(tmp_path):
    model = _model()
    reference = copy.deepcopy(model)
    m = offload_compile(model, _policy(tmp_path))
    runtime = _runtime(m)
    on_disk = [g for g in runtime.groups if g.on_disk]
    assert len(on_disk) == 4 and all(g.name.startswith("blocks.") for g in on_disk)  # the largest, streamed
    assert runtime.host.host_bytes <= m.offload_policy.host_budget_bytes
    assert os.listdir(tmp_path) == []  # the files are unlinked once mapped: nothing left behind
    x = torch.randn(3, 8)
    for _ in range(2):
        reset_offload_stats(m)
        with torch.no_grad():
            assert torch.equal(m(x), reference(x))
        stats = offload_stats(m)
        assert stats.disk_bytes_read == sum(g.nbytes for g in on_disk) == 4 * BLOCK
        assert stats.bytes_transferred == runtime.total_bytes and stats.disk_bytes == 4 * BLOCK
    assert "from disk" in describe_plan(m) and "disk tier" in describe_plan(m)
    assert "on disk" in str(offload_stats(m))


@pytest.mark.parametrize("how", ["add_", "data", "load_state_dict"])
def test_a_weight_on_disk_changed_between_calls_is_what_the_next_call_reads(tmp_path, how):
    model, reference = _model(), _model()
    m = offload_compile(model, _policy(tmp_path))
    name = next(g.name for g in _runtime(m).groups if g.on_disk)
    x = torch.randn(2, 8)
    with torch.no_grad():
        m(x)
        new = torch.randn(64, 64)
        for target in (m, reference):
            weight = target.get_submodule(name).weight
            if how == "add_":
                weight.add_(new)
            elif how == "data":
                weight.data = weight.data + new
            else:
                target.get_submodule(name).load_state_dict({"weight": weight + new, "bias": target.get_submodule(name).bias})
        assert torch.equal(m(x), reference(x))
        assert torch.equal(m.state_dict()[f"{name}.weight"], reference.state_dict()[f"{name}.weight"])


def test_remove_offload_gives_the_weights_back_in_memory_bit_for_bit(tmp_path):
    model = _model(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    m = offload_compile(model, _policy(tmp_path))
    with torch.no_grad():
        m(torch.randn(2, 8))
    files = [b.file for g in _runtime(m).groups for b in g.buckets if b.file is not None]
    plain = remove_offload(m)
    assert all(f.fd == -1 for f in files)
    assert all(torch.equal(before[k], v) for k, v in plain.state_dict().items())


def test_a_failed_fetch_from_disk_leaves_the_model_whole(tmp_path):
    model, reference = _model(2), _model(2)
    m = offload_compile(model, _policy(tmp_path))
    name = next(g.name for g in _runtime(m).groups if g.on_disk)
    inject_fault(m, "fetch", name)
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="injected"), torch.no_grad():
        m(x)
    with torch.no_grad():
        assert torch.equal(m(x), reference(x))


def test_prefetch_next_call_and_budget_stream_from_disk_too(tmp_path):
    model, reference = _model(3), _model(3)
    m = offload_compile(model, _policy(tmp_path, prefetch_next_call=True))
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(m(x), reference(x))
    assert offload_stats(m).carry_hits > 0
    m = offload_compile(_model(3), _policy(tmp_path, blocks_in_memory=3, strategy="budget",
                                           offload_gb=4 * BLOCK / 2**30))
    assert [g.on_disk for g in _runtime(m).groups if g.streamed].count(True) >= 1
    with torch.no_grad():
        assert torch.equal(m(x), reference(x))


def _device(name):
    from offload_compiler.testing import simulated_device
    return simulated_device() if name == "sim" else torch.device("cpu")


def _carrying(tmp_path, seed, device, **fields):
    """The stack with blocks 0, 1, 3 and 4 on disk and prefetch_next_call: a call reads blocks 0 and 1 (the
    reads the next call would issue at its start) for the next call, beside its first group in memory."""
    model, reference = _model(seed), _model(seed)
    m = offload_compile(model, _policy(tmp_path, prefetch=1, prefetch_next_call=True, device=device,
                                       debug_poison=True, **fields))
    return m, reference


def _group(m, name):
    return next(g for g in _runtime(m).groups if g.name == name)


def _carried(m):
    runtime = _runtime(m)
    schedule = runtime.graph_plans[0].schedule
    return [runtime.groups[schedule.instances[i].group].name for i, _ in schedule.carry_at]


def _exact(m, x, expected, device):
    with torch.no_grad():
        torch.testing.assert_close(m(x.to(device)).cpu(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("device", host_and("sim"))
def test_a_call_reads_the_next_calls_first_groups_on_disk_and_the_next_call_starts_with_them(
        tmp_path, device, monkeypatch):
    """prefetch_next_call with groups on disk: the reads a call issues at its start (the first prefetch + 1
    groups on disk) are issued by the call before it, at the wait of its last block (after its own prefetches),
    so the disk reads on across the calls' boundary. Each call still reads each group
    on disk once, the next call takes the copies read for it, the ledger counts them held between calls
    (the verified peak), and the outputs are exact."""
    from offload_compiler.runtime.transfers import TransferEngine
    dev = _device(device)
    m, reference = _carrying(tmp_path, 12, dev)
    runtime = _runtime(m)
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = reference(x)
    _exact(m, x, expected, dev)
    assert [g.name for g in runtime.groups if g.on_disk] == ["blocks.0", "blocks.1", "blocks.3", "blocks.4"]
    assert _carried(m) == ["blocks.0", "blocks.1", "inp"]
    held = 2 * BLOCK + _group(m, "inp").nbytes
    assert offload_stats(m).carried_bytes == held == offload_stats(m).live_device_bytes
    events = []
    fill, ready = TransferEngine._fill, TransferEngine._ready
    monkeypatch.setattr(TransferEngine, "_fill", lambda self, slot, g: (events.append(("fill", g.name)),
                                                                        fill(self, slot, g))[1])
    monkeypatch.setattr(TransferEngine, "_ready", lambda self, slot: (events.append(
        ("wait", self.groups[slot.group].name)), ready(self, slot))[1])
    plan = runtime.graph_plans[0]
    for _ in range(2):
        events.clear()
        reset_offload_stats(m)
        _exact(m, x, expected, dev)
        stats = offload_stats(m)
        assert stats.carry_hits == 3 and stats.fetch_count == len(plan.schedule.instances)
        assert stats.disk_bytes_read == 4 * BLOCK  # each group on disk read once per call, two for the next
        assert stats.bytes_transferred == runtime.total_bytes
        assert stats.peak_resident_bytes == plan.verified.peak_bytes
        assert stats.carried_bytes == stats.live_device_bytes == held
        # the call started with its first reads done or in flight: none of them is issued in it before a wait,
        # and it issued them for the next call once the last block on disk was waited for
        fills = [name for kind, name in events if kind == "fill"]
        assert events[0] == ("wait", "inp") and fills.count("blocks.0") == fills.count("blocks.1") == 1
        assert events.index(("fill", "blocks.0")) > events.index(("wait", "blocks.4"))
        assert fills[-3:] == ["blocks.0", "blocks.1", "inp"]


@pytest.mark.parametrize("how", ["add_", "data", "load_state_dict"])
@pytest.mark.parametrize("device", host_and("sim"))
def test_a_group_on_disk_read_for_the_next_call_and_changed_before_it_is_read_again_not_served_stale(
        tmp_path, device, how):
    """The previous call read blocks.0 for the next; the weight changes between the calls after that read
    ended: the next call drops the stale copy and reads the group again, then carries it again."""
    dev = _device(device)
    m, reference = _carrying(tmp_path, 13, dev)
    x = torch.randn(2, 8)
    with torch.no_grad():
        _exact(m, x, reference(x), dev)
    assert "blocks.0" in _carried(m)
    _runtime(m).wait_for_copies()  # the read for the next call is done: the slot holds the old bytes
    new = torch.randn(64, 64)
    with torch.no_grad():
        value, bias = reference.blocks[0].weight + new, reference.blocks[0].bias.clone()
        for target in (m, reference):
            block = target.get_submodule("blocks.0")
            if how == "add_":
                block.weight.add_(new)
            elif how == "data":
                block.weight.data = value.clone()
            else:
                block.load_state_dict({"weight": value.clone(), "bias": bias})
        expected = reference(x)
    reset_offload_stats(m)
    _exact(m, x, expected, dev)
    stats, instances = offload_stats(m), len(_runtime(m).graph_plans[0].schedule.instances)
    assert stats.carry_hits == 2 and stats.fetch_count == instances + 1  # blocks.0 read again, the others taken
    assert stats.disk_bytes_read == 5 * BLOCK
    reset_offload_stats(m)
    _exact(m, x, expected, dev)
    assert offload_stats(m).carry_hits == 3 and offload_stats(m).disk_bytes_read == 4 * BLOCK


@pytest.mark.parametrize("device", host_and("sim"))
def test_a_group_read_from_the_checkpoint_for_the_next_call_and_changed_moves_to_the_tiers_file_after_that_read(
        tmp_path, device):
    """blocks.0 read from the checkpoint's own extents for the next call, then changed in place while that read
    may still run: the next call drops the read (stale), waits for it, and moves the group to its region of the
    tier's file before reading it again; the checkpoint is never written."""
    dev = _device(device)
    reference = _model(17)
    model, path, folder = _checkpoint(tmp_path, reference)
    saved = path.read_bytes()
    m = offload_compile(model, _policy(folder, prefetch=1, prefetch_next_call=True, device=dev, debug_poison=True),
                        checkpoint=path)
    x = torch.randn(2, 8)
    with torch.no_grad():
        _exact(m, x, reference(x), dev)
        assert "blocks.0" in _carried(m) and _group(m, "blocks.0").buckets[0].file.read_only
        delta = torch.randn(64, 64)
        for target in (m, reference):  # no wait for the read in flight: the write goes to the private mapping
            target.blocks[0].weight.add_(delta)
        expected = reference(x)
    reset_offload_stats(m)
    _exact(m, x, expected, dev)
    assert offload_stats(m).carry_hits == 2 and not _group(m, "blocks.0").buckets[0].file.read_only
    reset_offload_stats(m)
    _exact(m, x, expected, dev)
    assert offload_stats(m).carry_hits == 3 and path.read_bytes() == saved


@pytest.mark.parametrize("device", host_and("sim"))
def test_a_read_for_the_next_call_that_fails_fails_the_call_that_takes_it_and_the_model_stays_whole(
        tmp_path, device, monkeypatch):
    """An OSError in a read a call issued for its next call (on the worker, after the call returned): the next
    call raises it naming the group, holds nothing after, and the call after it is exact and carries again."""
    from offload_compiler.runtime import disk
    dev = _device(device)
    m, reference = _carrying(tmp_path, 14, dev)
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = reference(x)
    _exact(m, x, expected, dev)  # blocks.0 read twice: for this call and for the next
    _runtime(m).wait_for_copies()  # (the read for the next call done before the reads fail)
    first = _group(m, "blocks.0").buckets[0].file
    reads, real = [], disk.DiskFile.read_into

    def third_read_of_block_0_fails(self, target):
        if self.base == first.base:
            reads.append(self.base)
            if len(reads) == 1:
                raise OSError(5, "Input/output error")
        real(self, target)
    monkeypatch.setattr(disk.DiskFile, "read_into", third_read_of_block_0_fails)
    _exact(m, x, expected, dev)  # took the copy read for it; its read of blocks.0 for the next call fails
    _runtime(m).wait_for_copies()
    assert reads == [first.base]  # ... already: issued in the call before the one that takes it
    with pytest.raises(OSError) as caught, torch.no_grad():
        m(x.to(dev))
    assert caught.value.errno == 5 and "group 'blocks.0'" in "\n".join(caught.value.__notes__)
    stats = offload_stats(m)
    assert stats.live_device_bytes == 0 and stats.carried_bytes == 0
    _exact(m, x, expected, dev)
    reset_offload_stats(m)
    _exact(m, x, expected, dev)
    assert offload_stats(m).carry_hits == 3


@pytest.mark.parametrize("device", host_and("sim"))
def test_reads_for_the_next_call_go_with_a_fault_another_graph_and_remove_offload(tmp_path, device):
    """The reads a call issued for the next: a call that fails releases them, a call that takes another graph
    (another input shape) drops them before its own copies, and remove_offload gives the weights back bit for
    bit with the files closed, each right after a call left them in flight."""
    dev = _device(device)
    m, reference = _carrying(tmp_path, 15, dev)
    before = {k: v.clone() for k, v in reference.state_dict().items()}
    x, other = torch.randn(2, 8), torch.randn(5, 8)
    with torch.no_grad():
        expected, expected_other = reference(x), reference(other)
    _exact(m, x, expected, dev)
    held = offload_stats(m).carried_bytes
    assert held == 2 * BLOCK + _group(m, "inp").nbytes  # blocks 0 and 1 in flight or read for the next
    inject_fault(m, "fetch", "blocks.3")
    with pytest.raises(RuntimeError, match="injected"), torch.no_grad():
        m(x.to(dev))
    assert offload_stats(m).live_device_bytes == 0 and offload_stats(m).carried_bytes == 0
    for inputs, out in ((x, expected), (other, expected_other), (x, expected), (other, expected_other)):
        reset_offload_stats(m)
        _exact(m, inputs, out, dev)
        stats = offload_stats(m)
        assert stats.peak_resident_bytes <= max(p.verified.peak_bytes for p in _runtime(m).graph_plans)
        assert stats.live_device_bytes == stats.carried_bytes == held
    files = [b.file for g in _runtime(m).groups for b in g.buckets if b.file is not None]
    plain = remove_offload(m)
    assert all(f.fd == -1 for f in files)
    assert all(torch.equal(before[k], v) for k, v in plain.state_dict().items())
    with torch.no_grad():
        assert torch.equal(plain(x), expected)


def test_a_budget_below_what_must_stay_in_memory_is_refused_with_the_figure(tmp_path):
    policy = OffloadPolicy(strategy="budget", offload_gb=BLOCK / 2**30, host_budget_gb=1e-6, disk_dir=str(tmp_path))
    model = _model()
    with pytest.raises(ValueError, match="host_budget_gb=.*below what stays in host memory"):
        offload_compile(model, policy)
    assert state_of(model) is None


def test_on_a_device_that_is_not_the_host_disk_groups_go_through_a_staging_buffer(tmp_path):
    from offload_compiler.testing import simulated_device
    device = simulated_device()
    model = _model(4)
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = copy.deepcopy(model)(x)
    m = offload_compile(model, _policy(tmp_path, device=device, debug_poison=True))
    for _ in range(3):  # the staging buffers are reused: each read waits for the copy that last read them
        with torch.no_grad():
            torch.testing.assert_close(m(x.to(device)).cpu(), expected)
    stats = offload_stats(m)
    assert stats.disk_bytes_read == 3 * 4 * BLOCK and stats.on_demand_bytes == 0


def _checkpoint(tmp_path, reference, dtype=None):
    from safetensors.torch import save_file
    path = tmp_path / "model.safetensors"
    save_file({k: v if dtype is None else v.to(dtype) for k, v in reference.state_dict().items()}, str(path))
    folder = tmp_path / "disk"
    folder.mkdir()
    with empty_weights():
        model = Stack().eval()
    return model, path, folder


def test_groups_on_disk_are_read_from_the_checkpoints_own_file(tmp_path, monkeypatch):
    """Loading reads nothing of the groups on disk: their weights view the checkpoint (privately mapped), and
    each fill reads their extents from it."""
    from offload_compiler import checkpoint
    read, real = [], checkpoint._Reader._read
    monkeypatch.setattr(checkpoint._Reader, "_read", lambda self, address, entry: (read.append(entry.name),
                                                                                   real(self, address, entry)))
    reference = _model(5)
    model, path, folder = _checkpoint(tmp_path, reference)
    m = offload_compile(model, _policy(folder), checkpoint=path)
    runtime = _runtime(m)
    on_disk = [g for g in runtime.groups if g.on_disk]
    assert len(on_disk) == 4 and all(b.file.read_only and b.host is None for g in on_disk for b in g.buckets)
    assert sorted(read) == sorted(k for k in reference.state_dict() if not any(
        k.startswith(g.name + ".") for g in on_disk))
    assert os.listdir(folder) == []
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(m(x), reference(x))
    assert offload_stats(m).disk_bytes_read == 4 * BLOCK


@pytest.mark.parametrize("how", ["add_", "data", "state_dict"])
def test_a_weight_read_from_the_checkpoint_changed_moves_its_group_to_a_file_and_never_writes_the_checkpoint(
        tmp_path, how):
    """Also through a state_dict tensor (plain PyTorch's edits the model): its write lands in the checkpoint's
    private mapping, which no fill reads, so the runtime sees it (`HostStore.watch`) and moves the group."""
    reference = _model(6)
    model, path, folder = _checkpoint(tmp_path, reference)
    saved = path.read_bytes()
    m = offload_compile(model, _policy(folder), checkpoint=path)
    group = next(g for g in _runtime(m).groups if g.on_disk)
    x = torch.randn(2, 8)
    held = []
    with torch.no_grad():
        m(x)
        delta = torch.randn(64, 64)
        for target in (m, reference):
            weight = target.get_submodule(group.name).weight
            if how == "add_":
                weight.add_(delta)
            elif how == "state_dict":  # kept (``held``) until the calls below have read the change
                held.append(target.state_dict())
                held[-1][group.name + ".weight"].add_(delta)
            else:
                weight.data = weight.data + delta
        assert torch.equal(m(x), reference(x))
        assert torch.equal(m(x), reference(x))
    assert not any(b.file.read_only for b in group.buckets)  # its own file now
    assert path.read_bytes() == saved


def test_a_checkpoint_in_another_dtype_is_written_to_files_of_its_own(tmp_path):
    reference = _model(7)
    model, path, folder = _checkpoint(tmp_path, reference, torch.bfloat16)
    m = offload_compile(model, _policy(folder), checkpoint=path)
    on_disk = [g for g in _runtime(m).groups if g.on_disk]
    assert len(on_disk) == 4 and not any(b.file.read_only for g in on_disk for b in g.buckets)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(m(x), reference.to(torch.bfloat16).float()(x))


@pytest.mark.slow
@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/self/status")
def test_host_memory_stays_within_the_budget_while_loading_and_running(tmp_path):
    """A 168 MB model loaded from a checkpoint and called twice, in fresh processes, with a 42 MB host budget
    and without: the peak resident size with the disk tier is lower by the bytes on disk (30 of 40 blocks),
    within 10% of the model (what else a process grows by, capture included, is the same in both)."""
    folder = tmp_path / "disk"
    folder.mkdir()
    script, path = stack_script(tmp_path, f"""
        disk = dict(host_budget_gb={10 * BLOCK_BYTES} / 2**30, disk_dir=sys.argv[3]) if sys.argv[1] == "disk" else {{}}
        m = offload_compile(model, OffloadPolicy(strategy="layerwise", **disk), checkpoint=sys.argv[2])
        with torch.no_grad():
            m(torch.randn(1, 1024))
            m(torch.randn(1, 1024))
        print(status("VmHWM:") - before, offload_stats(m).disk_bytes_read)
    """)
    runs = {how: tuple(run(script, how, path, str(folder))) for how in ("memory", "disk")}
    model_bytes = os.path.getsize(path)
    on_disk = 30 * BLOCK_BYTES
    assert runs["disk"][1] == 2 * on_disk and runs["memory"][1] == 0  # read at each of the two calls
    saved = runs["memory"][0] - runs["disk"][0]
    assert abs(saved - on_disk) <= 0.1 * model_bytes, (runs, on_disk)


def test_a_disk_that_fills_up_while_packing_leaves_the_model_running_unchanged(tmp_path, monkeypatch):
    from offload_compiler.runtime import disk
    model = _model(6)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    real, writes = disk.DiskFile.write, []

    def full(self, offset, tensor):
        writes.append(offset)
        if len(writes) == 5:
            raise OSError(28, "No space left on device")
        real(self, offset, tensor)
    monkeypatch.setattr(disk.DiskFile, "write", full)
    with pytest.raises(OSError, match="No space"):
        offload_compile(model, _policy(tmp_path))
    assert state_of(model) is None and os.listdir(tmp_path) == []
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_on_a_device_that_is_not_the_host_groups_read_from_the_checkpoint_stream_too(tmp_path):
    from offload_compiler.testing import simulated_device
    device = simulated_device()
    reference = _model(8)
    model, path, folder = _checkpoint(tmp_path, reference)
    m = offload_compile(model, _policy(folder, device=device), checkpoint=path)
    assert sum(b.file is not None and b.file.read_only for g in _runtime(m).groups for b in g.buckets) == 4
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = reference(x)
        for _ in range(2):
            torch.testing.assert_close(m(x.to(device)).cpu(), expected)
        assert torch.equal(m.state_dict()["blocks.0.weight"], reference.state_dict()["blocks.0.weight"])
    assert offload_stats(m).on_demand_bytes == 0


def test_auto_plans_the_host_budget_and_the_runtime_reads_what_it_predicted(tmp_path):
    """strategy="auto" with a host budget: the planner predicts the groups on disk with the rule the host store
    applies, charges their reads at the disk bandwidth it measured, and the runtime reads exactly those."""
    from offload_compiler import offload_plan
    model, reference = _model(9), _model(9)
    device_budget = (2 * BLOCK + 8 * 64 * 4 + 64 * 4 * 4) / 2**30 * 4  # room for a few blocks, not all
    policy = _policy(tmp_path, blocks_in_memory=2, strategy="auto", device_budget_gb=device_budget)
    m = offload_compile(model, policy)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(m(x), reference(x))
    plan = offload_plan(m)
    runtime = _runtime(m)
    predicted = {plan.table.groups[g].name for g in plan.solution.prediction.disk}
    assert predicted and predicted == {g.name for g in runtime.groups if g.on_disk}
    assert runtime.host.host_bytes <= policy.host_budget_bytes
    rows = {row["group"]: row for row in plan.rows()}
    assert all(rows[name]["residency"] == "disk" for name in predicted) and "read from disk" in str(plan)
    assert plan.table.disk_bandwidth > 0
    without = dataclasses.replace(plan.table, host_budget=None)
    from offload_compiler.planning.planner import predict
    assert predict(plan.table, plan.solution.choice).time_s > predict(without, plan.solution.choice).time_s
    reset_offload_stats(m)
    with torch.no_grad():
        m(x)
    assert offload_stats(m).disk_bytes_read == sum(g.nbytes for g in runtime.groups if g.on_disk)


def test_auto_with_no_host_memory_to_spare_streams_every_group_from_disk(tmp_path):
    """Streaming a group is always possible, so a host budget of nothing is met by reading everything from
    disk: auto, whose device budget would let it keep groups resident, streams them all from disk instead."""
    from offload_compiler import offload_plan
    policy = OffloadPolicy(strategy="auto", device_budget_gb=1.0, host_budget_gb=0, disk_dir=str(tmp_path))
    model, reference = _model(10), _model(10)
    m = offload_compile(model, policy)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(m(x), reference(x))
    runtime = _runtime(m)
    assert runtime.host.host_bytes == 0 and all(g.on_disk for g in runtime.groups if g.nbytes)
    assert not offload_plan(m).resident


class _WideHead(nn.Module):
    """Four blocks and a head larger than a block: the head goes to disk first, then block 0."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        self.head = nn.Linear(64, 256)

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x)) + x
        return self.head(x)


@pytest.mark.parametrize("device", host_and("sim"))
def test_a_group_on_disk_is_read_as_soon_as_the_read_before_it_was_waited_for(tmp_path, device):
    """The head's read is issued at the wait of block 0 (the read before it), not one group before the head:
    the worker reads it while blocks 1 to 3 compute. Its slot is held from there, and the plan says so: the
    ledger's peak equals the verified one, the traffic equals the plan, and the outputs are the plain model's."""
    from offload_compiler.testing import assert_offload_equivalent, simulated_device
    device = simulated_device() if device == "sim" else device
    torch.manual_seed(5)
    model = _WideHead().eval().requires_grad_(False)
    head, block = (64 * 256 + 256) * 4, BLOCK
    policy = OffloadPolicy(strategy="layerwise", prefetch=1, device=device, host_budget_gb=3 * block / 2**30,
                           disk_dir=str(tmp_path))
    m = offload_compile(copy.deepcopy(model), policy)
    runtime = _runtime(m)
    assert {g.name for g in runtime.groups if g.on_disk} == {"head", "blocks.0"}
    report = assert_offload_equivalent(model, policy, torch.randn(2, 64), calls=2)
    assert report.peak_resident_bytes == 2 * block + head  # blocks k and k+1, and the head read ahead
    with torch.no_grad():
        m(torch.randn(2, 64).to(device))
    schedule = runtime.graph_plans[0].schedule
    order = [runtime.groups[i.group].name for i in schedule.instances]
    assert order == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    assert schedule.prefetch_at == (0, 0, 1, 2, 0)  # the head: at the wait of blocks.0, the read before it


def test_groups_of_one_size_beyond_the_budget_are_spread_over_the_call_not_the_first_ones():
    """The largest groups go first (the head); of the blocks, as many as the budget needs, evenly spaced from the
    first: blocks in memory between the reads compute while the disk reads the next one."""
    from offload_compiler.runtime.disk import beyond_budget
    sizes = [10] + [5] * 12 + [0, 10]  # embedding, 12 blocks, a group without bytes, head
    assert sorted(beyond_budget(sizes, range(15), budget=50)) == [0, 1, 7, 14]  # 2 blocks: 0 and 6 of 12
    assert sorted(beyond_budget(sizes, range(15), budget=40)) == [0, 1, 4, 7, 10, 14]  # 4 blocks: 0, 3, 6, 9
    assert sorted(beyond_budget(sizes, range(15), budget=0)) == [i for i in range(15) if sizes[i]]
    assert beyond_budget(sizes, range(15), budget=80) == frozenset()
    assert beyond_budget(sizes, [1, 2], budget=50) is None  # the rest cannot go: no choice fits


@pytest.mark.parametrize("device", host_and("sim"))
def test_reads_from_disk_start_at_the_call_and_each_runs_while_a_group_in_memory_computes(
        tmp_path, device, monkeypatch):
    """Three of six blocks on disk: blocks 0, 2 and 4 (not 0 to 2). The first two reads are issued before the
    call waits for anything, and every later read before the wait of the read two before it, so the disk reads
    while the blocks in memory compute; the ledger, the traffic and the outputs agree with the plan."""
    from offload_compiler.runtime.transfers import TransferEngine
    from offload_compiler.testing import assert_offload_equivalent, simulated_device
    device = simulated_device() if device == "sim" else device
    model = _model(11)
    policy = _policy(tmp_path, blocks_in_memory=3, prefetch=1, device=device)
    report = assert_offload_equivalent(model, policy, torch.randn(2, 8), calls=2)
    m = offload_compile(copy.deepcopy(model), policy)
    runtime = _runtime(m)
    on_disk = [g.name for g in runtime.groups if g.on_disk]
    assert on_disk == ["blocks.0", "blocks.2", "blocks.4"]
    x = torch.randn(2, 8).to(device)
    with torch.no_grad():
        m(x)  # compiled, packed
    events = []
    fill, ready = TransferEngine._fill, TransferEngine._ready

    def logged_fill(self, slot, group):
        events.append(("fill", group.name))
        return fill(self, slot, group)

    def logged_ready(self, slot):
        events.append(("wait", self.groups[slot.group].name))
        return ready(self, slot)

    monkeypatch.setattr(TransferEngine, "_fill", logged_fill)
    monkeypatch.setattr(TransferEngine, "_ready", logged_ready)
    reset_offload_stats(m)
    with torch.no_grad():
        m(x)
    waits = [name for kind, name in events if kind == "wait"]
    first_wait = events.index(("wait", waits[0]))
    assert events.index(("fill", "blocks.0")) < first_wait  # the disk reads from the call's start
    for name in on_disk[1:]:
        before = waits[waits.index(name) - 1]
        assert before not in on_disk  # a block in memory between two reads
        assert events.index(("fill", name)) < events.index(("wait", before))
    # queued behind the read in flight: issued before the call waits for the read before it (prefetch + 1 back)
    assert events.index(("fill", "blocks.2")) < first_wait
    assert events.index(("fill", "blocks.4")) < events.index(("wait", "blocks.2"))
    stats = offload_stats(m)
    assert stats.disk_bytes_read == 3 * BLOCK and stats.bytes_transferred == runtime.total_bytes
    assert stats.peak_resident_bytes == runtime.graph_plans[0].verified.peak_bytes == report.peak_resident_bytes


def test_the_groups_on_disk_are_regions_of_one_file_in_their_order(tmp_path):
    """One file for every bucket on disk, each at a page-aligned region, in the groups' order: reading the groups
    in call order reads the file start to end (a disk reads one file's consecutive ranges faster than as many
    files). Loading from a checkpoint lays them out the same way; the file closes with its last region."""
    import mmap
    model = _model(12)
    folder = tmp_path / "own"
    folder.mkdir()
    m = offload_compile(copy.deepcopy(model), _policy(folder))
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(m(x), model(x))

    def regions(m):
        files = [b.file for g in _runtime(m).groups if g.on_disk for b in g.buckets if b.file is not None]
        assert len(files) == 4 and len({f.path for f in files}) == 1 and len({f.fd for f in files}) == 1
        bases = [f.base for f in files]
        assert bases == sorted(bases) and all(b % mmap.ALLOCATIONGRANULARITY == 0 for b in bases)
        assert all(a.base + a.nbytes <= b.base for a, b in zip(files, files[1:]))  # no overlap
        return files

    files = regions(m)
    descriptor = files[0].fd
    plain = remove_offload(m)
    assert all(f.fd == -1 for f in files)
    with pytest.raises(OSError):
        os.fstat(descriptor)  # closed with the last region
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in plain.state_dict().items())
    loaded, path, folder = _checkpoint(tmp_path, model, torch.bfloat16)  # another dtype: written, not viewed
    m = offload_compile(loaded, _policy(folder), checkpoint=path)
    regions(m)
    assert os.listdir(folder) == []
    with torch.no_grad():
        assert torch.equal(m(x), model.to(torch.bfloat16).float()(x))


@pytest.mark.skipif(platform.system() != "Linux", reason="/proc/self/maps and MADV_PAGEOUT are Linux's")
def test_packing_reads_the_file_mappings_once_and_still_advises_a_mapped_weight(tmp_path, monkeypatch):
    """Packing releases the pages of weights that view a mapped file (a checkpoint loaded with mmap): the file
    mappings are read once for the whole model, not once per group, and a weight in a mapped file is still
    advised, whichever mapping it falls in among the process's many."""
    from offload_compiler.runtime import disk
    reads, advised = [], []
    real_read, real_release = disk._file_mappings, disk.release_mapped_pages
    monkeypatch.setattr(disk, "_file_mappings", lambda: reads.append(1) or real_read())
    monkeypatch.setattr(disk, "release_mapped_pages",
                        lambda tensors: advised.append(real_release(tensors)) or advised[-1])
    import offload_compiler.runtime.host as host
    monkeypatch.setattr(host, "release_mapped_pages", disk.release_mapped_pages)
    model = _model(3)
    path = tmp_path / "weights.bin"
    torch.save(model.state_dict(), path)
    model.load_state_dict(torch.load(path, mmap=True), assign=True)  # the blocks' weights view the file's mapping
    m = offload_compile(model, OffloadPolicy(strategy="layerwise"))
    assert len(reads) == 1 and len(advised) == len(_runtime(m).groups) == 8
    assert sum(advised) > 0  # the weights' whole pages in the file (MADV_PAGEOUT: Linux 5.4+)
    with torch.no_grad():
        x = torch.randn(2, 8)
        assert torch.equal(m(x), _model(3)(x))


def test_a_tensor_is_advised_over_exactly_the_file_mappings_it_overlaps():
    """The mappings are searched by address: a tensor is advised over the whole pages it shares with each
    mapping it overlaps (one starting before it, two inside it), none of the others."""
    from offload_compiler.runtime import disk
    page = os.sysconf("SC_PAGE_SIZE")
    calls = []

    class Libc:
        def madvise(self, start, size, advice):
            calls.append((start.value, size.value))
            return 0
    tensor = torch.empty(6 * page, dtype=torch.uint8)  # covers [base, base + 5 pages) at least
    base = (tensor.data_ptr() + page - 1) // page * page
    mappings = [(base - 12 * page, base - 9 * page), (base - 8 * page, base + page), (base + page, base + 2 * page),
                (base + 3 * page, base + 4 * page), (base + 10 * page, base + 100 * page)]
    with mock.patch.object(disk, "_file_mappings", lambda: mappings), mock.patch.object(disk, "_libc", lambda: Libc()):
        advised = disk.release_mapped_pages([tensor])
    assert calls == [(base, page), (base + page, page), (base + 3 * page, page)] and advised == 3 * page


@pytest.mark.parametrize("prefetch", [1, 2])
def test_the_estimate_before_the_first_call_is_the_pool_the_read_ahead_holds(tmp_path, prefetch):
    """Groups on disk are read prefetch + 1 reads ahead (`passes.schedule._prefetch_points`): the estimate before
    the first call holds their slots too, and warns as the held pool is over half the model."""
    from offload_compiler import OffloadSavingWarning, plan_summary

    with pytest.warns(OffloadSavingWarning, match="layerwise keeps up to"):
        m = offload_compile(_model(), _policy(tmp_path, prefetch=prefetch, compiler="eager"))
    before = plan_summary(m)["saving"]
    with torch.no_grad():
        m(torch.randn(3, 8))
    after = plan_summary(m)["saving"]
    assert not before["verified"] and after["verified"]
    assert before["device_weight_peak_bytes"] == after["device_weight_peak_bytes"] > (prefetch + 1) * BLOCK
    assert "more for the groups on disk" in describe_plan(_model_estimated(tmp_path, prefetch))


def _model_estimated(tmp_path, prefetch):
    """An offloaded model not yet called (describe_plan shows the estimate)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return offload_compile(_model(), _policy(tmp_path, prefetch=prefetch, compiler="eager"))


def test_the_plan_apis_flag_the_groups_on_disk_as_describe_plan_does_and_the_bytes_read_per_call(tmp_path):
    from offload_compiler import offload_groups, plan_summary

    m = offload_compile(_model(), _policy(tmp_path, compiler="eager"))
    x = torch.randn(3, 8)
    with torch.no_grad():
        m(x)
    reset_offload_stats(m)
    with torch.no_grad():
        m(x)
    rows = [line.split() for line in describe_plan(m).splitlines() if line.lstrip().startswith("group ")]
    described = {row[2] for row in rows if "from disk" in " ".join(row)}
    assert len(described) == 4
    assert {g.name for g in offload_groups(m) if g.on_disk} == described
    summary = plan_summary(m)
    assert {g["name"] for g in summary["groups"] if g["on_disk"]} == described
    assert all(isinstance(g["on_disk"], bool) for g in summary["groups"])
    assert summary["disk_bytes"] == 4 * BLOCK
    (graph,) = summary["graphs"]
    assert graph["disk_bytes_per_call"] == offload_stats(m).disk_bytes_read == 4 * BLOCK
    assert graph["routed_disk_bytes_at_most_per_call"] == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_after_a_call_reads_its_groups_from_disk(tmp_path):
    """The disk reads run on a worker thread, which a forked child does not have: the child makes its own."""
    import signal
    model, reference = _model(9), _model(9)
    m = offload_compile(model, _policy(tmp_path, prefetch_next_call=True))
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = reference(x)
        assert torch.equal(m(x), expected)  # the worker thread exists, and reads for the next call are in flight
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 for an exact output, 1 otherwise, SIGALRM where it hangs
        code = 1
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)  # killed, not a handler that a blocked thread never runs
            signal.alarm(30)
            with torch.no_grad():
                reset_offload_stats(m)
                exact = torch.equal(m(x), expected) and torch.equal(m(x), expected)
            # and it streamed from disk: each call read the plan's bytes from the file
            planned = plan_summary(m)["graphs"][0]["disk_bytes_per_call"]
            code = 0 if exact and planned > 0 and offload_stats(m).disk_bytes_read == 2 * planned else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    with torch.no_grad():
        assert torch.equal(m(x), expected)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_the_disk_tier_holds_a_few_descriptors_however_many_groups_it_has(tmp_path):
    """Each region's tensor views one mapping of the tier's file: a mapping per region would hold a descriptor
    per group on disk, and a model of a thousand blocks would run out of them (1024 by default)."""
    model = Stack(d=16, n=96).eval().requires_grad_(False)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 8)
    with torch.no_grad():
        reference(x)
    before = len(os.listdir("/proc/self/fd"))
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", host_budget_gb=0, disk_dir=str(tmp_path)))
    assert sum(g.on_disk for g in _runtime(m).groups) >= 96
    with torch.no_grad():
        assert torch.equal(m(x), reference(x))
    # every block read from its region of the file at each call
    assert offload_stats(m).disk_bytes_read == plan_summary(m)["graphs"][0]["disk_bytes_per_call"] >= 96 * 16 * 17 * 4
    assert len(os.listdir("/proc/self/fd")) - before <= 4
    files = [b.file for g in _runtime(m).groups for b in g.buckets if b.file is not None]
    plain = remove_offload(m)
    assert all(f.fd == -1 for f in files)
    del m, plain, files
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before  # the mapping's too, with the last tensor viewing it


def test_a_checkpoint_replaced_at_its_path_before_the_first_call_is_not_what_the_calls_read(tmp_path):
    """The groups left in the checkpoint are read through the descriptor opened when it was mapped: the weights
    (its mapping, what ``state_dict`` shows) and the calls stay the file that was loaded."""
    from safetensors.torch import save_file
    reference = _model(13)
    model, path, folder = _checkpoint(tmp_path, reference)
    m = offload_compile(model, _policy(folder), checkpoint=path)
    assert sum(b.file is not None and b.file.read_only for g in _runtime(m).groups for b in g.buckets) == 4
    other = tmp_path / "other.safetensors"
    save_file(_model(14).state_dict(), str(other))
    os.replace(other, path)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(m(x), reference(x))
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in m.state_dict().items())
    files = {id(f): f for g in _runtime(m).groups for b in g.buckets if b.file is not None and b.file.read_only
             for f in b.file._files.values()}
    remove_offload(m)
    assert all(f.fd == -1 for f in files.values())  # closed with the last group that read from it


@pytest.mark.parametrize("fault", ["create", "write"])
def test_a_disk_dir_that_cannot_hold_the_file_is_named_with_the_reason_and_the_fix(tmp_path, monkeypatch, fault):
    """A directory that exists but where the file cannot be made (a read-only or pseudo file system, which the
    policy's access check lets through as root) or written: the error names disk_dir, the OS reason and what
    to do, keeps its type and errno, and the model runs on unchanged."""
    from offload_compiler.runtime import disk
    model = _model(15)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    if fault == "create":
        def refused(*args, **kwargs):
            raise PermissionError(13, "Permission denied", str(tmp_path / "offload-x.bin"))
        monkeypatch.setattr(disk.tempfile, "mkstemp", refused)
        kind, errno, reason = PermissionError, 13, "Permission denied"
    else:
        monkeypatch.setattr(disk.os, "pwrite", mock.Mock(side_effect=OSError(28, "No space left on device")))
        kind, errno, reason = OSError, 28, "No space left on device"
    with pytest.raises(kind) as caught:
        offload_compile(model, _policy(tmp_path))
    message = str(caught.value)
    assert caught.value.errno == errno and f"disk_dir={str(tmp_path)!r}" in message and reason in message
    assert "writable directory on a fast local disk" in message
    monkeypatch.undo()
    assert state_of(model) is None and os.listdir(tmp_path) == []
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model(x), expected)


@pytest.mark.parametrize("device", host_and("simulated"))
def test_an_os_error_reading_a_group_from_disk_names_the_group_and_the_bytes(tmp_path, monkeypatch, device):
    """EIO during a fill: the OSError keeps its type and errno, with notes naming the group and the region of
    the file it was reading; the next call reads again and is exact."""
    from offload_compiler.testing import simulated_device
    dev = torch.device("cpu") if device == "cpu" else simulated_device()
    model, reference = _model(16), _model(16)
    m = offload_compile(model, _policy(tmp_path, device=dev))
    names = [g.name for g in _runtime(m).groups if g.on_disk]
    x = torch.randn(2, 8)
    real = os.preadv
    monkeypatch.setattr(os, "preadv", mock.Mock(side_effect=OSError(5, "Input/output error")))
    with pytest.raises(OSError) as caught, torch.no_grad():
        m(x.to(dev))
    monkeypatch.setattr(os, "preadv", real)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert caught.value.errno == 5 and type(caught.value) is OSError
    assert any(f"group {name!r}" in notes for name in names), notes
    assert "reading bytes " in notes and "offload-" in notes, notes
    with torch.no_grad():
        torch.testing.assert_close(m(x.to(dev)).cpu(), reference(x), rtol=0, atol=0)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_groups_moved_off_the_checkpoint_take_regions_of_the_tiers_one_file(tmp_path):
    """A group read from the checkpoint's own extents moves, at its first change, to its region of the tier's
    file, not to a file of its own: changing every weight of a many-block model holds no descriptor per group."""
    from safetensors.torch import save_file
    reference = Stack(d=16, n=64).eval().requires_grad_(False)
    path = tmp_path / "model.safetensors"
    save_file(reference.state_dict(), str(path))
    folder = tmp_path / "disk"
    folder.mkdir()
    with empty_weights():
        model = Stack(d=16, n=64).eval()
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", host_budget_gb=0, disk_dir=str(folder)),
                        checkpoint=path)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(m(x), reference(x))
        before = len(os.listdir("/proc/self/fd"))
        for target in (m, reference):
            for block in target.blocks:
                block.weight.add_(1e-3)
        assert torch.equal(m(x), reference(x))
    assert len(os.listdir("/proc/self/fd")) - before <= 4
    moved = [b.file for g in _runtime(m).groups if g.on_disk and g.name.startswith("blocks.") for b in g.buckets]
    assert len(moved) == 64 and not any(f.read_only for f in moved) and len({f.path for f in moved}) == 1
    assert os.listdir(folder) == []
