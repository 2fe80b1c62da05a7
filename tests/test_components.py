"""Component offload (alternating / sequential), multi-stage models driven stage by stage, diffusion
model-level offload on a container and on a pipeline object."""

import copy
from pathlib import Path

import pytest
from devices import host_and
import torch

from multistage import Omni, omni, thinker
from offload_compiler import OffloadPolicy, offload_compile, offload_stats
from offload_compiler.components import resolve
from offload_compiler.testing.models import diffusion_container, diffusion_pipeline
from offload_compiler.testing import assert_offload_equivalent

CPU = dict(device="cpu", debug_poison=True)
DATA = Path(__file__).parent / "data"


def _bytes(module):
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _named(model, name):
    """The one submodule called ``name``, wherever the installed transformers puts it (from 5.21 the Omni
    thinker's encoders are ``thinker.model.visual``...; before, ``thinker.visual``)."""
    (module,) = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] == name]
    return module


@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_sub_components_in_one_forward_are_never_on_the_device_together(compiler):
    model, args = thinker()
    policy = OffloadPolicy(strategy="alternating", components=["visual", "audio_tower"], compiler=compiler, **CPU)
    report = assert_offload_equivalent(model, policy, *args)
    visual, audio = _bytes(model.visual), _bytes(model.audio_tower)
    assert report.peak_resident_bytes == max(visual, audio)  # one at a time, the other not even prefetched
    assert report.bytes_transferred >= 2 * visual + audio  # the last one stays (latency-minimising)


def test_stages_called_one_by_one_alternate_on_the_device():
    model, args = omni()
    with torch.no_grad():
        expected = model.token2wav(model.talker(model.thinker(*args)))
    m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="alternating", **CPU))  # None: discovered
    assert [g.name for g in m._offload_runtime.groups] == ["talker", "thinker", "token2wav"]
    sizes = {name: _bytes(getattr(model, name)) for name in ("thinker", "talker", "token2wav")}
    for call in range(2):
        live_after = []
        with torch.no_grad():
            h = m.thinker(*args)
            live_after.append(offload_stats(m).live_device_bytes)
            t = m.talker(h)
            live_after.append(offload_stats(m).live_device_bytes)
            out = m.token2wav(t)
            live_after.append(offload_stats(m).live_device_bytes)
        assert torch.equal(out, expected)
        # latency-minimising: each stage stays after its forward, alone, until the next one needs the room
        assert live_after == [sizes["thinker"], sizes["talker"], sizes["token2wav"]]
    stats = offload_stats(m)
    assert stats.peak_resident_bytes == max(sizes.values())
    seed_claim = 1 - stats.peak_resident_bytes / sum(sizes.values())
    assert seed_claim > 0.3  # the seeds promise 30-50% for multi-stage models


def test_memory_saving_mode_evicts_after_use():
    model, args = omni()
    m = offload_compile(model, OffloadPolicy(strategy="alternating", keep_after_use=False, **CPU))
    with torch.no_grad():
        m.thinker(*args)
    assert offload_stats(m).live_device_bytes == 0 and offload_stats(m).parked_bytes == 0


def test_sequential_components_fetch_on_demand_with_prefetch():
    model, args = thinker()
    policy = OffloadPolicy(strategy="sequential", components=["visual", "audio_tower"], prefetch=1, **CPU)
    report = assert_offload_equivalent(model, policy, *args)
    assert report.peak_resident_bytes == _bytes(model.visual) + _bytes(model.audio_tower)  # next one prefetched
    assert report.bytes_transferred == 2 * (_bytes(model.visual) + _bytes(model.audio_tower))


def test_component_names_paths_and_globs():
    model = Omni()
    assert resolve(model, ["visual"]) == ["thinker.visual"]
    assert resolve(model, ["thinker.audio_tower", "talker"]) == ["thinker.audio_tower", "talker"]
    assert resolve(model, ["visual.*"]) == ["thinker.visual.a", "thinker.visual.b"]
    assert resolve(model, ["thinker.*"]) == ["thinker.audio_tower", "thinker.language_model", "thinker.lm_head",
                                             "thinker.visual"]
    assert resolve(model, None) == ["talker", "thinker", "token2wav"]


