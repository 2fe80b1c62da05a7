"""The disk tier on the CPU: a Llama (random weights, float32) whose weights do not fit the host budget, one
forward of ``--tokens`` tokens per call, one torch thread, against

  plain                 the model in memory (compute only)
  ours                  offload_compile(layerwise, host_budget_gb=--budget x the model, disk_dir=...)
  ours-carry            the same with prefetch_next_call=True: the first groups on disk (the prefetch + 1 reads a
                        call issues at its start) are read for the next call while this call's last groups compute

Each method is timed over `LOOP_CALLS` calls in a row, as a loop of calls (decoding, denoising) makes them: a
disk under a virtual machine caches recently read files outside it, where dropping the guest's pages does not
reach, so a method whose files were just read reads them faster; timed one call at a time between the other
methods (gigabytes read in between), the same files read 2x slower. Ours' timing ends with the wait for the
read its last call carries for the next (the runtime's ``wait_for_copies``): every call pays for the read it
starts, and the first call of a loop adopts what the previous loop carried, as in a longer loop.

and two limits, each max(compute, the time to read the bytes ours reads per call), measured once per round
(medians over the rounds, as the methods': the disk's bandwidth drifts by 10-20% here): ``limit_reading_its_own_files_s``
reads ours' own files (the groups it reads whole, in group order, with its reader, right after its call, no compute
beside), and ``limit_s`` a file of that size written for the measurement, its pages dropped first. They differ where
the disk is cached outside the machine (a virtual disk): a freshly written file then reads faster than the model's
files, and no reader of the model reaches it. Ours reads the token embedding's rows
for the call's tokens, not its table (a lookup: `passes.routed`), so it reads fewer bytes than the groups on disk
hold; ``limit_reading_every_group_on_disk_s`` is the limit of an offloader that reads each group whole. Before every call of every method, the
pages of the files it reads are dropped from the page cache (``posix_fadvise``; ours drops its own after each
read), so each call reads the disk, as a model larger than memory would. The methods are interleaved, loop by loop,
in this one process; medians over the rounds.

    PYTHONPATH=. python benchmarks/disk_tier.py [--hidden 1024] [--layers 12] [--tokens 4] [--rounds 5]
    PYTHONPATH=. python benchmarks/disk_tier.py --only-ours --rounds 11 --out benchmarks/results/disk_tier_carry.json

With ``--device cuda`` (any accelerator) plain is the model on the device and ours reads each group on disk into
a host staging buffer on the worker thread, then copies it to the device on the copy stream; the CPU offloaders
are left out. ``--device sim`` runs that path on the simulated accelerator, as a check that it runs and gives the
plain model's outputs, not as a timing: its stream checker compares every in-flight copy's host source before
each op, which costs far more than the reads (a 4-layer hidden-256 Llama: about 20 s a call, against 0.2 s plain).

``--per-group`` adds one more call of ours after the rounds, timed group by group (``per_group`` in the
results): when each group's fill ran and on which thread (a group on disk is read on the worker thread, one in
memory is copied on the calling thread), how long the call waited for it, and where the worker's disk sat idle.
The instrumentation wraps the runtime's fills (`runtime.transfers._copy_group`; on an accelerator also
`_read_staged`, the read into a staging buffer) and its wait (`TransferEngine._ready`) for that call only: it costs
microseconds per group, against milliseconds per read.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, environment, exact_command, write_json  # noqa: E402


def _model(hidden: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def _drop_pages(folder: str) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _bandwidth_file(nbytes: int, folder: str) -> str:
    """A file of ``nbytes`` (random bytes, on the disk: synced) to measure the read bandwidth on."""
    path = os.path.join(folder, "bandwidth.bin")
    block = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(max(nbytes >> 20, 1)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    return path


def _read_seconds(path: str) -> float:
    """Seconds to read ``path`` start to end (16 MiB reads into one buffer), its pages dropped first."""
    buffer = bytearray(1 << 24)
    with open(path, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        while f.readinto(buffer):
            pass
        return time.perf_counter() - start


def _own_files(ours) -> list:
    """The files ours reads whole per call, in group order: each on-disk bucket of a group it fetches whole (not
    the groups it only looks rows up in: `testing.routed_only_groups`)."""
    from offload_compiler.testing import routed_only_groups
    looked_up = routed_only_groups(ours)
    return [bucket for index, group in enumerate(ours._offload_runtime.groups)
            if group.on_disk and index not in looked_up for bucket in group.buckets if bucket.file is not None]


def _read_own_files_seconds(buckets: list, scratch: torch.Tensor) -> float:
    """Seconds to read ``buckets``' files one after another on this thread, as ours' fills read them (its reader,
    its chunk size, pages dropped after each file), with no compute beside: the same files in the same state of
    every cache beneath the process as ours' call just before (a disk under a virtual machine may cache a file
    outside it, where dropping the guest's pages does not reach, so a file written for the measurement can read
    3x faster than files written minutes earlier). ``scratch``: memory already touched, as ours' slots are (a
    fresh allocation would add a page fault per 4 KiB read)."""
    start = time.perf_counter()
    for bucket in buckets:
        bucket.file.read_into(scratch[:bucket.nbytes])
    return time.perf_counter() - start


LOOP_CALLS = 6


def _methods(model, folder: str, budget: float, device: str, others: bool = True
             ) -> dict[str, tuple[object, str | None]]:
    """name -> (the callable model, the folder whose pages to drop before a call). On a device that is not the
    host: the plain model on the device, and ours (the others offload to the CPU only)."""
    from offload_compiler import OffloadPolicy, offload_compile
    plain = model if device == "cpu" else copy.deepcopy(model).to(device)
    methods: dict[str, tuple[object, str | None]] = {"plain": (plain, None)}
    ours_dir = os.path.join(folder, "ours")
    os.makedirs(ours_dir)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    policy = OffloadPolicy(strategy="layerwise", device=device, host_budget_gb=budget * model_bytes / 2**30,
                           disk_dir=ours_dir)
    methods["ours"] = (offload_compile(copy.deepcopy(model), policy), None)
    carry_dir = os.path.join(folder, "ours-carry")
    os.makedirs(carry_dir)
    carry = OffloadPolicy(strategy="layerwise", device=device, host_budget_gb=budget * model_bytes / 2**30,
                          disk_dir=carry_dir, prefetch_next_call=True)
    methods["ours-carry"] = (offload_compile(copy.deepcopy(model), carry), None)
    if device != "cpu" or not others:
        return methods
    try:
        from accelerate import disk_offload
        acc_dir = os.path.join(folder, "accelerate")
        methods["accelerate-disk"] = (disk_offload(copy.deepcopy(model), acc_dir, execution_device="cpu"), acc_dir)
    except ImportError:
        pass
    try:
        from diffusers.hooks import apply_group_offloading
        diff_dir = os.path.join(folder, "diffusers")
        os.makedirs(diff_dir)
        offloaded = copy.deepcopy(model)
        apply_group_offloading(offloaded, onload_device=torch.device("cpu"), offload_device=torch.device("cpu"),
                               offload_type="block_level", num_blocks_per_group=1, offload_to_disk_path=diff_dir)
        methods["diffusers-disk"] = (offloaded, diff_dir)
    except ImportError:
        pass
    return methods


def _per_group(ours, call: Callable[[object], torch.Tensor]) -> dict:
    """One call of ours, timed group by group (milliseconds from the call's start): each fill (``thread``:
    ``worker`` reads a group on disk, ``caller`` copies one in memory inline) and each wait of the call for a
    group's slot; then the worker's reads laid end to end against the call."""
    from offload_compiler.runtime import transfers
    fills: list[dict] = []
    waits: list[dict] = []
    copy_group, read_staged, ready = transfers._copy_group, transfers._read_staged, transfers.TransferEngine._ready
    caller = threading.current_thread()
    start = time.perf_counter()

    def ms(t: float) -> float:
        return round((t - start) * 1e3, 3)

    def timed(fill):
        def run(buffers, group):
            began = time.perf_counter()
            fill(buffers, group)
            fills.append({"group": group.name, "on_disk": group.on_disk, "bytes": group.nbytes,
                          "thread": "caller" if threading.current_thread() is caller else "worker",
                          "start_ms": ms(began), "end_ms": ms(time.perf_counter())})
        return run

    def timed_ready(self, slot):
        began = time.perf_counter()
        out = ready(self, slot)
        waits.append({"group": self.groups[slot.group].name, "at_ms": ms(began),
                      "waited_ms": round((time.perf_counter() - began) * 1e3, 3)})
        return out

    transfers._copy_group, transfers._read_staged = timed(copy_group), timed(read_staged)
    transfers.TransferEngine._ready = timed_ready
    try:
        start = time.perf_counter()
        call(ours)
        total = time.perf_counter() - start
    finally:
        transfers._copy_group, transfers._read_staged, transfers.TransferEngine._ready = copy_group, read_staged, ready
    reads = sorted((f for f in fills if f["thread"] == "worker"), key=lambda f: f["start_ms"])
    idle = [reads[0]["start_ms"]] + [b["start_ms"] - a["end_ms"] for a, b in zip(reads, reads[1:])] if reads else []
    return {
        "call_ms": round(total * 1e3, 3), "fills": sorted(fills, key=lambda f: f["start_ms"]), "waits": waits,
        "summary": {
            "reading_ms": round(sum(f["end_ms"] - f["start_ms"] for f in reads), 3),
            "read_bytes": sum(f["bytes"] for f in reads),
            "disk_idle_before_first_read_ms": round(idle[0], 3) if idle else None,
            "disk_idle_between_reads_ms": round(sum(idle[1:]), 3) if idle else None,
            "after_last_read_ms": round(total * 1e3 - reads[-1]["end_ms"], 3) if reads else None,
            "waited_ms": round(sum(w["waited_ms"] for w in waits), 3),
            "inline_copies_ms": round(sum(f["end_ms"] - f["start_ms"] for f in fills if f["thread"] == "caller"),
                                      3),
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=float, default=0.4, help="host budget as a share of the model")
    parser.add_argument("--device", default="cpu",
                        help="'cpu', an accelerator ('cuda': groups on disk are read into host staging buffers, then "
                             "copied to it; plain and ours only), or 'sim' (the simulated one: a check, not a timing)")
    parser.add_argument("--out", type=Path, default=None, help="default: results/disk_tier[_sim].json")
    parser.add_argument("--per-group", action="store_true", help="one more call of ours, timed group by group")
    parser.add_argument("--only-ours", action="store_true",
                        help="plain, ours and ours-carry only: ours with and without prefetch_next_call compared "
                             "with no other offloader's reads between them (which move what a virtual disk caches)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from offload_compiler import offload_stats, reset_offload_stats
    device = args.device
    if device == "sim":
        from offload_compiler.testing import simulated_device
        device = simulated_device()
    out = args.out or RESULTS / ("disk_tier.json" if device == "cpu" else f"disk_tier_{args.device}.json")
    model = _model(args.hidden, args.layers)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, 32000, (1, args.tokens), device=device)
    with tempfile.TemporaryDirectory(dir=os.environ.get("DISK_TIER_DIR")) as folder:
        methods = _methods(model, folder, args.budget, device, others=not args.only_ours)
        call: Callable[[object], torch.Tensor] = lambda m: m(ids, use_cache=False).logits.cpu()  # noqa: E731
        with torch.no_grad():
            expected = call(methods["plain"][0])
            outputs = {name: torch.equal(call(m), expected) for name, (m, _) in methods.items()}  # warm, compiled
            ours = methods["ours"][0]
            reset_offload_stats(ours)
            call(ours)
            stats = offload_stats(ours)
            times: dict[str, list[float]] = {name: [] for name in methods}
            # the disk's bandwidth varies by 10-20% from minute to minute here: read a file of the bytes ours
            # reads per call once per round, between the methods, and take the median like theirs
            bandwidth_file = _bandwidth_file(stats.disk_bytes_read, folder)
            bandwidth_file_bytes = os.path.getsize(bandwidth_file)
            read_times: list[float] = []
            own_files = _own_files(ours) if device == "cpu" else []
            scratch = torch.zeros(max((b.nbytes for b in own_files), default=0), dtype=torch.uint8)
            own_read_times: list[float] = []
            for _ in range(args.rounds):
                for name, (m, pages) in methods.items():
                    start = time.perf_counter()
                    for _ in range(LOOP_CALLS):
                        if pages is not None:  # (a millisecond, against their reads' hundreds)
                            _drop_pages(pages)
                        call(m)
                    if name.startswith("ours"):
                        m._offload_runtime.wait_for_copies()
                    times[name].append((time.perf_counter() - start) / LOOP_CALLS)
                    if name == "ours" and own_files:  # right after ours' call: the same files, as cached as it saw them
                        own_read_times.append(_read_own_files_seconds(own_files, scratch))
                read_times.append(_read_seconds(bandwidth_file))
            carried = offload_stats(methods["ours-carry"][0])
            carry = {"carry_hits": carried.carry_hits, "fetches": carried.fetch_count}  # over the rounds' calls
            per_group = _per_group(ours, call) if args.per_group else None
    bandwidth = bandwidth_file_bytes / statistics.median(read_times)
    median = {name: statistics.median(t) for name, t in times.items()}
    limit = max(median["plain"], stats.disk_bytes_read / bandwidth)
    # groups on disk that ours reads by lookup only (the token embedding: the rows of the call's tokens); an
    # offloader reading whole groups reads them whole, so its limit counts every group on disk
    from offload_compiler.testing import routed_only_groups
    groups = ours._offload_runtime.groups
    looked_up_on_disk = sum(groups[g].nbytes for g in routed_only_groups(ours) if groups[g].on_disk)
    limit_whole = max(median["plain"], stats.disk_bytes / bandwidth)
    own_read = statistics.median(own_read_times) if own_read_times else None
    limit_own = max(median["plain"], own_read) if own_read is not None else None
    result = {
        "command": exact_command(), "environment": environment(),
        "model": f"LlamaForCausalLM hidden {args.hidden}, {args.layers} layers, float32, {args.tokens} tokens per call",
        "device": device,
        "model_bytes": model_bytes, "host_budget_bytes": int(args.budget * model_bytes),
        "disk_bytes": stats.disk_bytes, "disk_bytes_read_per_call": stats.disk_bytes_read,
        "looked_up_groups_on_disk_bytes": looked_up_on_disk, "routed_bytes_per_call": stats.routed_bytes,
        "read_bandwidth_bytes_per_s": bandwidth, "read_bandwidth_all_bytes_per_s":
            [bandwidth_file_bytes / t for t in read_times], "limit_s": limit, "median_s": median,
        "over_limit": {name: t / limit for name, t in median.items()},
        "limit_reading_every_group_on_disk_s": limit_whole,
        "over_limit_reading_every_group_on_disk": {name: t / limit_whole for name, t in median.items()},
        "own_files_read_s": own_read_times, "own_files_bytes": sum(b.nbytes for b in own_files),
        "limit_reading_its_own_files_s": limit_own,
        "over_limit_reading_its_own_files": ({name: t / limit_own for name, t in median.items()}
                                             if limit_own is not None else None),
        "ours_speedup": {name: t / median["ours"] for name, t in median.items()
                         if name not in ("ours", "ours-carry", "plain")},
        "outputs_equal_plain": outputs, "rounds": args.rounds, "calls_per_sample": LOOP_CALLS,
        "ours_carry_adopted": carry, "times_s": times,
        **({"per_group": per_group} if per_group is not None else {}),
        "targets": {**{f"{name} within 1.2x the limit": median[name] <= 1.2 * limit for name in ("ours", "ours-carry")},
                    **({f"{name} within 1.2x the limit on its own files": median[name] <= 1.2 * limit_own
                        for name in ("ours", "ours-carry")} if limit_own is not None else {}),
                    **({"ours >= 2.5x faster than accelerate disk_offload":
                        median["accelerate-disk"] >= 2.5 * median["ours"]} if "accelerate-disk" in median else {}),
                    **({"ours faster than diffusers disk offload": median["diffusers-disk"] > median["ours"]}
                       if "diffusers-disk" in median else {})},
    }
    write_json(out, result)
    print({k: result[k] for k in ("median_s", "limit_s", "over_limit", "limit_reading_its_own_files_s",
                                  "over_limit_reading_its_own_files", "ours_speedup", "outputs_equal_plain",
                                  "targets")})


if __name__ == "__main__":
    main()
