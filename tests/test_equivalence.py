"""Random block stacks × strategies × prefetch depth × compiler: outputs equal the plain model, and the
ledger proves the weights moved and how many were on the device at once."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from offload_compiler import OffloadPolicy
from offload_compiler.testing import assert_offload_equivalent, block_models, policies


# each example captures and runs a model twice (about a second on a 2-core machine); the `ci` profile draws the same
# examples every run (derandomize), the `dev` profile new ones each run
@settings(max_examples=12)
@given(block_models(max_blocks=4), policies(compilers=["eager"]))
def test_eager_equivalence_and_ledger(model_and_input, policy):
    model, x = model_and_input
    report = assert_offload_equivalent(model, policy, x)
    assert report.max_abs_diff == 0.0  # eager on CPU runs the very same kernels: bit-exact


@pytest.mark.slow
@settings(max_examples=3)  # each example an inductor compile (5 to 20 s on a 2-core machine)
@given(block_models(max_blocks=3), policies(compilers=["inductor"], strategies=["layerwise", "budget", "sequential"]))
def test_inductor_equivalence_and_ledger(model_and_input, policy):
    model, x = model_and_input
    assert_offload_equivalent(model, policy, x)


@pytest.mark.slow  # up to five blocks per example; the fast subset checks each peak against its plan above
@settings(max_examples=8)
@given(block_models(max_blocks=5), st.integers(0, 3))
def test_layerwise_peak_is_about_prefetch_plus_one_groups(model_and_input, prefetch):
    model, x = model_and_input
    policy = OffloadPolicy(strategy="layerwise", prefetch=prefetch, device="cpu", debug_poison=True)
    report = assert_offload_equivalent(model, policy, x)
    from offload_compiler.grouping import plan_groups
    sizes = sorted((g.nbytes for g in plan_groups(model, policy)), reverse=True)
    assert report.bytes_transferred >= 2 * sum(sizes)  # two calls, every group moved each time
    assert report.peak_resident_bytes <= sum(sizes[:prefetch + 1])  # never more than prefetch+1 groups
    assert report.peak_resident_bytes < sum(sizes) or len(sizes) <= prefetch + 1


class _PermutedLinears(torch.nn.Module):
    """Linear layers over a permuted 5-D input (diffusers' UNet3D ``transformer_in.proj_in``): torch's matmul
    rounds such an input differently when the weight requires grad, even under no_grad."""
    _layerwise_offload_blocks_attr = "blocks"

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x.permute(0, 3, 4, 2, 1)).permute(0, 4, 3, 1, 2)
        return x


def test_eager_equivalence_is_bit_exact_where_torch_rounds_by_requires_grad():
    """The reference computes with weights that do not require grad, as the offloaded graph's do: bit-exact
    (it differed by about 1e-7 with the weights as the model has them)."""
    torch.manual_seed(0)
    report = assert_offload_equivalent(_PermutedLinears(), OffloadPolicy(strategy="layerwise", device="cpu"),
                                       torch.randn(1, 4, 2, 8, 8))
    assert report.max_abs_diff == 0.0 and report.bytes_transferred > 0


@settings(max_examples=4)
@given(block_models(max_blocks=3), policies(strategies=["alternating"], components=["blocks.0"]))
def test_the_component_strategies_draw_valid_policies_for_the_components_named(model_and_input, policy):
    """``policies`` drew ``prefetch_next_call`` for the component strategies, which refuse it, and took no
    components: a user's property-based test failed while drawing."""
    model, x = model_and_input
    assert policy.components == ("blocks.0",) and not policy.prefetch_next_call and not policy.keep_after_use
    assert_offload_equivalent(model, policy, x)


def test_the_component_strategies_without_components_name_the_argument():
    with pytest.raises(ValueError, match=r"components=\['encoder'"):
        policies(strategies=["alternating"])


def test_a_nan_the_plain_model_does_not_have_is_the_largest_difference():
    """``max(worst, nan)`` keeps ``worst``: the difference was reported as 0.0 where an output was NaN."""
    from offload_compiler.testing import _max_abs_diff
    nan, inf = float("nan"), float("inf")
    assert math.isnan(_max_abs_diff(torch.tensor([1.0, nan]), torch.tensor([1.0, 2.0])))  # a NaN of its own
    assert math.isnan(_max_abs_diff(torch.tensor([1.0, 2.0]), torch.tensor([nan, 2.0])))  # a number for a NaN
    assert _max_abs_diff(torch.tensor([nan, inf, 1.5]), torch.tensor([nan, inf, 1.0])) == 0.5  # NaN in both: equal


class _NaNWhenCompiled(torch.nn.Module):
    """Three linear blocks; traced (the offloaded graph), the first element of the output becomes NaN."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        if torch.compiler.is_compiling():
            x = torch.where(torch.arange(x.numel()).view_as(x) == 0, float("nan"), x)
        return x


def test_an_output_nan_where_the_plain_model_has_a_number_is_named_in_the_failure():
    policy = OffloadPolicy(strategy="layerwise", device="cpu", compiler="eager")
    with pytest.raises(AssertionError, match=r"output 0 differs .*max diff nan: 1 NaN\(s\) where the plain model has a number"):
        assert_offload_equivalent(_NaNWhenCompiled(), policy, torch.randn(2, 8))