def test_unknown_component_lists_the_real_ones_and_touches_nothing():
    model, args = omni()
    expected = model(*args).detach()
    with pytest.raises(ValueError, match="unknown component 'vision'.*'talker', 'thinker', 'token2wav'"):
        offload_compile(model, strategy="alternating", components=["vision"], device="cpu")
    assert torch.equal(model(*args), expected)


def test_the_rest_of_the_model_stays_on_the_device_and_is_reported():
    model, args = thinker()
    m = offload_compile(model, OffloadPolicy(strategy="alternating", components=["visual", "audio_tower"], **CPU))
    m(*args)
    stats = offload_stats(m)
    assert stats.unmanaged_bytes == _bytes(model.language_model) + _bytes(model.lm_head)
    assert stats.peak_device_weight_bytes == stats.peak_resident_bytes + stats.unmanaged_bytes
    assert "kept on the device" in str(stats)


@pytest.mark.slow  # CLIP, Flux and a VAE captured per component (inductor: a minute); fast: the pipeline object below
@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.trial)])
def test_model_level_offload_on_a_diffusion_container(compiler):
    model, kwargs = diffusion_container()
    report = assert_offload_equivalent(model, OffloadPolicy(strategy="model", compiler=compiler, **CPU), **kwargs)
    dit, encoder = _bytes(model.transformer), _bytes(model.text_encoder)
    assert report.peak_resident_bytes == max(dit, encoder)  # mutually exclusive; the VAE is not managed


def test_model_level_offload_on_a_pipeline_object():
    pipe, kwargs = diffusion_pipeline()
    expected = pipe(**kwargs)
    dit, encoder = _bytes(pipe.transformer), _bytes(pipe.text_encoder)
    offloaded = offload_compile(copy.deepcopy(pipe), OffloadPolicy(strategy="model", **CPU))
    for _ in range(2):
        assert torch.equal(offloaded(**kwargs), expected)
    stats = offload_stats(offloaded)
    assert stats.peak_resident_bytes == max(dit, encoder) and stats.fetch_count == 4
    assert stats.unmanaged_bytes == _bytes(pipe.vae)


@pytest.mark.parametrize("keep, message", [(("transformer", "vae"), "No encoder modules found, skipping model-level"),
                                           (("text_encoder", "vae"), "No DiT/transformer modules found")])
def test_model_level_without_dit_or_encoders_warns_and_offloads_nothing(keep, message):
    model, _ = diffusion_container()
    partial = torch.nn.Module()
    for name in keep:
        partial.add_module(name, getattr(model, name))
    with pytest.warns(UserWarning, match=message):
        m = offload_compile(partial, OffloadPolicy(strategy="model", **CPU))
    assert m._offload_runtime.groups == [] and offload_stats(m).total_bytes == 0
    held = [t for n in keep for t in list(getattr(model, n).parameters()) + list(getattr(model, n).buffers())]
    assert offload_stats(m).unmanaged_bytes == sum(t.numel() * t.element_size() for t in held)


def test_model_level_on_a_language_model_names_layerwise_as_the_fix():
    from offload_compiler.testing.models import llama
    model, _ = llama()
    with pytest.warns(UserWarning, match="No DiT/transformer modules found") as caught:
        offload_compile(model, OffloadPolicy(strategy="model", **CPU))
    (message,) = [str(w.message) for w in caught if "No DiT" in str(w.message)]
    assert "strategy='layerwise'" in message and "language model" in message


# -- real Qwen2.5-Omni architectures (tiny, random weights) ----------------------------------------------

@pytest.mark.slow  # ~12 s; the alternating strategy's fast tests are the small models above
def test_qwen25_omni_thinker_text_image_audio_offloads_visual_and_audio_tower():
    from offload_compiler.testing.omni_models import omni_thinker
    model, kwargs = omni_thinker()
    policy = OffloadPolicy(strategy="alternating", components=["visual", "audio_tower"], **CPU)
    report = assert_offload_equivalent(model, policy, **kwargs)
    visual, audio = _bytes(_named(model, "visual")), _bytes(_named(model, "audio_tower"))
    assert report.peak_resident_bytes <= max(visual, audio) + 1024  # one encoder at a time (+ its buffers)
    assert report.bytes_transferred >= visual + audio


