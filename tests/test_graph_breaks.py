"""Graph breaks degrade, they do not refuse: a frame that dynamo runs without a graph (a graph break inside a
loop: ``Tensor.item()``, a data-dependent size) still streams what it reads. The modules it calls run as their
own offloaded graphs (their routed class, `RoutedPart`), a weight it computes with directly is a host master read on demand, and one
warning per model says what that cost, as measured (bytes, ops), and the fix."""

import contextlib
import copy
import gc
import re
import warnings

import pytest
from devices import host_and
import torch
from torch import nn
import torch.nn.functional as F

from offload_compiler import OffloadPolicy, offload_compile, offload_stats, reset_offload_stats
from offload_compiler.offloaded import state_of
from offload_compiler.testing import assert_traffic_matches_plan, simulated_device, tensors_of


class Tower(nn.Module):
    """An audio tower in miniature: ``.item()`` and a data-dependent size inside its layer loop, so dynamo runs
    this whole frame without a graph; it calls a Conv1d, Linear blocks, a LayerNorm and a Linear from there."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = F.gelu(self.conv(x)).transpose(1, 2)
        for block in self.blocks:
            keep = int((h.sum(-1) > 0).sum().item())  # a graph break inside the loop
            h = torch.cat([block(h[:, :keep]), h[:, keep:]], dim=1)
        return self.proj(self.norm(h))


class WithTower(nn.Module):
    _layerwise_offload_blocks_attr = "tower.blocks"

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.tower = Tower()
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        return self.head(self.tower(self.embed(x.transpose(1, 2)).transpose(1, 2)))


_HOST_READERS = {"linear": F.linear, "conv1d": F.conv1d, "layer_norm": F.layer_norm}


@contextlib.contextmanager
def host_reads(model: nn.Module):
    """Records each call of ``F.linear``, ``F.conv1d`` or ``F.layer_norm`` made from Python (not traced by dynamo)
    with one of ``model``'s own weights -- the host masters -- as an argument: a read of host memory."""
    masters = {id(t) for t in list(model.parameters()) + list(model.buffers())}
    seen: list[str] = []

    def probe(name, original):
        def reader(*args, **kwargs):
            if not torch.compiler.is_compiling():
                seen.extend(name for value in list(args) + list(kwargs.values()) if id(value) in masters)
            return original(*args, **kwargs)
        return reader

    for name, original in _HOST_READERS.items():
        setattr(F, name, probe(name, original))
    try:
        yield seen
    finally:
        for name, original in _HOST_READERS.items():
            setattr(F, name, original)


def _skipping_frame_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "without a graph" in str(w.message)]


# three calls, each frame run without a graph calling its modules as graphs of their own; the fast subset routes
# such a frame in tests/test_routes.py
@pytest.mark.slow
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_a_frame_run_without_a_graph_streams_what_its_modules_read(compiler):
    torch.manual_seed(0)
    # weights that do not require grad, as the offloaded graphs' (a non-contiguous matmul input takes another
    # path, with other rounding, for a weight that does: `assert_offload_equivalent`)
    model, x = WithTower().eval().requires_grad_(False), torch.randn(2, 4, 6)
    with torch.no_grad():
        expected = model(x)
    m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="layerwise", device="cpu", compiler=compiler,
                                                             debug_poison=True))
    runtime = state_of(m).runtime
    with warnings.catch_warnings(record=True) as caught, host_reads(m) as reads, torch.no_grad():
        warnings.simplefilter("always")
        for _ in range(3):  # compiling, then dynamo skips the marked frame silently: the same route each time
            reset_offload_stats(m)
            got = m(x)
            if compiler == "eager":
                assert torch.equal(got, expected)
            else:
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
            assert runtime.used_groups == {g.index for g in runtime.groups}  # every group fetched by a graph
            assert_traffic_matches_plan(m)  # bytes and fetches: exactly what the graphs that ran planned
    assert reads == []  # no module read a host master
    (warning,) = _skipping_frame_warnings(caught)  # one warning per model, naming the break and its cost
    assert "tower" in warning and "fetched" in warning and "hook-based offloader" in warning


