"""Offload methods compared in one run, same model and inputs, interleaved per repetition.

Workloads (sizes are flags; the defaults put several GB of bf16 weights on the GPU machine):
  dit          compute-heavy DiT-like block stack (adaLN modulation, self-attention, 4x MLP) at a video-like
               sequence length (default 20 blocks of width 3072, 16384 tokens: ~6.8 GB of weights)
  llm_prefill  Llama-like decoder stack (RMSNorm, GQA attention, SwiGLU MLP), batch 1, 2048 tokens
  llm_decode_b1, llm_decode_b64
               the same model, one new token per sequence at batch 1 and 64 (no KV cache: the attention over a
               cache is left out, the weight stream is what decode pays for)

Methods:
  none, none-inductor                       weights resident on the device (compute-only time, eager / inductor)
  ours-layerwise-p{1,2}-{eager,inductor}    offload_compile(strategy="layerwise", prefetch=1|2)
  ours-layerwise-p1wrap-{eager,inductor}    the same with prefetch_next_call=True (the last group of a call
                                            prefetches the first group of the next call)
  ours-budget-{eager,inductor}              offload_compile(strategy="budget"): --budget-fraction of the blocks
  accelerate-cpu_offload                    accelerate.cpu_offload(model, execution_device)
  diffusers-group-block                     diffusers.hooks.apply_group_offloading(block_level, 1 block per group,
                                            use_stream=True, non_blocking=True)
  vllm-functional_call                      vLLM's cpu_offload_gb mechanism (pinned host params, per forward
                                            ``{k: v.to(dev, non_blocking=True)}`` + ``functional_call``) on exactly
                                            the weights ours-budget streams

Metrics per workload and method: median forward time, ``torch.cuda.max_memory_allocated`` attributable to the
method, host peak RSS at setup (a fresh subprocess per method, see ``rss_child``), bytes moved host→device per
forward (CUDA profiler memcpy records; ours also from its ledger), achieved GB/s, and the lower bound
``max(compute-only time, bytes / pinned H2D bandwidth)``; then the issue's target ratios from the same run.

    PYTHONPATH=. python benchmarks/gpu_offload.py                 # on a CUDA machine; writes results/
    PYTHONPATH=. python benchmarks/gpu_offload.py --smoke         # tiny, CPU: proves the harness end to end

In ``--smoke`` on a machine without CUDA the compute device is the CPU: the CUDA-only metrics are null and
diffusers runs with ``use_stream=False`` (streams need an accelerator). Smoke numbers are not benchmark results.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, environment, exact_command, have_matplotlib, median, write_json  # noqa: E402

GIB = 1 << 30
ALL_METHODS = ("none", "none-inductor",
               "ours-layerwise-p1-eager", "ours-layerwise-p2-eager",
               "ours-layerwise-p1-inductor", "ours-layerwise-p2-inductor",
               "ours-layerwise-p1wrap-eager", "ours-layerwise-p1wrap-inductor",
               "ours-budget-eager", "ours-budget-inductor",
               "accelerate-cpu_offload", "diffusers-group-block", "vllm-functional_call")
ALL_WORKLOADS = ("dit", "llm_prefill", "llm_decode_b1", "llm_decode_b64")


# ---------------------------------------------------------------------------------------------------------
# models

class DiTBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.fc1 = nn.Linear(hidden, mlp_ratio * hidden)
        self.fc2 = nn.Linear(mlp_ratio * hidden, hidden)
        self.ada = nn.Linear(hidden, 6 * hidden)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        sh1, sc1, g1, sh2, sc2, g2 = self.ada(F.silu(c)).unsqueeze(1).chunk(6, dim=-1)
        y = self.norm1(x) * (1 + sc1) + sh1
        q, k, v = self.qkv(y).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, h)
        x = x + g1 * self.proj(y)
        y = self.norm2(x) * (1 + sc2) + sh2
        return x + g2 * self.fc2(F.gelu(self.fc1(y), approximate="tanh"))


class DiTStack(nn.Module):
    _layerwise_offload_blocks_attr = "blocks"

    def __init__(self, hidden: int, heads: int, blocks: int, in_channels: int = 64) -> None:
        super().__init__()
        self.patch = nn.Linear(in_channels, hidden)
        self.cond = nn.Linear(hidden, hidden)
        self.blocks = nn.ModuleList(DiTBlock(hidden, heads) for _ in range(blocks))
        self.norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.out = nn.Linear(hidden, in_channels)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        h = self.patch(x)
        c = self.cond(c)
        for block in self.blocks:
            h = block(h, c)
        return self.out(self.norm(h))


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class DecoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, intermediate: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.input_norm = RMSNorm(hidden)
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.post_norm = RMSNorm(hidden)
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.input_norm(x)
        q = self.q(y).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(y).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(y).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=s > 1).transpose(1, 2).reshape(b, s, h)
        x = x + self.o(a)
        y = self.post_norm(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class DecoderLM(nn.Module):
    _layerwise_offload_blocks_attr = "layers"

    def __init__(self, vocab: int, hidden: int, heads: int, kv_heads: int, intermediate: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(DecoderLayer(hidden, heads, kv_heads, intermediate) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h)[:, -1:])  # next-token logits, as generation computes them


@dataclasses.dataclass(frozen=True)
class Family:
    """A model (built identically for every method) and the workloads that run it."""
    name: str
    build: Callable[[], nn.Module]
    workloads: dict[str, Callable[[torch.device, torch.dtype], tuple]]  # name -> inputs
    blocks_attr: str
    num_blocks: int
    config: dict


def init_weights(model: nn.Module, seed: int) -> nn.Module:
    """Deterministic weights without a float32 detour (the model is created in its final dtype on meta)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if "norm" in name else 0.0)
            else:
                bound = 1.0 / math.sqrt(p.shape[-1])
                p.uniform_(-bound, bound, generator=g)
    return model


