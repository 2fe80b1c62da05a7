"""Host masters, on a device that is not the host (the simulated accelerator) and on ``cpu`` alike: an offloaded
weight's device is the compute device and its bytes stay in host memory, so no route can compute with host
weights unseen, and what a route reads outside an offloaded graph is fetched on demand (on ``cpu``: read in
place) and counted."""

import copy
import io

import pytest
from devices import host_and
import torch
from torch import nn

from offload_compiler import (OffloadPolicy, OffloadRefusal, offload_compile, offload_groups, offload_stats,
                              remove_offload, reset_offload_stats)
from offload_compiler.host_masters import HostMaster
from offload_compiler.testing import BlockSpec, ModelSpec, assert_traffic_matches_plan, build_block_model, \
    simulated_device

DEVICE = simulated_device()
DEVICES = host_and(DEVICE)


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
SPEC = ModelSpec(8, (BlockSpec("mlp", 8), BlockSpec("mlp", 8), BlockSpec("mlp", 8)), False, False, 3, 1)


def _policy(device=DEVICE, **fields):
    fields.setdefault("strategy", "layerwise")
    return OffloadPolicy(device=device, compiler="eager", debug_poison=True, **fields)


def _offloaded(device=DEVICE, **fields):
    model, x = build_block_model(SPEC, seed=3)
    model.eval().requires_grad_(False)
    return model, offload_compile(copy.deepcopy(model), _policy(device, **fields)), x


def _run(m, x):
    with torch.no_grad():
        return m(x.to(m.device)).cpu()


def _plain(model, x):
    with torch.no_grad():
        return model(x)


def test_offloaded_weights_are_masters_on_every_device(device):
    model, m, x = _offloaded(device)
    streamed = [p for p in m.parameters() if isinstance(p, HostMaster)]
    assert streamed and all(p.device == torch.device(device) and p.host.device.type == "cpu" for p in streamed)
    for p, q in zip(m.parameters(), model.parameters()):  # their bytes are the model's
        assert torch.equal(p.host, q)


def test_tied_weights_stay_tied(device):
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16, bias=False)).eval()
    model[2].weight = model[0].weight
    m = offload_compile(copy.deepcopy(model), _policy(device, strategy="sequential"))
    assert m[2].weight is m[0].weight and isinstance(m[0].weight, HostMaster)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(m(ids.to(device)).cpu(), model(ids))


def test_state_dict_is_plain_host_tensors_that_torch_save_and_safetensors_take(device):
    safetensors = pytest.importorskip("safetensors.torch")
    model, m, x = _offloaded(device)
    state = m.state_dict()
    assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in state.values())
    assert state.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value)
    assert all(type(t) is torch.Tensor for t in m.blocks[0].state_dict().values())  # a part's own state_dict
    blob = safetensors.save(state)
    assert torch.equal(safetensors.load(blob)["blocks.0.up.weight"], model.blocks[0].up.weight)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    assert buffer.tell() > 0


def test_torch_save_and_deepcopy_of_weights_hold_the_weights_bytes_not_their_groups(device):
    """A weight's host bytes are a slice of its group's packed buffer: ``torch.save`` of the state_dict writes the
    model's bytes once (the plain model's file size), and a copy of one weight holds that weight, not its group."""
    model, m, x = _offloaded(device)
    files = []
    for state in (model.state_dict(), m.state_dict()):
        buffer = io.BytesIO()
        torch.save(state, buffer)
        files.append(buffer.getvalue())
    assert len(files[1]) == len(files[0])
    loaded = torch.load(io.BytesIO(files[1]))
    assert sum(t.untyped_storage().nbytes() for t in loaded.values()) == sum(
        t.numel() * t.element_size() for t in model.state_dict().values())
    for key, value in model.state_dict().items():
        assert torch.equal(loaded[key], value)
    copied = copy.deepcopy(m.state_dict()["blocks.1.up.weight"])
    assert copied.untyped_storage().nbytes() == model.blocks[1].up.weight.numel() * 4
    torch.testing.assert_close(_run(m, x), _plain(model, x))  # the handed-out tensors changed nothing


