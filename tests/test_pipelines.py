"""Real diffusers pipelines (tiny, random weights, word-level tokenizers) offloaded in one line under the block
strategies: the encoders and denoisers stream block by block, the VAE lives on the device, and every method a
pipeline calls either runs the offloaded graphs or refuses. Outputs equal the plain pipeline's bit for bit, and
the bytes and fetches equal the verified plans'."""

import copy
import re

import pytest
import torch

from offload_compiler import (OffloadPolicy, offload_compile, offload_plan, offload_stats, remove_offload,
                              reset_offload_stats)
from offload_compiler.components import DIT_MODULES, ENCODER_MODULES
from offload_compiler.testing import assert_traffic_matches_plan
from offload_compiler.testing.models import vae_roundtrip
from offload_compiler.testing.pipelines import PIPELINES

CPU = dict(device="cpu", debug_poison=True)


def _bytes(module):
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def _run(pipe, kwargs):
    return pipe(**{**kwargs, "generator": torch.Generator().manual_seed(0)}).images


def _plain(name):
    pipe, kwargs = PIPELINES[name]()
    with torch.no_grad():
        return pipe, kwargs, _run(pipe, kwargs)


def _is_block(group):
    return re.search(r"\.\d+(-\d+)?$", group.name) is not None  # blocks are named by their index in the list


def _groups(pipe):
    return {g.name: g for g in pipe._offload_state.runtime.groups}


# each a whole pipeline (encoders, denoiser, VAE) captured: the fast subset runs Flux
@pytest.mark.parametrize("name", [pytest.param("sd3", marks=pytest.mark.slow), "flux",
                                  pytest.param("sd", marks=pytest.mark.slow)])
def test_layerwise_streams_encoders_and_denoiser_block_by_block_and_keeps_the_vae(name):
    pipe, kwargs, expected = _plain(name)
    weights = {n: _bytes(getattr(pipe, n)) for n in ("vae", *DIT_MODULES, *ENCODER_MODULES)
               if isinstance(getattr(pipe, n, None), torch.nn.Module)}
    assert offload_compile(pipe, OffloadPolicy(strategy="layerwise", **CPU)) is pipe
    groups = _groups(pipe)
    components = {g.split(".", 1)[0] for g in groups}
    assert components == set(weights) - {"vae"}  # every encoder and the denoiser stream; the VAE does not
    denoiser = next(n for n in DIT_MODULES if n in weights)
    assert sum(1 for g in groups.values() if g.name.startswith(denoiser + ".") and _is_block(g)) >= 2  # by block
    assert torch.equal(_run(pipe, kwargs), expected)
    stats = assert_traffic_matches_plan(pipe)  # each encoder once, the denoiser per step, exactly as verified
    assert stats.bytes_transferred > sum(weights[c] for c in components)
    assert stats.unmanaged_bytes == weights["vae"] and stats.live_device_bytes == 0
    assert stats.peak_resident_bytes < max(weights[c] for c in components)  # never a whole component at once


@pytest.mark.slow  # a whole pipeline captured
def test_budget_streams_offload_gb_encoders_first_and_keeps_the_rest_resident():
    pipe, kwargs, expected = _plain("flux")
    offload_gb = 0.1 / 1024  # 0.1 MiB: the encoders' blocks, then the transformer's first
    offload_compile(pipe, OffloadPolicy(strategy="budget", offload_gb=offload_gb, **CPU))
    groups = list(_groups(pipe).values())
    streamed = [g for g in groups if g.streamed]
    assert sum(g.nbytes for g in streamed) >= offload_gb * 2**30 and any(not g.streamed for g in groups)
    blocks = [g.name for g in groups if _is_block(g)]
    streamed_blocks = [g.name for g in streamed if _is_block(g)]
    assert streamed_blocks == blocks[:len(streamed_blocks)] and len(streamed_blocks) > 4  # front to back
    assert blocks[0].startswith("text_encoder")
    assert torch.equal(_run(pipe, kwargs), expected)
    reset_offload_stats(pipe)  # the resident groups were copied once, by the first call
    assert torch.equal(_run(pipe, kwargs), expected)
    stats = assert_traffic_matches_plan(pipe, resident_filled=True)
    assert stats.resident_bytes == sum(g.nbytes for g in groups if not g.streamed)


