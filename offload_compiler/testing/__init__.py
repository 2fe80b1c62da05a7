"""Helpers for property-based test suites (ours and users'): hypothesis strategies for policies and small
random block models, and `assert_offload_equivalent`, which checks outputs *and* that offloading happened.

    from hypothesis import given, settings
    from offload_compiler.testing import block_models, policies, assert_offload_equivalent

    # each example captures and compiles a model (seconds, not hypothesis's 200 ms default deadline)
    @settings(deadline=None, max_examples=20)
    @given(block_models(), policies(devices=["cpu"]))
    def test_my_stack(model_and_input, policy):
        model, x = model_and_input
        assert_offload_equivalent(model, policy, x)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from typing import Any, Sequence

import torch
from torch import nn

from .._tree import tensors_of, to_device
from ..api import offload_compile, offload_stats
from ..offloaded import state_of
from ..policy import COMPONENT_STRATEGIES, REGIONS_TAKE_OFFLOADED_WEIGHTS, OffloadPolicy
from ..runtime import OffloadStats
from .simulated import OrderingViolation, simulated_device  # noqa: F401 (public: the simulated accelerator)

GENERIC_STRATEGIES = ("none", "sequential", "layerwise", "budget")

try:
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - hypothesis is a test extra
    st = None


# -- random block models -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BlockSpec:
    kind: str  # "mlp" | "attention"
    hidden: int  # MLP expansion width or number of heads


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    width: int
    blocks: tuple[BlockSpec, ...]
    tied_head: bool  # the output head reuses the input projection (tied weights used far apart)
    parent_table: bool  # a parameter of the root read after the blocks (like DiT's scale_shift_table)
    seq: int
    batch: int


class MLPBlock(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.register_buffer("gate", torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x)))) * self.gate


class AttentionBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width * heads, bias=False)
        self.out = nn.Linear(width * heads, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, s, -1))


class BlockStack(nn.Module):
    """A small model shaped like the real ones: embedding projection, blocks, final norm, head."""
    _layerwise_offload_blocks_attr = "blocks"

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed = nn.Linear(spec.width, spec.width, bias=False)
        self.blocks = nn.ModuleList(
            MLPBlock(spec.width, b.hidden) if b.kind == "mlp" else AttentionBlock(spec.width, b.hidden)
            for b in spec.blocks)
        self.norm = nn.LayerNorm(spec.width)
        self.tied_head = spec.tied_head
        if not spec.tied_head:
            self.head = nn.Linear(spec.width, spec.width, bias=False)
        self.table = nn.Parameter(torch.randn(spec.width) * 0.1) if spec.parent_table else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        h = self.norm(h)
        if self.table is not None:
            h = h * (1 + self.table)
        return h @ self.embed.weight if self.tied_head else self.head(h)


def build_block_model(spec: ModelSpec, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = BlockStack(spec).eval()
    x = torch.randn(spec.batch, spec.seq, spec.width, generator=generator)
    return model, x


if st is not None:
    def model_specs(max_blocks: int = 4, widths: Sequence[int] = (8, 16, 24)) -> "st.SearchStrategy[ModelSpec]":
        block = st.one_of(st.builds(BlockSpec, st.just("mlp"), st.sampled_from([8, 16, 32])),
                          st.builds(BlockSpec, st.just("attention"), st.integers(1, 2)))
        return st.builds(ModelSpec, st.sampled_from(list(widths)),
                         st.lists(block, min_size=1, max_size=max_blocks).map(tuple),
                         st.booleans(), st.booleans(), st.integers(1, 6), st.integers(1, 2))

    def block_models(max_blocks: int = 4) -> "st.SearchStrategy[tuple[nn.Module, torch.Tensor]]":
        """(model, input) pairs: random stacks of MLP and attention blocks with random widths and depth,
        tied weights, buffers and a parent-level table."""
        return st.builds(build_block_model, model_specs(max_blocks), st.integers(0, 2**16))

    def policies(strategies: Sequence[str] = GENERIC_STRATEGIES, devices: Sequence[str] = ("cpu",),
                 compilers: Sequence[str] = ("eager",), max_prefetch: int = 3,
                 components: Sequence[str] | None = None) -> "st.SearchStrategy[OffloadPolicy]":
        """Valid policies; ``budget`` draws offload_gb from nothing to more than a small model holds; ``auto``
        plans within the free device memory; ``regional`` on or off (off only, on a torch that has no regions
        over offloaded weights). The default strategies apply to any model; ``alternating`` takes the model's
        ``components`` (paths, as `OffloadPolicy` takes them; ``sequential`` takes them too where given) and
        streams them (``keep_after_use=False``); the component strategies never draw ``prefetch_next_call``,
        which they refuse (``model`` finds its components itself)."""
        components = list(components) if components is not None else None
        if components is None and "alternating" in strategies:
            raise ValueError(f"policies(strategies={list(strategies)!r}): the component strategies offload named "
                             f"components of your model; pass them: policies(..., components=['encoder', ...])")

        def build(strategy, device, compiler, prefetch, per_group, budget_kib, wrap, regional):
            by_component = strategy in COMPONENT_STRATEGIES
            return OffloadPolicy(strategy=strategy, device=device, compiler=compiler, prefetch=prefetch,
                                 blocks_per_group=per_group, debug_poison=True,
                                 offload_gb=budget_kib / 2**20 if strategy == "budget" else None,
                                 device_budget_gb="free" if strategy == "auto" else None,
                                 prefetch_next_call=wrap and prefetch > 0 and not by_component,
                                 keep_after_use=strategy != "alternating", regional=regional,
                                 components=components if strategy in ("alternating", "sequential") else None)
        return st.builds(build, st.sampled_from(list(strategies)), st.sampled_from(list(devices)),
                         st.sampled_from(list(compilers)), st.integers(0, max_prefetch), st.integers(1, 2),
                         st.integers(0, 64), st.booleans(),
                         st.booleans() if REGIONS_TAKE_OFFLOADED_WEIGHTS else st.just(False))
else:
    def _needs_hypothesis(*_: Any, **__: Any) -> Any:
        raise ImportError("offload_compiler.testing's property-based helpers (model_specs, block_models, policies) "
                          "draw with hypothesis, which is not installed: pip install hypothesis (or "
                          "pip install 'offload_compiler[test]')")

    model_specs = block_models = policies = _needs_hypothesis


# -- the checks -----------------------------------------------------------------------------------------

def planned_traffic(offloaded: Any, resident_filled: bool = False) -> tuple[int, int]:
    """(bytes, fetches) that the verified plans say the calls since the last `reset_offload_stats` moved:
    for each captured graph, its fetched groups' bytes times how often it ran. For policies whose groups are
    all streamed, evicted after use and not carried to the next call (layerwise, sequential, budget with
    everything streamed, alternating with ``keep_after_use=False``). ``resident_filled``: resident groups
    are allowed too (budget, auto), for calls after the one that first copied them to the device (they move
    once, not per call): only the streamed groups' fetches are counted."""
    runtime = state_of(offloaded).runtime
    # keep_after_use parks only components that alternate (exclusive groups): a model that is its one component
    # has none, and moves the same bytes every call
    parks = runtime.policy.keep_after_use and any(g.exclusive for g in runtime.groups)
    if (any(not g.streamed for g in runtime.groups) and not resident_filled) or runtime.policy.prefetch_next_call or (
            runtime.policy.strategy in ("alternating", "model") and parks):
        raise ValueError("planned_traffic counts per-call fetches: use a policy that streams every group (or pass "
                         "resident_filled=True after a first call), with keep_after_use=False and "
                         "prefetch_next_call=False")
    moved = fetches = 0
    for nbytes, plan, calls in runtime.calls_by_plan():
        moved += calls * sum(nbytes[i.group] for i in plan.schedule.instances)
        fetches += calls * plan.verified.fetches
    return moved, fetches