def make_builder(factory: Callable[[], nn.Module], dtype: torch.dtype, seed: int) -> Callable[[], nn.Module]:
    def build(meta: bool = False) -> nn.Module:
        with torch.device("meta"):
            model = factory()
        model = model.to(dtype=dtype)
        if meta:  # shapes and bytes only
            return model
        model = model.to_empty(device="cpu")
        return init_weights(model, seed).eval()
    return build


def families(args, dtype: torch.dtype) -> list[Family]:
    dit_cfg = dict(hidden=args.dit_hidden, heads=args.dit_heads, blocks=args.dit_blocks, in_channels=64)
    llm_cfg = dict(vocab=args.llm_vocab, hidden=args.llm_hidden, heads=args.llm_heads, kv_heads=args.llm_kv_heads,
                   intermediate=args.llm_intermediate, layers=args.llm_layers)

    def dit_inputs(device, dt):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(args.dit_batch, args.dit_seq, 64, generator=g).to(device, dt)
        c = torch.randn(args.dit_batch, args.dit_hidden, generator=g).to(device, dt)
        return (x, c)

    def llm_inputs(batch, seq):
        def make(device, dt):
            g = torch.Generator().manual_seed(2)
            return (torch.randint(0, args.llm_vocab, (batch, seq), generator=g).to(device),)
        return make

    return [
        Family("dit", make_builder(lambda: DiTStack(**dit_cfg), dtype, 0), {"dit": dit_inputs}, "blocks",
               args.dit_blocks, {**dit_cfg, "batch": args.dit_batch, "seq": args.dit_seq}),
        Family("llm", make_builder(lambda: DecoderLM(**llm_cfg), dtype, 0),
               {"llm_prefill": llm_inputs(1, args.llm_prefill_seq),
                "llm_decode_b1": llm_inputs(1, 1),
                f"llm_decode_b{args.llm_decode_batch}": llm_inputs(args.llm_decode_batch, 1)},
               "layers", args.llm_layers, {**llm_cfg, "prefill_seq": args.llm_prefill_seq,
                                           "decode_batches": [1, args.llm_decode_batch]}),
    ]


def model_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


# ---------------------------------------------------------------------------------------------------------
# methods

@dataclasses.dataclass
class Method:
    name: str
    forward: Callable[..., Any]
    model: nn.Module
    info: dict
    runtime_of: Any = None  # the object offload_stats() takes (ours)
    static_device_bytes: int | None = None
    cleanup: Callable[[], None] | None = None


def budget_policy_fields(family: Family, model: nn.Module, fraction: float) -> dict:
    """offload_gb that makes ours-budget stream exactly round(fraction * blocks) whole blocks."""
    blocks = model.get_submodule(family.blocks_attr)
    k = max(1, min(len(blocks), round(fraction * len(blocks))))
    nbytes = sum(model_bytes(blocks[i]) for i in range(k))
    return {"offload_gb": (nbytes - 0.5) / GIB, "_blocks": k, "_bytes": nbytes}


def streamed_module_names(model: nn.Module, policy) -> list[str]:
    from offload_compiler.grouping import plan_groups
    return [g.name for g in plan_groups(model, policy) if g.streamed]


