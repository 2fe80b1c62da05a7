"""The examples the README points at keep running and keep saying their outputs are right."""

import logging
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def check_example_output(stdout: str, expected: str) -> None:
    """What every example must print: its own check passing, no comparison saying False, and bytes moved."""
    lines = stdout.splitlines()
    assert expected in stdout, stdout[-3000:]
    assert not [line for line in lines if "equal" in line and "False" in line], stdout[-3000:]
    moved = [line for line in lines if "moved " in line]
    assert moved and not [line for line in moved if re.search(r"moved (0\.0+ MiB|0 B)\b", line)], moved


def run_example(script: str, *args: str, capsys, monkeypatch, tmp_path):
    """Run ``examples/<script>`` in this process, as ``python examples/<script> <args>`` would (its ``main()``
    under the script's own argv, from an empty directory), and return what it printed and what ``main()``
    returned. In-process: a fresh interpreter imports torch, transformers and diffusers again (10 to 20 s on a
    2-core machine) for each script."""
    namespace = runpy.run_path(str(EXAMPLES / script), run_name=f"example_{Path(script).stem}")
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / script), *args])
    monkeypatch.chdir(tmp_path)
    dynamo_log = logging.getLogger("torch._dynamo")
    level = dynamo_log.level  # the examples quieten dynamo's log: the tests after them keep theirs
    capsys.readouterr()
    try:
        result = namespace["main"]()
    except SystemExit as exc:  # an example's own check failed
        pytest.fail(f"{script} exited with {exc.code!r}:\n{capsys.readouterr().out[-3000:]}")
    finally:
        dynamo_log.setLevel(level)
    return capsys.readouterr().out, result


@pytest.mark.slow  # a fresh interpreter imports torch, transformers and diffusers
def test_an_example_runs_as_a_script_in_a_fresh_process(tmp_path):
    """One example as the README runs them, in a fresh interpreter (the rest run in this process, below)."""
    result = subprocess.run([sys.executable, str(EXAMPLES / "diffusers_pipeline.py")], capture_output=True,
                            text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    check_example_output(result.stdout, "outputs equal: True")


# multistage_omni.py runs in tests/test_components.py, which also checks the stages it alternates
@pytest.mark.parametrize("script, args, expected", [
    # two layers and four tokens: prefill, decoding steps and the carried prefetch between them, as with the
    # defaults (eight layers, sixteen tokens)
    pytest.param("decode_loop.py", ("--layers", "2", "--tokens", "4"),
                 "tokens equal the plain model's greedy decoding: True", marks=pytest.mark.slow),
    pytest.param("diffusion_model_level.py", (), "outputs equal: True", marks=pytest.mark.slow),
])
def test_example_runs_and_checks_its_outputs(script, args, expected, capsys, monkeypatch, tmp_path):
    stdout, _ = run_example(script, *args, capsys=capsys, monkeypatch=monkeypatch, tmp_path=tmp_path)
    check_example_output(stdout, expected)


def test_examples_use_only_public_api():
    """The examples are what users copy: none reads the offload's private state (``pipe._offload_state``,
    ``m._offload_runtime``); `offload_groups`, `plan_summary`, `offload_stats` and `describe_plan` give it."""
    import ast
    private = []
    for script in sorted(EXAMPLES.glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_offload"):
                private.append(f"{script.name}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("offload_compiler"):
                private += [f"{script.name}:{node.lineno} import {a.name}" for a in node.names
                            if a.name.startswith("_")]
    assert not private, private


@pytest.mark.filterwarnings("ignore::offload_compiler.OffloadSavingWarning")  # one block of three is streamed
def test_offload_groups_and_plan_summary_report_the_groups_as_data():
    import torch
    from offload_compiler import OffloadGroup, OffloadPolicy, describe_plan, offload_compile, offload_groups, \
        offload_stats, plan_summary, reset_offload_stats
    from offload_compiler.testing.models import llama
    model, inputs = llama()
    m = offload_compile(model, OffloadPolicy(strategy="budget", offload_gb=1e-9, device="cpu"))
    with torch.no_grad():
        m(**inputs)  # fills the resident groups
        reset_offload_stats(m)
        m(**inputs)
    groups = offload_groups(m)
    assert groups and all(isinstance(g, OffloadGroup) for g in groups)
    assert [g.index for g in groups] == list(range(len(groups)))
    assert any(g.streamed for g in groups) and any(not g.streamed for g in groups)  # budget: some of each
    stats = offload_stats(m)
    assert sum(g.nbytes for g in groups) == stats.total_bytes
    assert sum(g.nbytes for g in groups if g.streamed) == stats.streamed_bytes
    assert groups[0].name == "model.layers.0" and groups[0].component == "model"
    plan = describe_plan(m)
    assert all(g.name in plan for g in groups)
    summary = plan_summary(m)
    assert [(g["name"], g["bytes"], g["residency"] == "streamed") for g in summary["groups"]] == [
        (g.name, g.nbytes, g.streamed) for g in groups]
    assert summary["graphs"][0]["fetches_per_call"] == stats.fetch_count
    auto = offload_compile(llama()[0], OffloadPolicy(strategy="auto", device_budget_gb=1, device="cpu"))
    assert offload_groups(auto) == [] and plan_summary(auto)["planned"] is False
    with torch.no_grad():
        auto.model.embed_tokens(inputs["input_ids"])  # a part before the plan: every block streams meanwhile
    before = offload_groups(auto)
    assert len(before) > 1 and all(g.streamed for g in before if g.nbytes)
    assert sum(g.nbytes for g in before if g.streamed) == offload_stats(auto).streamed_bytes > 0
    assert "not planned yet" in describe_plan(auto) and before[1].name in describe_plan(auto)
    with torch.no_grad():
        auto(**inputs)  # plans: the groups are the plan's
    assert plan_summary(auto)["planned"] and offload_groups(auto)