class DirectRead(nn.Module):
    """A weight read as a tensor in a frame dynamo runs without a graph: no module call to route."""
    _layerwise_offload_blocks_attr = "blocks"

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        for block in self.blocks:
            x = block(x) * self.scale  # ``scale`` read as a tensor, in the frame run without a graph
            if float(x.sum()) > 1e9:  # a graph break inside the loop
                x = x * 0
        return x


@pytest.mark.parametrize("device", host_and(simulated_device()))
def test_a_weight_read_as_a_tensor_without_a_graph_is_read_on_demand_and_said_once_with_its_bytes(device):
    """No module call to route: ``scale`` is a host master, read on demand for each of its two ops (on ``cpu`` in
    place; on an accelerator a copy), counted, and the one warning per model gives the bytes and ops measured --
    not refused, not read unseen."""
    torch.manual_seed(0)
    model, x = DirectRead().eval().requires_grad_(False), torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="layerwise", device=device))
    scale = 8 * 4
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for _ in range(2):
            reset_offload_stats(m)
            torch.testing.assert_close(m(x.to(device)).cpu(), expected)
            assert offload_stats(m).on_demand_bytes == 2 * scale
            assert_traffic_matches_plan(m)  # the blocks: each its own graph, exactly as planned
    (warning,) = _skipping_frame_warnings(caught)
    assert re.search(r"blocks\.0.*own offloaded graph.*1 weights it computed with directly were fetched on demand "
                     rf"for each op \({2 * scale} B in 2 ops.*TORCH_LOGS=graph_breaks", warning), warning


def test_a_part_met_by_the_users_torch_compile_is_still_a_boundary():
    """Parts stay installed during calls now; the user's own compile of code calling one must not trace into
    its host weights."""
    torch.manual_seed(0)
    model = WithTower().eval()
    m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="layerwise", device="cpu"))
    h = torch.randn(2, 5, 8)
    with torch.no_grad():
        expected = model.head(h)
        reset_offload_stats(m)
        got = torch.compile(lambda t: m.head(t) * 1, backend="eager")(h)
    assert torch.equal(got, expected)
    assert_traffic_matches_plan(m)


@pytest.mark.slow  # the tiny thinker: 20 s eager, 100 s under inductor on a 2-core machine
@pytest.mark.parametrize("strategy, compiler", [("layerwise", "eager"), ("sequential", "eager"),
                                                pytest.param("layerwise", "inductor", marks=pytest.mark.trial)])
def test_qwen25_omni_thinker_audio_tower_streams_under_layerwise(strategy, compiler):
    """transformers 5.24's audio tower has graph breaks in its frame (data-dependent shapes, Tensor.item(),
    ContextVar.get): dynamo runs it without a graph. Its conv1, conv2, ln_post and proj were read from host
    memory and the thinker was refused; they stream now, each as its own graph, and the group they share moves
    once per call (it moved 5.2 times the thinker's weights per call under ``sequential``, 1.55 under
    ``layerwise``, each part's graph fetching it again)."""
    from offload_compiler.testing.omni_models import omni_thinker
    model, kwargs = omni_thinker()
    with torch.no_grad():
        expected = tensors_of(model(**kwargs))
    m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy=strategy, device="cpu", compiler=compiler))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m(**kwargs)
        reset_offload_stats(m)
        got = tensors_of(m(**kwargs))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=0 if compiler == "eager" else 1e-5,
                                   rtol=0 if compiler == "eager" else 1e-4)
    assert len(_skipping_frame_warnings(caught)) == 1
    stats = assert_traffic_matches_plan(m)
    assert stats.held_hits and stats.bytes_transferred - stats.routed_bytes <= stats.streamed_bytes  # once each


