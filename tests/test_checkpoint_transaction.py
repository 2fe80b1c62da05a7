"""Loading from a checkpoint is part of offloading's one transaction: whatever fails after the checkpoint's
tensors were read (a disk-tier write, packing a later group, a refusal made late), the model holds the very
tensors it held before the call -- on meta, or its own weights with their values --, no descriptor or file is
left, and offloading it again works. And ``auto``, which groups at its first call, holds the host budget while
loading and packing, not the model."""

import gc
import json
import os
import platform

import pytest
from devices import host_and
import torch
from safetensors.torch import save_file
from torch import nn

from offload_compiler import OffloadPolicy, OffloadedModule, empty_weights, offload_compile, offload_stats, remove_offload
from offload_compiler.offloaded import state_of
from fresh_process import BLOCK_BYTES, run, stack_script


class Stack(nn.Module):
    def __init__(self, d=32, n=6):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.out = nn.Linear(d, 4)
        self.register_buffer("scale", torch.full((d,), 0.5), persistent=False)

    def forward(self, x):
        h = self.inp(x) * self.scale
        for block in self.blocks:
            h = torch.relu(block(h)) + h
        return self.out(h)


BLOCK = (32 * 32 + 32) * 4


def _reference(seed):
    torch.manual_seed(seed)
    return Stack().eval().requires_grad_(False)


def _save(folder, model, sharded, dtype=None):
    state = {k: v.to(dtype or v.dtype).contiguous() for k, v in model.state_dict().items()}
    if not sharded:
        save_file(state, str(folder / "model.safetensors"))
        return folder / "model.safetensors"
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(folder / shard))
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def _descriptors():
    gc.collect()  # the loaded tensors and the files they map go with the error's frames
    return sorted(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else []


def _fail_at_call(monkeypatch, owner, name, at, error=None):
    """``owner.name`` raises at its ``at``-th call (the earlier ones did their work)."""
    real, calls = getattr(owner, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise error or OSError(28, "injected: no space left on device")
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, failing)
    return calls


def _inject(monkeypatch, point):
    from offload_compiler import api, checkpoint
    from offload_compiler.offloaded import install
    from offload_compiler.runtime import disk, host
    if point == "reading":  # while the loader reads (nothing replaced yet)
        return _fail_at_call(monkeypatch, checkpoint._Reader, "_read", 3)
    if point == "disk write":  # the loader writing a group to the disk tier's file
        return _fail_at_call(monkeypatch, disk.DiskFile, "write", 2)
    if point == "packing":  # the runtime packing its second group in memory, after the first took its buffer
        return _fail_at_call(monkeypatch, host, "pack_group", 2)
    if point == "attaching":  # after the runtime was built
        return _fail_at_call(monkeypatch, install, "install_forwards", 1, RuntimeError("injected: attaching"))
    assert point == "late refusal"  # the policy refused once the model is offloaded (as -W error makes a warning)
    return _fail_at_call(monkeypatch, api, "_check_saving", 1, ValueError("injected: a policy refused late"))


POINTS = ["reading", "disk write", "packing", "attaching", "late refusal"]


@pytest.mark.parametrize("device", host_and("sim"))
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("weights", ["meta", "own"])
def test_a_failure_after_loading_leaves_the_model_as_it_was_and_a_retry_loads_it(tmp_path, monkeypatch, device,
                                                                                   point, weights):
    """On meta (``empty_weights``) or holding weights of its own that the checkpoint's would replace: after the
    failure every parameter and buffer is the very object it was, on its device, with its values; nothing is
    left open or in ``disk_dir``; offloading again loads the checkpoint and runs as the model that saved it."""
    from offload_compiler.testing import simulated_device
    dev = simulated_device() if device == "sim" else "cpu"
    sharded = point in ("packing", "late refusal")  # a sharded directory with its index, and one file
    reference = _reference(1)
    # float64 (cast exactly into float32): the groups on disk are written to the tier's file, not left in the
    # checkpoint's own extents
    path = _save(tmp_path, reference, sharded, torch.float64 if point == "disk write" else None)
    folder = tmp_path / "disk"
    folder.mkdir()
    if weights == "meta":
        with empty_weights():
            model = Stack().eval()
    else:
        model = _reference(2)
    cls = type(model)
    held = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    values = {k: v.clone() for k, v in held.items() if not v.is_meta}
    small = (8 * 32 + 32 + 32 * 4 + 4) * 4
    policy = OffloadPolicy(strategy="layerwise", device=dev, compiler="eager",
                           host_budget_gb=(2 * BLOCK + small) / 2**30, disk_dir=str(folder))
    open_before = _descriptors()
    calls = _inject(monkeypatch, point)
    # the undo gives the model back what it held: no weight is copied into memory of its own on the way (the
    # groups on disk of a model larger than host memory would not fit), whatever had been packed
    from offload_compiler.runtime import host
    copied = _fail_at_call(monkeypatch, host, "_own_copy", 0)
    with pytest.raises((OSError, RuntimeError, ValueError), match="injected"):
        offload_compile(model, policy, checkpoint=path)
    assert calls, "the failure was not reached"
    assert not copied, f"{len(copied)} weights copied back into memory before being given back"
    monkeypatch.undo()
    assert state_of(model) is None and type(model) is cls and not isinstance(model, OffloadedModule)
    now = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert list(now) == list(held)
    for name, tensor in now.items():
        assert tensor is held[name], f"{name} is another object"
        assert tensor.device == held[name].device and tensor.is_meta == (weights == "meta" and name != "scale"), name
    for name, value in values.items():
        assert torch.equal(now[name], value), f"{name} changed"
    assert _descriptors() == open_before and os.listdir(folder) == []
    x = torch.randn(2, 8)
    if weights == "own":
        with torch.no_grad():
            assert torch.equal(model(x), _reference(2)(x))  # still runs, as itself
    offload_compile(model, policy, checkpoint=path)  # the retry loads it
    with torch.no_grad():
        torch.testing.assert_close(model(x.to(dev)).cpu(), reference(x))
    runtime = state_of(model).runtime
    assert offload_stats(model).disk_bytes_read == sum(g.nbytes for g in runtime.groups if g.on_disk) > 0
    remove_offload(model)
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name].cpu(), value), name