def planned_routed(offloaded: Any) -> tuple[int, int]:
    """(routed fetches, the most bytes they may move) that the verified plans allow the calls since the last
    `reset_offload_stats`: a routed fetch moves the experts its router named, a data-dependent subset bounded
    by its slot (`passes.routed`)."""
    runtime = state_of(offloaded).runtime
    fetches = bound = 0
    for _, plan, calls in runtime.calls_by_plan():
        fetches += calls * plan.verified.routed_fetches
        bound += calls * plan.verified.routed_bound_bytes
    return fetches, bound


def routed_only_groups(offloaded: Any) -> set[int]:
    """The groups that the captured plans read only by indices, never fetched whole (a token embedding's table,
    looked up; experts at decode): a call moves the rows its indices name instead (``routed_fetches``,
    ``routed_bytes``), so "every group once per call" reads ``fetch_count == len(groups) - len(this)``."""
    plans = state_of(offloaded).runtime.graph_plans
    fetched_whole = {i.group for plan in plans for i in plan.schedule.instances}
    return {r.group for plan in plans for r in plan.routed} - fetched_whole


def routed_only_bytes(offloaded: Any) -> int:
    """The bytes of `routed_only_groups`: "every streamed byte moved" reads
    ``bytes_transferred - routed_bytes >= streamed_bytes - routed_only_bytes``."""
    groups = state_of(offloaded).runtime.groups
    return sum(groups[g].nbytes for g in routed_only_groups(offloaded))


