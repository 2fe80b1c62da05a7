"""Seed configuration names, stage YAML and the command line."""

import json
import warnings
from pathlib import Path

import pytest

from offload_compiler import OffloadPolicy
from offload_compiler.cli import _parser, main, policy_from_args
from offload_compiler.config import load_stage_configs, policy_from_engine_args

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
@pytest.mark.filterwarnings("ignore:engine args. cpu_offload_components is ignored")
def test_seed_engine_args(args, strategy, extra):
    policy = OffloadPolicy.from_engine_args({**args, "device": "cpu"})
    assert policy.strategy == strategy
    for key, value in extra.items():
        assert getattr(policy, key) == value


def test_layerwise_wins_over_model_level_with_a_warning():
    with pytest.warns(UserWarning, match="layerwise offload takes priority") as record:
        policy = OffloadPolicy.from_engine_args({"enable_cpu_offload": True, "enable_layerwise_offload": True,
                                                 "device": "cpu"})
    assert policy.strategy == "layerwise"
    assert {w.filename for w in record} == {__file__}  # the caller's line, not config.py


@pytest.mark.parametrize("args, strategy, words", [
    ({"strategy": "layerwise", "cpu_offload_enabled": True}, "alternating",
     ["strategy is ignored", "cpu_offload_enabled selects strategy 'alternating'"]),
    ({"cpu_offload_enabled": True, "cpu_offload_gb": 2}, "alternating",
     ["cpu_offload_gb is ignored", "cpu_offload_enabled wins"]),
    ({"cpu_offload_components": ["thinker"]}, "none",
     ["cpu_offload_components is ignored", "set cpu_offload_enabled: true"]),
    ({"cpu_offload_strategy": "sequential"}, "none",
     ["cpu_offload_strategy is ignored", "set cpu_offload_enabled: true"]),
    ({"cpu_offload_enabled": False, "cpu_offload_components": ["visual"]}, "none",
     ["cpu_offload_components is ignored", "cpu_offload_enabled is not true"]),
    ({"enable_cpu_offload": True, "cpu_offload_enabled": True, "cpu_offload_components": ["visual"]}, "model",
     ["cpu_offload_enabled is ignored", "cpu_offload_components is ignored", "enable_cpu_offload wins"]),
    ({"enable_layerwise_offload": True, "cpu_offload_gb": 4}, "layerwise",
     ["cpu_offload_gb is ignored", "enable_layerwise_offload wins"]),
])
def test_ignored_keys_warn_with_the_key_and_what_wins(args, strategy, words):
    """The same precedence as before (stage YAML files rely on it), but nothing is dropped silently."""
    for build in (OffloadPolicy.from_engine_args, policy_from_engine_args):
        with pytest.warns(UserWarning) as record:
            policy = build({**args, "device": "cpu"})
        assert policy.strategy == strategy
        text = " | ".join(str(w.message) for w in record)
        for word in words:
            assert word in text
        assert {w.filename for w in record} == {__file__}  # the caller's line, not config.py or policy.py


@pytest.mark.parametrize("args", [{}, {"cpu_offload_enabled": True, "cpu_offload_components": ["visual"]},
                                  {"cpu_offload_enabled": False}, {"cpu_offload_gb": 0}, {"strategy": "sequential"},
                                  {"enable_layerwise_offload": True, "cpu_offload_pin_memory": False}])
def test_settings_that_apply_do_not_warn(args):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        policy_from_engine_args({**args, "device": "cpu"})


def test_stage_yaml_warning_names_the_file_and_the_stage(tmp_path):
    path = tmp_path / "stages.yaml"
    path.write_text("stage_args:\n  - stage_id: 4\n    engine_args: {cpu_offload_strategy: sequential}\n")
    with pytest.warns(UserWarning, match="stages.yaml, stage 4: .*cpu_offload_strategy is ignored") as record:
        (stage,) = load_stage_configs(path)
    assert stage.policy.strategy == "none" and [w.filename for w in record] == [__file__]


@pytest.mark.parametrize("args, message", [
    ({"cpu_offload_enabled": True, "cpu_offload_strategy": "greedy"}, "cpu_offload_strategy='greedy' is unknown"),
    ({"enable_layerwise_offload": True, "cpu_offload_strategy": "sometimes"}, "'sometimes' is unknown"),
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
    ("stage_args:\n  - stage_id: 5\n    engine_args: {cpu_offload_strategy: sometimes}\n",
     "stage 5.*cpu_offload_strategy='sometimes' is unknown"),  # invalid even where no key selects it
])
def test_bad_stage_yaml_names_the_file_stage_and_key(tmp_path, text, message):
    path = tmp_path / "stages.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        load_stage_configs(path)
    assert str(path) in str(err.value)


@pytest.mark.slow  # the CLI plans, then runs a Llama
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


@pytest.mark.slow
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


