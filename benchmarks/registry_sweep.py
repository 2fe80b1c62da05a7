"""Every model type a transformers task registers, offloaded as a new user would: nobody here picked them.

For each model type of ``--task`` (transformers' auto mapping: ``causal-lm`` has about 200, ``image-classification``
about 40), a tiny random-weight config (`unseen_architectures.SMALL` and its per-type fields for language models;
for vision models the default config with 4 layers where it has a layer count, 64-pixel images, 10 labels) is
built and run plain on the CPU; a model whose tiny config does not build or run there is recorded as such
(``build_error``: a config field this generic recipe does not set, a library not installed) and left out of the
counts. Each built model is then offloaded like `unseen_architectures.trial`: ``layerwise`` (prefetch 1), eager,
on the simulated accelerator (a device that is not the host) -- outputs against the plain CPU model, traffic
against the verified plan, the ledger's device weight peak as a share of the model, bytes read on demand. A model
that fails is compiled plain with ``torch.compile(backend="eager")`` to say whether torch itself can.

Models run in worker processes of ``--chunk`` models each, ``--jobs`` at once (a fresh process per chunk; a model that takes the
process down -- out of memory, past ``--timeout`` -- is recorded as ``killed`` and the next chunk goes on).

    python benchmarks/registry_sweep.py --task causal-lm --jobs 2 --out benchmarks/results/registry_causal_lm.json
    python benchmarks/registry_sweep.py --task image-classification --out benchmarks/results/registry_image_classification.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PEAK_SHARE_LIMIT = 0.6  # issue 30's bound for a layerwise plan (prefetch 1): well below the whole model
ATOL = 1e-4  # outputs "equal": float32 on the CPU in both, the same kernels up to summation order
VISION = dict(num_hidden_layers=4, image_size=64, num_labels=10)


def registry(task: str) -> list[str]:
    from transformers.models.auto import modeling_auto
    mapping = {"causal-lm": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
               "image-classification": modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES}[task]
    return list(mapping)


def build(task: str, kind: str):
    """The tiny model, its inputs and how to read its output; raises where the recipe does not fit the type."""
    import torch
    from transformers import AutoConfig
    torch.manual_seed(0)
    if task == "causal-lm":
        from transformers import AutoModelForCausalLM
        from unseen_architectures import DECODERS, SMALL
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **SMALL, **DECODERS.get(kind, {})))
        ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(1))
        inputs = dict(input_ids=ids, use_cache=False)
    else:
        from transformers import AutoModelForImageClassification
        config = AutoConfig.for_model(kind)
        for name, value in VISION.items():
            if hasattr(config, name):
                try:
                    setattr(config, name, value)
                except (AttributeError, TypeError, ValueError):  # a derived or validated field: left as it is
                    pass
        model = AutoModelForImageClassification.from_config(config)
        size = config.image_size if isinstance(getattr(config, "image_size", None), int) else 64
        channels = getattr(config, "num_channels", 3)
        inputs = dict(pixel_values=torch.randn(1, channels, size, size, generator=torch.Generator().manual_seed(1)))
    model = model.eval().requires_grad_(False)
    with torch.no_grad():
        model(**inputs)  # the plain model runs on this recipe, or the type is recorded as not built
    return model, inputs, lambda out: out.logits


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:200] if lines else ""


def worker(task: str, kinds: list[str]) -> None:
    import torch
    from unseen_architectures import trial
    from offload_compiler.testing import simulated_device
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    device = simulated_device()
    for kind in kinds:
        print(f"START {kind}", flush=True)
        record = {"kind": kind}
        try:
            model, inputs, output = build(task, kind)
        except Exception as error:  # noqa: BLE001 - a recipe that does not fit this type is recorded, not ours
            record["build_error"] = f"{type(error).__name__}: {_first_line(error)}"
        else:
            record["parameters"] = sum(p.numel() for p in model.parameters())
            record.update(trial(model, inputs, output, device, "eager"))
        torch.compiler.reset()
        print("RESULT " + json.dumps(record), flush=True)


def run_chunk(task: str, kinds: list[str], timeout: float) -> list[dict]:
    """``kinds`` in one fresh worker process; a model the process died on (or ran past ``timeout`` on) is
    recorded as killed, and the kinds after it run in the next worker."""
    root = Path(__file__).resolve().parent.parent
    results: list[dict] = []
    pending = list(kinds)
    while pending:
        process = subprocess.Popen([sys.executable, __file__, "--worker", task, *pending], cwd=root, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                   env={**os.environ, "PYTHONPATH": str(root)})
        state = {"current": None, "started": time.monotonic()}
        watchdog = threading.Thread(target=_kill_past, args=(process, state, timeout), daemon=True)
        watchdog.start()
        for line in process.stdout:
            if line.startswith("START "):
                state.update(current=line.split(None, 1)[1].strip(), started=time.monotonic())
            elif line.startswith("RESULT "):
                results.append(json.loads(line[len("RESULT "):]))
                print(results[-1], flush=True)
                pending.remove(results[-1]["kind"])
                state["current"] = None
        process.wait()
        current = state["current"]
        if current is not None:  # the worker died on it (killed for memory, or past the timeout)
            results.append({"kind": current, "killed": f"the worker process ended (return code {process.returncode}) "
                                                       f"while this model ran"})
            print(results[-1], flush=True)
            pending.remove(current)
        elif pending and process.returncode != 0:  # died between models: the rest is recorded as not run
            results += [{"kind": kind, "killed": f"the worker process ended (return code {process.returncode}) "
                                                 f"before this model ran"} for kind in pending]
            break
    return results


def _kill_past(process: subprocess.Popen, state: dict, timeout: float) -> None:
    """Kill the worker once the model it runs has taken more than ``timeout`` seconds."""
    while process.poll() is None:
        if state["current"] is not None and time.monotonic() - state["started"] > timeout:
            process.kill()
            return
        time.sleep(1)


def summarize(results: list[dict]) -> dict:
    built = [r for r in results if "build_error" not in r and "killed" not in r]
    passed = [r for r in built if r.get("ok") and r["max_abs_diff"] <= ATOL]
    failed = [r for r in built if r not in passed]
    return {
        "registered": len(results),
        "built": len(built),
        "not_built": len(results) - len(built),
        "passed": len(passed),
        "failed": [r["kind"] for r in failed if not r.get("plain_torch_compile_fails_too")],
        "failed_plain_torch_compile_too": [r["kind"] for r in failed if r.get("plain_torch_compile_fails_too")],
        f"peak_share_above_{PEAK_SHARE_LIMIT}": {r["kind"]: r["device_weight_peak_share"] for r in passed
                                                 if r["device_weight_peak_share"] > PEAK_SHARE_LIMIT},
        # a plan that holds much of the model and was not warned about at offload_compile (`OffloadSavingWarning`)
        f"peak_share_above_{PEAK_SHARE_LIMIT}_not_warned": [
            r["kind"] for r in passed if r["device_weight_peak_share"] > PEAK_SHARE_LIMIT and not r["saving_warning"]],
        "read_on_demand": {r["kind"]: r["on_demand_bytes"] for r in passed if r["on_demand_bytes"]},
        "max_peak_share": max((r["device_weight_peak_share"] for r in passed), default=None),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=["causal-lm", "image-classification"], default="causal-lm")
    parser.add_argument("--only", nargs="*", default=None, help="these model types only")
    parser.add_argument("--chunk", type=int, default=12, help="models per worker process")
    parser.add_argument("--timeout", type=float, default=240, help="seconds one model may take")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes at once (each runs one torch thread)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from common import environment, exact_command, write_json
    kinds = args.only or registry(args.task)
    chunks = [kinds[start:start + args.chunk] for start in range(0, len(kinds), args.chunk)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        done = pool.map(lambda chunk: run_chunk(args.task, chunk, args.timeout), chunks)
        results = [record for chunk in done for record in chunk]  # the registry's order
    report = {"command": exact_command(), "environment": environment(), "task": args.task,
              "policy": "OffloadPolicy(strategy='layerwise', prefetch=1, compiler='eager'), simulated accelerator",
              "summary": summarize(results), "results": results}
    print(json.dumps(report["summary"], indent=1))
    if args.out:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3:])
    else:
        main()
