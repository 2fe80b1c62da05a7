"""Shared helpers for the benchmarks: environment record, JSON writing, small statistics."""

from __future__ import annotations

import functools
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def exact_command() -> str:
    """The command line that produced a result, runnable from the repository root."""
    argv = [Path(sys.argv[0]).as_posix()] + sys.argv[1:]
    try:
        argv[0] = str(Path(argv[0]).resolve().relative_to(Path(__file__).resolve().parent.parent))
    except ValueError:
        pass
    return " ".join(shlex.quote(a) for a in ["python", *argv])


def git_commit(root: Path | None = None) -> str | None:
    """The commit of ``root``'s checkout (default: this benchmark's), ``-dirty`` if tracked files changed."""
    try:
        root = root or Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else None
    except Exception:
        return None


def _library_tree() -> dict[str, str | None]:
    try:
        import offload_compiler
    except ImportError:
        return {"path": None, "git_commit": None}
    tree = Path(offload_compiler.__file__).resolve().parent.parent
    return {"path": str(tree), "git_commit": git_commit(tree)}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def host_memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "host_memory_bytes": host_memory_bytes(),
        "cuda_available": torch.cuda.is_available(),
        "git_commit": git_commit(),
        # the library measured: a tree given by PYTHONPATH (another commit, for a before/after) shows here
        "offload_compiler": _library_tree(),
        "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda,
                   driver_capability=list(torch.cuda.get_device_capability(0)))
    for name in ("accelerate", "diffusers", "transformers", "matplotlib"):
        try:
            env[name] = __import__(name).__version__
        except Exception:
            env[name] = None
    return env


class FullCollections:
    """A ``gc.callbacks`` entry adding up the seconds spent in full (generation 2) garbage collections: a capture
    makes enough objects that one may fall inside the span being timed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None


def run_worker(script: str, args: Sequence[str], timeout: int) -> dict:
    """``script --worker ARGS`` in a fresh process (the repository on its path): the JSON object its last line
    prints, or ``{"error": [its last line of stderr]}``."""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, script, "--worker", *args], cwd=root, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(root)})
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """Least squares y = intercept + slope * x, with R²."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx if sxx else 0.0
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
    return {"slope": slope, "intercept": intercept, "r2": 1 - ss_res / ss_tot if ss_tot else 1.0}


def loglog_exponent(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Exponent k of y ~ x^k (1 = linear, 2 = quadratic)."""
    import math
    return linear_fit([math.log(x) for x in xs], [math.log(y) for y in ys])["slope"]


def write_json(path: Path, data: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    return path


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False


# -- side-by-side timing of methods in one process (host_overhead, decode) ---------------------------------

STACK_DEPTHS = 8  # see `interleave`
# bytes: the size of the chunks CPython 3.11-3.13 keeps frames in (DATA_STACK_CHUNK_SIZE, Python/pystate.c)
FRAME_CHUNK = 16 * 1024


@functools.cache
def _padding(nbytes: int) -> Callable[[int, Callable[[], Any]], Any]:
    """``pad(depth, fn)``: ``fn()`` called under ``depth`` frames of about ``nbytes`` each (a function with that
    many local slots; they are never assigned)."""
    names = " = ".join(f"_{i}" for i in range(max(nbytes // 8 - 16, 1)))
    namespace: dict = {}
    exec(f"def pad(depth, fn):\n    if False:\n        {names} = None\n"
         f"    return fn() if depth == 0 else pad(depth - 1, fn)\n", namespace)
    return namespace["pad"]


def at_depth(depth: int, fn: Callable[[], Any], depths: int = STACK_DEPTHS, step_bytes: int | None = None) -> Any:
    """``fn()`` called ``depth`` steps deeper into CPython's frame stack; a step is ``step_bytes`` (default:
    ``depths`` steps span one frame chunk)."""
    return _padding(step_bytes or FRAME_CHUNK // depths)(depth, fn)


def interleave(prepare: dict[str, Callable[[], Callable[[], None]]], rounds: int, calls: int,
               depths: int = STACK_DEPTHS, step_bytes: int | None = None) -> dict[str, dict]:
    """Time ``calls`` steps of every method, the methods in turn, from ``depths`` places in CPython's frame stack
    spread evenly over one frame chunk (or ``step_bytes`` apart: a fine sweep of one stretch), for ``rounds``
    rounds. ``prepare[name]()`` runs untimed before each batch and returns the step.

    Per method: wall seconds, this process's CPU seconds (all its threads: what other processes on a shared
    machine inflate least) and minor page faults, per step: the median over rounds at each place, then the mean
    over places (the expected cost where a caller's stack happens to put it), with the per-place medians kept.
    Why places: CPython 3.11 keeps frames in 16 KiB chunks and frees a chunk as soon as the frame that opened it
    returns, so Python work that keeps crossing a chunk boundary pays an mmap, a munmap and page faults per
    crossing (python/cpython#142183, fixed by caching a chunk in 3.13 and 3.14 maintenance releases); where the
    boundary falls depends on how deep the caller's stack is, which a user does not choose. One place would
    measure luck; neighbouring places, a biased sample."""
    samples: dict[str, list[list[tuple[float, float, float]]]] = {name: [[] for _ in range(depths)]
                                                                  for name in prepare}

    def batch(step) -> tuple[float, float, float]:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(calls):
            step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return wall / calls, cpu / calls, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / calls

    for _ in range(rounds):
        for depth in range(depths):
            for name, make in prepare.items():
                step = make()
                samples[name][depth].append(at_depth(depth, lambda: batch(step), depths, step_bytes))
    out = {}
    for name, by_depth in samples.items():
        medians = [[statistics.median(s[k] for s in runs) for k in range(3)] for runs in by_depth]
        out[name] = {"wall_s": statistics.fmean(m[0] for m in medians),
                     "cpu_s": statistics.fmean(m[1] for m in medians),
                     "minor_faults": statistics.fmean(m[2] for m in medians),
                     "wall_s_by_place": [m[0] for m in medians], "minor_faults_by_place": [m[2] for m in medians]}
    return out


def against_baseline(results: dict[str, dict], baseline: dict[str, str], default: str = "plain-eager"):
    """(name, result, its baseline's result) for every method that is not itself a plain baseline."""
    for name, result in results.items():
        base = results.get(baseline.get(name, default))
        if base is not None and not name.startswith("plain-") and "error" not in result:
            yield name, result, base


def moved_per_call(module, call: Callable[[], Any]) -> dict:
    """Offloading happened: fetches and bytes of one ``call()`` of an offloaded ``module``, from its ledger."""
    import torch
    from offload_compiler import offload_stats, reset_offload_stats
    reset_offload_stats(module)
    with torch.no_grad():
        call()
    stats = offload_stats(module)
    return {"fetches_per_call": stats.fetch_count, "bytes_per_call": stats.bytes_transferred,
            "peak_device_weight_bytes": stats.peak_device_weight_bytes}
