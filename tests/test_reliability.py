"""Bad input gets a clear error that names the fix; faults leave the model whole. One test per case."""

import gc
import resource
import threading
import warnings

import pytest
from devices import host_and
import torch
from torch import nn

from offload_compiler import (OffloadedModule, OffloadPolicy, inject_fault, offload_compile, offload_stats, remove_offload)
from offload_compiler.testing import BlockSpec, ModelSpec, build_block_model

SPEC = ModelSpec(32, (BlockSpec("mlp", 64), BlockSpec("attention", 2), BlockSpec("mlp", 32)), False, True, 6, 2)
CPU = dict(device="cpu")


def _model(seed=0):
    model, x = build_block_model(SPEC, seed)
    return model, x, model(x).detach(), _snapshot(model)


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_whole(model, snapshot, x=None, expected=None, runner=None):
    """Every weight bit-for-bit what it was, and the model (or its offloaded runner) still right."""
    state = model.state_dict()
    assert list(state) == list(snapshot)
    for name, value in snapshot.items():
        assert torch.equal(state[name], value), f"{name} changed"
    if x is not None:
        assert torch.equal((runner or model)(x).detach(), expected)


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(x))


# -- bad input ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, message", [
    ({"strategy": "fastest"}, "strategy='fastest' is unknown; choose one of"),
    ({"prefetch": -1}, "prefetch must be an integer >= 0"),
    ({"blocks_per_group": "two"}, "blocks_per_group must be an integer >= 1"),
    ({"strategy": "budget", "offload_gb": -1}, "offload_gb must be a number of GiB >= 0"),
    ({"strategy": "budget"}, "needs offload_gb"),
    ({"device": "cuda:7"}, "device='cuda:7'"),
    ({"device": "nonsense"}, "device='nonsense' is not a device torch knows"),
    ({"prefetch_next_call": True, "prefetch": 0}, "prefetch_next_call=True needs prefetch >= 1"),
    ({"prefetch_next_call": True, "strategy": "alternating"}, "prefetch_next_call does not apply to strategy="),
    ({"prefetch_next_call": "yes"}, "prefetch_next_call must be True or False"),
])
def test_bad_policy_values_are_refused_and_nothing_is_touched(fields, message):
    model, x, expected, snapshot = _model()
    pointers = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ValueError, match=message):
        offload_compile(model, **{**CPU, **fields})
    assert pointers == [p.data_ptr() for p in model.parameters()]
    _assert_whole(model, snapshot, x, expected)


def test_layerwise_without_blocks_names_the_attribute_and_touches_nothing():
    model = Plain()
    snapshot = _snapshot(model)
    with pytest.raises(ValueError, match="_layerwise_offload_blocks_attr = 'path.to.blocks'"):
        offload_compile(model, strategy="layerwise", **CPU)
    _assert_whole(model, snapshot)
    offloaded = offload_compile(model, strategy="sequential", **CPU)  # the fix the error names works
    assert offloaded(torch.ones(1, 8)) is not None and offload_stats(offloaded).fetch_count == 2


def test_blocks_attribute_pointing_at_nothing():
    class Misdeclared(Plain):
        _layerwise_offload_blocks_attr = "model.layers"
    with pytest.raises(ValueError, match="'model.layers' on Misdeclared points at nothing.*\\['a', 'b'\\]"):
        offload_compile(Misdeclared(), strategy="layerwise", **CPU)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning succeeds where CUDA exists")
def test_pinned_memory_that_cannot_be_had_falls_back_with_one_warning():
    from offload_compiler.grouping import plan_groups
    from offload_compiler.runtime import OffloadRuntime
    model, x, expected, snapshot = _model()
    policy = OffloadPolicy(strategy="layerwise", **CPU)
    object.__setattr__(policy, "device", "cuda")  # a CUDA policy on a machine whose torch cannot pin
    with pytest.warns(RuntimeWarning, match="pinned host memory is unavailable") as caught:
        runtime = OffloadRuntime(policy, plan_groups(model, policy))
    assert len([w for w in caught if "pinned" in str(w.message)]) == 1 and not runtime.pinned
    assert all(g.packed for g in runtime.groups)
    _assert_whole(model, snapshot, x, expected)


