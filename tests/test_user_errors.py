"""The first hour's mistakes get a short error that names the fix, and nothing is lost: a backward through an
offloaded model, a wrong input shape, a method offload_compiler does not route. After each, the model runs
again and every weight is bit-for-bit what it was."""

import copy
import pickle
import re

import pytest
from devices import host_and
import torch
from torch import nn
from torch.nn import functional as F

from offload_compiler import OffloadedModule, OffloadPolicy, OffloadRefusal, offload_compile, offload_stats, \
    remove_offload, reset_offload_stats
from offload_compiler.testing import assert_traffic_matches_plan

CPU = dict(device="cpu")


class Stack(nn.Module):
    _layerwise_offload_blocks_attr = "blocks"

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)

    def first_block(self, x):
        """A public method that runs part of the model from Python: not routed."""
        return self.blocks[0](x)

    def width(self):
        return self.blocks[0].in_features  # reads no weight


def _offloaded(model_class=None, device="cpu"):
    """The model offloaded onto ``device`` (``x`` there too), the plain model's output and its weights before."""
    torch.manual_seed(0)
    model = (model_class or Stack)().eval()
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    return offload_compile(model, OffloadPolicy(strategy="layerwise", device=device)), x.to(device), expected, snapshot


def _still_whole(m, x, expected, snapshot):
    reset_offload_stats(m)
    with torch.no_grad():
        assert torch.equal(m(x).cpu(), expected)
    assert_traffic_matches_plan(m)
    assert all(torch.equal(v.cpu(), snapshot[k]) for k, v in m.state_dict().items())


def test_backward_through_an_offloaded_model_says_inference_only_and_names_the_fix():
    m, x, expected, snapshot = _offloaded()
    y = m(x)  # grad mode on, as for the plain model: the output requires grad
    assert y.requires_grad and torch.equal(y.detach(), expected)
    with pytest.raises(RuntimeError, match=r"runs inference only.*torch\.no_grad\(\).*remove_offload\(m\)"):
        y.sum().backward()
    assert all(p.grad is None for p in m.parameters())
    z = m(x)
    z += 1  # in place, as on the plain model's output
    assert torch.equal(z.detach(), expected + 1)
    with torch.inference_mode():
        assert not m(x).requires_grad
    _still_whole(m, x, expected, snapshot)
    for p in m.parameters():  # frozen weights: the plain model's output needs no grad, nor does ours
        p.requires_grad_(False)
    assert not m(x).requires_grad
    probe = x.clone().requires_grad_()  # an input that requires grad (a saliency map): so does the output
    y = m(probe)
    assert y.requires_grad and torch.equal(y.detach(), expected)
    with pytest.raises(RuntimeError, match="runs inference only"):
        y.sum().backward()
    assert probe.grad is None


def test_backward_on_a_device_that_is_not_the_host_is_refused_by_name():
    """On the simulated accelerator the backward reaches our refusal, as on the CPU: nothing of the device's own
    autograd set-up fails first, no gradient is written, and the model runs on."""
    from offload_compiler.testing import simulated_device
    m, x, expected, snapshot = _offloaded(device=simulated_device())
    probe = x.clone().requires_grad_()
    y = m(probe)
    assert y.requires_grad and torch.equal(y.detach().cpu(), expected)
    with pytest.raises(OffloadRefusal, match=r"runs inference only.*remove_offload\(m\)"):
        y.sum().backward()
    assert probe.grad is None and all(p.grad is None for p in m.parameters())
    _still_whole(m, x, expected, snapshot)


def test_parts_chain_with_grad_mode_on_as_the_plain_modules_do():
    """One part's output (it requires grad, as the plain block's would) is the next part's input: it runs, and
    only a backward is refused. Before, the second call refused the first one's output as an input."""
    m, x, expected, snapshot = _offloaded()
    reset_offload_stats(m)
    h = x
    for block in m.blocks:
        h = torch.relu(block(h))
    y = m.head(h)
    assert y.requires_grad and torch.equal(y.detach(), expected)
    assert assert_traffic_matches_plan(m).fetch_count == 4  # each part streamed its own group, as planned
    with pytest.raises(RuntimeError, match="runs inference only"):
        y.sum().backward()
    _still_whole(m, x, expected, snapshot)