@pytest.mark.slow  # about a minute on a 2-core machine
@pytest.mark.trial
def test_qwen25_omni_driven_stage_by_stage_alternates_thinker_talker_token2wav(capsys, monkeypatch, tmp_path):
    """examples/multistage_omni.py drives the tiny Qwen2.5-Omni stage by stage (thinker, talker, token2wav, the
    stages named as vllm-omni's engine args name them) and checks the outputs against the plain model: run here
    with debug_poison, it is also this test's model (one capture of the three stages, not two)."""
    from test_examples import check_example_output, run_example
    stdout, result = run_example("multistage_omni.py", "--debug-poison", capsys=capsys, monkeypatch=monkeypatch,
                                 tmp_path=tmp_path)
    check_example_output(stdout, "outputs equal the plain model: True")  # every stage's outputs, bit for bit
    m = result["stages"]
    assert m._offload_runtime.policy.debug_poison
    assert resolve(m, None) == ["talker", "thinker", "token2wav"]  # the stages it names are the ones discovered
    groups = {g.name: g.nbytes for g in m._offload_runtime.groups}
    assert set(groups) == {"thinker", "talker", "token2wav"}
    live = result["live_after_each_stage"]
    assert live == [groups["thinker"], groups["talker"], groups["token2wav"]]  # one stage on the device
    stats = offload_stats(m)
    # one stage at a time, and beside it the slot of the rows a lookup moved (the talker stage looks up the
    # thinker's token embedding while the thinker is still parked: rows, not the thinker, move)
    assert max(groups.values()) <= stats.peak_resident_bytes <= max(groups.values()) + stats.routed_bytes
    assert 1 - stats.peak_resident_bytes / sum(groups.values()) >= 0.3  # the seeds' 30-50% for multi-stage


@pytest.mark.slow  # a diffusion pipeline too
def test_remove_offload_restores_components_called_on_their_own():
    from offload_compiler import remove_offload
    model, args = omni()
    with torch.no_grad():
        expected = model.token2wav(model.talker(model.thinker(*args)))
    m = offload_compile(model, OffloadPolicy(strategy="alternating", **CPU))
    with torch.no_grad():
        m.talker(m.thinker(*args))
    assert offload_stats(m).fetch_count >= 2  # both components went through the device before removal
    plain = remove_offload(m)
    assert all("forward" not in sub.__dict__ for sub in plain.modules())
    with torch.no_grad():
        assert torch.equal(plain.token2wav(plain.talker(plain.thinker(*args))), expected)
    pipe, kwargs = diffusion_pipeline()
    expected = pipe(**kwargs)
    pipe = offload_compile(pipe, OffloadPolicy(strategy="model", **CPU))
    pipe(**kwargs)
    assert offload_stats(pipe).bytes_transferred > 0
    pipe = remove_offload(pipe)
    assert not hasattr(pipe, "_offload_runtime") and "forward" not in pipe.transformer.__dict__
    assert torch.equal(pipe(**kwargs), expected)


def test_a_misspelt_component_gets_the_closest_name():
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    model.head = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="unknown component 'blokcs'.*did you mean 'blocks'"):
        resolve(model, ["blokcs"])


@pytest.mark.parametrize("strategy,fields", [("layerwise", {}), ("budget", {"offload_gb": 1e-4}),
                                             ("auto", {"device_budget_gb": 1e-3})])
def test_components_with_a_block_strategy_on_a_model_are_refused_naming_the_ways_and_touch_nothing(strategy, fields):
    """On an nn.Module a block strategy streams the blocks of the whole model: components= (which names a
    pipeline's streamed components) is refused before anything changes, naming what streams part of a model;
    ``auto``, which groups at its first call, is refused at offload_compile too."""
    model, args = omni()
    expected = model(*args).detach()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"components=\['thinker'\] with strategy=.*Omni is a model.*"
                                         r"strategy='sequential' with components.*offload_gb.*blocks_attr"):
        offload_compile(model, OffloadPolicy(strategy=strategy, components=["thinker"], **fields, **CPU))
    assert type(model) is Omni and "_offload_state" not in model.__dict__
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(model(*args), expected)


# -- the seeds' stage YAML: each stage's engine args on the model of that stage --------------------------