class _RecordingCudart:
    """Stands in for torch.cuda.cudart(): records (un)registrations and whether the memory was still there."""

    def __init__(self):
        self.registered, self.unregistered = {}, []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


@pytest.mark.parametrize("release", ["remove_offload", "drop the model"])
def test_host_buffers_are_unregistered_exactly_once_before_their_memory_is_freed(monkeypatch, release):
    from offload_compiler.grouping import plan_groups
    from offload_compiler.runtime import OffloadRuntime
    cudart = _RecordingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    model, x, expected, snapshot = _model()
    policy = OffloadPolicy(strategy="layerwise", **CPU)
    object.__setattr__(policy, "device", "cuda")
    runtime = OffloadRuntime(policy, plan_groups(model, policy))
    hosts = [b.host for g in runtime.groups for b in g.buckets if b.host is not None]
    assert runtime.pinned and sorted(cudart.registered) == sorted(h.data_ptr() for h in hosts)
    assert all(cudart.registered[h.data_ptr()] == h.untyped_storage().nbytes() for h in hosts)  # exact size
    alive = [__import__("weakref").ref(h.untyped_storage()) for h in hosts]
    del hosts
    if release == "remove_offload":
        runtime.unpack()
        assert sorted(cudart.unregistered) == sorted(cudart.registered)
    else:
        unregistered_while_alive = []
        real = cudart.cudaHostUnregister
        cudart.cudaHostUnregister = lambda ptr: (unregistered_while_alive.append(all(r() is not None for r in alive)),
                                                 real(ptr))[1]
        del runtime, model  # nothing references the host buffers but the runtime's registrations now
        gc.collect()
        assert sorted(cudart.unregistered) == sorted(cudart.registered)
        assert unregistered_while_alive and all(unregistered_while_alive)  # never after the memory is freed
        assert all(r() is None for r in alive)  # ... and then the memory is freed
        return
    assert len(cudart.unregistered) == len(set(cudart.unregistered))
    _assert_whole(model, snapshot, x, expected)


class _SharedRows(nn.Module):
    """Two weights over overlapping rows of one tensor: neither can be packed without breaking the sharing."""

    def __init__(self):
        super().__init__()
        base = torch.randn(8, 8)
        self.a, self.b = nn.Parameter(base[:6]), nn.Parameter(base[2:])

    def forward(self, x):
        return (x @ self.a.T) * (x @ self.b.T)


def test_weights_sharing_bytes_are_copied_from_a_registered_staging_buffer(monkeypatch):
    """Defect 11: on CUDA, a copy of weights that share bytes reads a staging buffer pinned in place like every
    other host buffer (registered at its exact size), never their own pageable memory; the weights keep their
    storage, and the buffer is unregistered when the runtime unpacks."""
    from offload_compiler.grouping import plan_groups
    from offload_compiler.runtime import OffloadRuntime
    cudart = _RecordingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    model = _SharedRows()
    snapshot = _snapshot(model)
    policy = OffloadPolicy(strategy="sequential", **CPU)
    object.__setattr__(policy, "device", "cuda")
    runtime = OffloadRuntime(policy, plan_groups(model, policy))
    owners = [b for g in runtime.groups for b in g.buckets if b.owner is not None]
    assert len(owners) == 2 and runtime.pinned
    for bucket in owners:
        assert bucket.source() is bucket.host
        assert cudart.registered[bucket.host.data_ptr()] == bucket.host.untyped_storage().nbytes() == 6 * 8 * 4
    assert model.a.untyped_storage().data_ptr() == model.b.untyped_storage().data_ptr()  # still shared
    runtime.unpack()
    assert sorted(cudart.unregistered) == sorted(cudart.registered)
    _assert_whole(model, snapshot)


@pytest.mark.parametrize("make_bad, why", [
    (lambda m: m.register_buffer("q", torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)), "quantized"),
    (lambda m: setattr(m, "ghost", nn.Parameter(torch.empty(4, device="meta"))), "meta device"),
    (lambda m: m.register_buffer("sparse", torch.eye(4).to_sparse()), "sparse"),
])
def test_weights_the_engine_cannot_move_are_refused_by_name(make_bad, why):
    model, x, expected, _ = _model()
    make_bad(model)
    dense = [t for t in list(model.parameters()) + list(model.buffers())
             if t.layout == torch.strided and not t.is_meta and not t.is_quantized]
    pointers = [t.data_ptr() for t in dense]
    with pytest.raises(ValueError, match=f"plain dense.*{why}"):
        offload_compile(model, strategy="layerwise", **CPU)
    assert pointers == [t.data_ptr() for t in dense]  # nothing was packed or moved