def setup_method(name: str, family: Family, device: torch.device, args, shared: dict) -> Method:
    """Build the family's model and apply one method to it. ``shared`` carries the resident model between
    ``none`` and ``none-inductor`` (one device copy of the weights serves both)."""
    on_cuda = device.type == "cuda"
    if name in ("none", "none-inductor"):
        if "resident" not in shared:
            shared["resident"] = family.build().to(device)
        model = shared["resident"]
        fwd = model if name == "none" else torch.compile(model, dynamic=False)
        return Method(name, fwd, model, {"compiler": "eager" if name == "none" else "inductor"})

    model = family.build()
    if name.startswith("ours-"):
        from offload_compiler import OffloadPolicy, offload_compile
        _, strategy, *rest = name.split("-")
        compiler = rest[-1]
        fields: dict[str, Any] = {"strategy": strategy, "device": str(device), "compiler": compiler}
        if strategy == "layerwise":
            fields["prefetch"] = int(rest[0][1:].removesuffix("wrap"))
            fields["prefetch_next_call"] = rest[0].endswith("wrap")
        else:
            b = budget_policy_fields(family, model, args.budget_fraction)
            fields["offload_gb"] = b["offload_gb"]
            fields["prefetch"] = 1
        policy = OffloadPolicy(**fields)
        m = offload_compile(model, policy)
        return Method(name, m, model, {"policy": repr(policy)}, runtime_of=m)

    if name == "accelerate-cpu_offload":
        from accelerate import cpu_offload
        cpu_offload(model, execution_device=device)
        return Method(name, model, model, {"call": f"accelerate.cpu_offload(model, execution_device={device})"})

    if name == "diffusers-group-block":
        from diffusers.hooks import apply_group_offloading
        kwargs = dict(onload_device=device, offload_device=torch.device("cpu"), offload_type="block_level",
                      num_blocks_per_group=1, use_stream=on_cuda, non_blocking=on_cuda)
        apply_group_offloading(model, **kwargs)
        info = {"call": "diffusers.hooks.apply_group_offloading(model, " +
                ", ".join(f"{k}={v}" for k, v in kwargs.items()) + ")"}
        if not on_cuda:
            info["variant"] = "use_stream=False, non_blocking=False: streams need an accelerator (smoke on CPU)"
        return Method(name, model, model, info)

    if name == "vllm-functional_call":
        from offload_compiler import OffloadPolicy
        b = budget_policy_fields(family, model, args.budget_fraction)
        policy = OffloadPolicy(strategy="budget", device=str(device), offload_gb=b["offload_gb"])
        names = streamed_module_names(model, policy)
        offloaded = vllm_style_offload(model, names, device, pin=on_cuda)
        return Method(name, model, model, {"offloaded_modules": names, "offloaded_bytes": offloaded,
                                           "pinned": on_cuda})
    raise ValueError(f"unknown method {name!r}; choose from {ALL_METHODS}")


def _functional_forward(module: nn.Module, device: torch.device) -> Callable:
    from torch.func import functional_call
    original_forward = module.forward

    def forward(*args, **kwargs):
        module.forward = original_forward
        device_state = {k: v.to(device, non_blocking=True) for k, v in module.state_dict().items()}
        output = functional_call(module, device_state, args=args, kwargs=kwargs)
        module.forward = forward
        return output
    return forward


def vllm_style_offload(model: nn.Module, module_names: list[str], device: torch.device, pin: bool) -> int:
    """vLLM ``maybe_offload_to_cpu`` (vllm/model_executor/models/utils.py), applied to the named modules, the rest
    moved to the device: each offloaded parameter gets a pinned host copy (``empty_strided(pin_memory=True)``),
    and each forward copies the module's whole state dict to the device and runs ``functional_call``."""
    offloaded = 0
    off_ids = {id(p) for name in module_names for p in model.get_submodule(name).parameters()}
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if id(t) not in off_ids:
                t.data = t.data.to(device)
    for name in module_names:
        module = model.get_submodule(name)
        for p in module.parameters():
            cpu = torch.empty_strided(p.size(), p.stride(), dtype=p.dtype, device="cpu", pin_memory=pin)
            cpu.copy_(p.data)
            p.data = cpu
            offloaded += cpu.numel() * cpu.element_size()
        module.forward = _functional_forward(module, device)
    return offloaded


# ---------------------------------------------------------------------------------------------------------
# measurement

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_h2d_bandwidth(sizes: list[int], device: torch.device, repeats: int = 10) -> dict | None:
    """Host→device bandwidth of one copy from an exact-size pinned buffer, per size (median GB/s, 1e9 B/s);
    also pageable, for context. Measured on a side stream with events."""
    if device.type != "cuda":
        return None
    out = {}
    stream = torch.cuda.Stream(device)
    for n in sorted(set(sizes)):
        res = {}
        for kind in ("pinned", "pageable"):
            host = torch.empty(n, dtype=torch.uint8, pin_memory=kind == "pinned")
            host.fill_(1)
            dev = torch.empty(n, dtype=torch.uint8, device=device)
            times = []
            for i in range(repeats + 2):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    start.record(stream)
                    dev.copy_(host, non_blocking=True)
                    end.record(stream)
                end.synchronize()
                if i >= 2:
                    times.append(start.elapsed_time(end) / 1e3)
            res[f"{kind}_gbps"] = n / median(times) / 1e9
            del host, dev
        out[str(n)] = {"bytes": n, **res}
    return out