@pytest.mark.slow  # ~25 s: plans, then compiles the encoders again
def test_auto_plans_each_denoiser_at_its_first_call_within_the_budget():
    pipe, kwargs, expected = _plain("flux")
    kept = _bytes(pipe.vae)
    budget_gb = (kept + 0.2 * 2**20) / 2**30  # the VAE, and 0.2 MiB for the rest
    offload_compile(pipe, OffloadPolicy(strategy="auto", device_budget_gb=budget_gb, **CPU))
    with pytest.raises(ValueError, match="no auto offload plan"):
        offload_plan(pipe)  # nothing planned before the transformer runs
    assert torch.equal(_run(pipe, kwargs), expected)
    plan = offload_plan(pipe)
    assert plan.model_name == "FluxPipeline.transformer" and plan.budget_bytes < budget_gb * 2**30 - kept
    # the budget printed is the transformer's share, not the user's device_budget_gb under its own name
    header = str(plan).splitlines()[0]
    assert (f"budget {plan.budget_bytes / 2**20:9.3f} MiB" in header
            and f"(transformer's share of FluxPipeline's device_budget_gb={budget_gb:g} "
                f"({budget_gb * 1024:.3f} MiB)" in header)
    assert f"device_budget_gb={plan.budget_bytes / 2**30:g}" not in header
    groups = _groups(pipe)
    resident = [g.name for g in groups.values() if not g.streamed]
    assert resident and all(name.startswith("transformer") for name in resident)  # only the denoiser's plan keeps any
    assert all(g.streamed for name, g in groups.items() if name.startswith("text_encoder"))
    assert torch.equal(_run(pipe, kwargs), expected)  # the encoders compiled again over the planned runtime
    reset_offload_stats(pipe)
    assert torch.equal(_run(pipe, kwargs), expected)
    stats = assert_traffic_matches_plan(pipe, resident_filled=True)
    assert stats.bytes_transferred > 0 and stats.peak_resident_bytes <= plan.predicted_weights_peak_bytes + max(
        g.nbytes for g in groups.values() if g.name.startswith("text_encoder")) * 2


@pytest.mark.slow  # the VAE's decode and encode each captured
def test_vae_decode_and_encode_of_an_offloaded_vae_run_its_offloaded_graphs():
    model, inputs = vae_roundtrip()
    vae = model.vae
    plain = copy.deepcopy(vae)
    with torch.no_grad():
        latents = plain.encode(inputs["x"]).latent_dist.mode()
        expected = plain.decode(latents).sample
    m = offload_compile(vae, OffloadPolicy(strategy="layerwise", **CPU))
    for route, want in ((lambda: m.decode(latents).sample, expected),
                        (lambda: m.encode(inputs["x"]).latent_dist.mode(), latents)):
        reset_offload_stats(m)
        with torch.no_grad():
            assert torch.equal(route(), want)
        assert_traffic_matches_plan(m)  # the method ran an offloaded graph, never the host weights
    remove_offload(m)
    assert "decode" not in vae.__dict__ and torch.equal(vae.decode(latents).sample, expected)


@pytest.mark.slow  # a whole pipeline captured
def test_a_pipeline_runs_again_after_remove_offload_and_refuses_offloading_twice():
    pipe, kwargs, expected = _plain("flux")
    offload_compile(pipe, OffloadPolicy(strategy="layerwise", **CPU))
    with pytest.raises(ValueError, match="already offloaded"):
        offload_compile(pipe, OffloadPolicy(strategy="budget", offload_gb=1e-4, **CPU))
    assert torch.equal(_run(pipe, kwargs), expected)
    remove_offload(pipe)
    assert all("forward" not in m.__dict__ for m in pipe.transformer.modules())
    with torch.no_grad():
        assert torch.equal(_run(pipe, kwargs), expected)


def test_a_pipeline_without_denoiser_or_encoder_names_its_components():
    class Pipe:
        def __init__(self):
            self.vae = torch.nn.Linear(2, 2)
            self.upscaler = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"Pipe has none of the denoisers.*\['vae', 'upscaler'\].*pipe\.<component>"):
        offload_compile(Pipe(), OffloadPolicy(strategy="layerwise", **CPU))
    with pytest.raises(TypeError, match="strategy='none'.*pipe.to"):
        offload_compile(Pipe(), OffloadPolicy(strategy="none", **CPU))