def test_meta_inputs_are_refused_with_the_reason():
    model, x, expected, snapshot = _model()
    m = offload_compile(model, strategy="layerwise", **CPU)
    with pytest.raises(ValueError, match="meta device.*no data"):
        m(x.to("meta"))
    _assert_whole(model, snapshot, x, expected, runner=m)


def test_to_device_warns_and_keeps_the_offload_dtype_changes_are_refused():
    model, x, expected, snapshot = _model()
    m = offload_compile(model, strategy="layerwise", **CPU)
    from offload_compiler.testing import simulated_device
    with pytest.warns(UserWarning, match="ignored: this module keeps its weights in host memory"):
        assert m.to(simulated_device()) is m  # a device this machine has: the offload stays, said once
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert m.to("cpu") is m  # where it computes already: nothing to say
    if not torch.cuda.is_available():  # a device this machine lacks: an error, as for a plain module
        for move in (lambda: m.to("cuda"), lambda: m.cuda()):
            with pytest.raises(RuntimeError, match="not available on this machine.*The model is unchanged"):
                move()
    for change in (lambda: m.half(), lambda: m.to(torch.float16), lambda: m.double()):
        with pytest.raises(RuntimeError, match="remove_offload\\(m\\).to\\(dtype\\)"):
            change()
    _assert_whole(model, snapshot, x, expected, runner=m)
    assert offload_stats(m).bytes_transferred > 0


def test_a_buffer_the_forward_modifies_is_refused_and_offload_buffers_false_is_the_fix():
    class Counter(Plain):
        _layerwise_offload_blocks_attr = None

        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls.add_(1)
            return super().forward(x) + self.calls

    model = Counter()
    snapshot = _snapshot(model)
    m = offload_compile(model, strategy="sequential", **CPU)
    with pytest.raises(Exception, match="modifies weight .*calls.* in place.*offload_buffers=False"):
        m(torch.ones(1, 8))
    _assert_whole(model, snapshot)
    reference = Counter()
    reference.load_state_dict(snapshot)
    m = offload_compile(remove_offload(m), strategy="sequential", offload_buffers=False, **CPU)
    for _ in range(3):
        assert torch.equal(m(torch.ones(1, 8)), reference(torch.ones(1, 8)).detach())
    assert model.calls.item() == 3


# -- faults leave the model whole ------------------------------------------------------------------------

def _after_fault(model, snapshot, m, x, expected):
    gc.collect()
    assert offload_stats(m).live_device_bytes == 0, "a device copy outlived the failed call"
    assert not m._offload_runtime._pending
    _assert_whole(model, snapshot, x, expected, runner=m)


def test_bad_input_shape():
    model, x, expected, snapshot = _model()
    m = offload_compile(model, strategy="layerwise", **CPU)
    m(x)
    with pytest.raises(RuntimeError, match="shape|size|reduction dim") as err:
        m(torch.randn(2, 6, 5))
    assert not isinstance(err.value, torch._dynamo.exc.TorchDynamoException)  # the model's error, not dynamo's
    _after_fault(model, snapshot, m, x, expected)


@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_an_op_failing_midway(compiler):
    """An index out of range fails at run time, inside the graph, after weights were fetched."""
    class Lookup(nn.Module):
        _layerwise_offload_blocks_attr = "blocks"

        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Embedding(4, 8), nn.Linear(8, 8)])

        def forward(self, x, ids):
            return self.blocks[2](self.blocks[0](x) + self.blocks[1](ids))

    model = Lookup()
    x, ids = torch.randn(2, 8), torch.tensor([0, 3])
    expected, snapshot = model(x, ids).detach(), _snapshot(model)
    m = offload_compile(model, strategy="layerwise", compiler=compiler, **CPU)
    assert torch.equal(m(x, ids), expected) or compiler == "inductor"
    with pytest.raises((IndexError, RuntimeError), match="index|out of"):
        m(x, torch.tensor([0, 9]))
    gc.collect()
    assert offload_stats(m).live_device_bytes == 0
    _assert_whole(model, snapshot)
    torch.testing.assert_close(m(x, ids), expected)