def profile_h2d(fn: Callable[[], Any], device: torch.device) -> dict | None:
    """Bytes and copy-engine time of host→device memcpys during one call, from the CUDA profiler's records."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            sync(device)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.json")
            prof.export_chrome_trace(path)
            events = json.load(open(path)).get("traceEvents", [])
    except Exception as exc:  # pragma: no cover - profiler availability varies
        return {"error": repr(exc)}
    total = pinned = pageable = count = 0
    busy_us = 0.0
    for ev in events:
        name = str(ev.get("name", ""))
        if ev.get("cat") == "gpu_memcpy" and "HtoD" in name:
            nbytes = int(ev.get("args", {}).get("bytes", 0))
            total += nbytes
            count += 1
            busy_us += float(ev.get("dur", 0.0))
            if "Pinned" in name:
                pinned += nbytes
            elif "Pageable" in name:
                pageable += nbytes
    return {"h2d_bytes": total, "h2d_pinned_bytes": pinned, "h2d_pageable_bytes": pageable, "h2d_copies": count,
            "h2d_busy_s": busy_us / 1e6, "h2d_busy_gbps": total / (busy_us / 1e6) / 1e9 if busy_us else None}


def allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def flatten_out(out: Any) -> torch.Tensor:
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = (out.float() - ref.float()).abs()
    scale = ref.float().abs().max().item() or 1.0
    return {"max_abs_diff": diff.max().item(), "max_abs_diff_rel": diff.max().item() / scale,
            "finite": bool(torch.isfinite(out).all().item())}


# ---------------------------------------------------------------------------------------------------------
# host RSS at setup, one fresh process per method

def _rss_now() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss_peak() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_rss_peak() -> bool:
    """Linux: writing 5 to /proc/self/clear_refs resets VmHWM to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_child(args, device: torch.device, dtype: torch.dtype) -> dict:
    """Run in a fresh process: RSS before the model exists (torch and the device context initialised), peak
    through building the model in host memory and applying the method (``setup``), then peak through the first
    forward (capture/compile included). Deltas are against the RSS before the model was built."""
    family = next(f for f in families(args, dtype) if f.name == args.rss_family)
    if device.type == "cuda":
        torch.zeros(1, device=device)
        torch.empty(1, pin_memory=True)
    # import what the method needs first, so the deltas are the model and the setup, not module imports
    import torch._dynamo  # noqa: F401
    import torch.func  # noqa: F401
    if args.rss_method.startswith("ours-"):
        import offload_compiler  # noqa: F401
        import offload_compiler.api  # noqa: F401
    elif args.rss_method.startswith("accelerate"):
        import accelerate  # noqa: F401
    elif args.rss_method.startswith("diffusers"):
        import diffusers.hooks  # noqa: F401
    gc.collect()
    reset_ok = _reset_rss_peak()
    base = _rss_now()
    base_peak = _rss_peak()
    t0 = time.perf_counter()
    method = setup_method(args.rss_method, family, device, args, {})
    sync(device)
    setup_s = time.perf_counter() - t0
    setup_peak, after_setup = _rss_peak(), _rss_now()
    wl = next(iter(family.workloads))
    inputs = family.workloads[wl](device, dtype)
    with torch.no_grad():
        method.forward(*inputs)
    sync(device)
    first_peak = _rss_peak()
    model_nbytes = model_bytes(family.build(meta=True))
    return {"method": args.rss_method, "family": family.name, "hwm_reset": reset_ok,
            "hwm_valid": reset_ok or base_peak <= base * 1.02,
            "rss_before_bytes": base, "model_bytes": model_nbytes, "setup_s": setup_s,
            "setup_peak_rss_delta_bytes": setup_peak - base,
            "after_setup_rss_delta_bytes": after_setup - base,
            "first_call_peak_rss_delta_bytes": first_peak - base,
            "setup_peak_over_model_bytes": (setup_peak - base) / model_nbytes,
            "first_call_peak_over_model_bytes": (first_peak - base) / model_nbytes}


def measure_rss(args, methods: list[str], fams: list[str]) -> dict:
    out: dict = {}
    base = [sys.executable, str(Path(__file__).resolve())] + list(args.argv)
    for fam in fams:
        out[fam] = {}
        for name in methods:
            cmd = base + ["--rss-child", "--rss-family", fam, "--rss-method", name]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
            line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RSS_JSON ")), None)
            if proc.returncode != 0 or line is None:
                out[fam][name] = {"error": (proc.stderr or proc.stdout)[-2000:], "returncode": proc.returncode}
            else:
                out[fam][name] = json.loads(line[len("RSS_JSON "):])
            out[fam][name]["child_wall_s"] = time.perf_counter() - t0
            print(f"  rss {fam}/{name}: " + (
                f"setup peak {out[fam][name]['setup_peak_over_model_bytes']:.3f}x model bytes"
                if "error" not in out[fam][name] else "error " + out[fam][name]["error"][-300:]), flush=True)
    return out


