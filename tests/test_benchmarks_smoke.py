"""The benchmarks run end to end (tiny sizes, CPU) and write the JSON the README describes."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def _run(script: str, *args: str, timeout: int = 120) -> None:
    """Run a benchmark's main() in this process (torch is already imported: keeps the test quick). The
    harness's host-RSS measurement still starts its own fresh subprocesses."""
    del timeout
    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    spec = importlib.util.spec_from_file_location(f"bench_{Path(script).stem}", BENCH / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    argv = sys.argv
    sys.argv = [str(BENCH / script), *args]
    try:
        module.main(list(args))
    finally:
        sys.argv = argv


@pytest.mark.slow  # captures of 2 to 16 blocks, each timed
def test_pass_cost_small(tmp_path):
    out = tmp_path / "pass_cost.json"
    _run("pass_cost.py", "--blocks", "2", "6", "16", "--repeats", "2", "--capture-repeats", "1",
         "--strategies", "layerwise", "--profile-top", "3", "--no-plot", "--out", str(out))
    data = json.loads(out.read_text())
    assert {"command", "environment", "config", "series", "summary"} <= set(data)
    assert "pass_cost.py" in data["command"] and data["environment"]["torch"]
    series = data["series"]["layerwise"]
    points = series["points"]
    assert [p["blocks"] for p in points] == [2, 6, 16]
    nodes = [p["graph_nodes"] for p in points]
    times = [p["pass_s_median"] for p in points]
    assert nodes == sorted(nodes) and nodes[0] < nodes[-1]
    assert times[-1] > times[0] > 0, "pass time must grow with graph size"
    for p in points:
        assert p["capture_s_median"] > 0 and 0 < p["pass_over_capture"]
        assert set(p["stage_s_median"]) == {"analysis.weight_inputs", "analysis.collect_uses",
                                            "schedule.build_schedule", "insert.insert_transfers", "verify.verify"}
        assert p["fetches"] >= p["blocks"]  # every block group is streamed under layerwise
    assert series["fit_pass_s_vs_nodes"]["slope"] > 0 and -1 <= series["fit_pass_s_vs_nodes"]["r2"] <= 1
    prof = series["profile_largest"]
    assert prof["total_s"] > 0 and "function" in prof["by_cumulative_time"][0]


@pytest.mark.slow  # every method on two workloads, and host-RSS subprocesses: ~25 s
def test_gpu_harness_smoke(tmp_path):
    out = tmp_path / "gpu_smoke.json"
    methods = ["none", "ours-layerwise-p1-eager", "ours-layerwise-p1wrap-eager", "ours-budget-eager",
               "accelerate-cpu_offload", "diffusers-group-block", "vllm-functional_call"]
    _run("gpu_offload.py", "--smoke", "--device", "cpu", "--reps", "2", "--methods", *methods,
         "--workloads", "dit", "llm_decode_b4", "--rss-methods", "ours-layerwise-p1-eager", "--no-plot", "--out", str(out), timeout=180)
    data = json.loads(out.read_text())
    assert {"command", "environment", "config", "families", "targets", "host_rss", "pinned_h2d", "notes"} <= set(data)
    assert data["config"]["smoke"] is True and data["gpu_figures_measured"] is False
    assert data["pinned_h2d"] is None  # CUDA-only
    wls = {wl: w for fam in data["families"].values() for wl, w in fam["workloads"].items()}
    assert set(wls) == {"dit", "llm_decode_b4"}
    for wl, w in wls.items():
        res = w["methods"]
        assert set(res) == set(methods), (wl, set(methods) - set(res))
        for name, r in res.items():
            assert "error" not in r, (wl, name, r.get("error"))
            assert r["time_s_median"] > 0 and len(r["time_s_all"]) == 2
            assert r["max_memory_allocated_bytes"] is None  # CUDA-only
            assert r["finite"] and r["max_abs_diff_rel"] < 1e-3, (wl, name, r["max_abs_diff_rel"])
        for name in ("ours-layerwise-p1-eager", "ours-layerwise-p1wrap-eager", "ours-budget-eager"):
            ours = res[name]["ours"]
            assert ours["bytes_transferred_per_call"] > 0 and res[name]["bytes_moved"] > 0
            assert ours["ledger_peak_bytes"] == ours["plan_predicted_peak_bytes"]
        # wrap-around moves the same bytes per call (the first group one call early)
        assert res["ours-layerwise-p1wrap-eager"]["ours"]["bytes_transferred_per_call"] == \
            res["ours-layerwise-p1-eager"]["ours"]["bytes_transferred_per_call"]
        # budget streams fewer bytes than layerwise, exactly the bytes the functional_call baseline offloads
        assert res["ours-budget-eager"]["bytes_moved"] < res["ours-layerwise-p1-eager"]["bytes_moved"]
    fam_methods = data["families"]["dit"]["methods"]
    assert fam_methods["vllm-functional_call"]["offloaded_bytes"] == \
        wls["dit"]["methods"]["ours-budget-eager"]["ours"]["streamed_bytes"]
    targets = data["targets"]
    assert targets["dit"]["ours_over_lower_bound"]["value"] is None  # needs the CUDA bandwidth
    assert targets["dit"]["accelerate_over_ours"]["value"] > 0
    assert targets["dit"]["functional_call_over_budget"]["value"] > 0
    rss = data["host_rss"]["dit"]
    for name in ("ours-layerwise-p1-eager",):
        assert "error" not in rss[name], rss[name].get("error")
        assert rss[name]["model_bytes"] > 0 and rss[name]["setup_peak_rss_delta_bytes"] >= 0


@pytest.mark.slow  # every method, each compiled (inductor too)
def test_host_overhead_small(tmp_path):
    out = tmp_path / "host_overhead.json"
    _run("host_overhead.py", "--blocks", "4", "--rounds", "2", "--calls", "2", "--depths", "2", "--warmup", "1",
         "--out", str(out))
    data = json.loads(out.read_text())
    assert {"command", "environment", "config", "methods", "summary"} <= set(data)
    assert "host_overhead.py" in data["command"] and data["environment"]["torch"]
    methods = data["methods"]
    assert set(methods) == {"plain-eager", "plain-inductor", "ours-eager", "ours-inductor", "diffusers-group-block",
                            "accelerate-cpu_offload", "vllm-functional_call"}
    for name, r in methods.items():
        assert "error" not in r, (name, r.get("error"))
        assert r["wall_s"] > 0 and r["cpu_s"] > 0 and r["minor_faults"] >= 0
        assert r["max_abs_diff"] < 1e-4
        assert name.startswith("plain-") or {"host_us_per_group", "host_cpu_us_per_group"} <= set(r)
    for name in ("ours-eager", "ours-inductor"):
        assert methods[name]["fetches_per_call"] == 4 and methods[name]["bytes_per_call"] > 0  # offloading happened
        assert set(data["summary"][name]) >= {"wall", "cpu", "faults_per_call"}


@pytest.mark.slow  # a Llama generating under three methods
def test_decode_small(tmp_path):
    out = tmp_path / "decode.json"
    _run("decode.py", "--layers", "2", "--hidden", "64", "--prompt", "4", "--tokens", "3", "--rounds", "2",
         "--depths", "2", "--methods", "plain-eager", "ours-eager", "diffusers-group-block", "--out", str(out))
    methods = json.loads(out.read_text())["methods"]
    for name, r in methods.items():
        assert "error" not in r, (name, r.get("error"))
        assert r["same_tokens"] and r["wall_s"] > 0 and r["cpu_s"] > 0
    ours = methods["ours-eager"]
    assert ours["over_plain"] > 0 and ours["over_floor"] > 0
    # one token streams every decoder layer (and what else is offloaded) once: offloading happened
    assert ours["fetches_per_call"] >= 2 and ours["bytes_per_call"] > 0


def _bench_module(script: str):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{Path(script).stem}", BENCH / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # inductor
@pytest.mark.parametrize("variant", ["ours-inductor-without-copies", "ours-inductor-without-transfers"])
def test_decodes_diagnostic_variants_leave_out_what_they_say(variant):
    """``decode.py --decompose``: without copies, every fetch is still made and counted but no slot is written;
    without transfers, the graph runs over the slots as they are and nothing is fetched."""
    import torch
    from offload_compiler import OffloadPolicy, offload_compile, offload_stats, reset_offload_stats
    decode = _bench_module("decode.py")
    torch.manual_seed(0)
    model = _bench_module("host_overhead.py").Stack(blocks=3, hidden=8).eval()  # three blocks of two linears
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu", compiler="inductor"))
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = m(x)
    decode.strip(m, variant)
    pool = m._offload_runtime.pool
    buffers = [buf for slots in pool.slots.values() for slot in slots for buf in slot.buffers]
    for buf in buffers:
        buf.fill_(7.0)
    reset_offload_stats(m)
    with torch.no_grad():
        out = m(x)
    assert all(bool((buf == 7.0).all()) for buf in buffers)  # no slot was written
    assert not torch.equal(out, expected)  # the graph read the slots as they were
    fetches = offload_stats(m).fetch_count
    assert fetches == (3 if variant.endswith("copies") else 0)


def test_profile_overlap_summary_measures_copies_hidden_behind_kernels():
    spec = importlib.util.spec_from_file_location("bench_profile_forward", BENCH / "profile_forward.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH))
    spec.loader.exec_module(module)
    event = lambda cat, name, ts, dur: {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}  # noqa: E731
    trace = {"traceEvents": [event("kernel", "gemm", 0, 100), event("kernel", "gemm", 150, 50),
                             event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 50, 100),  # half under a kernel
                             event("gpu_memcpy", "Memcpy DtoH", 300, 10)]}  # not a weight fetch
    summary = module.overlap_summary(trace)
    assert summary["h2d_copy_us"] == 100 and summary["h2d_copy_overlapped_share"] == 0.5
    assert summary["kernel_us"] == 150 and summary["span_us"] == 200 and summary["gpu_idle_us"] == 0
    assert module.overlap_summary({"traceEvents": []}) == {"gpu_events": 0}


@pytest.mark.slow  # fresh processes per sample: ~10 s
def test_first_output_small(tmp_path):
    out = tmp_path / "first_output.json"
    _run("first_output.py", "--models", "stack", "--rounds", "1", "--out", str(out))
    data = json.loads(out.read_text())
    assert {"command", "environment", "config", "summary", "samples"} <= set(data)
    assert "first_output.py" in data["command"]
    methods = data["summary"]["stack"]
    assert set(methods) == {"plain-eager", "ours-eager"}
    for name, r in methods.items():
        assert "errors" not in r, (name, r.get("errors"))
        assert r["total_s"] >= r["first_call_s"] > 0 and r["capture_s"] > 0
    ours = methods["ours-eager"]
    assert ours["ratio_to_plain"] > 0 and ours["breakdown_s"]["pack"] > 0 and ours["breakdown_s"]["passes"] > 0


def test_call_fixed_cost_small(tmp_path):
    out = tmp_path / "call_fixed_cost.json"
    _run("call_fixed_cost.py", "--blocks", "4", "--number", "20", "--repeats", "2", "--out", str(out))
    data = json.loads(out.read_text())
    assert "call_fixed_cost.py" in data["command"]
    assert data["walked"] == {"routed parts": 4 * 3, "hook dicts": 2 * (1 + 1 + 4 * 3), "groups": 4}
    assert all(v > 0 for v in data["us_per_call"].values()) and data["summary"]["us_per_group"] > 0


@pytest.mark.slow  # fresh processes per load
def test_checkpoint_load_small(tmp_path):
    out = tmp_path / "checkpoint_load.json"
    _run("checkpoint_load.py", "--hidden", "256", "--layers", "1", "--rounds", "1", "--out", str(out))
    data = json.loads(out.read_text())
    assert set(data["median"]) == {"from_pretrained", "checkpoint"}
    for method in data["median"].values():
        assert method["seconds"] > 0 and method["peak_growth_bytes"] > 0
    assert 0.9 <= data["peak_growth_over_model"]["checkpoint"] <= 1.3  # the model once, not twice


@pytest.mark.slow  # four offloaders of one Llama, each call reading from disk (on the simulated accelerator: two)
@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_disk_tier_small(tmp_path, device):
    out = tmp_path / "disk_tier.json"
    hidden = "256" if device == "cpu" else "64"
    _run("disk_tier.py", "--device", device, "--hidden", hidden, "--layers", "2", "--rounds", "1", "--per-group",
         "--out", str(out))
    data = json.loads(out.read_text())
    assert all(data["outputs_equal_plain"].values()) and {"plain", "ours", "ours-carry"} <= set(data["median_s"])
    # a call in a loop adopts the first group the call before it read for it (prefetch_next_call)
    assert data["ours_carry_adopted"]["carry_hits"] >= data["rounds"] * (data["calls_per_sample"] - 1)
    # every group on disk read once per call: whole, or (the token embedding) the rows of the call's tokens
    assert data["looked_up_groups_on_disk_bytes"] > 0 and data["routed_bytes_per_call"] > 0
    assert data["disk_bytes_read_per_call"] == (data["disk_bytes"] - data["looked_up_groups_on_disk_bytes"]
                                                + data["routed_bytes_per_call"])
    assert data["disk_bytes"] >= data["model_bytes"] - data["host_budget_bytes"]
    assert data["read_bandwidth_bytes_per_s"] > 0 and data["limit_s"] > 0
    if device == "cpu":  # the limit on ours' own files reads exactly the groups it reads whole per call
        assert data["own_files_bytes"] == data["disk_bytes_read_per_call"] - data["routed_bytes_per_call"]
        assert len(data["own_files_read_s"]) == data["rounds"] and data["limit_reading_its_own_files_s"] > 0
    # the timed call: every group on disk read once, on the worker thread; the call waited for each fetch
    per_group = data["per_group"]
    reads = [f for f in per_group["fills"] if f["on_disk"]]
    assert {f["thread"] for f in reads} == {"worker"} and len({f["group"] for f in reads}) == len(reads)
    whole = data["disk_bytes"] - data["looked_up_groups_on_disk_bytes"]
    assert per_group["summary"]["read_bytes"] == sum(f["bytes"] for f in reads) >= whole
    assert {w["group"] for w in per_group["waits"]} >= {f["group"] for f in per_group["fills"]}
    assert 0 < per_group["summary"]["reading_ms"] <= per_group["call_ms"] * 1.05


@pytest.mark.slow  # a tiny MoE decoder on the simulated accelerator: per layer, its two expert weights fetched routed
def test_moe_decode_small_on_the_simulated_device(tmp_path):
    out = tmp_path / "moe_decode.json"
    _run("moe_decode.py", "--device", "sim", "--hidden", "64", "--layers", "2", "--experts", "16", "--top-k", "2",
         "--vocab", "128", "--prompt", "4", "--rounds", "1", "--calls", "1", "--out", str(out))
    result = json.loads(out.read_text())
    ours = result["ours_per_token"]
    assert result["tokens_equal_plain"] and result["device"] == "sim:0"
    # per layer its two expert weights, and the token embedding's row looked up
    assert ours["routed_fetches"] == 2 * 2 + 1 and ours["bytes_moved"] <= 1.1 * ours["bound_bytes"]
    assert ours["bytes_moved"] < ours["whole_layer_bytes"]


@pytest.mark.slow  # four fresh processes, each building and capturing a tiny DiT
def test_regional_capture_small(tmp_path):
    out = tmp_path / "regional_capture.json"
    _run("regional_capture.py", "--models", "dit", "--depth", "1", "--rounds", "1", "--methods", "ours-eager",
         "ours-regional", "plain-regional", "--out", str(out))
    data = json.loads(out.read_text())
    assert "regional_capture.py" in data["command"] and data["config"]["depths"] == [1, 2]
    rows = data["summary"]["dit"]
    assert set(rows) == {"ours-eager", "ours-regional", "plain-regional"}
    assert all(row["growth"] > 0 and row["full_gc_s_depth_2"] >= 0 for row in rows.values())
    moved = {s["method"]: s["bytes_moved"] for s in data["samples"] if s["depth"] == 2}
    assert moved["ours-regional"] == moved["ours-eager"] > 0  # streamed the same


@pytest.mark.slow  # four fresh processes, each building and capturing a tiny DiT
def test_regional_phases_small(tmp_path):
    out = tmp_path / "regional_phases.json"
    _run("regional_phases.py", "--depths", "1", "2", "--out", str(out))
    data = json.loads(out.read_text())
    rows = data["summary"]
    assert set(rows) == {"ours-regional", "plain-regional"}
    ours = rows["ours-regional"]["seconds"]
    assert all(ours[phase]["2"] > 0 for phase in ("dynamo", "trace", "backend", "guards", "setup", "first_call"))
    assert ours["trace"]["2"] <= ours["dynamo"]["2"] <= ours["first_call"]["2"]
    assert "backend" in rows["ours-regional"]["per_block_ms"]


@pytest.mark.slow  # a worker process importing transformers, then two models offloaded
def test_registry_sweep_records_each_model_type_and_counts_only_those_built(tmp_path):
    out = tmp_path / "registry.json"
    _run("registry_sweep.py", "--only", "llama", "gpt2", "no_such_model_type", "--chunk", "2", "--out", str(out))
    data = json.loads(out.read_text())
    assert [r["kind"] for r in data["results"]] == ["llama", "gpt2", "no_such_model_type"]  # two worker processes, in order
    summary = data["summary"]
    assert summary["registered"] == 3 and summary["built"] == summary["passed"] == 2 and summary["not_built"] == 1
    assert "build_error" in data["results"][2] and not summary["failed"]
    assert all(0 < r["device_weight_peak_share"] <= 0.6 and r["traffic_equals_plan"] for r in data["results"][:2])