@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("stage, exception", [("fetch", RuntimeError("copy engine fault")),
                                              ("evict", KeyboardInterrupt())])
def test_failure_inside_a_transfer_reaches_the_caller_unchanged(compiler, stage, exception):
    model, x, expected, snapshot = _model()
    m = offload_compile(model, strategy="layerwise", prefetch=1, compiler=compiler, **CPU)
    first = m(x)
    inject_fault(m, stage, group="blocks.1", exception=exception)
    with pytest.raises(type(exception)) as caught:
        m(x)
    assert caught.value is exception  # the very object raised, not a wrapper
    del caught
    gc.collect()
    assert offload_stats(m).live_device_bytes == 0 and not m._offload_runtime._pending
    _assert_whole(model, snapshot)
    assert torch.equal(m(x), first)


def test_a_thousand_calls_do_not_grow_device_copies_or_memory():
    model, x = build_block_model(ModelSpec(8, (BlockSpec("mlp", 8),) * 3, False, True, 2, 1), 1)
    expected, snapshot = model(x).detach(), _snapshot(model)
    m = offload_compile(model, strategy="layerwise", **CPU)
    for _ in range(100):
        m(x)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    live = []
    for _ in range(1000):
        m(x)
        live.append(offload_stats(m).live_device_bytes)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert set(live) == {0}
    leak_per_call_kib = offload_stats(m).total_bytes / 1024  # what leaking one call's copies would cost
    assert grown_kib < 100 * leak_per_call_kib + 4096, f"RSS grew {grown_kib} KiB over 1000 calls"
    assert offload_stats(m).fetch_count == 1100 * len(m._offload_runtime.graph_plans[0].schedule.instances)
    _assert_whole(model, snapshot, x, expected, runner=m)


def test_two_threads_get_correct_results():
    model, x, expected, _ = _model()
    inputs = [torch.randn_like(x) for _ in range(8)]
    wanted = [model(i).detach() for i in inputs]  # before offloading: the model itself is offloaded after
    m = offload_compile(model, strategy="layerwise", **CPU)
    m(x)
    errors, results = [], {}

    def worker(tid):
        try:
            for rep in range(15):
                k = (tid + rep) % len(inputs)
                results[(tid, rep)] = torch.equal(m(inputs[k]), wanted[k])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == 30 and all(results.values())
    instances = len(m._offload_runtime.graph_plans[0].schedule.instances)
    assert offload_stats(m).fetch_count == 31 * instances  # every call, from either thread, fetched its groups


@pytest.mark.parametrize("entry", ["offload_compile", "torch.compile"])
def test_remove_offload_gives_back_a_plain_equal_module(entry):
    model, x, expected, snapshot = _model()
    params, cls = list(model.parameters()), type(model)
    if entry == "offload_compile":
        wrapped = offload_compile(model, strategy="budget", offload_gb=1e-5, **CPU)
    else:
        wrapped = torch.compile(model, backend="omni_offload", options={"strategy": "layerwise", **CPU})
    with torch.no_grad():
        wrapped(x)
    plain = remove_offload(wrapped)
    assert plain is model  # host masters replaced its parameters, as FSDP2's sharded parameters do (on either
    # route): plain parameters again, equal, new objects
    assert all(type(p) is nn.Parameter and torch.equal(p, q) for p, q in zip(plain.parameters(), params))
    for p in plain.parameters():  # each weight owns its storage again
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size()
    _assert_whole(plain, snapshot, x, expected)
    assert type(plain) is cls and "forward" not in vars(plain)  # its own class and forward again
    with pytest.raises(ValueError, match="is not offloaded"):
        offload_stats(plain)
    again = offload_compile(plain, strategy="layerwise", **CPU)  # and it can be offloaded again
    assert torch.equal(again(x), expected)


