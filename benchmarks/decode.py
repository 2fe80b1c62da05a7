"""Decode at batch 1 (CPU): one token per call with a KV cache, where an offloader's host work shows most.

A tiny Llama (transformers, built from a config, random weights) prefills a prompt once per round; then each
method decodes ``--tokens`` tokens greedily from a copy of that cache, one forward per token. Methods in this
one process, interleaved round by round and from several stack depths (`common.interleave`), time per token:

  plain-eager / plain-inductor   the model itself (eager; torch.compile with inductor)
  ours-eager / ours-inductor     offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu"))
  diffusers-group-block          diffusers apply_group_offloading(block_level, 1 layer per group, onload cpu)
  vllm-functional_call           each layer copies its state dict per forward and runs torch.func.functional_call
                                 (not run by default: with a KV cache its decode tokens differ from the model's)

``--decompose`` adds two diagnostic variants of ours-inductor, which split what a token costs beyond plain (their
tokens are not the model's: their slots keep stale weights):

  ours-inductor-without-copies     the runtime does all its work except the memcpy of each fill
  ours-inductor-without-transfers  every transfer returns its slot's weights as they are: the entry path and the
                                   compiled graph only

Per method: ms per token, its ratio to its plain counterpart on wall time and on this process's CPU time
(ours-inductor against plain-inductor, everything else against plain-eager), minor page faults per token, and
for ours the bytes and fetches of one token from the ledger (offloading happened, every layer streamed per
token). With device ``cpu`` a fetch is a memcpy on the core that computes, so a token cannot cost less than
plain + the copies of the bytes it streams: the copy floor, measured here too (`token_copies`: the same host
buffers copied in the same order, timed interleaved with the methods; a hot flat memcpy of that many bytes,
which the caches flatter, is recorded beside it); ``over_floor`` is ours against it, and
``host_work_beyond_copies_s`` what our host work adds per token.

    python benchmarks/decode.py                      # writes benchmarks/results/decode.json
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (RESULTS, against_baseline, environment, exact_command, interleave,  # noqa: E402
                    STACK_DEPTHS, moved_per_call, write_json)
from host_overhead import functional_call_offload  # noqa: E402

DIAGNOSTIC = ("ours-inductor-without-copies", "ours-inductor-without-transfers")  # see the module doc
METHODS = ("plain-eager", "plain-inductor", "ours-eager", "ours-inductor", "diffusers-group-block",
           "vllm-functional_call")
DEFAULT_METHODS = METHODS[:-1]
# every other method is measured against plain-eager
BASELINE = {"ours-inductor": "plain-inductor", **{name: "plain-inductor" for name in DIAGNOSTIC}}


def setup(name: str, model) -> tuple[object, dict]:
    if name == "plain-eager":
        return model, {}
    if name == "plain-inductor":
        return torch.compile(model, backend="inductor"), {}
    if name.startswith("ours-"):
        from offload_compiler import OffloadPolicy, offload_compile
        policy = OffloadPolicy(strategy="layerwise", device="cpu", compiler=name.split("-", 1)[1])
        return offload_compile(model, policy), {"policy": repr(policy)}
    if name == "diffusers-group-block":
        from diffusers.hooks import apply_group_offloading
        apply_group_offloading(model, onload_device=torch.device("cpu"), offload_device=torch.device("cpu"),
                               offload_type="block_level", num_blocks_per_group=1)
        return model, {"call": "apply_group_offloading(model, onload_device=cpu, offload_device=cpu, "
                               "offload_type='block_level', num_blocks_per_group=1)"}
    if name == "vllm-functional_call":
        functional_call_offload(model.model.layers)
        return model, {"call": "per decoder layer: state_dict().to(cpu) + torch.func.functional_call"}
    raise ValueError(f"unknown method {name!r}; choose from {METHODS}")


def strip(offloaded, variant: str) -> None:
    """After warm-up (slots filled, every graph compiled): the diagnostic ``variant`` of an ours-inductor model."""
    runtime = offloaded._offload_runtime
    if variant == "ours-inductor-without-copies":
        runtime._copy_into = lambda slot, group: None
        return
    leaves = {index: (runtime._slot_of[plan.key] if plan.key is not None else runtime._resident[plan.group][0]
                      ).leaves(runtime.groups[plan.group]) for index, plan in enumerate(runtime._transfer_plans)}
    runtime.run_transfer = leaves.__getitem__
    runtime.evict = lambda *args: None


def prefill(model, prompt: torch.Tensor):
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
    return out.past_key_values, out.logits[:, -1:].argmax(-1)


class Decoder:
    """A timed step: one greedy token from its own copy of the prefilled cache (copied untimed, at creation)."""

    def __init__(self, fn, cache, token: torch.Tensor) -> None:
        self.fn, self.cache, self.token = fn, copy.deepcopy(cache), token

    def __call__(self) -> None:
        out = self.fn(input_ids=self.token, past_key_values=self.cache, use_cache=True)
        self.cache, self.token = out.past_key_values, out.logits[:, -1:].argmax(-1)


def decode(fn, cache, token: torch.Tensor, tokens: int) -> list[int]:
    """Greedy decode from a copy of ``cache``; the tokens produced."""
    step, produced = Decoder(fn, cache, token), []
    with torch.no_grad():
        for _ in range(tokens):
            step()
            produced.append(int(step.token))
    return produced


COPIES = "copies-only"  # timed with the methods: the copies a token makes, nothing else (see `token_copies`)


def token_copies(runtime) -> Callable[[], None]:
    """A step doing only the copies of one offloaded token: every streamed group's host buffers, in order, into
    device memory of its size (two destinations per size class, as prefetch 1 alternates two slots). With
    device ``cpu`` this memcpy from host buffers the caches no longer hold is what an offloaded token cannot
    avoid; plain + this is the copy floor."""
    targets: dict[tuple, list] = {}
    pairs = []
    for group in (g for g in runtime.groups if g.streamed):
        sizes = tuple((b.numel, b.dtype) for b in group.buckets)
        slots = targets.setdefault(sizes, [[torch.empty(n, dtype=d) for n, d in sizes] for _ in range(2)])
        slots.reverse()
        pairs += [(dst, bucket.source()) for dst, bucket in zip(slots[0], group.buckets)]

    def step() -> None:
        for dst, src in pairs:
            dst.copy_(src)
    return step


def _copy_seconds(source: torch.Tensor, target: torch.Tensor, repeats: int = 5) -> float:
    """The median time of one memcpy of ``source`` (the bytes a token streams) on this core."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens prefilled once per round")
    parser.add_argument("--tokens", type=int, default=8, help="tokens decoded per method per round and stack depth")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the medians are over these")
    parser.add_argument("--depths", type=int, default=STACK_DEPTHS, help="Python stack depths (common.interleave)")
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=METHODS + DIAGNOSTIC)
    parser.add_argument("--decompose", action="store_true", help="add the diagnostic variants (module doc)")
    parser.add_argument("--out", type=Path, default=RESULTS / "decode.json")
    args = parser.parse_args(argv)
    if args.decompose:
        args.methods += [name for name in DIAGNOSTIC if name not in args.methods]
    from offload_compiler.testing.models import llama
    torch.set_num_threads(1)
    reference, inputs = llama(layers=args.layers, hidden=args.hidden, vocab=256, seq=args.prompt)
    cache, first = prefill(reference, inputs["input_ids"])
    expected = decode(reference, cache, first, args.tokens)
    runs, info, errors = {}, {}, {}
    for name in args.methods:
        try:
            runs[name], info[name] = setup("ours-inductor" if name in DIAGNOSTIC else name, copy.deepcopy(reference))
            produced = decode(runs[name], cache, first, args.tokens)  # warm-up: every cache length compiled
            produced = decode(runs[name], cache, first, args.tokens)
            info[name]["same_tokens"] = produced == expected
            if name in DIAGNOSTIC:
                strip(runs[name], name)
                info[name] = {"diagnostic": True}
            elif name.startswith("ours-"):
                info[name].update(moved_per_call(runs[name], Decoder(runs[name], cache, first)))
        except Exception as exc:  # a method that cannot run here is reported, not fatal
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            runs.pop(name, None)
    streamed = max((info[n].get("bytes_per_call", 0) for n in runs), default=0)
    source, target = torch.empty(streamed, dtype=torch.uint8), torch.empty(streamed, dtype=torch.uint8)
    steps = {name: (lambda fn=fn: Decoder(fn, cache, first)) for name, fn in runs.items()}
    ours = next((runs[n] for n in runs if n.startswith("ours-") and n not in DIAGNOSTIC), None)
    if ours is not None:
        steps[COPIES] = lambda: token_copies(ours._offload_runtime)
    with torch.no_grad():
        timed = interleave(steps, args.rounds, args.tokens, args.depths)
    copy_s = statistics.median(_copy_seconds(source, target) for _ in range(args.rounds))
    copies_s = timed.pop(COPIES)["wall_s"] if ours is not None else copy_s
    results = {name: {**timed[name], **info[name]} for name in runs}
    for name, r, base in against_baseline(results, BASELINE):
        r["baseline"] = BASELINE.get(name, "plain-eager")
        r["over_plain"] = r["wall_s"] / base["wall_s"]
        r["over_plain_cpu"] = r["cpu_s"] / base["cpu_s"]
        if name.startswith("ours-") and name not in DIAGNOSTIC:
            r["copy_floor_s"] = base["wall_s"] + copies_s
            r["over_floor"] = r["wall_s"] / r["copy_floor_s"]
            r["host_work_beyond_copies_s"] = r["wall_s"] - r["copy_floor_s"]
    for name, error in errors.items():
        results[name] = {"error": error}
    summary = {name: {"over_plain": results.get(name, {}).get("over_plain"),
                      "over_plain_cpu": results.get(name, {}).get("over_plain_cpu"),
                      "over_copy_floor": results.get(name, {}).get("over_floor"), "target": 1.10,
                      "meets_target": (results.get(name, {}).get("over_plain") or 99) <= 1.10}
               for name in ("ours-eager", "ours-inductor")}
    summary.update({f"{name}_over_plain": results[name]["over_plain"] for name in DIAGNOSTIC if name in runs})
    summary["copies_of_a_token_s"] = copies_s
    summary["memcpy_of_streamed_bytes_hot_s"] = copy_s
    data = {"command": exact_command(), "environment": environment(),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "methods": results, "summary": summary}
    write_json(args.out, data)
    for name, r in results.items():
        print(f"{name:32s} " + (r["error"] if "error" in r else
                                f"{r['wall_s'] * 1e3:8.3f} ms/token  "
                                f"{r.get('over_plain', float('nan')):5.2f}x plain  "
                                f"({r.get('over_plain_cpu', float('nan')):5.2f}x on CPU time)  "
                                f"{r.get('over_floor', float('nan')):5.2f}x copy floor  "
                                f"{r['minor_faults']:8.1f} faults/token"
                                + ("" if r.get("same_tokens", True) else "  TOKENS DIFFER")))
    print(summary)
    return data


if __name__ == "__main__":
    main()