def test_a_wrong_input_shape_is_one_short_error_with_the_shapes_given():
    m, x, expected, snapshot = _offloaded()
    m(torch.randn(3, 8))  # another batch size first: dynamo then traces with symbolic sizes
    with pytest.raises(RuntimeError) as error:
        m(torch.randn(2, 5))
    message = str(error.value)
    assert re.search(r"Stack\.forward\(x=Tensor\[2, 5\] float32\) failed: .*\[2, 5\] X \[8, 8\].*test_user_errors\.py",
                     message), message
    assert not re.search(r"\bs\d+\b", message), message  # sizes as numbers, not dynamo's symbols
    assert error.value.__cause__ is None and error.value.__suppress_context__
    assert len(message) < 400 and not isinstance(error.value, torch._dynamo.exc.TorchDynamoException)
    _still_whole(m, x, expected, snapshot)


_WRONG_SHAPE_SCRIPT = """
import torch
from offload_compiler import OffloadPolicy, offload_compile
from offload_compiler.testing import BlockSpec, ModelSpec, build_block_model
model, x = build_block_model(ModelSpec(8, (BlockSpec("mlp", 8),) * 3, False, False, 3, 1), seed=3)
m = offload_compile(model.eval(), OffloadPolicy(strategy="layerwise", device="cpu", compiler="eager"))
with torch.no_grad():
    m(torch.randn(3, 8))
    try:
        m(torch.randn(2, 5))
    except RuntimeError as error:
        print("raised:", error)
"""


@pytest.mark.slow  # a fresh process: torch's own log handlers (pytest's capture would hide what they write)
@pytest.mark.newest_torch
def test_a_wrong_input_shape_writes_nothing_else_to_stderr():
    """Fake tensors log every op that fails while dynamo traces, a traceback per op, to stderr; inside an
    offloaded call the failure is the one short error, so that log record is dropped."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", _WRONG_SHAPE_SCRIPT], capture_output=True,
                          text=True, timeout=300)
    assert "raised: BlockStack.forward(x=Tensor[2, 5] float32) failed" in done.stdout, done.stdout + done.stderr
    assert "fake_tensor" not in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("on", host_and("sim"))
def test_a_wrong_input_dtype_is_torchs_own_error_naming_the_call_and_the_model_runs_on(on, capsys):
    """Fake tensors accept a float64 input meeting float32 weights, so the op fails while the graph runs: torch's
    own error, as the plain model raises it, with a note naming the offloaded call and its inputs; nothing else on
    stderr (a graph module's call prints an excerpt of its generated code there); nothing left on the device."""
    from offload_compiler.testing import simulated_device
    m, x, expected, snapshot = _offloaded(device=simulated_device() if on == "sim" else "cpu")
    with torch.no_grad():
        assert torch.equal(m(x).cpu(), expected)
        capsys.readouterr()
        with pytest.raises(RuntimeError, match="same dtype") as error:
            m(x.double())
    assert "in Stack.forward(x=Tensor[2, 8] float64), run offloaded; the model is unchanged" in error.value.__notes__
    assert capsys.readouterr().err == ""
    assert offload_stats(m).live_device_bytes == 0  # the failed call's fetched groups were given back
    _still_whole(m, x, expected, snapshot)


class _CheckedPrefix(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 8)

    def forward(self, x):
        if x.shape[1] > 4:  # the model's own check, as SiglipTextEmbeddings' on max_position_embeddings
            raise ValueError(f"at most 4 positions, got {x.shape[1]}")
        return self.embed(x)


class _CheckedStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.prefix = _CheckedPrefix()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        x = self.prefix(x)
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.slow
@pytest.mark.newest_torch
def test_an_input_the_models_own_check_refuses_leaves_the_model_running():
    """The model raises on a bad input from Python code (``raise ValueError``): dynamo, tracing it, gives up on the
    frame and marks its code to run without a graph. Before the fix that code was our forward's, so every later
    call ran eagerly, read the weights from host memory and was refused for good ("part of ... ran outside its
    offloaded graphs")."""
    torch.manual_seed(0)
    model, x = _CheckedStack().eval(), torch.randn(2, 4, 8)
    with torch.no_grad():
        expected = model(x)
    snapshot = copy.deepcopy(model.state_dict())
    m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="layerwise", **CPU))
    with torch.no_grad():
        assert torch.equal(m(x), expected)
        with pytest.raises(ValueError, match="at most 4 positions, got 6"):
            m(torch.randn(2, 6, 8))
        for _ in range(2):
            reset_offload_stats(m)
            assert torch.equal(m(x), expected)
            assert_traffic_matches_plan(m)
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), snapshot.values()))