def test_a_device_budget_below_what_any_plan_needs_states_the_figure_and_touches_nothing():
    from offload_compiler import InfeasibleBudgetError
    model, x, expected, snapshot = _model()
    pointers = [p.data_ptr() for p in model.parameters()]
    m = offload_compile(model, strategy="auto", device_budget_gb=1e-6, **CPU)
    with pytest.raises(InfeasibleBudgetError, match="device_budget_gb >=") as err:
        m(x)
    assert err.value.needed_bytes > 1e-6 * 2**30  # the smallest budget that works, in bytes
    assert pointers == [p.data_ptr() for p in model.parameters()]  # planned before anything was packed
    with pytest.raises(InfeasibleBudgetError):  # every call says so (the budget is the model's policy)
        m(x)
    _assert_whole(remove_offload(m), snapshot, x, expected)
    works = offload_compile(model, strategy="auto", device_budget_gb=err.value.needed_bytes / 2**30, **CPU)
    assert torch.equal(works(x), expected)


# -- found by a new user's trial ----------------------------------------------------------------------------

@pytest.mark.slow  # a Llama generating
def test_generate_and_the_original_object_run_offloaded():
    from offload_compiler import reset_offload_stats
    from offload_compiler.testing.models import llama
    model, inputs = llama()
    plain = __import__("copy").deepcopy(model)
    m = offload_compile(model, strategy="layerwise", **CPU)
    m(**inputs)
    reset_offload_stats(m)
    tokens = m.generate(inputs["input_ids"], max_new_tokens=3, do_sample=False)  # HF generate calls the model
    assert torch.equal(tokens, plain.generate(inputs["input_ids"], max_new_tokens=3, do_sample=False))
    per_call = len(m._offload_runtime.graph_plans[0].schedule.instances)
    assert offload_stats(m).fetch_count >= 3 * per_call  # every decoding step streamed the weights
    reset_offload_stats(m)
    assert torch.equal(model(**inputs).logits, plain(**inputs).logits)  # the original object is offloaded too
    assert offload_stats(m).fetch_count == per_call
    assert m.device == torch.device("cpu") and [n for n, _ in m.named_parameters()] == [
        n for n, _ in plain.named_parameters()]  # the names of the model's state_dict, unprefixed


def test_weights_the_graph_does_not_hold_are_refused_not_read_from_host():
    model, x, expected, _ = _model()
    m = offload_compile(model, strategy="layerwise", **CPU)
    m(x)
    model.head.weight = nn.Parameter(torch.randn_like(model.head.weight))  # replaced, not updated
    with pytest.raises(RuntimeError, match=r"(in place of )?head\.weight, which offloading does not hold.*"
                                           r"remove_offload\(m\).*p\.data = new_tensor"):
        m(x)
    opts = {"strategy": "layerwise", "device": "cpu"}
    a, b = _model(1)[0], _model(2)[0]
    plain_b = __import__("copy").deepcopy(b)
    torch.compile(a, backend="omni_offload", options=opts)(x)
    # dynamo shares a's graph with b, compiled alike: that graph offloads b too, on a runtime of its own
    assert torch.equal(torch.compile(b, backend="omni_offload", options=opts)(x), plain_b(x))
    assert isinstance(b, OffloadedModule) and offload_stats(b).bytes_transferred > 0


def test_offloading_twice():
    model, x, expected, snapshot = _model()
    m = offload_compile(model, strategy="layerwise", **CPU)
    assert m is model  # offloaded in place: one object, one state
    m(x)
    with pytest.raises(ValueError, match="already offloaded.*offload_compile\\(remove_offload\\(m\\), policy\\)"):
        offload_compile(m, strategy="sequential", **CPU)
    assert torch.equal(m(x), expected)  # the refusal changed nothing
    again = offload_compile(remove_offload(m), strategy="sequential", **CPU)
    assert torch.equal(again(x), expected) and offload_stats(again).fetch_count > 0
    _assert_whole(remove_offload(again), snapshot)


def test_copy_pickle_and_backward_are_refused_with_the_alternative():
    import copy
    import pickle
    model, x, expected, snapshot = _model()
    m = offload_compile(model, strategy="layerwise", **CPU)
    with pytest.raises(TypeError, match="while m stays offloaded"):
        copy.deepcopy(m)
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(m)
    y = m(x.clone().requires_grad_())  # runs, as the plain model does; only a backward is refused
    with pytest.raises(RuntimeError, match="inference only"):
        y.sum().backward()
    assert torch.equal(m(x), expected)
    _assert_whole(model, snapshot)


