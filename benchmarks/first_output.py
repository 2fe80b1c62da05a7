"""Time to first output: offload_compile + the first call against plain ``torch.compile``'s first call.

Each measurement runs in a fresh Python process: torch, transformers, diffusers and the package are imported,
dynamo is warmed on a tiny unrelated function and the model is built (random weights, never timed) before the
clock starts. Then, per method:

  plain-<compiler>   torch.compile(model, backend=<compiler>) and its first call
  ours-<compiler>    offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu",
                     compiler=<compiler>)) and its first call

Models: ``sd3`` (the tiny SD3 transformer of `offload_compiler.testing.models`), ``llama8`` (a tiny 8-layer
Llama), ``llama1b`` (a TinyLlama-shaped 1.1B-parameter bf16 Llama with random weights: where packing
shows) and ``fluxpipe`` (the tiny Flux pipeline of `offload_compiler.testing.pipelines`: CLIP, T5, a Flux
transformer and a VAE; its first image, 4 steps). For the pipeline, plain is the pipeline with each of its
components compiled in place (``component.compile(backend=<compiler>)``), ours ``offload_compile(pipe, ...)``. Processes are interleaved (round by round, model by model, method by method); medians over rounds.
The breakdown of ours comes from timers wrapped around the package's functions from here (the library has no
timing code): packing (`runtime.host.pack_group`), our passes (`backend.rewrite_graph`, the eager lowering or
inductor's compile of the rewritten graph) and dynamo's capture (from the call until our backend is entered).

    python benchmarks/first_output.py            # writes benchmarks/results/first_output.json
    python benchmarks/first_output.py --quick    # tiny models only (a smoke run)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, environment, exact_command, median, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("sd3", "llama8", "llama1b", "fluxpipe", "stack")  # stack: torch only, for the smoke test
QUICK_MODELS = ("sd3", "llama8")
TARGET_RATIO = 1.5
LIBRARIES = {"sd3": ("diffusers",), "llama8": ("transformers",), "llama1b": ("transformers",),
             "fluxpipe": ("diffusers", "transformers")}  # imported untimed
LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)  # TinyLlama-1.1B's shape


# -- models (built before the clock starts) ---------------------------------------------------------------

def _fill_random(model, seed: int = 0) -> None:
    """Random weights without 1B calls into the RNG: every tensor takes a slice of one random block."""
    import torch
    tensors = list(model.parameters())  # buffers (rotary frequencies) are computed, not initialised
    largest = max(t.numel() for t in tensors)
    block = torch.randn(min(largest, 1 << 24), generator=torch.Generator().manual_seed(seed)) * 0.02
    with torch.no_grad():
        for t in tensors:
            flat = t.view(-1)
            for start in range(0, flat.numel(), block.numel()):
                piece = flat[start:start + block.numel()]
                piece.copy_(block[:piece.numel()])


def llama_1b(seq: int = 16):
    """TinyLlama-1.1B's shape in bf16, random weights, built without torch's slow default initialisation."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with no_init_weights():
            model = LlamaForCausalLM(LlamaConfig(**LLAMA_1B)).eval()
    finally:
        torch.set_default_dtype(default)
    _fill_random(model)
    ids = torch.randint(0, LLAMA_1B["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "use_cache": False}


def block_stack():
    """torch only (no transformers or diffusers to import): the smoke test's model."""
    from offload_compiler.testing import BlockSpec, ModelSpec, build_block_model
    spec = ModelSpec(32, (BlockSpec("mlp", 64), BlockSpec("attention", 2)) * 2, False, False, seq=4, batch=1)
    model, x = build_block_model(spec)
    return model, {"x": x}


def build(name: str):
    from offload_compiler.testing import models
    if name == "stack":
        return block_stack()
    if name == "sd3":
        return models.ARCHITECTURES["sd3"]()
    if name == "llama8":
        model, kwargs = models.llama(layers=8)
        return model, {**kwargs, "use_cache": False}
    if name == "llama1b":
        return llama_1b()
    if name == "fluxpipe":
        from offload_compiler.testing.pipelines import flux_pipeline
        pipe, kwargs = flux_pipeline()
        return pipe, {**kwargs, "num_inference_steps": 4}
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


# -- timers wrapped around the package's functions (from here, not in the library) ---------------------------

class Timers:
    """Seconds spent in wrapped functions (outermost calls only), and when the backend was first entered."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.first_backend_at: float | None = None
        self._depth: dict[str, int] = {}

    def wrap(self, owner, attr: str, label: str, backend: bool = False) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if backend and self.first_backend_at is None:
                self.first_backend_at = time.perf_counter()
            self.calls[attr] = self.calls.get(attr, 0) + 1
            depth = self._depth.get(label, 0)
            self._depth[label] = depth + 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth[label] = depth
                if depth == 0:
                    self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start
        setattr(owner, attr, timed)


def instrument_ours(timers: Timers) -> None:
    from offload_compiler import backend
    from offload_compiler.runtime import host  # the module that calls pack_group (a re-export would not see it)
    timers.wrap(host, "pack_group", "pack")
    timers.wrap(backend, "compile_graph", "backend", backend=True)
    timers.wrap(backend, "rewrite_graph", "passes")
    timers.wrap(backend, "lower_for_eager", "lowering")


def plain_backend(compiler: str, timers: Timers):
    """The plain compiler as a backend callable, so the moment dynamo hands it a graph is recorded."""
    def backend(gm, example_inputs):
        if timers.first_backend_at is None:
            timers.first_backend_at = time.perf_counter()
        start = time.perf_counter()
        try:
            if compiler == "inductor":
                from torch._inductor.compile_fx import compile_fx
                return compile_fx(gm, example_inputs)
            return gm.forward
        finally:
            timers.seconds["backend"] = timers.seconds.get("backend", 0.0) + time.perf_counter() - start
    return backend


# -- one measurement: a fresh process --------------------------------------------------------------------

def _warm_dynamo(compiler: str) -> None:
    """Dynamo's (and inductor's) lazy imports and first-use set-up, on a function unrelated to the model."""
    import torch
    fn = torch.compile(lambda x: torch.nn.functional.silu(x) * 2 + 1, backend=compiler)
    fn(torch.randn(8))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def _dynamo_stats() -> dict:
    """Frames dynamo compiled and graphs it captured so far (a capture done twice would show here)."""
    from torch._dynamo.utils import counters
    stats = counters["stats"]
    return {"frames_compiled": stats["unique_graphs"], "calls_captured": stats["calls_captured"]}


def _components(model) -> list:
    """The modules of ``model``: itself, or a pipeline's components holding weights."""
    import torch
    if isinstance(model, torch.nn.Module):
        return [model]
    return [c for c in vars(model).values() if isinstance(c, torch.nn.Module) and next(c.parameters(), None) is not None]


def _fresh(kwargs: dict) -> dict:
    """A call's arguments, a pipeline's generator seeded again (both calls make the same image)."""
    import torch
    if "generator" not in kwargs:
        return kwargs
    return {**kwargs, "generator": torch.Generator().manual_seed(0)}


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(model_name: str, method: str) -> dict:
    import torch
    from offload_compiler import OffloadPolicy, offload_compile
    for library in LIBRARIES.get(model_name, ()):
        __import__(library)
    kind, compiler = method.split("-", 1)
    _warm_dynamo(compiler)
    model, kwargs = build(model_name)
    components = _components(model)
    model_bytes = sum(t.numel() * t.element_size() for c in components for t in [*c.parameters(), *c.buffers()])
    timers = Timers()
    if kind == "ours":
        instrument_ours(timers)
    rss_before = _rss_bytes()
    with torch.no_grad():
        start = time.perf_counter()
        if kind == "ours":
            run = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu", compiler=compiler))
        elif components == [model]:
            run = torch.compile(model, backend=plain_backend(compiler, timers))
        else:  # a pipeline: its components compiled in place, as a compile user of the pipeline does
            for component in components:
                component.compile(backend=plain_backend(compiler, timers))
            run = model
        built = time.perf_counter()
        out = run(**_fresh(kwargs))
        first = time.perf_counter()
        graphs = _dynamo_stats()
        run(**_fresh(kwargs))
        second = time.perf_counter() - first
    del out
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    capture = timers.first_backend_at - built if timers.first_backend_at else None
    return {"model": model_name, "method": method, "construct_s": built - start, "first_call_s": first - built,
            "total_s": first - start, "second_call_s": second, "capture_s": capture, "timers_s": timers.seconds,
            "calls": timers.calls, "dynamo_first_call": graphs, "dynamo_after_second_call": _dynamo_stats(),
            "model_bytes": model_bytes, "rss_before_bytes": rss_before, "peak_rss_bytes": peak_rss,
            "peak_rss_over_model": (peak_rss - rss_before) / model_bytes}


def run_fresh(model: str, method: str, timeout: int) -> dict:
    """One measurement in a new interpreter (inductor: with an empty cache, so nothing comes from disk)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory(prefix="first_output_") as cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
        proc = subprocess.run([sys.executable, __file__, "--worker", model, method], env=env, capture_output=True,
                              text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        return {"model": model, "method": method, "error": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


COPY_SPEED = """
import time, torch
src = torch.ones({numel})
start = time.perf_counter(); dst = torch.empty_like(src).copy_(src); fresh = time.perf_counter() - start
start = time.perf_counter(); dst.copy_(src); touched = time.perf_counter() - start
print(src.nbytes / fresh / 1e9, src.nbytes / touched / 1e9)
"""


def host_copy_speed(nbytes: int = 1 << 29) -> dict:
    """memcpy on this machine, in a fresh process: ``copy_`` of a contiguous float32 tensor into freshly
    allocated memory (as packing does: the copy touches every page first) and into memory already touched."""
    out = subprocess.run([sys.executable, "-c", COPY_SPEED.format(numel=nbytes // 4)], capture_output=True,
                         text=True, timeout=120)
    fresh, touched = map(float, out.stdout.split())
    return {"bytes": nbytes, "fresh_gb_per_s": fresh, "touched_gb_per_s": touched}


def packing_speed(summary: dict) -> dict:
    """Packing throughput (model bytes / packing seconds) of each model, to set against `host_copy_speed`."""
    return {model: r["model_bytes"] / r["breakdown_s"]["pack"] / 1e9 for model, methods in summary.items()
            for method, r in methods.items() if method == "ours-eager" and r.get("breakdown_s", {}).get("pack")}


# -- summary ------------------------------------------------------------------------------------------------

def summarize(samples: list[dict]) -> dict:
    """Per model and method: medians over the rounds; ours also against plain with the same compiler."""
    out: dict[str, dict] = {}
    for s in samples:
        out.setdefault(s["model"], {}).setdefault(s["method"], []).append(s)
    result = {}
    for model, methods in out.items():
        result[model] = {method: _medians(runs) for method, runs in methods.items()}
        for method, r in result[model].items():
            plain = result[model].get("plain-" + method.split("-", 1)[1])
            if method.startswith("ours-") and plain and "total_s" in plain and "total_s" in r:
                r["ratio_to_plain"] = r["total_s"] / plain["total_s"]
                r["meets_target"] = r["ratio_to_plain"] <= TARGET_RATIO
    return result


def _medians(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"errors": [r["error"] for r in runs]}
    keys = ("construct_s", "first_call_s", "total_s", "second_call_s", "capture_s", "peak_rss_over_model")
    r = {k: median([x[k] for x in ok if x[k] is not None]) for k in keys}
    labels = sorted({label for x in ok for label in x["timers_s"]})
    r["breakdown_s"] = {label: statistics.median(x["timers_s"].get(label, 0.0) for x in ok) for label in labels}
    r["model_bytes"] = ok[0]["model_bytes"]
    r["total_s_all"] = [x["total_s"] for x in ok]
    if len(ok) < len(runs):
        r["errors"] = [x["error"] for x in runs if "error" in x]
    return r


def table(summary: dict) -> str:
    head = (f"{'model':8s} {'method':15s} {'construct':>9s} {'first':>7s} {'total':>7s} {'ratio':>6s} "
            f"{'pack':>6s} {'capture':>7s} {'passes':>6s} {'lower':>6s} {'rss/model':>9s}")
    lines = [head]
    for model, methods in summary.items():
        for method, r in methods.items():
            if "total_s" not in r:
                lines.append(f"{model:8s} {method:15s} error: {r.get('errors')}")
                continue
            b = r["breakdown_s"]
            cell = lambda v: f"{v:7.3f}" if v is not None else f"{'-':>7s}"  # noqa: E731
            lines.append(f"{model:8s} {method:15s} {r['construct_s']:9.3f} {r['first_call_s']:7.3f} {r['total_s']:7.3f} "
                         f"{r.get('ratio_to_plain', float('nan')):6.2f} {cell(b.get('pack'))[1:]} "
                         f"{cell(r['capture_s'])} {cell(b.get('passes'))[1:]} {cell(b.get('lowering'))[1:]} "
                         f"{r['peak_rss_over_model']:9.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=None)
    parser.add_argument("--compilers", nargs="+", choices=("eager", "inductor"), default=["eager"])
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per model and method")
    parser.add_argument("--quick", action="store_true", help="tiny models only (sd3, llama8)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per process")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return {}
    models = args.models or (QUICK_MODELS if args.quick else MODELS[:4])
    methods = [f"{kind}-{c}" for c in args.compilers for kind in ("plain", "ours")]
    samples = [run_fresh(model, method, args.timeout)
               for _ in range(args.rounds) for model in models for method in methods]
    summary = summarize(samples)
    copy_speed = {**host_copy_speed(), "packing_gb_per_s": packing_speed(summary)}
    out = args.out or RESULTS / ("first_output_quick.json" if args.quick else "first_output.json")
    data = {"command": exact_command(), "environment": environment(),
            "config": {"models": list(models), "methods": methods, "rounds": args.rounds, "llama1b": LLAMA_1B,
                       "target_ratio": TARGET_RATIO},
            "summary": summary, "host_copy": copy_speed, "samples": samples}
    write_json(out, data)
    print(table(summary))
    print(f"memcpy {copy_speed['fresh_gb_per_s']:.2f} GB/s into fresh memory, {copy_speed['touched_gb_per_s']:.2f} "
          f"GB/s into touched memory; packing (GB/s): "
          + ", ".join(f"{m} {v:.2f}" for m, v in copy_speed["packing_gb_per_s"].items()))
    return data


if __name__ == "__main__":
    main()
