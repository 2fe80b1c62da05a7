"""What only an accelerator can show. Skipped without CUDA; run on a GPU whenever one is available."""

import pytest
import torch

from offload_compiler import OffloadPolicy, offload_compile, offload_stats
from offload_compiler.testing.models import llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _model():
    model, kwargs = llama(layers=8, hidden=512, vocab=2048, seq=64)
    return model, {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_layerwise_on_cuda_matches_and_uses_less_device_memory(compiler):
    model, kwargs = _model()
    plain = __import__("copy").deepcopy(model).cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        expected = plain(**kwargs).logits
    plain_peak = torch.cuda.max_memory_allocated() - base + sum(p.numel() * p.element_size() for p in plain.parameters())
    del plain
    torch.cuda.empty_cache()
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cuda", prefetch=1, compiler=compiler))
    m(**kwargs)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = m(**kwargs).logits
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    torch.testing.assert_close(out, expected, atol=2e-4, rtol=2e-4)
    stats = offload_stats(m)
    assert m._offload_runtime.pinned and all(
        b.host.is_pinned() for g in m._offload_runtime.groups for b in g.buckets if b.host is not None)
    assert peak < 0.6 * plain_peak, (peak, plain_peak)
    assert stats.live_device_bytes == 0


def test_prefetch_runs_on_a_copy_stream():
    model, kwargs = _model()
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cuda", prefetch=1))
    m(**kwargs)
    assert m._offload_runtime._copy_stream is not None
    assert m._offload_runtime._copy_stream != torch.cuda.current_stream()


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_prefetch_next_call_on_cuda_is_exact_and_carries_the_first_group(compiler):
    model, kwargs = _model()
    plain = __import__("copy").deepcopy(model).cuda()
    with torch.no_grad():
        expected = plain(**kwargs).logits
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cuda", prefetch=1, compiler=compiler,
                                             prefetch_next_call=True))
    m(**kwargs)
    for _ in range(3):
        torch.cuda.synchronize()
        before = offload_stats(m).carry_hits
        out = m(**kwargs).logits
        torch.testing.assert_close(out, expected, atol=2e-4, rtol=2e-4)
        assert offload_stats(m).carry_hits == before + 1
    stats = offload_stats(m)
    assert stats.carried_bytes > 0 and stats.live_device_bytes == stats.carried_bytes
    allocated = torch.cuda.memory_allocated()
    from offload_compiler import release_device_copies
    assert release_device_copies(m) == stats.carried_bytes
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= allocated - stats.carried_bytes  # the device memory really went back


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_a_cuda_graph_captured_around_the_offloaded_forward_replays_the_stream(compiler):
    """Fixed slots make the offloaded forward capturable: the copies into the slots are recorded on the copy
    stream (joined into the capture), and each replay streams the weights again into the same addresses."""
    import copy
    from offload_compiler import reset_offload_stats
    model, kwargs = _model()
    plain = copy.deepcopy(model).cuda()
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cuda", prefetch=1, compiler=compiler))
    ids = kwargs["input_ids"]
    other = torch.randint_like(ids, 0, 2048)
    with torch.no_grad():
        expected, expected_other = plain(input_ids=ids).logits, plain(input_ids=other).logits
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream: graphs compiled, slots allocated
            for _ in range(2):
                m(input_ids=ids)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pool = m._offload_runtime.pool.nbytes
        reset_offload_stats(m)
        static = ids.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = m(input_ids=static).logits
        stats = offload_stats(m)  # the capture ran the schedule once, as a call does
        assert stats.fetch_count == m._offload_runtime.graph_plans[-1].verified.fetches
        allocated = torch.cuda.memory_allocated()
        for inputs, want in ((ids, expected), (other, expected_other), (ids, expected)):
            static.copy_(inputs)
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(out, want, atol=2e-4, rtol=2e-4)
        assert torch.cuda.memory_allocated() == allocated  # replays allocate nothing
        assert m._offload_runtime.pool.nbytes == pool  # the capture used the slots the plan reserved


def test_a_failed_host_registration_leaves_no_cuda_error_behind():
    """Defect 4: torch's cudaHostRegister binding leaves CUDA's last error set on failure (an already registered
    buffer here), which the next kernel launch would report; a zero-byte buffer is not registered at all."""
    from offload_compiler.runtime import HostRegistrations
    registrations = HostRegistrations()
    assert not registrations.register(torch.empty(0))
    host = torch.empty(1 << 20)
    assert registrations.register(host)
    assert not HostRegistrations().register(host)  # cudaErrorHostMemoryAlreadyRegistered
    assert int(getattr(torch.cuda.cudart().cudaGetLastError(), "value", 0)) == 0
    torch.cuda.synchronize()
    assert (torch.ones(4, device="cuda") + 1).sum().item() == 8
    registrations.unregister_all()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_offloading_to_a_second_device_copies_from_pinned_memory():
    """Defect 5: buffers are registered portable (pinned for every device), not for the current device only."""
    model, kwargs = _model()
    kwargs = {k: v.to("cuda:1") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    plain = __import__("copy").deepcopy(model).to("cuda:1")
    with torch.no_grad():
        expected = plain(**kwargs).logits
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cuda:1", prefetch=1))
    torch.testing.assert_close(m(**kwargs).logits, expected, atol=2e-4, rtol=2e-4)
    assert m._offload_runtime.pinned
    assert all(b.host.is_pinned() for g in m._offload_runtime.groups for b in g.buckets if b.host is not None)


def test_weights_loaded_while_the_gpu_is_behind_do_not_leak_into_queued_calls():
    """Defect 6 on hardware: the GPU is kept busy (torch.cuda._sleep) so the call's copies are still queued when
    load_state_dict writes the pinned host buffers; they must read the old weights. Many calls, no sync."""
    import copy
    model, kwargs = _model()
    plain = copy.deepcopy(model).cuda()
    with torch.no_grad():
        expected = plain(**kwargs).logits
    new_state = {k: v + 0.01 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cuda", prefetch=1, debug_poison=True,
                                             prefetch_next_call=True))
    m(**kwargs)
    torch.cuda.synchronize()
    outs = []
    for _ in range(4):
        torch.cuda._sleep(50_000_000)  # the GPU falls behind the host
        outs.append(m(**kwargs).logits)
    m.load_state_dict(new_state)
    for out in outs:
        torch.testing.assert_close(out, expected, atol=2e-4, rtol=2e-4)