@pytest.mark.parametrize("carry", [False, True])
@pytest.mark.parametrize("change", ["load_state_dict", "data", "add_", "copy_"])
def test_a_weight_changed_between_calls_is_what_the_next_call_reads(change, carry, device):
    model, m, x = _offloaded(device, prefetch=1, prefetch_next_call=carry)
    _run(m, x), _run(m, x)  # with carry, the second call prefetches for the third: that copy is now stale
    new = torch.full_like(model.blocks[1].up.weight, 0.05)
    with torch.no_grad():
        if change == "load_state_dict":
            m.load_state_dict({**model.state_dict(), "blocks.1.up.weight": new})
        elif change == "data":
            m.blocks[1].up.weight.data = new.clone()
        elif change == "add_":
            m.blocks[1].up.weight.add_(new.to(device) - model.blocks[1].up.weight.to(device))
        else:
            m.blocks[1].up.weight.copy_(new)
        model.blocks[1].up.weight.copy_(new)
    reset_offload_stats(m)
    torch.testing.assert_close(_run(m, x), _plain(model, x))
    assert isinstance(m.blocks[1].up.weight, HostMaster)
    assert offload_stats(m).on_demand_bytes == 0
    if not carry:
        assert_traffic_matches_plan(m)


def _snapshot(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def _still_streams_unchanged(m, model, x, snapshot, traffic=None):
    """After a refused (or no-op) change: the same weights, bit for bit, still masters, the plain model's output,
    and the plan's traffic per call (``traffic``: the bytes a call moved before)."""
    assert all(torch.equal(v, snapshot[k]) for k, v in m.state_dict().items())
    assert all(isinstance(p, HostMaster) for p in m.parameters())
    reset_offload_stats(m)
    torch.testing.assert_close(_run(m, x), _plain(model, x))
    stats = assert_traffic_matches_plan(m)
    assert stats.on_demand_bytes == 0 and traffic in (None, stats.bytes_transferred)


@pytest.mark.parametrize("new", ["shape", "dtype", "transposed master"])
def test_a_data_rebind_to_another_shape_or_dtype_is_refused_before_anything_changes(new, device):
    """Before the fix ``p.data = t`` with another shape was taken: the weight still reported its old shape and
    every later call failed inside the runtime's repack."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 12), nn.Linear(12, 8)).eval().requires_grad_(False)
    x = torch.randn(2, 8)
    m = offload_compile(copy.deepcopy(model), _policy(device, strategy="sequential"))
    _run(m, x)
    snapshot = _snapshot(m)
    weight = m[1].weight
    value = {"shape": lambda: torch.randn(13, 8), "dtype": lambda: torch.randn(12, 8, dtype=torch.float64),
             "transposed master": lambda: weight.data.T}[new]()
    with pytest.raises(OffloadRefusal, match=r"shape \(12, 8\).*Nothing was changed.*m = remove_offload\(m\).*"
                                             r"m = offload_compile\(m, policy\)"):
        weight.data = value
    assert m[1].weight is weight and weight.shape == (12, 8) and weight.dtype == torch.float32
    _still_streams_unchanged(m, model, x, snapshot)
    weight.data = torch.full((12, 8), 0.5)  # the same shape and dtype: taken, as before
    model[1].weight.fill_(0.5)
    torch.testing.assert_close(_run(m, x), _plain(model, x))


def test_a_data_rebind_to_another_weights_master_takes_its_values(device):
    """``a.data = b.data.T`` between offloaded weights: before the fix torch rebound the wrapper alone and the
    weight kept its old bytes, silently."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)).eval().requires_grad_(False)
    x = torch.randn(2, 8)
    m = offload_compile(copy.deepcopy(model), _policy(device, strategy="sequential"))
    _run(m, x)
    m[1].weight.data = m[2].weight.data.T
    model[1].weight.data = model[2].weight.data.T
    torch.testing.assert_close(_run(m, x), _plain(model, x))
    assert torch.equal(m.state_dict()["1.weight"], model[2].weight.T) and isinstance(m[1].weight, HostMaster)


def test_resize_token_embeddings_is_refused_before_it_changes_anything(device):
    """transformers' ``resize_token_embeddings`` builds a resized embedding and rebinds the old weight's
    ``.data`` to it: refused there, before it replaces any module or the config's vocabulary size (before the
    fix a dynamo assertion about ``HostMaster.__tensor_unflatten__``, and on an accelerator a resized lm_head
    made on the device)."""
    from offload_compiler.testing.models import llama
    model, inputs = llama(layers=2)
    model.requires_grad_(False)
    m = offload_compile(copy.deepcopy(model), _policy(device))
    ids = inputs["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(m(ids.to(m.device)).logits.cpu(), model(ids).logits)
    traffic = offload_stats(m).bytes_transferred
    snapshot, modules = _snapshot(m), dict(m.named_modules())
    with pytest.raises(OffloadRefusal, match=r"resize_token_embeddings.*m = remove_offload\(m\)"):
        m.resize_token_embeddings(200)
    assert dict(m.named_modules()) == modules and m.config.vocab_size == 128
    assert m.get_input_embeddings().num_embeddings == 128 and m.lm_head.weight.shape == (128, 64)
    assert all(torch.equal(v, snapshot[k]) for k, v in m.state_dict().items())
    reset_offload_stats(m)
    with torch.no_grad():
        torch.testing.assert_close(m(ids.to(m.device)).logits.cpu(), model(ids).logits)
    assert assert_traffic_matches_plan(m).bytes_transferred == traffic
    plain = remove_offload(m).resize_token_embeddings(200)  # the fix the refusal names
    assert plain.weight.shape == (200, 64)


def test_conversions_that_change_no_weight_are_no_ops_and_real_ones_are_refused(device):
    """``.float()`` of a float32 model changes nothing in PyTorch; before the fix it was refused as a dtype
    change (and ``share_memory()`` with the dtype wording)."""
    model, m, x = _offloaded(device)
    _run(m, x)
    traffic, snapshot = offload_stats(m).bytes_transferred, _snapshot(m)
    for same in (m.float, lambda: m.to(torch.float32), lambda: m.to(m.device, torch.float32),
                 lambda: m.type(torch.float32)):
        assert same() is m
    _still_streams_unchanged(m, model, x, snapshot, traffic)
    for change in (m.half, m.double, m.bfloat16, lambda: m.to(torch.float16), lambda: m.type(torch.float64)):
        with pytest.raises(OffloadRefusal, match=r"nothing was changed.*remove_offload\(m\)\.to\(dtype\)"):
            change()
    with pytest.raises(TypeError, match="only accepts floating point or complex dtypes"):  # as for a plain module
        m.to(torch.int64)
    with pytest.raises(OffloadRefusal, match=r"other processes.*remove_offload\(m\)\.share_memory\(\)"):
        m.share_memory()
    _still_streams_unchanged(m, model, x, snapshot, traffic)


class _Convs(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Conv2d(3, 3, 3, padding=1) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x).relu()
        return x


def test_a_memory_format_change_is_refused_and_one_that_changes_nothing_is_a_no_op(device):
    """``m.to(memory_format=torch.channels_last)`` converts a plain model's 4-d weights; on an offloaded model (and
    on one of its parts) it was silently ignored, the weights kept their layout. A real change is refused as a
    dtype change is; one that changes nothing (weights already in that layout, ``preserve_format``) is a no-op."""
    model = _Convs().eval().requires_grad_(False)
    x = torch.randn(1, 3, 6, 6)
    m = offload_compile(copy.deepcopy(model), _policy(device, blocks_attr="blocks"))
    _run(m, x)
    traffic, snapshot = offload_stats(m).bytes_transferred, _snapshot(m)
    for target in (m, m.blocks[1]):
        with pytest.raises(OffloadRefusal, match=r"layout.*nothing was changed"):
            target.to(memory_format=torch.channels_last)
        assert target.to(memory_format=torch.contiguous_format) is target
        assert target.to(memory_format=torch.preserve_format) is target
    _still_streams_unchanged(m, model, x, snapshot, traffic)


_FOREACH = {  # each: (the weights, other tensors of their shapes) -> the write; timm's EMA is _foreach_lerp_
    "mul_": lambda ws, qs: torch._foreach_mul_(ws, 2.0),
    "add_": lambda ws, qs: torch._foreach_add_(ws, qs),
    "lerp_": lambda ws, qs: torch._foreach_lerp_(ws, qs, 0.5),
    "copy_": lambda ws, qs: torch._foreach_copy_(ws, qs),
    "zero_": lambda ws, qs: torch._foreach_zero_(ws),
    "out=": lambda ws, qs: [torch.mul(q, 3.0, out=w) for w, q in zip(ws, qs)],
}


@pytest.mark.parametrize("policy", [dict(strategy="none"), dict(prefetch=1, prefetch_next_call=True)],
                         ids=["resident", "carried"])
@pytest.mark.parametrize("op", sorted(_FOREACH))
def test_an_op_that_writes_a_list_of_weights_or_out_writes_their_host_bytes(op, policy, device):
    """An op whose schema writes an argument holding masters writes their host bytes, whichever argument comes
    first: a foreach op's first argument is a list (an on-demand device copy took the write, never the host,
    and a resident or carried copy stayed stale), ``out=`` its last. The next call fetches the changed group
    again, and only it."""
    model, m, x = _offloaded(device, **policy)
    _run(m, x), _run(m, x)
    others = [torch.rand_like(p) for p in model.blocks[1].parameters()]
    with torch.no_grad():
        _FOREACH[op](list(model.blocks[1].parameters()), [q.clone() for q in others])
        _FOREACH[op](list(m.blocks[1].parameters()), [q.to(device) for q in others])
    assert all(isinstance(p, HostMaster) for p in m.blocks[1].parameters())
    assert torch.equal(m.state_dict()["blocks.1.up.weight"], model.blocks[1].up.weight)
    _fetches_the_changed_block_again(model, m, x, policy)


def _fetches_the_changed_block_again(model, m, x, policy: dict) -> None:
    """The next call equals the plain model's, reads nothing on demand, and (resident) fetches the stale copy
    of ``blocks.1`` again, and only it."""
    reset_offload_stats(m)
    torch.testing.assert_close(_run(m, x), _plain(model, x))
    stats = offload_stats(m)
    assert stats.on_demand_bytes == 0
    if policy.get("strategy") == "none":
        changed = next(g for g in offload_groups(m) if g.name == "blocks.1")
        assert (stats.fetch_count, stats.bytes_transferred) == (1, changed.nbytes)


_ALIASES = {  # a plain tensor (or array) over a weight's host bytes the library handed out, and a write through it
    "state_dict": (lambda m: m.state_dict()["blocks.1.up.weight"], lambda a: a.mul_(2)),
    "part's state_dict": (lambda m: m.blocks[1].state_dict()["up.weight"], lambda a: a.mul_(2)),
    "numpy": (lambda m: m.blocks[1].up.weight.detach().numpy(), lambda a: a.__imul__(2)),
}


@pytest.mark.parametrize("policy", [dict(strategy="none"), dict(prefetch=1, prefetch_next_call=True)],
                         ids=["resident", "carried"])
@pytest.mark.parametrize("held", [False, True], ids=["written at once", "written after a call"])
@pytest.mark.parametrize("alias", sorted(_ALIASES))
def test_a_write_through_a_state_dict_tensor_or_numpy_array_is_seen_by_the_next_call(alias, held, policy, device):
    """Plain PyTorch's ``m.state_dict()[k].mul_(2)`` edits the model, and so does a write into
    ``p.detach().numpy()`` on the CPU: here they write the host bytes, no master sees them, and a resident or
    carried device copy stayed stale (on the simulator, the write raced a queued copy: "changed the source").
    The runtime watches what it hands out: the next call fetches the changed group again. An alias kept across a
    call and written after it is seen too, and the call ended after its copies (no race)."""
    if alias == "numpy" and device != "cpu":
        pytest.skip("numpy() of a tensor on an accelerator is refused, as plain PyTorch refuses it")
    model, m, x = _offloaded(device, **policy)
    _run(m, x), _run(m, x)
    take, write = _ALIASES[alias]
    with torch.no_grad():
        handed = take(m)
        if held:
            torch.testing.assert_close(_run(m, x), _plain(model, x))
        write(handed)
        model.blocks[1].up.weight.mul_(2)
    if not held:
        del handed  # gone before the next call: its write is seen all the same
    assert torch.equal(m.blocks[1].up.weight.cpu(), model.blocks[1].up.weight)
    _fetches_the_changed_block_again(model, m, x, policy)
    if held:
        del handed
    reset_offload_stats(m)  # once the alias is gone, nothing is fetched again (but the one fetch for a numpy
    torch.testing.assert_close(_run(m, x), _plain(model, x))  # array just gone: its writes are never seen)
    if policy.get("strategy") == "none":
        assert offload_stats(m).fetch_count == (1 if alias == "numpy" and held else 0)


def test_a_state_dict_read_and_dropped_fetches_nothing_again(device):
    """Saving (a state_dict read, never written) leaves every device copy valid."""
    model, m, x = _offloaded(device, strategy="none")
    _run(m, x)
    state = m.state_dict()
    assert torch.equal(state["blocks.1.up.weight"], model.blocks[1].up.weight)
    reset_offload_stats(m)
    _run(m, x)
    del state
    _run(m, x)
    assert offload_stats(m).fetch_count == 0


def test_a_frame_run_without_a_graph_reads_weights_on_demand_counted(device):
    """A forward calling a function that dynamo must not compile, which reads a weight directly: that frame
    runs without a graph; its read computes on a device copy of the weight (on ``cpu``: on the host bytes in
    place), counted, while the blocks stream through their graph."""
    class Disabled(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
            self.head = nn.Linear(8, 4)

        def forward(self, x):
            for block in self.blocks:
                x = torch.relu(block(x))
            return self.project(x)

        @torch.compiler.disable
        def project(self, x):
            return x @ self.head.weight.T + self.head.bias

    torch.manual_seed(0)
    model = Disabled().eval().requires_grad_(False)
    x = torch.randn(2, 8)
    m = offload_compile(copy.deepcopy(model), _policy(device, blocks_attr="blocks"))
    torch.testing.assert_close(_run(m, x), _plain(model, x))
    reset_offload_stats(m)
    _run(m, x)
    head = (m.head.weight.numel() + m.head.bias.numel()) * 4
    assert offload_stats(m).on_demand_bytes == head
    blocks = sum(g.nbytes for g in m._offload_runtime.groups if g.name.startswith("blocks"))
    assert offload_stats(m).bytes_transferred == blocks


def test_remove_offload_gives_plain_weights_back_bit_for_bit(device):
    model, m, x = _offloaded(device)
    _run(m, x)
    plain = remove_offload(m)
    params = dict(plain.named_parameters())
    assert all(type(p) is nn.Parameter and p.device.type == "cpu" for p in params.values())
    for name, p in model.named_parameters():
        assert torch.equal(params[name], p)
    torch.testing.assert_close(_plain(plain, x), _plain(model, x))


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.register_buffer("scale", torch.full((8,), 1.5))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x * self.scale


def test_a_reference_taken_before_offloading_fails_naming_the_fix_and_remove_offload_gives_it_back(device):
    """Offloading puts a new tensor (a host master) in the model's place of each parameter and buffer; a reference
    kept from before (an optimizer, an EMA copy, ``w = m.lm_head.weight``) silently computed with, and wrote,
    bytes the model no longer read. Now any use of it is refused, naming the weight and the fix, and
    `remove_offload` makes those very objects the model's weights again, holding the values changed meanwhile."""
    torch.manual_seed(0)
    m, x = _Scaled().eval().requires_grad_(False), torch.randn(2, 8)
    plain = copy.deepcopy(m)
    weight, scale = m.blocks[1][0].weight, m.scale
    weight.note = "kept"  # an attribute of the object (transformers sets some) comes back with it
    ids = {name: id(t) for name, t in [*m.named_parameters(), *m.named_buffers()]}
    offload_compile(m, _policy(device, strategy="none"))
    assert m.blocks[1][0].weight is not weight and isinstance(m.blocks[1][0].weight, HostMaster)
    _run(m, x)
    with torch.no_grad():
        with pytest.raises(OffloadRefusal, match=r"model\.get_parameter\('blocks\.1\.0\.weight'\).*after "
                                                 r"offloading.*remove_offload"):
            weight.mul_(2)
        with pytest.raises(OffloadRefusal, match=r"get_buffer\('scale'\)"):
            scale + 1
        with pytest.raises(OffloadRefusal, match="after offloading"):
            torch._foreach_mul_([weight], 2.0)
        with pytest.raises(OffloadRefusal, match="after offloading"):
            torch.optim.SGD([weight], lr=0.1).step()
        m.blocks[1][0].weight.mul_(2), plain.blocks[1][0].weight.mul_(2)  # through the model's own: seen
        m.scale.add_(1), plain.scale.add_(1)
    torch.testing.assert_close(_run(m, x), _plain(plain, x))
    remove_offload(m)
    assert m.blocks[1][0].weight is weight and m.scale is scale
    assert {name: id(t) for name, t in [*m.named_parameters(), *m.named_buffers()]} == ids
    assert type(weight) is nn.Parameter and type(scale) is torch.Tensor and weight.note == "kept"
    assert torch.equal(weight, plain.blocks[1][0].weight) and torch.equal(scale, plain.scale)
    torch.testing.assert_close(_plain(m, x), _plain(plain, x))
    offload_compile(m, _policy(device, strategy="none"))  # offloaded again: retired again, given back again
    torch.testing.assert_close(_run(m, x), _plain(plain, x))
    with pytest.raises(OffloadRefusal, match="after offloading"):
        weight.sum()
    remove_offload(m)
    assert m.blocks[1][0].weight is weight and torch.equal(weight, plain.blocks[1][0].weight)


def test_views_and_copies_of_a_master_move_no_bytes_to_the_device(device):
    _, m, _ = _offloaded(device)
    w = m.blocks[0].up.weight
    reset_offload_stats(m)
    assert isinstance(w.T, HostMaster) and isinstance(w.detach(), HostMaster)
    assert torch.equal(w.cpu(), w.host) and w.to("cpu", torch.float64).dtype == torch.float64
    assert offload_stats(m).on_demand_bytes == 0
    assert "HostMaster" in repr(w)



class _SplitWeight(nn.Module):
    """A forward that splits, chunks and unbinds a weight (Wan's and DiT's modulation tables do): views that come
    as a list."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(12, 12) for _ in range(2))
        self.table = nn.Parameter(torch.randn(4, 12))

    def forward(self, x):
        a, b, c = self.table[:3].split([4, 4, 4], dim=1)
        d, _ = self.table[3].chunk(2)
        rows = self.table.unbind(0)
        for block in self.blocks:
            x = block(x) * a.sum() + b.mean() + c[0, 0] + d.sum() + rows[1].sum()
        return x


def test_views_that_come_as_a_list_are_masters_too(device):
    """split/chunk/unbind of a master give a list of masters, in a capture (fake tensors) and outside it."""
    torch.manual_seed(0)
    model = _SplitWeight().eval().requires_grad_(False)
    m = offload_compile(copy.deepcopy(model), _policy(device, strategy="sequential"))
    x = torch.randn(2, 12)
    torch.testing.assert_close(_run(m, x), _plain(model, x))
    parts = m.table.split([4, 8], dim=1)
    assert len(parts) == 2 and all(isinstance(p, HostMaster) for p in parts)
    assert all(isinstance(r, HostMaster) for r in m.table.unbind(0))
    assert torch.equal(parts[1].cpu(), model.table[:, 4:])


def test_a_weight_read_in_a_method_is_counted_on_the_cpu_too():
    """``x @ m.proj.weight`` in a method no route knows of: on ``cpu`` the master computes on its host bytes in
    place (no copy), and the read is counted as one outside the offloaded graph."""
    model, m, x = _offloaded("cpu")
    w = m.blocks[0].up.weight
    reset_offload_stats(m)
    with torch.no_grad():
        got = torch.randn(2, w.shape[1]) @ w.T
    assert type(got) is torch.Tensor and got.device.type == "cpu"
    assert offload_stats(m).on_demand_bytes == w.numel() * w.element_size()
    assert m._offload_runtime.on_demand.ops == 1


@pytest.mark.parametrize("through", ["data", "row", "detach", "split"])
def test_a_write_through_a_view_of_a_resident_weight_is_seen_by_the_next_call(through, device):
    """``p.data.mul_(2)``, ``p[0].mul_(2)``, ``p.detach().mul_(2)``, ``p.split(...)[1].zero_()``: a view of a
    master is a master over the same host bytes, and a write through it is a write to the weight, so the
    resident copy made before is stale and fetched again (a packed weight's host bytes are an alias with a
    version counter of its own: the view says which weight it views)."""
    model, m, x = _offloaded(device, strategy="none")
    _run(m, x)
    with torch.no_grad():
        for w in (m.blocks[1].up.weight, model.blocks[1].up.weight):
            view = {"data": lambda: w.data, "row": lambda: w[0], "detach": lambda: w.detach(),
                    "split": lambda: w.split(2)[1]}[through]()
            view.mul_(2)
    assert not torch.equal(m.blocks[1].up.weight.cpu(), _offloaded(device)[0].blocks[1].up.weight)
    reset_offload_stats(m)
    torch.testing.assert_close(_run(m, x), _plain(model, x))
    stats = offload_stats(m)  # the stale resident copy, and only it, was fetched again
    changed = next(g for g in offload_groups(m) if g.name == "blocks.1")
    assert (stats.fetch_count, stats.bytes_transferred, stats.on_demand_bytes) == (1, changed.nbytes, 0)