@pytest.mark.slow  # ten models captured
def test_auto_plans_beside_many_offloaded_models_of_the_same_class():
    models = [offload_compile(_model(i)[0], strategy="layerwise", **CPU) for i in range(9)]
    model, x, expected, _ = _model()
    for m in models:
        m(x)
    m = offload_compile(model, strategy="auto", device_budget_gb=6e-5, **CPU)  # past dynamo's recompile limit (8)
    assert torch.equal(m(x), expected)
    stats = offload_stats(m)
    assert 0 < stats.streamed_bytes and stats.bytes_transferred >= stats.streamed_bytes  # the tight budget streams


# -- offloading is one transaction ----------------------------------------------------------------------

def _fail_at_call(monkeypatch, module, name, at):
    """``module.name`` raises an OSError at its ``at``-th call (after the earlier ones did their work)."""
    real, calls = getattr(module, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise OSError(28, "injected: no space left on the disk tier")
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, failing)
    return calls


@pytest.mark.parametrize("device", host_and("sim"))
@pytest.mark.parametrize("tier", ["disk", "memory"])
def test_a_failure_while_building_the_runtime_leaves_the_model_as_it_was(device, tier, tmp_path, monkeypatch):
    """The last step of building a runtime (packing, the disk tier's file) fails partway: every weight is the very
    object it was, on its device, with its values; the model runs plainly and offloads again."""
    from offload_compiler.runtime import host
    from offload_compiler.testing import simulated_device
    dev = simulated_device() if device == "sim" else "cpu"
    model, x, expected, snapshot = _model()
    cls = type(model)
    weights = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    devices = {name: t.device for name, t in weights.items()}
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    # the buffers stay on the device (unmanaged): moved there first, they must come back
    policy = OffloadPolicy(strategy="layerwise", device=dev, compiler="eager", offload_buffers=False,
                           **(dict(host_budget_gb=total * 0.3 / 2**30, disk_dir=str(tmp_path)) if tier == "disk" else {}))
    # disk: the second bucket written to the tier's file fails; memory: the last group packed
    calls = (_fail_at_call(monkeypatch, host, "_write_bucket", 2) if tier == "disk"
             else _fail_at_call(monkeypatch, host, "pack_group", 4))
    with pytest.raises(OSError, match="injected"):
        offload_compile(model, policy)
    assert calls, "the failure was not reached"
    monkeypatch.undo()
    assert not isinstance(model, OffloadedModule) and type(model) is cls
    now = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert list(now) == list(weights)
    for name, tensor in now.items():
        assert tensor is weights[name], f"{name} is another object"
        assert type(tensor) in (torch.Tensor, nn.Parameter) and tensor.device == devices[name], name
    _assert_whole(model, snapshot, x, expected)
    offload_compile(model, policy)  # not refused as offloaded already
    with torch.no_grad():
        torch.testing.assert_close(model(x.to(dev)).cpu(), expected)
    assert offload_stats(model).bytes_transferred > 0
    remove_offload(model)
    _assert_whole(model, snapshot, x, expected)


def test_a_conversion_of_a_part_names_the_offloaded_model_and_the_part_path_and_a_copy_names_its_side_effect():
    import copy
    from offload_compiler import OffloadRefusal
    model, x, expected, snapshot = _model()
    m = offload_compile(model, strategy="sequential", **CPU)
    path, part = next((p, mod) for p, mod in m.named_modules() if p and any(True for _ in mod.parameters()))
    with pytest.raises(OffloadRefusal, match=rf"m\.{path}, a {type(part).__name__} in the offloaded "
                                             rf"{type(m).__name__} m.*m being the offloaded {type(m).__name__}: "
                                             rf"offload_compile\(remove_offload\(m\)\.to\(dtype\), policy\)"):
        part.half()
    with pytest.raises(TypeError, match=r"(?s)while m stays offloaded: .*load_state_dict\(m\.state_dict\(\)\).*"
                                        r"remove_offload\(m\) makes m the plain model again"):
        copy.deepcopy(m)
    assert torch.equal(m(x), expected)
    _assert_whole(model, snapshot)