# ---------------------------------------------------------------------------------------------------------
# the run

def run_family(family: Family, methods: list[str], workloads: list[str], device: torch.device,
               dtype: torch.dtype, args, bandwidth: dict | None) -> dict:
    on_cuda = device.type == "cuda"
    print(f"== {family.name}: {family.config}", flush=True)
    ref_model = family.build(meta=True)
    fam = {"config": family.config, "model_bytes": model_bytes(ref_model), "num_blocks": family.num_blocks,
           "block_bytes": model_bytes(ref_model.get_submodule(family.blocks_attr)[0]), "methods": {}, "workloads": {}}
    del ref_model
    gc.collect()

    shared: dict = {}
    live: dict[str, Method] = {}
    for name in methods:
        before = allocated(device)
        t0 = time.perf_counter()
        try:
            m = setup_method(name, family, device, args, shared)
        except Exception as exc:
            fam["methods"][name] = {"error": f"setup failed: {exc!r}"}
            print(f"  {name}: setup failed: {exc!r}", flush=True)
            continue
        sync(device)
        m.info["setup_s"] = time.perf_counter() - t0
        if on_cuda:
            m.static_device_bytes = allocated(device) - before
            if name == "none-inductor":
                m.static_device_bytes = live["none"].static_device_bytes if "none" in live else m.static_device_bytes
        m.info["static_device_bytes"] = m.static_device_bytes
        fam["methods"][name] = m.info
        live[name] = m
        print(f"  set up {name} in {m.info['setup_s']:.2f} s", flush=True)

    for wl in workloads:
        if wl not in family.workloads:
            continue
        inputs = family.workloads[wl](device, dtype)
        res: dict[str, dict] = {name: {} for name in live}
        ref = None
        # warm-up: compiles, first-call packing and pinning, allocator growth
        for name, m in list(live.items()):
            try:
                with torch.no_grad():
                    for _ in range(args.warmup):
                        out = flatten_out(m.forward(*inputs))
                sync(device)
                if name == "none":
                    ref = out.detach().clone()
                res[name]["_out"] = out.detach().clone()
            except Exception as exc:
                res[name]["error"] = f"forward failed: {exc!r}"
                print(f"  {wl}/{name}: forward failed: {exc!r}", flush=True)
        ok = [n for n in live if "error" not in res[n]]
        times: dict[str, list[float]] = {n: [] for n in ok}
        peaks: dict[str, list[int]] = {n: [] for n in ok}
        base_alloc: dict[str, int] = {}
        for rep in range(args.reps):
            order = ok[rep % len(ok):] + ok[:rep % len(ok)]  # rotate: no method always runs first
            for name in order:
                m = live[name]
                if on_cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                    base_alloc[name] = allocated(device)
                sync(device)
                t0 = time.perf_counter()
                with torch.no_grad():
                    m.forward(*inputs)
                sync(device)
                times[name].append(time.perf_counter() - t0)
                if on_cuda:
                    peaks[name].append(torch.cuda.max_memory_allocated(device) - base_alloc[name])
        for name in ok:
            m = live[name]
            r = res[name]
            r["time_s_median"] = median(times[name])
            r["time_s_all"] = times[name]
            r["forward_peak_increase_bytes"] = max(peaks[name]) if peaks[name] else None
            r["max_memory_allocated_bytes"] = (m.static_device_bytes + max(peaks[name])
                                               if on_cuda and m.static_device_bytes is not None else None)
            if ref is not None:
                r.update(compare(r["_out"], ref))
            r.pop("_out", None)
            if m.runtime_of is not None:
                from offload_compiler import offload_stats, plan_summary, reset_offload_stats
                reset_offload_stats(m.runtime_of)
                with torch.no_grad():
                    m.forward(*inputs)
                sync(device)
                st = offload_stats(m.runtime_of)
                plans = plan_summary(m.runtime_of)["graphs"]
                r["ours"] = {"bytes_transferred_per_call": st.bytes_transferred, "fetches_per_call": st.fetch_count,
                             "ledger_peak_bytes": st.peak_resident_bytes, "resident_bytes": st.resident_bytes,
                             "streamed_bytes": st.streamed_bytes, "total_bytes": st.total_bytes,
                             "plan_predicted_peak_bytes": (max(p["streamed_peak_bytes"] for p in plans)
                                                           + st.resident_bytes) if plans else None,
                             "graphs": len(plans), "carried_bytes": st.carried_bytes,
                             "carry_hits_per_call": st.carry_hits}
                if r["max_memory_allocated_bytes"] is not None:  # copies carried into the timed call were
                    r["max_memory_allocated_bytes"] += st.carried_bytes  # allocated before its peak reset
                r["bytes_moved"] = st.bytes_transferred
                r["bytes_moved_source"] = "offload ledger"
            prof = None
            if on_cuda and not args.no_profile:
                def once(m=m):
                    with torch.no_grad():
                        m.forward(*inputs)
                prof = profile_h2d(once, device)
                r["profiler"] = prof
                if prof and "h2d_bytes" in prof:
                    r["bytes_moved_profiler"] = prof["h2d_bytes"]
                    if "bytes_moved" not in r:
                        r["bytes_moved"] = prof["h2d_bytes"]
                        r["bytes_moved_source"] = "CUDA profiler memcpy HtoD"
            r.setdefault("bytes_moved", None)
            if r["bytes_moved"] is not None and r["time_s_median"]:
                r["achieved_gbps"] = r["bytes_moved"] / r["time_s_median"] / 1e9
            else:
                r["achieved_gbps"] = None
        # lower bounds: compute-only time with the same compiler, and bytes / pinned bandwidth at group size
        bw = None
        if bandwidth:
            key = str(fam["block_bytes"] * 1)
            bw = bandwidth.get(key, next(iter(bandwidth.values())))["pinned_gbps"]
        for name in ok:
            r = res[name]
            compute = res.get("none-inductor" if "inductor" in name else "none", {}).get("time_s_median")
            transfer = r["bytes_moved"] / (bw * 1e9) if (bw and r.get("bytes_moved") is not None) else None
            r["compute_only_s"] = compute
            r["transfer_bound_s"] = transfer
            r["lower_bound_s"] = (max(compute, transfer) if compute is not None and transfer is not None else None)
            r["time_over_lower_bound"] = (r["time_s_median"] / r["lower_bound_s"] if r["lower_bound_s"] else None)
        fam["workloads"][wl] = {"inputs": [list(t.shape) for t in inputs], "pinned_h2d_gbps_used": bw,
                                "methods": res}
        print(f"  -- {wl}", flush=True)
        for name in ok:
            r = res[name]
            print(f"    {name:28s} {r['time_s_median'] * 1e3:10.2f} ms"
                  + (f"  peak {r['max_memory_allocated_bytes'] / GIB:7.2f} GiB" if r.get("max_memory_allocated_bytes")
                     is not None else "")
                  + (f"  moved {r['bytes_moved'] / 2**20:9.1f} MiB" if r.get("bytes_moved") is not None else "")
                  + (f"  x{r['time_over_lower_bound']:.3f} of bound" if r.get("time_over_lower_bound") else ""),
                  flush=True)
    for m in live.values():
        if m.cleanup:
            m.cleanup()
    live.clear()
    shared.clear()
    torch._dynamo.reset()
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
    return fam