def assert_traffic_matches_plan(offloaded: Any, resident_filled: bool = False) -> OffloadStats:
    """The ledger's bytes and fetches since the last `reset_offload_stats` equal `planned_traffic`: offloading
    happened, and exactly as planned (no group read from host memory, none fetched twice). A planned fetch that
    a copy held within the call served (``held_hits``: parts that code run without a graph called one by one)
    counts as made, its bytes not moved. Routed expert fetches are counted apart: exactly as many as planned,
    each moving at least one expert and their bytes within the plans' bound (`planned_routed`)."""
    stats = offload_stats(offloaded)
    moved, fetches = planned_traffic(offloaded, resident_filled)
    routed_fetches, routed_bound = planned_routed(offloaded)
    assert stats.calls, "no offloaded graph ran since the last reset_offload_stats"
    whole = stats.bytes_transferred - stats.routed_bytes
    held = f" (and {stats.held_hits} served by held copies, {stats.held_hit_bytes} B)" if stats.held_hits else ""
    assert (whole + stats.held_hit_bytes, stats.fetch_count + stats.held_hits) == (moved, fetches), (
        f"moved {whole} B in {stats.fetch_count} whole fetches{held}; the plans say {moved} B in {fetches}")
    assert stats.routed_fetches == routed_fetches, (
        f"{stats.routed_fetches} routed fetches ran; the plans say {routed_fetches}")
    assert stats.routed_bytes <= routed_bound, (
        f"routed fetches moved {stats.routed_bytes} B, above the plans' bound of {routed_bound} B")
    assert (stats.routed_bytes > 0) == (routed_fetches > 0), "routed fetches ran but moved nothing"
    return stats


@contextlib.contextmanager
def one_intra_op_thread():
    """Run the block at one intra-op thread, the setting restored after. Bit-for-bit comparisons on the CPU
    need it: torch's multi-threaded CPU kernels (MKL's GEMM among them) do not promise the same bits from run
    to run, so with many threads a plain model can differ from itself by ~1e-5 between two calls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclasses.dataclass(frozen=True)
class EquivalenceReport:
    max_abs_diff: float
    bytes_transferred: int
    peak_resident_bytes: int
    predicted_peak_bytes: int
    streamed_bytes: int
    # streamed groups that no plan fetches whole, only the rows indices name (a token embedding's table, experts
    # at decode): their bytes, and the routed fetches that ran
    routed_group_bytes: int = 0
    routed_fetches: int = 0
    # the device memory held for weights: the slots of the plan's window, resident groups, weights outside groups
    peak_device_weight_bytes: int = 0


def _max_abs_diff(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest absolute difference between two floating tensors of one shape, NaN where one of them is NaN
    where the other is not (a NaN the plain model does not have is the largest difference there is; ``abs().max()``
    would give NaN only by chance of reduction order, and ``max(worst, nan)`` drops it). Equal values are 0 (two
    equal infinities too); places NaN in both count as equal."""
    g, e = got.detach().float().cpu(), expected.detach().float().cpu()
    if not e.numel():
        return 0.0
    if not torch.equal(g.isnan(), e.isnan()):
        return math.nan
    differs = (g != e) & ~e.isnan()
    return (g[differs] - e[differs]).abs().max().item() if differs.any() else 0.0


def _diff_text(got: torch.Tensor, expected: torch.Tensor, diff: float) -> str:
    """The failure's figure: the max diff, and where it is NaN, how many NaNs the plain model does not have."""
    if not math.isnan(diff):
        return f"max diff {diff}"
    g, e = got.detach().float().cpu(), expected.detach().float().cpu()
    extra, lost = int((g.isnan() & ~e.isnan()).sum()), int((e.isnan() & ~g.isnan()).sum())
    return (f"max diff nan: {extra} NaN(s) where the plain model has a number"
            + (f", {lost} number(s) where it has NaN" if lost else "") + f", of {e.numel()} elements")


