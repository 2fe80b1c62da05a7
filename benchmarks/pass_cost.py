"""The passes' own cost (CPU; no GPU needed).

For block stacks of N blocks, capture the FX graph once with dynamo (a recording backend, fullgraph, under
``no_grad`` as ``offload_compile`` runs it), then time ``offload_compiler.backend.rewrite_graph`` on that graph
(analysis → schedule → insert → verify) as a whole and stage by stage, repeated (median). Compare with
dynamo's capture time for the same model. Reports time per node, a linear fit of pass time against graph size
(slope, R²), the log-log exponent (1 = linear) and the ratio pass / capture.

    PYTHONPATH=. python benchmarks/pass_cost.py                      # N = 50 100 200 400, writes results/
    PYTHONPATH=. python benchmarks/pass_cost.py --blocks 4 8 --repeats 3 --out /tmp/x.json --no-plot
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (RESULTS, environment, exact_command, have_matplotlib, linear_fit,  # noqa: E402
                    loglog_exponent, median, write_json)

from offload_compiler import OffloadPolicy  # noqa: E402
from offload_compiler.backend import rewrite_graph  # noqa: E402
from offload_compiler.grouping import plan_groups  # noqa: E402
from offload_compiler.passes.analysis import collect_uses, weight_inputs  # noqa: E402
from offload_compiler.passes.insert import insert_transfers  # noqa: E402
from offload_compiler.passes.schedule import build_schedule  # noqa: E402
from offload_compiler.passes.verify import verify  # noqa: E402
from offload_compiler.runtime import OffloadRuntime  # noqa: E402
from offload_compiler.testing import BlockSpec, ModelSpec, build_block_model  # noqa: E402

STAGES = ("analysis.weight_inputs", "analysis.collect_uses", "schedule.build_schedule", "insert.insert_transfers",
          "verify.verify")


def block_model(n_blocks: int, width: int = 32):
    """N transformer-ish blocks, alternating attention and MLP (like a decoder layer split in two)."""
    blocks = tuple(BlockSpec("attention", 1) if i % 2 == 0 else BlockSpec("mlp", 2 * width) for i in range(n_blocks))
    return build_block_model(ModelSpec(width, blocks, tied_head=False, parent_table=True, seq=4, batch=1), seed=0)


def capture(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.fx.GraphModule, list, float]:
    """One dynamo capture (fresh caches) with a backend that only records; returns the graph and the wall time
    of the first call (dynamo tracing + the recorded graph's eager run, which is tiny at these sizes)."""
    torch._dynamo.reset()
    captured: list = []

    def recorder(gm, example_inputs, **_):
        captured.append((gm, list(example_inputs)))
        return gm.forward

    compiled = torch.compile(model, backend=recorder, fullgraph=True, dynamic=False)
    gc.collect()
    with torch.no_grad():
        t0 = time.perf_counter()
        compiled(x)
        elapsed = time.perf_counter() - t0
    assert len(captured) == 1, f"expected one graph, dynamo produced {len(captured)}"
    gm, inputs = captured[0]
    return gm, inputs, elapsed


def make_runtime(model: torch.nn.Module, policy: OffloadPolicy) -> OffloadRuntime:
    # pack_now=False: the passes only read the layout; packing is setup cost, not pass cost
    return OffloadRuntime(policy, plan_groups(model, policy), type(model).__name__, pack_now=False)


def staged(gm, example_inputs, runtime: OffloadRuntime) -> dict[str, float]:
    """rewrite_graph's body, each stage timed (kept in step with offload_compiler/backend.py)."""
    t = {}
    c0 = time.perf_counter()
    weights = weight_inputs(gm, example_inputs, runtime.group_of)
    c1 = time.perf_counter()
    streamed = {g.index for g in runtime.groups if g.streamed}
    uses, reads = collect_uses(gm, weights, streamed)
    c2 = time.perf_counter()
    schedule = build_schedule(uses, runtime.policy.prefetch)
    c3 = time.perf_counter()
    resident = {w.group for w in weights.values()} - streamed
    rewritten = insert_transfers(gm, weights, schedule, reads, resident, runtime.id, runtime.layout,
                                 runtime.new_fetch_key)
    c4 = time.perf_counter()
    verify(rewritten.graph_module, weights, {g.index: g.nbytes for g in runtime.groups})
    c5 = time.perf_counter()
    for name, (a, b) in zip(STAGES, ((c0, c1), (c1, c2), (c2, c3), (c3, c4), (c4, c5))):
        t[name] = b - a
    t["_instances"] = len(schedule.instances)
    t["_rewritten_nodes"] = len(rewritten.graph_module.graph.nodes)
    return t


def capture_model(n_blocks: int, capture_repeats: int):
    model, x = block_model(n_blocks)
    captures = []
    for _ in range(capture_repeats):
        gm, inputs, elapsed = capture(model, x)
        captures.append(elapsed)
    return model, gm, inputs, captures


def measure(n_blocks: int, model, gm, inputs, captures: list[float], policy: OffloadPolicy, repeats: int) -> dict:
    runtime = make_runtime(model, policy)
    totals, stages = [], {s: [] for s in STAGES}
    info = {}
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        new_gm, _, plan = rewrite_graph(gm, inputs, runtime)
        totals.append(time.perf_counter() - t0)
        gc.collect()
        st = staged(gm, inputs, runtime)
        for s in STAGES:
            stages[s].append(st[s])
        info = {"instances": st["_instances"], "rewritten_nodes": st["_rewritten_nodes"],
                "fetches": plan.verified.fetches}
    nodes = len(gm.graph.nodes)
    pass_s = median(totals)
    capture_s = median(captures)
    return {
        "blocks": n_blocks,
        "graph_nodes": nodes,
        "placeholders": sum(1 for n in gm.graph.nodes if n.op == "placeholder"),
        "groups": len(runtime.groups),
        "streamed_groups": sum(1 for g in runtime.groups if g.streamed),
        **info,
        "pass_s_median": pass_s,
        "pass_s_all": totals,
        "stage_s_median": {s: median(v) for s, v in stages.items()},
        "pass_us_per_node": pass_s / nodes * 1e6,
        "capture_s_median": capture_s,
        "capture_s_all": captures,
        "pass_over_capture": pass_s / capture_s,
    }


def profile_rewrite(model, gm, inputs, policy: OffloadPolicy, top: int = 15) -> dict:
    """cProfile of rewrite_graph on a captured graph: the functions with the most own time."""
    runtime = make_runtime(model, policy)
    prof = cProfile.Profile()
    prof.enable()
    rewrite_graph(gm, inputs, runtime)
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    total = max(ct for (_, _, _), (_, _, _, ct, _) in stats.stats.items())
    rows = []
    for (file, line, func), (cc, nc, tt, ct, _) in stats.stats.items():
        short = file.split("site-packages/")[-1].split("wt-bench/")[-1]
        rows.append({"function": f"{short}:{line}:{func}", "calls": nc, "own_s": tt, "cumulative_s": ct,
                     "cumulative_share": ct / total if total else None})
    by_own = sorted(rows, key=lambda r: r["own_s"], reverse=True)[:top]
    # cumulative view of the code we own and of torch.fx (where the passes spend their time)
    ours_or_fx = [r for r in rows if "offload_compiler" in r["function"] or "torch/fx" in r["function"]
                  or "builtins.compile" in r["function"]]
    by_cum = sorted(ours_or_fx, key=lambda r: r["cumulative_s"], reverse=True)[:top]
    return {"total_s": total, "by_own_time": by_own, "by_cumulative_time": by_cum}


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, series in results["series"].items():
        nodes = [r["graph_nodes"] for r in series["points"]]
        axes[0].plot(nodes, [r["pass_s_median"] * 1e3 for r in series["points"]], "o-", label=f"passes ({name})")
        fit = series["fit_pass_s_vs_nodes"]
        axes[0].plot(nodes, [(fit["intercept"] + fit["slope"] * n) * 1e3 for n in nodes], "k:", lw=0.8)
        axes[1].plot(nodes, [r["pass_over_capture"] * 100 for r in series["points"]], "o-", label=name)
    first = next(iter(results["series"].values()))["points"]
    axes[0].plot([r["graph_nodes"] for r in first], [r["capture_s_median"] * 1e3 for r in first], "s--",
                 label="dynamo capture")
    axes[0].set(xlabel="nodes in captured graph", ylabel="ms (median)", title="pass cost vs graph size",
                yscale="log")
    axes[0].legend(fontsize=8)
    axes[1].set(xlabel="nodes in captured graph", ylabel="passes / dynamo capture (%)",
                title="share of capture time")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"offload_compiler passes on CPU ({results['environment']['cpu']}, torch "
                 f"{results['environment']['torch']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, nargs="+", default=[50, 100, 200, 400])
    ap.add_argument("--strategies", nargs="+", default=["layerwise", "sequential"],
                    help="policies to schedule with (layerwise: prefetch=1; sequential: one group per module)")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs of the passes per size (median)")
    ap.add_argument("--capture-repeats", type=int, default=2, help="dynamo captures per size (median)")
    ap.add_argument("--out", type=Path, default=RESULTS / "pass_cost_cpu.json")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--profile-top", type=int, default=15, help="cProfile rows for the largest graph (0: off)")
    args = ap.parse_args(argv)

    results: dict = {"benchmark": "pass_cost", "command": exact_command(), "environment": environment(),
                     "config": {"blocks": args.blocks, "strategies": args.strategies, "repeats": args.repeats,
                                "capture_repeats": args.capture_repeats, "device": "cpu",
                                "model": "offload_compiler.testing.BlockStack, width 32, alternating attention/MLP "
                                         "blocks, parent table, input (1, 4, 32)"},
                     "series": {}}
    policies = {s: OffloadPolicy(strategy=s, device="cpu", prefetch=1) for s in args.strategies}
    points: dict[str, list] = {s: [] for s in args.strategies}
    capture(*block_model(2))  # warm dynamo up (imports, first-call caches) so the smallest N is not penalised
    for n in sorted(args.blocks):
        model, gm, inputs, captures = capture_model(n, args.capture_repeats)
        for strategy, policy in policies.items():
            point = measure(n, model, gm, inputs, captures, policy, args.repeats)
            points[strategy].append(point)
            print(f"[{strategy}] N={n:4d} nodes={point['graph_nodes']:6d} groups={point['groups']:5d} "
                  f"passes={point['pass_s_median'] * 1e3:8.2f} ms ({point['pass_us_per_node']:.1f} us/node) "
                  f"capture={point['capture_s_median']:.2f} s ratio={point['pass_over_capture'] * 100:.2f}%",
                  flush=True)
        largest = (model, gm, inputs)
        torch._dynamo.reset()
    for strategy, policy in policies.items():
        pts = points[strategy]
        nodes = [p["graph_nodes"] for p in pts]
        times = [p["pass_s_median"] for p in pts]
        series = {"policy": repr(policy), "points": pts}
        if len(pts) >= 2:
            series["fit_pass_s_vs_nodes"] = linear_fit(nodes, times)
            series["loglog_exponent"] = loglog_exponent(nodes, times)
            series["fit_capture_s_vs_nodes"] = linear_fit(nodes, [p["capture_s_median"] for p in pts])
            print(f"[{strategy}] fit: {series['fit_pass_s_vs_nodes']['slope'] * 1e6:.2f} us/node, "
                  f"R2={series['fit_pass_s_vs_nodes']['r2']:.4f}, exponent={series['loglog_exponent']:.3f}")
        if args.profile_top:
            series["profile_largest"] = profile_rewrite(*largest, policy, args.profile_top)
        results["series"][strategy] = series

    del largest
    largest = {s: v["points"][-1] for s, v in results["series"].items()}
    results["summary"] = {
        s: {"blocks": p["blocks"], "graph_nodes": p["graph_nodes"], "pass_s": p["pass_s_median"],
            "capture_s": p["capture_s_median"], "pass_over_capture": p["pass_over_capture"],
            "under_one_second": p["pass_s_median"] < 1.0,
            "loglog_exponent": results["series"][s].get("loglog_exponent"),
            "r2": results["series"][s].get("fit_pass_s_vs_nodes", {}).get("r2")}
        for s, p in largest.items()}
    results["plot"] = None
    if not args.no_plot:
        if have_matplotlib():
            png = args.out.with_suffix(".png")
            plot(results, png)
            results["plot"] = png.name
        else:
            results["plot_skipped"] = "matplotlib is not installed"
    write_json(args.out, results)
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