def test_a_part_called_from_python_streams_through_its_own_graph():
    """A public method running a block, a block called by hand, a compiled function calling the head: each
    part runs its own offloaded graph (the plan's fetches), never its host weights."""
    m, x, expected, snapshot = _offloaded()
    with torch.no_grad():
        expected_block, expected_head = remove_offload(m).blocks[0](x), m.head(x)
    m = offload_compile(m, OffloadPolicy(strategy="layerwise", **CPU))
    routes = {"a method of the model": (lambda: m.first_block(x), expected_block),
              "a block by hand": (lambda: m.blocks[0](x), expected_block),
              "a compiled function calling the head": (lambda: torch.compile(lambda: m.head(x) * 1)(), expected_head)}
    for name, (route, wanted) in routes.items():
        reset_offload_stats(m)
        with torch.no_grad():
            assert torch.equal(route(), wanted), name
        stats = assert_traffic_matches_plan(m)
        assert stats.fetch_count == 1 and stats.live_device_bytes == 0, name
    assert m.width() == 8  # a method that computes nothing runs as before
    _still_whole(m, x, expected, snapshot)


def test_a_part_whose_weights_stay_on_the_device_fetches_nothing_and_the_check_says_so():
    """``budget`` streams two blocks and keeps the rest resident: the head's own graph fetches nothing, as its plan
    says, and `assert_traffic_matches_plan` accepts that (it said "no offloaded graph ran" before)."""
    m, x, expected, snapshot = _offloaded()
    m = offload_compile(remove_offload(m), OffloadPolicy(strategy="budget", offload_gb=2 * 72 * 4 / 1e9, **CPU))
    with torch.no_grad():
        assert torch.equal(m(x), expected)
        expected_head = F.linear(x, snapshot["head.weight"], snapshot["head.bias"])
        reset_offload_stats(m)
        assert torch.equal(m.head(x), expected_head)
    stats = assert_traffic_matches_plan(m, resident_filled=True)
    assert stats.fetch_count == 0 and stats.bytes_transferred == 0
    reset_offload_stats(m)
    with pytest.raises(AssertionError, match="no offloaded graph ran"):
        assert_traffic_matches_plan(m, resident_filled=True)
    with torch.no_grad():
        assert torch.equal(m.blocks[0](x), F.linear(x, snapshot["blocks.0.weight"], snapshot["blocks.0.bias"]))
    assert assert_traffic_matches_plan(m, resident_filled=True).fetch_count == 1  # a streamed block's part


def test_a_copy_of_a_part_is_a_plain_module_and_pickling_one_names_the_fix():
    m, x, expected, snapshot = _offloaded()
    block = copy.deepcopy(m.blocks[0])
    assert type(block) is nn.Linear and "forward" not in vars(block)  # its own class, not a route into the offload
    with torch.no_grad():
        assert torch.equal(block(x), F.linear(x, snapshot["blocks.0.weight"], snapshot["blocks.0.bias"]))
    with pytest.raises(TypeError, match=r"part of the offloaded Stack.*state_dict\(\).*remove_offload"):
        pickle.dumps(m.blocks[0])
    plain = remove_offload(m)
    assert type(plain.blocks[0]) is nn.Linear and "forward" not in vars(plain.blocks[0])  # a plain module again
    with torch.no_grad():
        assert torch.equal(plain.first_block(x), plain.blocks[0](x))


def test_a_block_added_after_offloading_is_refused_not_read_from_host_memory():
    """Before the fix the appended block ran from host memory, silently: the graph dynamo captured again read
    its new parameters as plain inputs."""
    m, x, expected, snapshot = _offloaded()
    m.blocks.append(nn.Linear(8, 8))
    with pytest.raises(OffloadRefusal, match=r"blocks\.3\.weight.*which offloading does not hold.*module added or "
                                             r"replaced.*remove_offload\(m\)") as refused:
        with torch.no_grad():
            m(x)
    _own_words_only(refused.value)
    del m.blocks[3]
    _still_whole(m, x, expected, snapshot)


class Counter(Stack):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1  # rebinds nothing: += on a tensor writes it in place
        return super().forward(x)