def assert_offload_equivalent(model: nn.Module, policy: OffloadPolicy, *args: Any, atol: float | None = None,
                              rtol: float | None = None, calls: int = 2, **kwargs: Any) -> EquivalenceReport:
    """Offload a deep copy of ``model`` under ``policy``, run it ``calls`` times, and check that

    - every output equals the plain model's (bit-exact for the eager compiler on CPU, else within tolerance);
    - offloading happened: each call moved at least the streamed bytes, and the ledger saw device copies;
    - the ledger's peak equals the verified schedule's predicted peak (resident + streamed window);
    - no device copy outlives a call except resident, parked and carried ones (and with ``prefetch_next_call``,
      each call after the first used the copies its previous call prefetched).

    Returns the figures for further assertions. ``model`` itself is left untouched.
    """
    device = policy.torch_device
    # the weights an offloaded graph computes with do not require grad, and torch's matmul of a non-contiguous
    # N-d input takes another path (other rounding) for a weight that does, even under no_grad: the reference
    # computes with weights that do not either (diffusers' UNet3D differs by 6e-7 otherwise)
    plain = copy.deepcopy(model).to(device).eval().requires_grad_(False)
    exact = policy.compiler == "eager" and device.type == "cpu" and atol is None
    # bit for bit only where the kernels are reproducible themselves (`one_intra_op_thread`)
    threads = one_intra_op_thread if exact else contextlib.nullcontext
    with torch.no_grad(), threads():
        expected = tensors_of(plain(*to_device(args, device), **to_device(kwargs, device)))
    offloaded = offload_compile(copy.deepcopy(model).eval(), policy)
    atol = 1e-5 if atol is None else atol
    rtol = 1e-4 if rtol is None else rtol
    worst = 0.0
    for _ in range(calls):
        with threads():
            got = tensors_of(offloaded(*to_device(args, device), **to_device(kwargs, device)))
        assert len(got) == len(expected), f"offloaded model returned {len(got)} tensors, plain {len(expected)}"
        for i, (g, e) in enumerate(zip(got, expected)):
            assert g.shape == e.shape and g.dtype == e.dtype, f"output {i}: {g.shape}/{g.dtype} vs {e.shape}/{e.dtype}"
            diff = _max_abs_diff(g, e) if e.is_floating_point() else 0.0
            # max() keeps its first argument against a NaN (every comparison with NaN is False): once NaN, the
            # worst stays NaN
            worst = worst if math.isnan(worst) else diff if math.isnan(diff) else max(worst, diff)
            if exact:
                assert torch.equal(g, e), f"output {i} differs from the plain model ({_diff_text(g, e, diff)})"
            else:
                torch.testing.assert_close(g, e, atol=atol, rtol=rtol, msg=lambda m: f"output {i}: {m}")
    stats = offload_stats(offloaded)
    runtime = offloaded._offload_runtime  # after the calls: strategy="auto" builds it at the first
    streamed = stats.streamed_bytes
    plans = runtime.graph_plans
    assert plans, "no graph was captured: the model never ran through the offload backend"
    if streamed:
        assert stats.bytes_transferred >= calls * sum(
            g.nbytes for g in runtime.groups if g.streamed and any(
                i.group == g.index for p in plans for i in p.schedule.instances)), "streamed groups were not moved"
        assert stats.fetch_count >= calls, "no fetch happened"
    predicted = max(p.verified.streamed_peak_bytes for p in plans) + stats.resident_bytes
    assert stats.peak_resident_bytes == predicted, (
        f"ledger peak {stats.peak_resident_bytes} B != predicted peak {predicted} B")
    held = stats.resident_bytes + stats.parked_bytes + stats.carried_bytes
    assert stats.live_device_bytes == held, f"{stats.live_device_bytes - held} B of device copies outlived the call"
    if len(plans) == 1 and plans[0].carry_keys and calls > 1:  # one graph: each call takes the last one's copies
        assert stats.carry_hits >= calls - 1, "prefetch_next_call: no call used the copies its previous call carried"
    routed_only = routed_only_bytes(offloaded)
    if routed_only:
        assert stats.routed_fetches >= calls, "groups read by indices were not moved"
    return EquivalenceReport(worst, stats.bytes_transferred, stats.peak_resident_bytes, predicted, streamed,
                             routed_only, stats.routed_fetches, stats.peak_device_weight_bytes)
