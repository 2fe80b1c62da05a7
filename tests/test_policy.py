import pytest
import torch

from offload_compiler import OffloadPolicy


def test_defaults():
    p = OffloadPolicy()
    assert p.strategy == "layerwise" and p.prefetch == 1 and p.blocks_per_group == 1
    assert p.device == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert p.pin_memory is True and p.compiler == "eager"


def test_frozen():
    with pytest.raises(Exception):
        OffloadPolicy().prefetch = 3


@pytest.mark.parametrize("fields, words", [
    ({"strategy": "fastest"}, ["strategy", "layerwise", "budget"]),
    ({"strategy": 3}, ["strategy"]),
    ({"prefetch": -1}, ["prefetch", ">= 0"]),
    ({"prefetch": 1.5}, ["prefetch", "integer"]),
    ({"prefetch": True}, ["prefetch"]),
    ({"blocks_per_group": 0}, ["blocks_per_group", ">= 1"]),
    ({"offload_gb": -2}, ["offload_gb", ">= 0"]),
    ({"offload_gb": "8"}, ["offload_gb"]),
    ({"offload_gb": float("nan")}, ["offload_gb"]),
    ({"strategy": "budget"}, ["offload_gb", "budget"]),
    ({"compiler": "tvm"}, ["compiler", "eager", "inductor"]),
    ({"pin_memory": "yes"}, ["pin_memory"]),
    ({"device": "gpu0"}, ["device"]),
    ({"device": "meta"}, ["meta"]),
    ({"blocks_attr": ""}, ["blocks_attr"]),
    ({"strategy": "auto"}, ["device_budget_gb", "auto", "free"]),
    ({"strategy": "auto", "device_budget_gb": 0}, ["device_budget_gb", "> 0"]),
    ({"strategy": "auto", "device_budget_gb": "most"}, ["device_budget_gb", "free"]),
    ({"strategy": "auto", "device_budget_gb": 1, "budget_margin_gb": -1}, ["budget_margin_gb", ">= 0"]),
    ({"strategy": "layerwise", "device_budget_gb": 1}, ["device_budget_gb", "strategy='auto'"]),
    # found by a user trial: TypeError/AttributeError, or accepted and failing later (OverflowError)
    ({"blocks_attr": 3}, ["blocks_attr", "dotted attribute path"]),
    ({"blocks_attr": [None]}, ["blocks_attr"]),
    ({"strategy": "alternating", "components": [1]}, ["components", "component names"]),
    ({"strategy": "alternating", "components": 3}, ["components", "component names"]),
    ({"strategy": "alternating", "components": [" "]}, ["components"]),
    ({"strategy": "budget", "offload_gb": float("inf")}, ["offload_gb", "finite"]),
    ({"strategy": "auto", "device_budget_gb": float("inf")}, ["device_budget_gb", "finite", "free"]),
    ({"strategy": "auto", "device_budget_gb": 1, "budget_margin_gb": float("inf")}, ["budget_margin_gb", "finite"]),
    ({"strategy": "layerwise", "offload_gb": 2}, ["offload_gb", "strategy='budget'"]),
    ({"strategy": "none", "offload_gb": 0}, ["offload_gb", "strategy='budget'"]),
    ({"strategy": "layerwise", "keep_after_use": False}, ["keep_after_use", "'alternating'", "'model'"]),
    ({"strategy": "sequential", "keep_after_use": False}, ["keep_after_use", "strategy='alternating'"]),
])
def test_invalid_values_name_the_field_and_the_choices(fields, words):
    with pytest.raises(ValueError) as err:
        OffloadPolicy(**fields)
    for word in words:
        assert word in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_unavailable_device_says_what_to_use():
    with pytest.raises(ValueError, match="not available.*device='cpu'"):
        OffloadPolicy(device="cuda")


def test_normalisation():
    p = OffloadPolicy(strategy=" Budget ", offload_gb=1, device="cpu", blocks_attr=["a.b"])
    assert p.strategy == "budget" and p.offload_gb == 1.0 and isinstance(p.offload_gb, float)
    assert p.offload_bytes == 2**30 and p.blocks_attr == "a.b"


@pytest.mark.parametrize("strategy", ["alternating", "model"])
def test_keep_after_use_false_is_accepted_where_it_applies(strategy):
    assert OffloadPolicy(strategy=strategy, keep_after_use=False, device="cpu").keep_after_use is False


