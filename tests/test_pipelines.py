"""Real diffusers pipelines (tiny, random weights, word-level tokenizers) offloaded in one line under the block
strategies: the encoders and denoisers stream block by block, the VAE lives on the device unless
``components=`` names it, and every method a pipeline calls either runs the offloaded graphs or refuses.
Outputs equal the plain pipeline's bit for bit, and the bytes and fetches equal the verified plans'."""

import copy
import re

import pytest
import torch

from offload_compiler import (OffloadPolicy, describe_plan, offload_compile, offload_plan, offload_stats,
                              remove_offload, reset_offload_stats)
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


@pytest.mark.slow  # about 7 s: auto plans a pipeline twice
def test_auto_too_small_for_a_pipeline_names_the_pipelines_budget_that_works():
    """A denoiser's share too small: the error names the budget the pipeline needs (kept + the encoders' window +
    the denoiser's smallest plan), which is above what was given, and that budget plans."""
    from offload_compiler import InfeasibleBudgetError
    pipe, kwargs, expected = _plain("flux")
    given = _bytes(pipe.vae) + 40_000  # the VAE and a little: the transformer's share is too small
    offload_compile(pipe, OffloadPolicy(strategy="auto", device_budget_gb=given / 2**30, **CPU))
    with pytest.raises(InfeasibleBudgetError, match="too small for FluxPipeline: its transformer's smallest plan") as error:
        _run(pipe, kwargs)
    advised = float(re.search(r"Set device_budget_gb >= ([0-9.e-]+)", str(error.value)).group(1))
    assert error.value.needed_bytes > given and advised * 2**30 >= error.value.needed_bytes
    assert str(error.value).count("device_budget_gb >=") == 1  # one figure to set: the pipeline's
    pipe, kwargs, expected = _plain("flux")
    offload_compile(pipe, OffloadPolicy(strategy="auto", device_budget_gb=advised, **CPU))
    assert torch.equal(_run(pipe, kwargs), expected)


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



SD3_WITH_VAE = ["text_encoder", "text_encoder_2", "transformer", "vae"]


def _weights(pipe):
    """Every component's weights, cloned (an offloaded component's host masters read as its weights)."""
    return {f"{name}.{key}": value.detach().clone() for name in SD3_WITH_VAE
            for key, value in getattr(pipe, name).state_dict().items()}


def _unchanged(pipe, before):
    return _weights(pipe).keys() == before.keys() and all(
        torch.equal(value, before[key]) for key, value in _weights(pipe).items())


def _vae_decoder_bytes(groups):
    return sum(g.nbytes for name, g in groups.items() if name.startswith(("vae.decoder.", "vae.post_quant_conv")))


@pytest.mark.slow  # a whole pipeline captured
def test_components_naming_the_vae_stream_it_block_by_block_and_its_decode_by_hand_streams():
    """``components=[..., "vae"]`` under layerwise: the VAE is grouped block by block like the encoders and the
    denoiser, nothing is kept on the device, the images equal the plain pipeline's, the traffic is the verified
    plan's (the VAE's decode included), and ``pipe.vae.decode`` called by hand fetches the decoder's groups."""
    pipe, kwargs, expected = _plain("sd3")
    plain_vae = copy.deepcopy(pipe.vae)
    vae_bytes = _bytes(pipe.vae)
    offload_compile(pipe, OffloadPolicy(strategy="layerwise", components=SD3_WITH_VAE, **CPU))
    groups = _groups(pipe)
    vae_groups = [g for name, g in groups.items() if name.startswith("vae.")]
    assert {name.split(".", 1)[0] for name in groups} == set(SD3_WITH_VAE)
    assert sum(g.nbytes for g in vae_groups) == vae_bytes and all(g.streamed for g in vae_groups)
    assert "vae.decoder.up_blocks.0" in groups and "vae.decoder.up_blocks.0" in describe_plan(pipe)
    assert torch.equal(_run(pipe, kwargs), expected)
    stats = assert_traffic_matches_plan(pipe)
    assert stats.unmanaged_bytes == 0 and "kept on the device" not in str(offload_stats(pipe))
    # nothing kept on the device: the weight memory held is the slots the streamed copies share (the comparison
    # with the VAE kept on the device: tests/test_simulated_device.py, where the device's allocations are counted)
    assert stats.peak_device_weight_bytes == stats.pool_bytes < stats.total_bytes
    latents = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        want = plain_vae.decode(latents).sample
    reset_offload_stats(pipe)
    with torch.no_grad():
        assert torch.equal(pipe.vae.decode(latents).sample, want)
    stats = assert_traffic_matches_plan(pipe)
    assert stats.bytes_transferred == _vae_decoder_bytes(groups) > 0 and stats.peak_resident_bytes < vae_bytes