def test_a_failure_under_auto_after_loading_leaves_the_model_on_meta(tmp_path, monkeypatch):
    """``auto`` reads the checkpoint at offload_compile and groups at the first call: a failure between the two
    (attaching) gives the meta tensors back too, and the mappings of the file with them."""
    reference = _reference(3)
    path = _save(tmp_path, reference, sharded=True)
    with empty_weights():
        model = Stack().eval()
    held = dict(model.named_parameters())
    open_before = _descriptors()
    calls = _inject(monkeypatch, "attaching")
    with pytest.raises(RuntimeError, match="injected"):
        offload_compile(model, OffloadPolicy(strategy="auto", device_budget_gb=1.0), checkpoint=path)
    assert calls
    monkeypatch.undo()
    assert all(p is held[n] and p.is_meta for n, p in model.named_parameters())
    assert _descriptors() == open_before
    offload_compile(model, OffloadPolicy(strategy="auto", device_budget_gb=1.0), checkpoint=path)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_auto_reads_nothing_at_loading_and_packs_from_the_checkpoints_mapping(tmp_path, monkeypatch):
    """Under ``auto`` the weights the checkpoint holds as the model does are views of a private mapping of the
    file until its first call packs them: nothing is read into tensors of their own, no descriptor is held,
    and a weight written before packing is written in this process only, never in the file."""
    from offload_compiler import checkpoint
    reads = []
    real = checkpoint._Reader._read
    monkeypatch.setattr(checkpoint._Reader, "_read", lambda self, address, entry: (reads.append(entry.name),
                                                                                   real(self, address, entry)))
    reference = _reference(4)
    path = _save(tmp_path, reference, sharded=False)
    saved = path.read_bytes()
    with empty_weights():
        model = Stack().eval()
    open_before = _descriptors()
    m = offload_compile(model, OffloadPolicy(strategy="auto", device_budget_gb=1.0, compiler="eager"), checkpoint=path)
    assert reads == [] and _descriptors() == open_before
    with torch.no_grad():
        m.blocks[0].weight.add_(1.0)
        expected = reference.blocks[0].weight + 1.0
        assert torch.equal(m.blocks[0].weight, expected)
    assert path.read_bytes() == saved
    x = torch.randn(2, 8)
    with torch.no_grad():
        reference.blocks[0].weight.add_(1.0)
        assert torch.equal(m(x), reference(x))
    assert offload_stats(m).bytes_transferred > 0
    plain = remove_offload(m)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), reference.state_dict().values()))


@pytest.mark.slow  # a fresh process over a 168 MB checkpoint
@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/self/status")
def test_auto_with_the_disk_tier_holds_the_host_budget_not_the_model_while_loading_and_planning(tmp_path):
    """A 168 MB stack loaded from its checkpoint on meta under ``auto`` with a 42 MB host budget, in a fresh
    process whose dynamo, planner probes and imports were paid for by a small model first: the peak resident
    size through offload_compile and the first call (which plans, packs and runs) grows by at most the host
    budget, the largest tensor (4 MB) and a margin of 24 MiB for the captured graph, the plan and the device
    slots (on the CPU, host memory). Measured: 41.5 MiB; before, 238 MiB (the model read into tensors of their
    own, then its freed heap kept by the allocator, and the disk bandwidth probe's two 64 MiB buffers)."""
    for name in ("disk", "warm"):
        (tmp_path / name).mkdir()
    script, path = stack_script(tmp_path, f"""
        class Small(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
            def forward(self, x):
                for b in self.blocks:
                    x = b(x)
                return x
        warm = offload_compile(Small(), OffloadPolicy(strategy="auto", device_budget_gb=1e-4, host_budget_gb=1e-5,
                                                      disk_dir=sys.argv[4], compiler="eager"))
        with torch.no_grad():
            warm(torch.randn(1, 64))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = status("VmRSS:")
        m = offload_compile(model, OffloadPolicy(strategy="auto", device_budget_gb={8 * BLOCK_BYTES} / 2**30,
                                                 host_budget_gb={10 * BLOCK_BYTES} / 2**30, disk_dir=sys.argv[3],
                                                 compiler="eager"), checkpoint=sys.argv[2])
        loaded = status("VmHWM:")
        with torch.no_grad():
            m(torch.randn(1, 1024))
        print(before, loaded, status("VmHWM:"), offload_stats(m).disk_bytes_read)
    """)
    before, loaded, peak, read = run(script, "auto", path, str(tmp_path / "disk"), str(tmp_path / "warm"))
    bound = 10 * BLOCK_BYTES + 1024 * 1024 * 4 + 24 * 2**20
    assert read > 0  # groups on disk, read at the call
    assert loaded - before <= bound and peak - before <= bound, ((loaded - before) / 2**20, (peak - before) / 2**20)