def _stage_policy(yaml_name, stage_id, device):
    from offload_compiler import load_stage_configs
    (stage,) = [s for s in load_stage_configs(DATA / yaml_name) if s.stage_id == stage_id]
    return stage.policy.replace(device=device, debug_poison=True)


def _devices():
    from offload_compiler.testing import simulated_device
    return host_and(simulated_device())


@pytest.mark.parametrize("device", _devices())
def test_a_stage_model_offloaded_without_components_is_on_the_device_only_while_it_runs(device):
    """The seeds' stage 2 (``model_stage: code2wav, cpu_offload_enabled: true  # Offload code2wav when not in
    use``, no components): the code2wav model holds none of the known component names, so it is the one
    component itself, fetched whole for each call and given back after it, device memory included."""
    from multistage import code2wav
    from offload_compiler import describe_plan, plan_summary, reset_offload_stats
    from offload_compiler.testing import assert_traffic_matches_plan
    model, (codes,) = code2wav()
    with torch.no_grad():
        expected = model(codes)
    policy = _stage_policy("seed_selective.yaml", 2, device)
    assert (policy.strategy, policy.components, policy.keep_after_use) == ("alternating", None, True)
    dev = torch.get_device_module(device) if device != "cpu" else None
    if dev is not None:
        dev.synchronize()
        base = dev.memory_allocated()
    m = offload_compile(copy.deepcopy(model), policy)
    (group,) = m._offload_runtime.groups
    assert (group.name, group.streamed, group.nbytes) == ("(root)", True, _bytes(model))
    assert "the whole model, its one component: fetched for each call" in describe_plan(m)
    with torch.no_grad():
        for call in range(3):
            if call == 1:
                reset_offload_stats(m)
                if dev is not None:
                    dev.reset_peak_memory_stats()
            out = m(codes.to(device))
            torch.testing.assert_close(out.cpu(), expected, atol=0, rtol=0)
            del out
            stats = offload_stats(m)
            # between calls: no copy alive, none parked, and (on a device with an allocator) no memory held
            assert (stats.live_device_bytes, stats.parked_bytes, stats.unmanaged_bytes) == (0, 0, 0)
            if dev is not None:
                dev.synchronize()
                assert dev.memory_allocated() == base
    stats = assert_traffic_matches_plan(m)  # the plan's fetches and bytes, every call
    assert (stats.calls, stats.fetch_count, stats.bytes_transferred) == (2, 2, 2 * _bytes(model))
    assert stats.peak_resident_bytes == _bytes(model)  # the ledger: the whole model while it runs
    if dev is not None:
        assert dev.max_memory_allocated() - base >= _bytes(model)  # it ran on the device, weights and all
    saving = plan_summary(m)["saving"]
    assert saving["device_weight_peak_bytes"] == _bytes(model) and saving["between_calls_bytes"] == 0
    assert "held only while a call runs" in describe_plan(m) and "between calls 0 B" in str(stats)


def _talker_with_visual():
    """A stage model with a visual encoder and a language model (the seeds' stage 1 comment: offload visual,
    keep language_model on GPU)."""
    return thinker()


def _talker():
    torch.manual_seed(0)
    from multistage import MLP
    return MLP(20, 8, 96).eval(), (torch.randn(1, 4, 20),)