def test_a_component_name_that_is_not_one_lists_the_pipelines_components_and_touches_nothing():
    pipe, _ = PIPELINES["sd3"]()
    classes = {name: type(getattr(pipe, name)) for name in SD3_WITH_VAE}
    before = _weights(pipe)
    with pytest.raises(ValueError, match=r"\['vea'\] is no component of StableDiffusion3Pipeline \(did you mean "
                                         r"'vae'\?\).*holding weights: "
                                         r"\['vae', 'text_encoder', 'text_encoder_2', 'transformer'\]"):
        offload_compile(pipe, OffloadPolicy(strategy="layerwise", components=["transformer", "vea"], **CPU))
    assert "_offload_state" not in pipe.__dict__ and _unchanged(pipe, before)
    assert all(type(getattr(pipe, name)) is cls for name, cls in classes.items())


@pytest.mark.slow  # a whole pipeline captured
def test_a_vae_offloaded_on_its_own_refuses_its_pipeline_naming_the_components_that_stream_it():
    """VAE first, then the pipeline: refused, naming the fix that streams the VAE with the pipeline (give it back,
    offload the pipeline with ``components=[..., 'vae']``). The pipeline still runs, its weights bit for bit
    unchanged, and the fix named works."""
    pipe, kwargs, expected = _plain("sd3")
    before = _weights(pipe)
    policy = OffloadPolicy(strategy="layerwise", **CPU)
    offload_compile(pipe.vae, policy)
    fix = (r"remove_offload\(pipe\.vae\); offload_compile\(pipe, OffloadPolicy\(strategy='layerwise', .*"
           r"components=\['text_encoder', 'text_encoder_2', 'transformer', 'vae'\]\)\)")
    with pytest.raises(ValueError, match="vae belongs to AutoencoderKL, which is offloaded already, on its "
                                         "own.*" + fix):
        offload_compile(pipe, policy)
    assert "_offload_state" not in pipe.__dict__ and "_offload_state" not in pipe.transformer.__dict__
    assert torch.equal(_run(pipe, kwargs), expected) and _unchanged(pipe, before)
    remove_offload(pipe.vae)
    offload_compile(pipe, policy.replace(components=SD3_WITH_VAE))
    assert any(name.startswith("vae.") for name in _groups(pipe))
    assert torch.equal(_run(pipe, kwargs), expected)
    assert assert_traffic_matches_plan(pipe).unmanaged_bytes == 0


@pytest.mark.slow  # a whole pipeline captured
def test_a_component_of_an_offloaded_pipeline_is_refused_naming_the_pipeline_policy_that_streams_it():
    """Pipeline first, then its VAE: refused, saying the VAE is a component of the offloaded pipeline kept on the
    device and naming the policy that streams it too; a streamed component is refused as the pipeline's. The
    pipeline still runs as offloaded, weights bit for bit unchanged, and the fix named works."""
    pipe, kwargs, expected = _plain("sd3")
    before = _weights(pipe)
    policy = OffloadPolicy(strategy="layerwise", **CPU)
    offload_compile(pipe, policy)
    state = pipe._offload_state
    with pytest.raises(ValueError, match=r"vae is a component of the offloaded StableDiffusion3Pipeline, kept on the "
                                         r"device.*offload_compile\(remove_offload\(pipe\), OffloadPolicy\(strategy="
                                         r"'layerwise', .*components=\['text_encoder', 'text_encoder_2', "
                                         r"'transformer', 'vae'\]\)\)"):
        offload_compile(pipe.vae, policy)
    with pytest.raises(ValueError, match=r"transformer is a component of the offloaded StableDiffusion3Pipeline, "
                                         r"which streams it.*offload_compile\(remove_offload\(pipe\), policy\)"):
        offload_compile(pipe.transformer, policy)
    assert pipe._offload_state is state and pipe.vae.__dict__["_offload_state"] is state
    assert torch.equal(_run(pipe, kwargs), expected) and _unchanged(pipe, before)
    assert assert_traffic_matches_plan(pipe).unmanaged_bytes == _bytes(pipe.vae)
    offload_compile(remove_offload(pipe), policy.replace(components=SD3_WITH_VAE))
    assert torch.equal(_run(pipe, kwargs), expected)
    assert assert_traffic_matches_plan(pipe).unmanaged_bytes == 0
