"""Per-rank offload under torch.distributed: 2 processes on gloo (CPU), spawned by the test, bounded in time.

Tensor parallel: DTensor weights (torch.distributed.tensor.parallel) stream each rank's local shards.
Pipeline parallel: each rank offloads its own stage; microbatches batched in one call reuse each fetch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from offload_compiler.testing.two_ranks import BLOCKS, HIDDEN, MICROBATCHES, WIDTH

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F32 = 4


def _two_ranks(case: str, compiler: str, tmp_path, backend: str = "gloo") -> list[dict]:
    env = dict(os.environ, OFFLOAD_TWO_RANKS_OUT=str(tmp_path),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "offload_compiler.testing.two_ranks", case, compiler, backend],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # inductor on a loaded 2-core machine: >120 s
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow  # two ranks in subprocesses: each a fresh interpreter (under inductor: a trial, about 17 s)
@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.trial)])
def test_tensor_parallel_streams_each_ranks_shards(compiler, tmp_path):
    ranks = _two_ranks("tp", compiler, tmp_path)
    # up: columns sharded (weight and bias); down: rows sharded, its bias replicated
    per_block = (HIDDEN // 2 * WIDTH + HIDDEN // 2 + WIDTH * HIDDEN // 2 + WIDTH) * F32
    full = BLOCKS * ((WIDTH * HIDDEN + HIDDEN) + (HIDDEN * WIDTH + WIDTH)) * F32
    for r in ranks:
        assert r["max_abs_diff"] <= 1e-5  # equal to the unsharded model
        assert r["shard_bytes"] == BLOCKS * per_block < full == r["full_bytes"]
        assert r["total_bytes"] == r["shard_bytes"]
        assert r["bytes_transferred"] == 2 * r["shard_bytes"]  # two calls, each rank its own shards only
        assert r["fetch_count"] == 2 * BLOCKS
        assert r["buckets_per_group"] == 1  # a block's shards move in one copy
        assert r["peak_resident_bytes"] <= 2 * per_block  # prefetch=1: at most two blocks' shards
        assert f"rank={r['rank']}/2" in r["plan"] and "DTensor weights" in r["plan"]


@pytest.mark.slow  # two ranks in subprocesses
def test_pipeline_parallel_offloads_each_stage(tmp_path):
    ranks = _two_ranks("pp", "eager", tmp_path)
    block = ((WIDTH * HIDDEN + HIDDEN) + (HIDDEN * WIDTH + WIDTH)) * F32
    assert [r["stage_blocks"] for r in ranks] == [[0, 1], [2, 3]]
    for r in ranks:
        assert r["stage_bytes"] == BLOCKS // 2 * block
        assert r["microbatch_bytes"] == MICROBATCHES * r["stage_bytes"]  # one forward per microbatch
        assert r["microbatch_fetches"] == MICROBATCHES * BLOCKS // 2
        assert r["batched_bytes"] == r["stage_bytes"] and r["batched_fetches"] == BLOCKS // 2  # fetched once
        assert f"rank={r['rank']}/2" in r["plan"]
    assert ranks[1]["max_abs_diff"] <= 1e-5


def test_dtensor_helpers_leave_plain_tensors_alone():
    from offload_compiler.distributed import is_dtensor, local_of
    from offload_compiler.subclasses import leaf_paths, plain_leaves, rebuild_spec
    t = torch.ones(3)
    assert local_of(t) is t and not is_dtensor(t)
    assert leaf_paths(t) == [()] and plain_leaves(t)[0] is t and rebuild_spec(t) is None


class Untraceable(torch.Tensor):
    """A subclass without __tensor_flatten__: neither dynamo nor the engine can take it apart."""


def test_untraceable_subclasses_still_refused():
    from offload_compiler import OffloadPolicy, offload_compile
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[0].weight = torch.nn.Parameter(torch.Tensor._make_subclass(Untraceable, torch.ones(2, 2)))
    with pytest.raises(ValueError, match="Untraceable.*without __tensor_flatten__.*traceable tensor subclass"):
        offload_compile(model, OffloadPolicy(strategy="sequential", device="cpu"))
    assert type(model[0].weight) is Untraceable and torch.equal(model[0].weight, torch.ones(2, 2))  # untouched


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                    reason="needs 2 CUDA devices and NCCL")
@pytest.mark.parametrize("case", ["tp", "pp"])
def test_two_gpus_nccl(case, tmp_path):
    ranks = _two_ranks(case, "eager", tmp_path, backend="nccl")
    for r in ranks:
        if case == "tp":
            assert r["bytes_transferred"] == 2 * r["shard_bytes"] and r["max_abs_diff"] <= 1e-4
        else:
            assert r["batched_bytes"] == r["stage_bytes"]
