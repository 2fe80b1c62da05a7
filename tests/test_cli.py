"""The command line as a new user meets it: --help, --json, --plots for every strategy, the words of its notes
and errors. Each test runs the tiny llama (a few seconds)."""

import json

import pytest
import torch

from offload_compiler import OffloadPolicy, offload_compile
from offload_compiler.cli import builtin_model_names, main
from offload_compiler.offloaded import state_of
from offload_compiler.testing.models import ARCHITECTURES, BUILDERS, llama

PLAN_LLAMA = ["plan", "--model", "llama", "--device", "cpu"]


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["plan", "--help"]])
def test_help_lists_every_builtin_model(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    shown = capsys.readouterr().out
    assert len(builtin_model_names()) >= 34 + len(BUILDERS)
    assert all(name in shown for name in {*BUILDERS, *ARCHITECTURES})


def test_json_gives_the_plan_of_a_fixed_strategy_as_data(capsys):
    assert main(PLAN_LLAMA + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    plan = report["plan"]
    assert plan["strategy"] == "layerwise" and plan["pinned"] is False
    assert [g["name"] for g in plan["groups"]][:3] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert all(g["bytes"] > 0 and g["residency"] in ("streamed", "resident") for g in plan["groups"][:3])
    (graph,) = plan["graphs"]
    # every group once per call: whole, or the token embedding's rows looked up
    assert graph["fetches_per_call"] + graph["routed_fetches_per_call"] == len(plan["groups"])
    (table,) = graph["routed"]
    assert table["weight"] == "model.embed_tokens.weight" and 0 < table["at_most"] < table["rows"]
    assert 0 < graph["predicted_peak_bytes"] <= plan["total_bytes"]
    # the device memory the plan holds for weights as a share of the model: its device slots (allocated whole, at
    # least the copies in flight the verifier predicts) and resident groups
    saving = plan["saving"]
    held = saving["pool_bytes"] + graph["resident_bytes"] + plan["unmanaged_bytes"]
    assert saving["verified"] and saving["device_weight_peak_bytes"] == held
    assert saving["pool_bytes"] >= graph["streamed_peak_bytes"]
    assert saving["share_of_model"] == pytest.approx(held / (plan["total_bytes"] + plan["unmanaged_bytes"]))
    assert "no accelerator" in report["pinning"]


def test_run_on_the_simulated_device_checks_outputs_and_traffic(capsys):
    """``--device sim``: the job on a device that is not the host, from the command line of a machine without one."""
    assert main(["run", "--model", "llama", "--device", "sim", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["policy"]["device"] == "sim:0" and report["equivalence"]["equal"]
    assert report["plan"]["saving"]["share_of_model"] < 1


@pytest.mark.slow  # a plan and its plots for every strategy
def test_text_plan_says_why_nothing_is_pinned_and_plots_any_strategy(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(PLAN_LLAMA + ["--plots", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "pinned=False" in captured.out
    assert "device weight peak" in captured.out and "of the model (held from the first call on" in captured.out
    assert "pin_memory=True but pinned=False: the compute device is the cpu (no accelerator)" in captured.out
    assert (tmp_path / "residency.png").stat().st_size > 0 and f"saved {tmp_path / 'residency.png'}" in captured.err


def test_the_pinning_note_on_a_device_without_pinned_memory_gives_the_reason(capsys):
    """On a device whose torch has no pinned memory (the simulated accelerator) nothing warns, so the note says
    why instead of pointing at a warning that never came."""
    from offload_compiler.testing import simulated_device
    device = simulated_device()
    args = [a if a != "cpu" else device for a in PLAN_LLAMA]
    assert device in args
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "pinned=False: sim has no pinned host memory in this torch" in out and "see the warning" not in out


@pytest.mark.slow
def test_no_pinning_note_when_pin_memory_is_off(capsys):
    assert main(PLAN_LLAMA + ["--no-cpu-offload-pin-memory"]) == 0
    assert "pin_memory=True" not in capsys.readouterr().out


def test_component_error_names_the_command_line_flag():
    with pytest.raises(SystemExit) as exit_:
        main(PLAN_LLAMA + ["--cpu-offload-enabled", "--cpu-offload-components", "vision"])
    message = str(exit_.value.code)
    assert "--cpu-offload-components" in message and "components=[...]" not in message


def test_cpu_offload_enabled_without_components_plans_the_whole_model_as_its_one_component(capsys):
    """A model with none of the known component names (a stage model loaded on its own): the whole model is the
    one component, on the device only while a call runs."""
    assert main(PLAN_LLAMA + ["--cpu-offload-enabled"]) == 0
    out = capsys.readouterr().out
    assert "the whole model, its one component" in out and out.count("streamed") >= 1


@pytest.mark.slow
def test_the_residency_plot_follows_the_verified_plan(tmp_path):
    pytest.importorskip("matplotlib")
    from offload_compiler.planning.plots import live_bytes, save_runtime_plots
    model, inputs = llama()
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu", prefetch=1))
    with torch.no_grad():
        m(**inputs)
    runtime = state_of(m).runtime
    (plan,) = runtime.graph_plans
    live = live_bytes(plan.schedule, [g.nbytes for g in runtime.groups], plan.verified.resident_bytes,
                      plan.num_nodes)
    assert max(live) == plan.verified.peak_bytes == runtime.ledger.peak
    assert save_runtime_plots(runtime, str(tmp_path)) == [str(tmp_path / "residency.png")]


def test_a_misspelt_model_name_gets_the_closest_one():
    with pytest.raises(SystemExit, match="--model 'lama': did you mean 'llama'"):
        main(["plan", "--model", "lama", "--device", "cpu"])


def test_the_readme_counts_the_builtin_models_help_lists():
    """The README's numbers of built-in ``--model`` names are the ones ``--help`` lists (it said 38 beside 46)."""
    import re
    from pathlib import Path
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    text = " ".join(readme.split())
    listed = re.search(r"`--help` lists every built-in model: (\d+) names, the (\d+) builders", text)
    classes = re.search(r"tiny random-weight configs of (\d+) transformers/diffusers classes", text)
    assert listed and classes, "the README no longer counts the built-in models where this test looks"
    assert int(listed.group(1)) == len(builtin_model_names())
    assert int(listed.group(2)) == len(BUILDERS) and int(classes.group(1)) == len(ARCHITECTURES)
    assert all(f"`{name}`" in text for name in BUILDERS)


def test_the_equality_line_says_how_equality_was_judged():
    """"True (max abs diff 1.79e-07)" read as a contradiction: the line names the tolerance, or bit for bit."""
    from offload_compiler.cli import _equivalence, equivalence_line
    out = torch.ones(3)
    close = _equivalence(out + 2e-7, out)
    assert close["equal"] and not close["exact"]
    assert equivalence_line(close) == ("outputs equal the plain model: True (within the tolerance 1e-04: max abs "
                                       f"diff {close['max_abs_diff']:.2e}, not bit for bit)")
    assert equivalence_line(_equivalence(out.clone(), out)) == "outputs equal the plain model: True (bit for bit)"
    far = _equivalence(out + 1, out)
    assert equivalence_line(far) == ("outputs equal the plain model: False (max abs diff 1.00e+00 is over the "
                                     "tolerance 1e-04)")


def _builder_that_raises():
    raise RuntimeError("no weights here")


@pytest.mark.parametrize("argv, says", [
    (["run", "--model", "llama", "--calls", "0"], "argument --calls: 0: at least 1 call"),
    (["plan", "--model", "llama", "--device-budget-gb", "abc"], "argument --device-budget-gb: 'abc' is neither GiB"),
    (["plan", "--model", "llama", "--device-budget-gb", "-1"], "GiB above 0, or 'free'"),
    (["plan", "--model", "llama", "--stage", "3"], "--stage chooses a stage of --stage-config"),
    (["plan", "--model", "llama", "--plots", __file__], "a file is there; name a directory"),
])
def test_bad_flag_values_are_refused_before_anything_runs_naming_the_flag(argv, says, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert says in capsys.readouterr().err


def test_a_model_builder_that_fails_is_named_without_a_traceback():
    with pytest.raises(SystemExit, match=r"_builder_that_raises\(\) must take no arguments and return \(model, inputs\); "
                                         r"it raised RuntimeError: no weights here"):
        main(["plan", "--model", "test_cli:_builder_that_raises", "--device", "cpu"])