def test_components_are_stripped():
    assert OffloadPolicy(strategy="sequential", components=[" thinker ", "talker"], device="cpu").components == (
        "thinker", "talker")


def test_from_options():
    assert OffloadPolicy.from_options({"strategy": "sequential", "device": "cpu"}).strategy == "sequential"
    base = OffloadPolicy(device="cpu", prefetch=2)
    assert OffloadPolicy.from_options({"policy": base}) is base
    assert OffloadPolicy.from_options({"policy": base, "prefetch": 0}).prefetch == 0
    with pytest.raises(ValueError, match="unknown omni_offload option.*'stratgy'"):
        OffloadPolicy.from_options({"stratgy": "layerwise"})
    with pytest.raises(ValueError, match="must be an OffloadPolicy"):
        OffloadPolicy.from_options({"policy": {"strategy": "layerwise"}})


def test_from_options_takes_a_policy_itself_and_suggests_the_field_meant():
    """``options=OffloadPolicy(...)`` failed with "'OffloadPolicy' object is not iterable"; a misspelt field got
    the list of fields but no suggestion, where next to a policy it got one: both paths suggest alike."""
    base = OffloadPolicy(device="cpu", prefetch=2)
    assert OffloadPolicy.from_options(base) is base
    with pytest.raises(ValueError, match=r"unknown omni_offload option\(s\) \['prefetchh'\]; did you mean 'prefetch'\? valid"):
        OffloadPolicy.from_options({"prefetchh": 1})
    with pytest.raises(ValueError, match=r"\['prefetchh'\]; did you mean 'prefetch'\?"):
        OffloadPolicy.from_options({"policy": base, "prefetchh": 2})
    with pytest.raises(ValueError, match="options must be a dict of policy fields.*got str"):
        OffloadPolicy.from_options("layerwise")


@pytest.mark.parametrize("build", [lambda: OffloadPolicy(prefech=2),
                                   lambda: OffloadPolicy(device="cpu").replace(prefech=2)])
def test_a_misspelt_keyword_names_the_closest_field(build):
    with pytest.raises(TypeError, match="unexpected keyword argument 'prefech'; did you mean 'prefetch'"):
        build()


def test_an_unknown_keyword_with_no_close_field_lists_the_fields():
    with pytest.raises(TypeError, match="'zzz'; the fields are .*'prefetch'"):
        OffloadPolicy(zzz=1)


def test_every_field_still_passes_as_a_keyword():
    import dataclasses
    policy = OffloadPolicy(strategy="sequential", device="cpu", prefetch=2)
    fields = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
    assert OffloadPolicy(**fields) == policy == dataclasses.replace(policy)


@pytest.mark.parametrize("strategy,fields", [("layerwise", {}), ("budget", {"offload_gb": 1}),
                                             ("auto", {"device_budget_gb": 1})])
def test_components_are_taken_by_the_block_strategies(strategy, fields):
    """On a pipeline they name the components streamed block by block (the VAE among them if named)."""
    policy = OffloadPolicy(strategy=strategy, components=["text_encoder", " vae "], device="cpu", **fields)
    assert policy.components == ("text_encoder", "vae")


def test_components_with_strategy_model_name_alternating():
    with pytest.raises(ValueError, match=r"not 'model'.*finds a pipeline's denoisers and encoders itself.*"
                                         r"strategy='alternating' with components"):
        OffloadPolicy(strategy="model", components=["vae"], device="cpu")


def test_engine_args_with_layerwise_pass_the_components_field_through():
    """``components`` is a policy field: it passes through the seed args as any other field does, and layerwise
    takes it; ``cpu_offload_components`` stays the component offload's (ignored under layerwise, with a
    warning)."""
    from offload_compiler.policy import policy_from_engine_args
    policy = policy_from_engine_args({"enable_layerwise_offload": True, "components": ["transformer", "vae"],
                                      "device": "cpu"})
    assert policy.strategy == "layerwise" and policy.components == ("transformer", "vae")
    with pytest.warns(UserWarning, match="cpu_offload_components is ignored: enable_layerwise_offload wins"):
        policy = policy_from_engine_args({"enable_layerwise_offload": True, "cpu_offload_components": "vae",
                                          "device": "cpu"})
    assert policy.components is None
