"""On a CPU-only build: run the rewritten graph with fake CUDA activations. Any compute op that still read
a host weight would raise a device mismatch; the unrewritten graph does (so the check has teeth)."""

import copy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from capture import capture
from offload_compiler import OffloadPolicy
from offload_compiler.backend import rewrite_graph
from offload_compiler.grouping import plan_groups
from offload_compiler.testing.models import gpt2, llama
from offload_compiler.runtime import OffloadRuntime


def _as_if_captured_on_cuda(gm):
    """Dynamo bakes device constants (``arange(device=...)``) into the graph: move them, as a capture of the
    model on a GPU would have them."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    swap = lambda v: cuda if v == cpu or v == "cpu" else v  # noqa: E731
    for node in gm.graph.nodes:
        node.args = tuple(swap(a) if isinstance(a, (torch.device, str)) else a for a in node.args)
        node.kwargs = {k: swap(v) if isinstance(v, (torch.device, str)) else v for k, v in node.kwargs.items()}
    gm.recompile()
    return gm


def _fake_cuda_runtime(model, strategy):
    policy = OffloadPolicy(strategy=strategy, device="cpu", pin_memory=False, offload_gb=1e-4 if strategy == "budget" else None)
    object.__setattr__(policy, "device", "cuda")  # the fake run needs a CUDA compute device on a CPU build
    return OffloadRuntime(policy, plan_groups(model, policy), pack_now=False)


def _run_fake(gm, example_inputs, weight_ids):
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        args = []
        for value in example_inputs:
            if isinstance(value, torch.Tensor) and id(value) not in weight_ids:
                value = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cuda")
            elif isinstance(value, torch.Tensor):
                value = mode.from_tensor(value)  # host weights stay fake CPU tensors
            args.append(value)
        return gm(*args)


_CAPTURED = {}


def _captured(builder):
    """The model and its aten graph as if captured on a GPU, once per builder for the four strategies (the
    capture is the slow part; each test rewrites its own copy of the graph)."""
    if builder not in _CAPTURED:
        model, kwargs = builder()
        kwargs["use_cache"] = False  # a cache's tensor constants would be host tensors of the capture, not weights
        gm, example_inputs = capture(model, fullgraph=True, **kwargs)
        # aten level: Python indexing on a fake CUDA tensor needs a CUDA build, aten.slice does not
        gm = _as_if_captured_on_cuda(make_fx(gm, tracing_mode="fake")(*example_inputs))
        _CAPTURED[builder] = model, gm, example_inputs
    model, gm, example_inputs = _CAPTURED[builder]
    return model, copy.deepcopy(gm), example_inputs


@pytest.mark.parametrize("builder", [llama, pytest.param(gpt2, marks=pytest.mark.slow)])  # a capture each
@pytest.mark.parametrize("strategy", ["layerwise", "budget", "sequential", "none"])
def test_no_compute_op_sees_a_host_weight(builder, strategy):
    model, gm, example_inputs = _captured(builder)
    weight_ids = {id(p) for p in model.parameters()} | {id(b) for b in model.buffers()}
    with pytest.raises(Exception, match="device"):
        _run_fake(gm, example_inputs, weight_ids)  # the plain graph mixes cuda activations and host weights
    runtime = _fake_cuda_runtime(model, strategy)
    new_gm, _, _ = rewrite_graph(gm, example_inputs, runtime)
    outputs = _run_fake(new_gm, example_inputs, weight_ids)
    tensors = [o for o in outputs if isinstance(o, torch.Tensor) and o.numel()]
    assert tensors and all(o.device.type == "cuda" for o in tensors[:1])  # logits on the device