def test_a_buffer_the_forward_increments_names_offload_buffers():
    """Before the fix ``self.calls += 1`` passed the analysis (operator.iadd was not seen as a write), and the
    next call failed with an unrelated "weight it does not hold" error."""
    torch.manual_seed(0)
    model = Counter().eval()
    with pytest.raises(OffloadRefusal, match=r"modifies weight 'calls' in place.*offload_buffers=False") as refused:
        with torch.no_grad():
            offload_compile(model, OffloadPolicy(strategy="layerwise", **CPU))(torch.randn(2, 8))
    _own_words_only(refused.value)
    m = offload_compile(remove_offload(model), OffloadPolicy(strategy="layerwise", offload_buffers=False, **CPU))
    reset_offload_stats(m)
    with torch.no_grad():
        m(torch.randn(2, 8)), m(torch.randn(2, 8))
    assert assert_traffic_matches_plan(m).fetch_count == 2 * 4 and int(m.calls) == 2  # the refused call ran nothing


def _own_words_only(refusal: OffloadRefusal) -> None:
    """A refusal reaches the caller as itself: not inside dynamo's BackendCompilerFailed report, which asks for
    a PyTorch bug report (dynamo's full report stays on the error as ``offload_trace``)."""
    assert "BackendCompilerFailed" not in str(refusal) and "PyTorch" not in str(refusal)
    assert isinstance(refusal.offload_trace, torch._dynamo.exc.BackendCompilerFailed)


