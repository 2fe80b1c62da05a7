"""The dynamo helpers that routed parts rely on (``torch.compiler.assume_constant_result``, and
`_torch_private.inlined_only`, the host masters' guard filter `host_masters.keep_guards`), each checked for exactly what is relied on, so that a torch
upgrade that changes one fails here, by name, rather than as a slow or wrong offloaded call somewhere else."""

from __future__ import annotations

import pytest
from devices import host_and
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

from offload_compiler._torch_private import inlined_only
from offload_compiler.host_masters import GUARD_FILTER, HostMaster, keep_guards

_flag = {"on": True}


@torch.compiler.assume_constant_result
def _on() -> bool:
    return _flag["on"]


def test_assume_constant_result_is_read_once_at_trace_time_with_no_guard():
    """Read while dynamo traces, its value is a constant of the graph: changing what it reads later neither
    recompiles nor changes the compiled result (what `_tracing_an_offloaded_call` relies on: no guard per call).
    Called from Python it answers live."""
    torch._dynamo.reset()
    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def f(x):
        return x + 1 if _on() else x - 1

    x = torch.zeros(2)
    try:
        _flag["on"] = True
        assert f(x).tolist() == [1.0, 1.0]
        _flag["on"] = False
        assert f(x).tolist() == [1.0, 1.0]  # the constant traced, not re-read
        assert counter.frame_count == 1
        assert _on() is False
    finally:
        _flag["on"] = True
        torch._dynamo.reset()


class _Callable:
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, x):
        return x * 2


class _Inlined(_Callable):
    @inlined_only
    def __call__(self, x):
        return x * 2


def _compiled_frames(part) -> CompileCounter:
    """``part`` called from a frame that dynamo compiles and from one it runs without a graph (a graph break in
    a loop); the frames dynamo compiled."""
    torch._dynamo.reset()
    counter = CompileCounter()

    @torch.compile(backend=counter)
    def traced(x):
        return part(x) + 1

    @torch.compile(backend=counter)
    def breaks_in_a_loop(x):
        for _ in range(2):
            torch._dynamo.graph_break()
            x = part(x)
        return x

    x = torch.ones(2)
    assert traced(x).tolist() == [3.0, 3.0]
    assert breaks_in_a_loop(x).tolist() == [4.0, 4.0]
    return counter


def test_inlined_only_is_traced_into_but_not_compiled_as_a_frame_of_its_own():
    """Met in a frame dynamo compiles, it is traced into (its op in that graph); called from a frame dynamo runs
    without a graph, it runs as plain Python, where a plain callable's frame gets a graph of its own (what lets
    a routed part's forward there run its module's offloaded graph instead)."""
    try:
        plain = _compiled_frames(_Callable("plain"))
        inlined = _compiled_frames(_Inlined("inlined"))
    finally:
        torch._dynamo.reset()
    assert inlined.frame_count == 1 and inlined.op_count == 2  # traced(): x * 2 + 1, one graph
    assert plain.frame_count > inlined.frame_count  # the plain callable's own frame compiled from the loop


no_guard_filter_here = pytest.mark.skipif(GUARD_FILTER is None, reason="no guard filter on this torch")


@no_guard_filter_here
@pytest.mark.parametrize("device", host_and("sim"))
def test_the_guard_filter_keeps_a_host_masters_tensor_match_alone(device):
    """Of the guards on a host master (its type, its ``__tensor_flatten__`` context compared in Python, its inner
    ``host`` tensor, the list of its inner attributes through a Python lambda), only its own ``TENSOR_MATCH`` is
    kept, recognized from the entries' public fields (the value, by identity); every guard on the module and on
    a plain input stays. The compiled code is reused while the weight is the same master, and a master of
    another shape in its place recompiles. On the simulated accelerator too: masters whose device is not their
    host bytes' device, as on a GPU."""
    if device == "sim":
        from offload_compiler.testing import simulated_device
        device = simulated_device()
    device = torch.device(device)
    torch._dynamo.reset()
    seen: list[tuple[str, str, bool]] = []

    def recording(entries):
        kept = keep_guards(entries)
        seen.extend((e.guard_type, e.name, k) for e, k in zip(entries, kept))
        return kept

    layer = nn.Linear(4, 4)
    for name, p in list(layer._parameters.items()):
        layer._parameters[name] = nn.Parameter(HostMaster(p.detach(), device), requires_grad=False)
    counter = CompileCounter()
    compiled = torch.compile(layer, backend=counter, options={"guard_filter_fn": recording})
    x = torch.randn(2, 4, device=device)
    try:
        with torch.no_grad():
            compiled(x), compiled(x)
            assert counter.frame_count == 1
            on_weight = [(kind, k) for kind, name, k in seen if name.endswith("['weight']")]
            assert ("TENSOR_MATCH", True) in on_weight and ("TENSOR_SUBCLASS_METADATA_MATCH", False) in on_weight
            assert all(not k for kind, k in on_weight if kind != "TENSOR_MATCH")
            assert not any(k for kind, name, k in seen if name.endswith(".host") or "__tensor_flatten__" in name)
            assert any(name.endswith(".host") for kind, name, k in seen)  # there were such guards to drop
            assert any(name.endswith("__tensor_flatten__()[0]") for kind, name, k in seen)
            others = [k for kind, name, k in seen if "_parameters[" not in name]
            assert others and all(others)  # the module's guards, the input's: all kept
            layer._parameters["weight"] = nn.Parameter(HostMaster(torch.randn(4, 2), device),
                                                       requires_grad=False)  # another master, another shape
            with pytest.raises(Exception, match=r"\[2, 4\] X \[2, 4\]"):  # traced again: guards saw the new shape
                compiled(x)
    finally:
        torch._dynamo.reset()