class NeverCompiled(DirectRead):
    """A forward dynamo never compiles (``torch.compiler.disable``): the whole call runs without a graph of its own."""

    @torch.compiler.disable
    def forward(self, x):
        for block in self.blocks:
            x = block(x) * self.scale
        return x


def test_a_forward_run_without_any_graph_streams_and_is_not_refused():
    """Its blocks stream as their own graphs and ``scale`` is read on demand, measured and said once (before,
    the warning named ``scale`` as "fetched by no graph" and the CPU read it where it was, uncounted); a call
    that ran no graph of the model's own is not refused."""
    torch.manual_seed(0)
    model, x = NeverCompiled().eval().requires_grad_(False), torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="layerwise", device="cpu"))
    with pytest.warns(UserWarning, match=r"without a graph.*blocks\.0.*on demand for each op \(64 B in 2 ops") as \
            caught, torch.no_grad():
        assert torch.equal(m(x), expected)
    assert [w.filename for w in caught if "without a graph" in str(w.message)] == [__file__]  # the user's line
    assert offload_stats(m).on_demand_bytes == 64
    assert_traffic_matches_plan(m)


class ScaledAfterBlock(DirectRead):
    """A graph the backend sees (``blocks.0``), then ``scaled``, a frame dynamo runs without a graph (a graph
    break inside its loop) that reads ``scale`` as a tensor."""

    def forward(self, x):
        return self.scaled(self.blocks[1](self.blocks[0](x)))

    def scaled(self, x):
        for _ in range(2):
            x = x * self.scale
            if float(x.sum()) > 1e9:  # a graph break inside the loop
                x = x * 0
        return x


def test_the_backend_route_streams_a_frame_without_a_graph_through_host_masters_too():
    """``torch.compile(model, backend="omni_offload")``: after its first call the model holds host masters, as
    with `offload_compile`, so ``scale``, read in the frame dynamo runs without a graph, is counted on demand
    (before, that route kept plain weights: the read was silent on the CPU)."""
    from offload_compiler.host_masters import HostMaster
    torch.manual_seed(0)
    model, x = ScaledAfterBlock().eval().requires_grad_(False), torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    compiled = torch.compile(copy.deepcopy(model), backend="omni_offload",
                             options={"strategy": "layerwise", "device": "cpu"})
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.testing.assert_close(compiled(x), expected)  # offloads the model
        for _ in range(2):
            reset_offload_stats(compiled)
            torch.testing.assert_close(compiled(x), expected)
    m = compiled._orig_mod
    assert isinstance(m.scale, HostMaster) and isinstance(m.blocks[0].weight, HostMaster)
    assert offload_stats(m).on_demand_bytes == 2 * 8 * 4
    assert_traffic_matches_plan(m)
    assert len(_skipping_frame_warnings(caught)) == 1


class BrokenBlock(nn.Module):
    """A block whose own frame dynamo runs without a graph (``.item()`` inside its loop): its three projections,
    one group between them, are called from there one by one."""

    def __init__(self) -> None:
        super().__init__()
        self.projections = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, h):
        for projection in self.projections:
            keep = int((h.sum(-1) > 0).sum().item())  # a graph break inside the loop
            h = torch.cat([projection(h[:, :keep]), h[:, keep:]], dim=1)
        return h