class _LoopWithBreak(nn.Module):
    """A graph break inside the layer loop of an inner model (DBRX's ``DbrxModel.forward``: a data-dependent
    shape in its MoE): dynamo runs that frame without a graph and marks its code so for the whole process."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.norm = nn.Linear(8, 8)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
            torch._dynamo.graph_break()
        return self.norm(h)


class _WithInnerLoop(nn.Module):
    _layerwise_offload_blocks_attr = "inner.blocks"

    def __init__(self):
        super().__init__()
        self.inner = _LoopWithBreak()
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        return self.head(self.inner(x))


def test_a_frame_dynamo_skipped_for_an_earlier_model_streams_for_the_next_one_too():
    """Dynamo marks the skipped frame's code for the whole process: the next model of the class runs it without
    a graph with no dynamo counter moving. Before, the first model was refused and the next one read the inner
    model's weights (all but the head) from host memory with no error; its modules stream now, each model's."""
    for _ in range(2):  # the same weights each time
        m, x, expected, snapshot = _offloaded(_WithInnerLoop)
        with pytest.warns(UserWarning, match=r"without a graph.*inner\.embed"):  # once per model
            _still_whole(m, x, expected, snapshot)
        assert m._offload_runtime.used_groups == {g.index for g in m._offload_runtime.groups}
        plain = remove_offload(m)
        with torch.no_grad():
            assert torch.equal(plain(x), expected)


def _weights(model):
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def test_another_offloaders_hooks_are_refused_naming_how_to_remove_them():
    """accelerate's hooks and diffusers' group offloading move the weights at every call, as offloading does: both
    on one model would move host masters under our graphs. Refused before anything changes; with the hooks
    removed as the error says, the model offloads and streams its plan."""
    import accelerate
    from offload_compiler.testing.models import flux
    model = Stack().eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    accelerate.cpu_offload(model, execution_device="cpu")
    with pytest.raises(ValueError, match=r"accelerate's hooks .*remove_hook_from_module\(model, recurse=True\)"):
        offload_compile(model, OffloadPolicy(strategy="layerwise", **CPU))
    assert not isinstance(model, OffloadedModule)
    accelerate.hooks.remove_hook_from_module(model, recurse=True)
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", **CPU))
    with torch.no_grad():
        assert torch.equal(m(x), expected)
    assert assert_traffic_matches_plan(m).fetch_count == 4

    transformer, _ = flux()
    transformer.enable_group_offload(onload_device=torch.device("cpu"), offload_type="block_level",
                                     num_blocks_per_group=1)
    before = _weights(transformer)
    with pytest.raises(ValueError, match="group offloading enabled .*without enable_group_offload"):
        offload_compile(transformer, OffloadPolicy(strategy="layerwise", **CPU))
    after = _weights(transformer)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_shallow_copy_of_a_part_is_a_module_of_its_own_class_sharing_its_weights():
    m, x, expected, snapshot = _offloaded()
    shallow = copy.copy(m.blocks[0])
    assert type(shallow) is nn.Linear and shallow.weight is m.blocks[0].weight
    with torch.no_grad():  # host masters read outside an offloaded graph: fetched on demand (on cpu read in place)
        assert torch.equal(shallow(x), F.linear(x, snapshot["blocks.0.weight"], snapshot["blocks.0.bias"]))
    _still_whole(m, x, expected, snapshot)


class _Outer(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.out = inner, nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.inner(x))


@pytest.mark.parametrize("offloaded_first", ["inner", "outer"])
def test_a_model_inside_or_around_an_offloaded_one_is_refused_before_anything_changes(offloaded_first):
    """A model is offloaded once, as a whole: offloading a model that holds an offloaded one, or a part of an
    offloaded model, is refused naming the fix; the offloaded model keeps streaming its plan, unchanged."""
    torch.manual_seed(0)
    outer = _Outer(Stack()).eval()
    x = torch.randn(2, 8)
    snapshot = {k: v.clone() for k, v in outer.state_dict().items()}
    with torch.no_grad():
        expected_inner, expected_outer = outer.inner(x), outer(x)
    first, second = (outer.inner, outer) if offloaded_first == "inner" else (outer, outer.inner)
    m = offload_compile(first, OffloadPolicy(strategy="layerwise", **CPU))
    with pytest.raises(ValueError, match="offloaded already: a model is offloaded once.*remove_offload.*nothing was "
                                         "changed"):
        offload_compile(second, OffloadPolicy(strategy="layerwise", **CPU))
    if offloaded_first == "inner":
        assert type(outer) is _Outer  # not offloaded in part
    _still_whole(m, x, expected_inner if offloaded_first == "inner" else expected_outer,
                 {k.removeprefix("inner.") if offloaded_first == "inner" else k: v for k, v in snapshot.items()
                  if offloaded_first == "outer" or k.startswith("inner.")})
    plain = remove_offload(m)
    with torch.no_grad():  # given back, the outer model offloads as a whole
        assert torch.equal(offload_compile(outer, OffloadPolicy(strategy="layerwise", **CPU))(x), expected_outer)
    assert plain is first


@pytest.mark.parametrize("strategy", ["layerwise", pytest.param("auto", marks=pytest.mark.slow)])  # 3 s each
def test_a_model_that_rescales_its_weights_at_its_first_call_is_refused_naming_the_plain_call_first(strategy):
    """RWKV in eval mode divides its weights in place at its first call: an offloaded weight is read-only in the
    forward, so that call is refused by the weight's name with the fix (one plain call before offloading), which
    then works; nothing was changed by the refusal."""
    transformers = pytest.importorskip("transformers")
    config = transformers.RwkvConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                                     intermediate_size=64, context_length=32, rescale_every=1)
    torch.manual_seed(0)
    plain = transformers.RwkvForCausalLM(config).eval()
    fresh = copy.deepcopy(plain)
    snapshot = {k: v.clone() for k, v in fresh.state_dict().items()}
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        expected = plain(input_ids=ids).logits  # rescales plain's weights
    policy = OffloadPolicy(strategy=strategy, device="cpu", **({"device_budget_gb": 1.0} if strategy == "auto" else {}))
    m = offload_compile(fresh, policy)
    with pytest.raises(OffloadRefusal, match=r"modifies weight 'rwkv\.blocks\.\d\.\S+' in place.*call the plain model "
                                             r"once before offloading"):
        with torch.no_grad():
            m(input_ids=ids)
    restored = remove_offload(m)
    assert all(torch.equal(v, snapshot[k]) for k, v in restored.state_dict().items())
    with torch.no_grad():
        restored(input_ids=ids)  # the fix: one plain call, then offload
    m = offload_compile(restored, policy)
    with torch.no_grad():
        assert torch.equal(m(input_ids=ids).logits, expected)
    assert offload_stats(m).bytes_transferred > 0  # offloaded, not run on the host weights


def test_auto_names_the_models_own_refusal_of_the_inputs_not_a_tracing_limit():
    """Under auto the first call is traced whole to plan it: a model whose own check raises for these inputs
    (SigLIP's too-long input, CLIP without input_ids) is said to refuse them, with its message and line; nothing
    was planned, and a call with good inputs then plans and runs."""
    torch.manual_seed(0)
    model = _CheckedStack().eval()
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        expected = model(x)
    m = offload_compile(model, OffloadPolicy(strategy="auto", device_budget_gb=1.0, **CPU))
    with pytest.raises(ValueError, match=r"_CheckedStack refused this call's inputs while strategy='auto' traced it "
                                         r"to plan: .*test_user_errors\.py:\d+ in forward: raise ValueError\(f\"at "
                                         r"most 4 positions.*nothing was planned or moved"):
        with torch.no_grad():
            m(torch.randn(2, 6, 8))
    with torch.no_grad():
        assert torch.equal(m(x), expected)
    from offload_compiler import offload_plan
    assert offload_plan(m).predicted_peak_bytes > 0  # planned at the good call