def ratio(a, b):
    return a / b if (a is not None and b) else None


def check(value, op: str, threshold: float) -> dict:
    passed = None if value is None else (value <= threshold if op == "<=" else value >= threshold if op == ">="
                                         else value < threshold)
    return {"value": value, "target": f"{op} {threshold}", "pass": passed}


# the GPU issue's bounds on ours' time over max(compute-only, bytes / pinned H2D bandwidth)
LOWER_BOUND_TARGETS = {"dit": 1.10, "llm_decode_b1": 1.2}


def evaluate_targets(results: dict) -> dict:
    """The issue's targets, as ratios from this run (null where a figure is missing, e.g. CUDA-only)."""
    t: dict[str, Any] = {}
    fams = results["families"]
    layerwise = [m for m in ALL_METHODS if m.startswith("ours-layerwise")]
    budget = [m for m in ALL_METHODS if m.startswith("ours-budget")]

    def best(wres: dict, names: list[str]) -> tuple[str | None, float | None]:
        cands = [(wres[n]["time_s_median"], n) for n in names if n in wres and wres[n].get("time_s_median")]
        return (min(cands)[1], min(cands)[0]) if cands else (None, None)

    for fam in fams.values():
        for wl, w in fam["workloads"].items():
            res = w["methods"]
            name, t_ours = best(res, layerwise)
            entry: dict[str, Any] = {"best_ours": name}
            if wl in LOWER_BOUND_TARGETS:
                entry["ours_over_lower_bound"] = check(res[name].get("time_over_lower_bound") if name else None,
                                                       "<=", LOWER_BOUND_TARGETS[wl])
                entry["ours_over_lower_bound_each"] = {n: res[n].get("time_over_lower_bound")
                                                       for n in layerwise if n in res}
            entry["ours_over_diffusers"] = check(ratio(t_ours, res.get("diffusers-group-block", {})
                                                       .get("time_s_median")), "<", 1.0)
            entry["accelerate_over_ours"] = check(ratio(res.get("accelerate-cpu_offload", {}).get("time_s_median"),
                                                        t_ours), ">=", 3.0)
            bname, t_budget = best(res, budget)
            entry["best_budget"] = bname
            entry["functional_call_over_budget"] = check(
                ratio(res.get("vllm-functional_call", {}).get("time_s_median"), t_budget), ">=", 1.5)
            peaks = {}
            for n in layerwise + budget:
                r = res.get(n, {})
                ours = r.get("ours") or {}
                compute = res.get("none-inductor" if "inductor" in n else "none", {})
                act = (compute.get("forward_peak_increase_bytes"))
                pred = (ours.get("plan_predicted_peak_bytes") + act
                        if ours.get("plan_predicted_peak_bytes") is not None and act is not None else None)
                peaks[n] = {"measured_max_memory_allocated_bytes": r.get("max_memory_allocated_bytes"),
                            "predicted_bytes": pred,
                            "ledger_equals_plan": (ours.get("ledger_peak_bytes") == ours.get("plan_predicted_peak_bytes")
                                                   if ours else None),
                            "within_5_percent": check(
                                abs(r["max_memory_allocated_bytes"] / pred - 1)
                                if r.get("max_memory_allocated_bytes") is not None and pred else None, "<=", 0.05)}
            entry["peak_vs_plan"] = peaks
            t[wl] = entry
    rss = results.get("host_rss") or {}
    t["setup_rss_over_model_bytes"] = {
        f"{fam}/{m}": check(v.get("setup_peak_over_model_bytes"), "<=", 1.1)
        for fam, per in rss.items() for m, v in per.items() if m.startswith("ours-")}
    return t


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    wls = [(fam, wl, w) for fam in results["families"].values() for wl, w in fam["workloads"].items()]
    fig, axes = plt.subplots(2, len(wls), figsize=(4.6 * len(wls), 8), squeeze=False)
    for col, (fam, wl, w) in enumerate(wls):
        names = [n for n in ALL_METHODS if n in w["methods"] and w["methods"][n].get("time_s_median")]
        times = [w["methods"][n]["time_s_median"] * 1e3 for n in names]
        colors = ["tab:gray" if n.startswith("none") else "tab:blue" if n.startswith("ours") else "tab:orange"
                  for n in names]
        ax = axes[0][col]
        ax.barh(names, times, color=colors)
        bounds = [w["methods"][n].get("lower_bound_s") for n in names if n.startswith("ours-layerwise")]
        bounds = [b for b in bounds if b]
        if bounds:
            ax.axvline(min(bounds) * 1e3, color="k", ls="--", lw=1, label="lower bound")
            ax.legend(fontsize=7)
        ax.set(title=f"{wl}: median forward", xlabel="ms", xscale="log")
        ax.tick_params(labelsize=7)
        ax = axes[1][col]
        mem = [(n, w["methods"][n].get("max_memory_allocated_bytes")) for n in names]
        mem = [(n, v) for n, v in mem if v is not None]
        if mem:
            ax.barh([n for n, _ in mem], [v / GIB for _, v in mem],
                    color=[c for (n, c) in zip(names, colors) if n in dict(mem)])
            ax.set(title=f"{wl}: max_memory_allocated", xlabel="GiB")
        else:
            ax.text(0.5, 0.5, "no CUDA: device memory not measured", ha="center", va="center",
                    transform=ax.transAxes, fontsize=8)
            ax.set_axis_off()
        ax.tick_params(labelsize=7)
    env = results["environment"]
    fig.suptitle(f"offload methods, one run ({env.get('gpu', 'no GPU: ' + env['cpu'])}, torch {env['torch']})"
                 + ("  [SMOKE: not benchmark figures]" if results["config"]["smoke"] else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


SMOKE = dict(dit_hidden=32, dit_heads=2, dit_blocks=4, dit_seq=64, dit_batch=1, llm_vocab=128, llm_hidden=32,
             llm_heads=4, llm_kv_heads=2, llm_intermediate=64, llm_layers=4, llm_prefill_seq=16, llm_decode_batch=4,
             reps=3, warmup=1)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, runs on CPU; proves the harness, not results")
    ap.add_argument("--methods", nargs="+", default=list(ALL_METHODS), choices=ALL_METHODS)
    ap.add_argument("--workloads", nargs="+", default=None, help=f"default: all ({', '.join(ALL_WORKLOADS)})")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu (smoke only)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget-fraction", type=float, default=0.5, help="share of the blocks ours-budget streams")
    ap.add_argument("--dit-hidden", type=int, default=3072)
    ap.add_argument("--dit-heads", type=int, default=24)
    ap.add_argument("--dit-blocks", type=int, default=20)
    ap.add_argument("--dit-seq", type=int, default=16384)
    ap.add_argument("--dit-batch", type=int, default=1)
    ap.add_argument("--llm-vocab", type=int, default=32000)
    ap.add_argument("--llm-hidden", type=int, default=4096)
    ap.add_argument("--llm-heads", type=int, default=32)
    ap.add_argument("--llm-kv-heads", type=int, default=8)
    ap.add_argument("--llm-intermediate", type=int, default=14336)
    ap.add_argument("--llm-layers", type=int, default=14)
    ap.add_argument("--llm-prefill-seq", type=int, default=2048)
    ap.add_argument("--llm-decode-batch", type=int, default=64)
    ap.add_argument("--rss", choices=("subprocess", "off"), default="subprocess",
                    help="host peak RSS at setup, one fresh process per method")
    ap.add_argument("--rss-methods", nargs="+", default=None, help="default: every method run")
    ap.add_argument("--no-profile", action="store_true", help="skip the CUDA profiler pass (bytes moved)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rss-family", help=argparse.SUPPRESS)
    ap.add_argument("--rss-method", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    if args.smoke:
        explicit = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")}
        for k, v in SMOKE.items():
            if "--" + k.replace("_", "-") not in explicit:
                setattr(args, k, v)
    return args


def main(argv: list[str] | None = None) -> dict:
    # separate static graphs per input shape (prefill / decode batch sizes), and room for every method's models;
    # patched, not set, so an in-process run (the smoke test) leaves dynamo's configuration as it was
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=4096,
                                    accumulated_recompile_limit=4096):
        return _main(argv)


def _main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not args.smoke and not args.rss_child:
        raise SystemExit("gpu_offload.py needs CUDA; use --smoke to exercise the harness on CPU")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.rss_child:
        print("RSS_JSON " + json.dumps(rss_child(args, device, dtype)), flush=True)
        return {}

    fams = families(args, dtype)
    workloads = args.workloads or [w for f in fams for w in f.workloads]
    out = args.out or RESULTS / ("gpu_offload_smoke.json" if args.smoke else "gpu_offload.json")
    results: dict[str, Any] = {
        "benchmark": "gpu_offload", "command": exact_command(), "environment": environment(),
        "gpu_figures_measured": device.type == "cuda" and not args.smoke,
        "config": {"smoke": args.smoke, "device": str(device), "dtype": str(dtype), "methods": args.methods,
                   "workloads": workloads, "reps": args.reps, "warmup": args.warmup,
                   "budget_fraction": args.budget_fraction, "dynamo_automatic_dynamic_shapes": False},
        "notes": {
            "timing": "wall time of one forward between device synchronizations; methods interleaved, order rotated "
                      "every repetition; median over reps after warm-up calls",
            "max_memory_allocated": "per method: device bytes it holds after setup (memory_allocated delta at setup; "
                                    "none-inductor shares none's weights) + max_memory_allocated increase during its "
                                    "forward (reset_peak_memory_stats before each). All methods coexist in one "
                                    "process, so the raw counter would include the others' resident weights",
            "host_rss": "a fresh process per method: /proc/self/clear_refs=5 resets VmHWM after torch and the CUDA "
                        "context are initialised; peak VmHWM minus the RSS at that point, through model build + "
                        "method setup (setup_*) and through the first forward (first_call_*)",
            "bytes_moved": "ours: the runtime's ledger (bytes_transferred in one call); others: CUDA profiler memcpy "
                           "HtoD bytes in one call (ours' profiler figure is recorded too)",
            "lower_bound": "max(compute-only time (none, or none-inductor for inductor methods), bytes moved / pinned "
                           "H2D bandwidth measured for one copy of one block's bytes)",
            "peak_vs_plan": "predicted = plan's weight peak (verified schedule) + the compute-only method's forward "
                            "activation peak; measured = max_memory_allocated as above",
        },
    }
    if device.type == "cuda":
        block_sizes = []
        for f in fams:
            if any(w in workloads for w in f.workloads):
                m = f.build(meta=True)
                block_sizes.append(model_bytes(m.get_submodule(f.blocks_attr)[0]))
                del m
        results["pinned_h2d"] = pinned_h2d_bandwidth(block_sizes + [GIB], device)
        print(f"pinned H2D: {results['pinned_h2d']}", flush=True)
    else:
        results["pinned_h2d"] = None
    results["families"] = {}
    for f in fams:
        wls = [w for w in workloads if w in f.workloads]
        if wls:
            results["families"][f.name] = run_family(f, args.methods, wls, device, dtype, args,
                                                     results["pinned_h2d"])
            # a lease can end mid-run: what is measured so far is on disk after each family
            write_json(out, {**results, "complete": False, "targets": evaluate_targets(results)})
    if args.rss == "subprocess":
        print("host RSS at setup (subprocess per method)", flush=True)
        rss_methods = args.rss_methods or args.methods
        results["host_rss"] = measure_rss(args, rss_methods, list(results["families"]))
    else:
        results["host_rss"] = None
    results["targets"] = evaluate_targets(results)
    results["complete"] = True
    results["plot"] = None
    if not args.no_plot:
        if have_matplotlib():
            png = out.with_suffix(".png")
            plot(results, png)
            results["plot"] = png.name
        else:
            results["plot_skipped"] = "matplotlib is not installed"
    write_json(out, results)
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
