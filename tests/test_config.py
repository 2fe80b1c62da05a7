"""Seed configuration names, stage YAML and the command line."""

import json
from pathlib import Path

import pytest

from offload_compiler import OffloadPolicy
from offload_compiler.cli import main
from offload_compiler.config import load_stage_configs

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("args, strategy, extra", [
    ({}, "none", {}),
    ({"cpu_offload_enabled": False, "cpu_offload_components": ["visual"]}, "none", {}),
    ({"cpu_offload_enabled": True}, "alternating", {"components": None}),
    ({"cpu_offload_enabled": True, "cpu_offload_components": ["thinker", "talker"],
      "cpu_offload_strategy": "sequential"}, "sequential", {"components": ("thinker", "talker")}),
    ({"cpu_offload_enabled": True, "cpu_offload_components": "visual, audio_tower"}, "alternating",
     {"components": ("visual", "audio_tower")}),
    ({"cpu_offload_enabled": True, "cpu_offload_pin_memory": False}, "alternating", {"pin_memory": False}),
    ({"enable_cpu_offload": True}, "model", {}),
    ({"enable_layerwise_offload": True}, "layerwise", {}),
    ({"cpu_offload_gb": 8}, "budget", {"offload_gb": 8.0}),
])
def test_seed_engine_args(args, strategy, extra):
    policy = OffloadPolicy.from_engine_args({**args, "device": "cpu"})
    assert policy.strategy == strategy
    for key, value in extra.items():
        assert getattr(policy, key) == value


def test_layerwise_wins_over_model_level_with_a_warning():
    with pytest.warns(UserWarning, match="layerwise offload takes priority"):
        policy = OffloadPolicy.from_engine_args({"enable_cpu_offload": True, "enable_layerwise_offload": True,
                                                 "device": "cpu"})
    assert policy.strategy == "layerwise"


@pytest.mark.parametrize("args, message", [
    ({"cpu_offload_enabled": True, "cpu_offload_strategy": "greedy"}, "cpu_offload_strategy='greedy' is unknown"),
    ({"cpu_ofload_enabled": True}, "unknown key 'cpu_ofload_enabled'.*did you mean 'cpu_offload_enabled'"),
    ({"cpu_offload_enabled": "maybe"}, "cpu_offload_enabled must be true or false"),
    ({"cpu_offload_enabled": True, "cpu_offload_components": 3}, "cpu_offload_components must be a list"),
])
def test_bad_engine_args(args, message):
    with pytest.raises(ValueError, match=message):
        OffloadPolicy.from_engine_args({**args, "device": "cpu"})


def test_the_seed_yaml_files_load_as_written():
    stages = load_stage_configs(DATA / "seed_selective.yaml")
    assert [(s.stage_id, s.model_stage, s.policy.strategy, s.policy.components) for s in stages] == [
        (0, "thinker", "none", None), (1, "talker", "alternating", ("visual",)), (2, "code2wav", "alternating", None)]
    (stage,) = load_stage_configs(DATA / "seed_component_level.yaml")
    assert stage.model_arch == "Qwen2_5OmniForConditionalGeneration"
    assert stage.policy.components == ("visual", "audio_tower")
    assert [s.policy.strategy for s in load_stage_configs(DATA / "seed_stage_config.yaml")] == ["none", "alternating"]


@pytest.mark.parametrize("text, message", [
    ("stage_args: [\n  - stage_id: 0\n    engine_args: {cpu_offload_enabled: true\n", "not valid YAML"),
    ("stages: []\n", "expected a top-level 'stage_args' list"),
    ("stage_args:\n  - stage_id: 3\n    engine_args:\n      cpu_offload_enabeld: true\n",
     "stage 3.*unknown key 'cpu_offload_enabeld'.*did you mean 'cpu_offload_enabled'"),
    ("stage_args:\n  - stage_id: 1\n    engine_arg: {}\n", "stage 1: unknown key 'engine_arg'"),
    ("stage_args:\n  - stage_id: 0\n  - stage_id: 0\n", "stage_id values repeat"),
    ("stage_args:\n  - stage_id: 2\n    engine_args: {cpu_offload_enabled: true, cpu_offload_strategy: fast}\n",
     "stage 2.*cpu_offload_strategy='fast' is unknown"),
])
def test_bad_stage_yaml_names_the_file_stage_and_key(tmp_path, text, message):
    path = tmp_path / "stages.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        load_stage_configs(path)
    assert str(path) in str(err.value)


def test_cli_plan_and_run(capsys):
    assert main(["plan", "--model", "llama", "--device", "cpu", "--enable-layerwise-offload"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0" in out and "predicted peak" in out
    assert main(["run", "--model", "multistage:thinker", "--device", "cpu", "--cpu-offload-enabled",
                 "--cpu-offload-components", "visual,audio_tower", "--cpu-offload-strategy", "alternating"]) == 0
    out = capsys.readouterr().out
    assert "visual" in out and "audio_tower" in out and "outputs equal the plain model: True" in out


def test_cli_stage_config_and_json(capsys):
    code = main(["run", "--model", "multistage:thinker", "--device", "cpu", "--stage-config",
                 str(DATA / "seed_stage_config.yaml"), "--stage", "1", "--json"])
    report = json.loads(capsys.readouterr().out)
    # latency-minimising: the one component stays on the device, so the measured (second) call moves nothing
    assert code == 0 and report["equivalence"]["equal"] and report["stats"]["parked_bytes"] > 0
    assert report["policy"]["strategy"] == "alternating" and list(report["policy"]["components"]) == ["visual"]


def test_cli_prefetch_next_call(capsys):
    code = main(["run", "--model", "llama", "--device", "cpu", "--strategy", "layerwise", "--prefetch-next-call",
                 "--calls", "3", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["equivalence"]["equal"] and report["policy"]["prefetch_next_call"]
    assert report["stats"]["carry_hits"] == 1 and report["stats"]["carried_bytes"] > 0  # the measured call


def test_cli_bad_component_is_a_clear_exit():
    with pytest.raises(SystemExit, match="unknown component 'vision'"):
        main(["plan", "--model", "multistage:omni", "--device", "cpu", "--cpu-offload-enabled",
              "--cpu-offload-components", "vision"])
