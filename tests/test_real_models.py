"""Tiny real transformers and diffusers architectures, random weights: same outputs as the plain model
under both compilers, and the ledger shows the weights streamed through the device."""

import pytest

from offload_compiler import OffloadPolicy
from offload_compiler.testing.models import BUILDERS
from offload_compiler.testing import assert_offload_equivalent

pytest.importorskip("transformers")
pytest.importorskip("diffusers")


# the fast subset runs Llama and Qwen2 (with its KV cache) eagerly, GPT-2 in the tied-embedding test below and
# Flux in tests/test_pipelines.py; the other models and every inductor compile (up to minutes each) are slow
SLOW_EAGER = {"gpt2", "flux", "dit", "unet", "diffusion_container"}
TRIAL_INDUCTOR = {"unet", "diffusion_container", "flux", "dit", "qwen2", "gpt2"}  # up to a minute of inductor
# compiles each; llama stays in the suite under inductor (qwen2's and gpt2's eager runs too)


def _cases():
    for name in BUILDERS:
        for compiler in ("eager", "inductor"):
            marks = [pytest.mark.slow] if compiler == "inductor" or name in SLOW_EAGER else []
            if compiler == "inductor" and name in TRIAL_INDUCTOR:
                marks.append(pytest.mark.trial)
            yield pytest.param(name, compiler, marks=marks, id=f"{name}-{compiler}")


@pytest.mark.parametrize("name, compiler", list(_cases()))
def test_layerwise_matches_plain_model(name, compiler):
    model, kwargs = BUILDERS[name]()
    policy = OffloadPolicy(strategy="layerwise", device="cpu", prefetch=1, compiler=compiler, debug_poison=True)
    report = assert_offload_equivalent(model, policy, **kwargs)
    from offload_compiler.grouping import plan_groups
    sizes = sorted((g.nbytes for g in plan_groups(model, policy)), reverse=True)
    # two calls, every weight moved each time: whole, or the token embedding's rows looked up
    assert report.bytes_transferred >= 2 * (sum(sizes) - report.routed_group_bytes)
    if name in ("llama", "qwen2"):  # untied token embeddings: the table is read by lookup alone
        assert report.routed_group_bytes == model.get_input_embeddings().weight.nbytes and report.routed_fetches == 2
    assert report.peak_resident_bytes <= sizes[0] + sizes[1] < sum(sizes)  # prefetch 1: two groups at most


@pytest.mark.parametrize("strategy, extra", [pytest.param("budget", {"offload_gb": 2e-4}, marks=pytest.mark.slow),
                                             pytest.param("sequential", {}, marks=pytest.mark.slow),
                                             pytest.param("none", {}, marks=pytest.mark.slow)])
def test_other_strategies_on_llama(strategy, extra):
    model, kwargs = BUILDERS["llama"]()
    policy = OffloadPolicy(strategy=strategy, device="cpu", debug_poison=True, **extra)
    report = assert_offload_equivalent(model, policy, **kwargs)
    if strategy == "budget":
        assert 0 < report.streamed_bytes < sum(p.numel() * 4 for p in model.parameters())


def test_gpt2_tied_embedding_is_fetched_at_both_ends():
    model, kwargs = BUILDERS["gpt2"]()
    policy = OffloadPolicy(strategy="layerwise", device="cpu", debug_poison=True)
    from offload_compiler import offload_compile
    m = offload_compile(model, policy)
    m(**kwargs)
    plan = m._offload_runtime.graph_plans[0]
    wte = next(g.index for g in m._offload_runtime.groups if g.name == "transformer.wte")
    assert [i.group for i in plan.schedule.instances].count(wte) == 2