class BrokenVisual(nn.Module):
    """A vision tower in miniature whose frame runs without a graph, calling its patch embedding, blocks and
    merger one by one; beside a language model, so each is a component (`components.VISION_PARTS`)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.merger = nn.Linear(8, 8)

    def forward(self, h):
        h = self.patch_embed(h)
        for block in self.blocks:
            keep = int((h.sum(-1) > 0).sum().item())  # a graph break inside the loop
            h = torch.cat([block(h[:, :keep]), h[:, keep:]], dim=1)
        return self.merger(h)


class Language(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, h):
        for layer in self.layers:
            h = torch.relu(layer(h))
        return h


class TinyVLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.visual = BrokenVisual()
        self.language_model = Language()

    def forward(self, h):
        return self.language_model(self.visual(h))


class BrokenBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(BrokenBlock() for _ in range(2))
        self.head = nn.Linear(8, 8)

    def forward(self, h):
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.parameters())


@pytest.mark.parametrize("device", host_and(simulated_device()))
@pytest.mark.parametrize("build, strategy, group", [(TinyVLM, "sequential", "visual"),
                                                     (BrokenBlocks, "layerwise", "layers.0"),
                                                     (BrokenBlocks, "alternating", "(root)")])  # the one component
def test_parts_called_one_by_one_from_a_frame_without_a_graph_fetch_their_group_once(device, build, strategy, group):
    """Each part such a frame calls runs a graph of its own; where their weights are one group (a vision
    component under ``sequential``, a block whose own frame broke under ``layerwise``, the model that is its one
    component), each of those graphs fetched the whole group again: Qwen2.5-Omni's thinker moved 5.2 times its
    weights per call under ``sequential``, Qwen2-VL 4.4 times. The copy a part's graph evicts is held within the
    call for the next part's graph: every group moves once per call, the plans' other fetches are served by
    held copies (``held_hits``), and nothing is held after the call (on the device, not even the memory of a
    whole-model component's slot)."""
    torch.manual_seed(0)
    model, x = build().eval().requires_grad_(False), torch.randn(2, 5, 8)
    with torch.no_grad():
        expected = model(x)
    m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy=strategy, device=device, compiler="eager",
                                                             debug_poison=True))
    sizes = {g.name: g.nbytes for g in state_of(m).runtime.groups}
    assert sizes[group] == _nbytes(m if group == "(root)" else m.get_submodule(group))  # the parts share one group
    dev, x = torch.get_device_module(device) if device != "cpu" else None, x.to(device)
    base = dev.memory_allocated() if dev is not None else None
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for _ in range(2):
            reset_offload_stats(m)
            out = m(x)
            torch.testing.assert_close(out.cpu(), expected, atol=0 if device == "cpu" else 1e-6, rtol=0)
            del out
            stats = assert_traffic_matches_plan(m)  # the plans' fetches, each moved or served by a held copy
            assert stats.bytes_transferred == sum(sizes.values()) == _nbytes(model)  # every group once
            assert stats.fetch_count == len(sizes) and stats.held_hits >= 2
            assert stats.live_device_bytes == 0  # nothing held between calls
            if dev is not None and group == "(root)":
                gc.collect()
                assert dev.memory_allocated() == base
    (warning,) = _skipping_frame_warnings(caught)
    assert "own offloaded graph" in warning


@pytest.mark.parametrize("device", host_and(simulated_device()))
def test_a_fetch_failing_while_copies_are_held_leaves_nothing_held_and_the_model_whole(device):
    """The second block's fetch fails after the first block's parts held its copy: the call raises the fault,
    no copy stays on the device, and the next call computes what the plain model does, with every group moved
    once."""
    from offload_compiler import inject_fault
    torch.manual_seed(0)
    model, x = BrokenBlocks().eval().requires_grad_(False), torch.randn(2, 5, 8)
    with torch.no_grad():
        expected = model(x)
    m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="layerwise", device=device, compiler="eager"))
    x = x.to(device)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        m(x)  # captured
        inject_fault(m, "fetch", "layers.1", RuntimeError("disk gone"))
        with pytest.raises(RuntimeError, match="disk gone"):
            m(x)
        stats = offload_stats(m)
        assert stats.live_device_bytes == 0 and stats.held_hits  # the first block's parts held their copy
        reset_offload_stats(m)
        torch.testing.assert_close(m(x).cpu(), expected, atol=0 if device == "cpu" else 1e-6, rtol=0)
    stats = assert_traffic_matches_plan(m)
    assert stats.bytes_transferred == _nbytes(model) and stats.live_device_bytes == 0