def _cli_policy(*flags):
    return policy_from_args(_parser().parse_args(["plan", "--model", "llama", "--device", "cpu", *flags]))


@pytest.mark.slow
def test_cli_stage_config_gives_the_policy_not_the_default(tmp_path, capsys):
    """A stage that keeps offloading off (the seed's thinker stage) is not offloaded: the layerwise default is
    for a command line that names neither a stage config nor an offload flag."""
    path = tmp_path / "s.yaml"
    path.write_text("stage_args: [{stage_id: 0, engine_args: {model_stage: thinker, cpu_offload_enabled: false}}]\n")
    assert load_stage_configs(path)[0].policy.strategy == "none"
    assert _cli_policy("--stage-config", str(path), "--stage", "0").strategy == "none"
    assert _cli_policy("--stage-config", str(DATA / "seed_selective.yaml"), "--stage", "0").strategy == "none"
    assert main(["plan", "--model", "llama", "--device", "cpu", "--stage-config", str(path)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.lstrip().startswith("group ")]
    assert "strategy=none" in out and rows and all(line.endswith("resident") for line in rows)  # every group


@pytest.mark.parametrize("flags, strategy", [
    ((), "layerwise"),  # the default job
    (("--no-cpu-offload-pin-memory",), "layerwise"),  # says how, not what: the default still applies
    (("--cpu-offload-gb", "0"), "none"),
    (("--enable-cpu-offload",), "model"),
])
def test_cli_default_applies_only_without_offload_settings(flags, strategy):
    assert _cli_policy(*flags).strategy == strategy


@pytest.mark.parametrize("strategy", ["alternating", "sequential"])
def test_cli_strategy_keeps_the_components(strategy):
    policy = _cli_policy("--strategy", strategy, "--cpu-offload-components", "thinker")
    assert policy.strategy == strategy and policy.components == ("thinker",)
    policy = _cli_policy("--strategy", strategy, "--cpu-offload-enabled", "--cpu-offload-components", "a,b")
    assert policy.strategy == strategy and policy.components == ("a", "b")


def test_cli_strategy_budget_reads_cpu_offload_gb_and_names_the_flag():
    assert _cli_policy("--strategy", "budget", "--cpu-offload-gb", "2").offload_gb == 2.0
    with pytest.raises(ValueError, match="--strategy budget needs --cpu-offload-gb"):
        _cli_policy("--strategy", "budget")


def test_cli_strategy_warns_about_the_flags_it_overrides():
    with pytest.warns(UserWarning) as record:
        policy = _cli_policy("--strategy", "layerwise", "--cpu-offload-enabled", "--cpu-offload-components", "a")
    assert policy.strategy == "layerwise" and policy.components is None
    assert [str(w.message) for w in record] == ["cpu_offload_enabled is ignored: --strategy layerwise wins",
                                                "cpu_offload_components is ignored: --strategy layerwise wins"]


def test_cli_ignored_flag_warns_once(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("stage_args: [{stage_id: 0, engine_args: {cpu_offload_components: [visual]}}]\n")
    with pytest.warns(UserWarning) as record:
        assert _cli_policy("--stage-config", str(path)).strategy == "none"
    assert len(record) == 1 and "cpu_offload_components is ignored" in str(record[0].message)


def test_cli_auto_says_which_offload_settings_it_ignores():
    args = _parser().parse_args(["plan", "--model", "llama", "--device", "cpu", "--device-budget-gb", "1",
                                 "--cpu-offload-enabled", "--cpu-offload-components", "visual", "--prefetch", "2",
                                 "--no-cpu-offload-pin-memory"])
    with pytest.warns(UserWarning, match=r"strategy auto plans .*ignored: \['cpu_offload_components', "
                                         r"'cpu_offload_enabled', 'prefetch'\]"):
        policy = policy_from_args(args)
    assert policy.strategy == "auto" and policy.device_budget_gb == 1.0 and policy.pin_memory is False


def test_load_stage_configs_is_importable_from_the_package():
    import offload_compiler
    from offload_compiler import load_stage_configs as top_level

    assert top_level is load_stage_configs
    assert "load_stage_configs" in offload_compiler.__all__


@pytest.mark.parametrize("value, gib", [("4", 4.0), ("1e-6", 1e-6), (2, 2.0)])
def test_cpu_offload_gb_may_be_the_text_of_a_number_as_yaml_reads_1e_6(value, gib):
    policy = OffloadPolicy.from_engine_args({"cpu_offload_gb": value})
    assert policy.strategy == "budget" and policy.offload_gb == gib


@pytest.mark.parametrize("value", [-1, "abc", True, [4]])
def test_a_bad_cpu_offload_gb_is_refused_under_its_own_name(value):
    with pytest.raises(ValueError, match=r"cpu_offload_gb=.* must be the GiB of weights .* a number >= 0"):
        OffloadPolicy.from_engine_args({"cpu_offload_gb": value})