@pytest.mark.parametrize("yaml_name, stage_id, build, streamed", [
    ("seed_selective.yaml", 0, thinker, []),  # cpu_offload_enabled: false: nothing streams
    ("seed_selective.yaml", 1, _talker_with_visual, ["visual"]),
    ("seed_selective.yaml", 2, omni, ["talker", "thinker", "token2wav"]),  # a model holding its stages
    ("seed_stage_config.yaml", 0, thinker, []),
    ("seed_stage_config.yaml", 1, _talker_with_visual, ["visual"]),
    ("seed_component_level.yaml", 0, omni, ["thinker.visual", "thinker.audio_tower"]),
])
@pytest.mark.parametrize("device", _devices())
def test_every_stage_of_the_seed_yaml_examples_streams_as_configured(yaml_name, stage_id, build, streamed, device):
    model, args = build()
    with torch.no_grad():
        expected = model(*args)
    policy = _stage_policy(yaml_name, stage_id, device)
    if policy.strategy != "none":
        policy = policy.replace(keep_after_use=False)  # per-call traffic fixed: each call moves the plan's bytes
    m = offload_compile(copy.deepcopy(model), policy)
    args = tuple(a.to(device) for a in args)
    from offload_compiler import reset_offload_stats
    from offload_compiler.testing import assert_traffic_matches_plan
    with torch.no_grad():
        m(*args)
        reset_offload_stats(m)
        torch.testing.assert_close(m(*args).cpu(), expected, atol=0, rtol=0)
    groups = {g.name: g.nbytes for g in m._offload_runtime.groups if g.streamed}
    assert sorted(groups) == sorted(streamed)
    stats = assert_traffic_matches_plan(m, resident_filled=not streamed)
    assert stats.bytes_transferred == sum(groups.values())  # each component once per call
    resident = sum(g.nbytes for g in m._offload_runtime.groups if not g.streamed)  # strategy none: every group
    assert stats.peak_resident_bytes == resident + max(groups.values(), default=0)  # one component at a time
    assert stats.unmanaged_bytes + stats.total_bytes == _bytes(model)


@pytest.mark.parametrize("yaml_name", ["seed_selective.yaml", "seed_stage_config.yaml"])
def test_a_seed_stage_naming_a_component_its_model_lacks_is_refused_naming_the_fix(yaml_name):
    """Stage 1 names ``visual``; a talker stage model without one is refused before anything changes, with the
    names it has and the two ways out (name those, or leave the components unset)."""
    model, args = _talker()
    expected = model(*args).detach()
    with pytest.raises(ValueError, match=r"unknown component 'visual' in MLP.*top-level modules: \['a', 'b'\]. "
                                         r"Name those .*cpu_offload_components.*or leave components unset"):
        offload_compile(model, _stage_policy(yaml_name, 1, "cpu"))
    assert type(model).__name__ == "MLP" and torch.equal(model(*args), expected)


# -- vision-language models under sequential: the tower and projector stream, and a plan saving little says so --

def _llava(vision_layers=3, vision_hidden=32):
    import transformers as T
    torch.manual_seed(0)
    text = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    vision = T.CLIPVisionConfig(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                                num_hidden_layers=vision_layers, num_attention_heads=2, image_size=16, patch_size=4)
    cfg = T.LlavaConfig(vision_config=vision, text_config=text, image_token_id=5, vision_feature_layer=-2,
                        image_seq_length=16)
    model = T.LlavaForConditionalGeneration(cfg).eval()
    ids = torch.randint(10, 128, (1, 24))
    ids[0, 2:18] = 5
    return model, dict(input_ids=ids, pixel_values=torch.randn(1, 3, 16, 16), use_cache=False)


def _paligemma():
    import transformers as T
    torch.manual_seed(0)
    text = T.GemmaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=128)
    vision = T.SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                                  image_size=16, patch_size=4, projection_dim=64)
    cfg = T.PaliGemmaConfig(vision_config=vision, text_config=text, image_token_index=5, projection_dim=64)
    cfg.text_config.num_image_tokens = 16
    model = T.PaliGemmaForConditionalGeneration(cfg).eval()
    ids = torch.randint(10, 128, (1, 24))
    ids[0, :16] = 5
    return model, dict(input_ids=ids, pixel_values=torch.randn(1, 3, 16, 16), use_cache=False)


def _to(inputs, device):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def test_the_vision_parts_of_vision_language_models_are_components_and_clip_has_none():
    import transformers as T
    from offload_compiler.components import discover
    cases = {
        T.LlavaForConditionalGeneration: ["model.vision_tower", "model.language_model", "model.multi_modal_projector"],
        T.PaliGemmaForConditionalGeneration: ["model.vision_tower", "model.language_model",
                                              "model.multi_modal_projector"],
        T.Gemma3ForConditionalGeneration: ["model.vision_tower", "model.language_model", "model.multi_modal_projector"],
        T.MllamaForConditionalGeneration: ["model.vision_model", "model.language_model", "model.multi_modal_projector"],
        T.Qwen2VLForConditionalGeneration: ["model.visual", "model.language_model"],
        T.Qwen2_5_VLForConditionalGeneration: ["model.visual", "model.language_model"],
        # no language_model beside its vision_model: CLIP's names are a dual encoder's, streamed module by module
        T.Idefics3ForConditionalGeneration: [],
        T.CLIPModel: [],
        T.CLIPVisionModel: [],
    }
    for cls, expected in cases.items():
        config = cls.config_class()
        text = getattr(config, "text_config", None)
        if text is not None and (text.pad_token_id or 0) >= text.vocab_size:  # Idefics3's default, transformers 5.4
            text.pad_token_id = None
        with torch.device("meta"):
            model = cls(config)
        assert sorted(discover(model)) == sorted(expected), cls.__name__


