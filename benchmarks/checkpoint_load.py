"""Loading an offloaded model from a safetensors checkpoint: time and peak host memory of

- ``from_pretrained``: ``LlamaForCausalLM.from_pretrained(dir)`` then ``offload_compile(model, layerwise)``;
- ``checkpoint``: ``with empty_weights(): LlamaForCausalLM(config)`` then
  ``offload_compile(model, layerwise, checkpoint=dir)``.

Each run is a fresh process (a process's peak resident size cannot be reset between methods), the methods
interleaved, medians over the rounds; the checkpoint's pages are dropped from the page cache before every run
(``posix_fadvise``), so each run reads the file. Peak growth is VmHWM after loading minus VmRSS before (Linux).

    PYTHONPATH=. python benchmarks/checkpoint_load.py [--hidden 1024] [--layers 12] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

RESULTS = pathlib.Path(__file__).parent / "results" / "checkpoint_load.json"


def _config(hidden: int, layers: int):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _drop_pages(folder: str) -> None:
    for path in pathlib.Path(folder).glob("*.safetensors"):
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _child(method: str, folder: str, hidden: int, layers: int) -> None:
    """One load, in this fresh process; prints its JSON record."""
    from transformers import LlamaForCausalLM
    from offload_compiler import OffloadPolicy, empty_weights, offload_compile
    policy = OffloadPolicy(strategy="layerwise")
    config = _config(hidden, layers)
    _drop_pages(folder)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM restarts from the resident size now
    before = _status("VmRSS:")
    start = time.perf_counter()
    if method == "from_pretrained":
        model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
        offload_compile(model, policy)
    else:
        with empty_weights():
            model = LlamaForCausalLM(config)
        offload_compile(model, policy, checkpoint=folder)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak_growth_bytes": _status("VmHWM:") - before,
                      "resident_growth_bytes": _status("VmRSS:") - before}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child[0], args.child[1], args.hidden, args.layers)
        return
    from transformers import LlamaForCausalLM
    methods = ("from_pretrained", "checkpoint")
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        model = LlamaForCausalLM(_config(args.hidden, args.layers))
        model.save_pretrained(folder)
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        largest = max(p.numel() * p.element_size() for p in model.parameters())
        del model
        runs: dict[str, list[dict]] = {m: [] for m in methods}
        for _ in range(args.rounds):
            for method in methods:
                out = subprocess.run([sys.executable, __file__, "--hidden", str(args.hidden), "--layers",
                                      str(args.layers), "--child", method, folder], check=True, capture_output=True,
                                     text=True, env={**os.environ, "TQDM_DISABLE": "1"})
                runs[method].append(json.loads(out.stdout.strip().splitlines()[-1]))
    summary = {m: {k: statistics.median(r[k] for r in runs[m]) for k in runs[m][0]} for m in methods}
    result = {
        "command": "PYTHONPATH=. python benchmarks/checkpoint_load.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "model": f"LlamaForCausalLM hidden {args.hidden}, {args.layers} layers, float32",
        "model_bytes": model_bytes, "largest_tensor_bytes": largest, "rounds": args.rounds,
        "median": summary, "runs": runs,
        "peak_growth_over_model": {m: summary[m]["peak_growth_bytes"] / model_bytes for m in methods},
        "checkpoint_time_over_from_pretrained": summary["checkpoint"]["seconds"] / summary["from_pretrained"]["seconds"],
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