@pytest.mark.slow  # 12 s each; the fast subset's: tests/test_graph_breaks.py's vision tower under sequential
@pytest.mark.parametrize("device", ["cpu", _devices()[1]])
@pytest.mark.parametrize("build, streamed", [
    (lambda: _llava(vision_layers=4, vision_hidden=64), ["model.vision_tower", "model.multi_modal_projector"]),
    ], ids=["llava"])
def test_sequential_streams_the_vision_tower_and_projector_of_a_vision_language_model(build, streamed, device):
    """Each component one at a time (prefetch=0; offload_buffers=False keeps the int64 position ids on the device,
    so the components share one device slot): the device holds the largest (about half the model) and what no
    component covers, not the tower and projector kept there as weights outside every group."""
    import warnings
    from offload_compiler import OffloadSavingWarning, plan_summary, reset_offload_stats
    from offload_compiler.testing import assert_traffic_matches_plan
    model, inputs = build()
    with torch.no_grad():
        expected = model(**inputs).logits
    with warnings.catch_warnings():  # about half the model: at the warning's bound
        warnings.simplefilter("ignore", OffloadSavingWarning)
        m = offload_compile(model, OffloadPolicy(strategy="sequential", prefetch=0, offload_buffers=False,
                                                device=device))
    groups = {g.name: g.streamed for g in m._offload_runtime.groups}
    assert all(groups.get(name) for name in streamed + ["model.language_model"]), groups
    with torch.no_grad():
        m(**_to(inputs, device))
        reset_offload_stats(m)
        out = m(**_to(inputs, device)).logits
    torch.testing.assert_close(out.cpu(), expected)  # the graphs may fuse differently: float rounding
    assert_traffic_matches_plan(m)
    assert plan_summary(m)["saving"]["share_of_model"] < 0.6  # the old plan, the tower kept: above 100%


@pytest.mark.slow  # about 20 s each: the fast subset streams a vision-language model under sequential above
@pytest.mark.parametrize("device", _devices())
def test_sequential_saving_little_on_a_vision_language_model_warns_naming_layerwise_which_saves(device):
    """The language model is one component, most of the model: sequential keeps nearly all of it on the device
    (with prefetch=1 the tower beside it, and the lm_head no component covers). The warning says so, naming the
    group and the kept module, and the fix it names saves."""
    from offload_compiler import OffloadSavingWarning, plan_summary
    from offload_compiler.testing import assert_traffic_matches_plan
    model, inputs = _llava()
    with torch.no_grad():
        expected = model(**inputs).logits
    with pytest.warns(OffloadSavingWarning, match=r"(?s)sequential keeps up to (9\d|100)% .*'model.language_model', "
                                                  r"holds 79% .*outside its groups .*'lm_head'.* Fix: "
                                                  r"strategy='layerwise' .*OffloadPolicy\(strategy='layerwise'"):
        m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy="sequential", device=device))
    with torch.no_grad():
        m(**_to(inputs, device))
    assert plan_summary(m)["saving"]["share_of_model"] > 0.9
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", OffloadSavingWarning)
        fixed = offload_compile(model, OffloadPolicy(strategy="layerwise", device=device))
    with torch.no_grad():
        fixed(**_to(inputs, device))
        from offload_compiler import reset_offload_stats
        reset_offload_stats(fixed)
        out = fixed(**_to(inputs, device)).logits
    torch.testing.assert_close(out.cpu(), expected)  # the graphs may fuse differently: float rounding
    assert_traffic_matches_plan(fixed)
    assert plan_summary(fixed)["saving"]["share_of_model"] < 0.5
