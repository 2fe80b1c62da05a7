"""Two-rank (gloo, CPU) runs of per-rank offload, shared by ``examples/two_ranks.py`` and the tests.

``python -m offload_compiler.testing.two_ranks {tp,pp} [eager|inductor] [gloo|nccl]`` spawns 2 processes on a free
loopback port; each rank checks its outputs against the unsharded model and its own ledger, and writes its figures as
JSON to ``$OFFLOAD_TWO_RANKS_OUT/rank{r}.json`` when that is set.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch
import torch.distributed as dist
from torch import nn

WIDTH, HIDDEN, BLOCKS, MICROBATCHES = 16, 32, 4, 4


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    """Blocks ``first..last-1`` of the full model (the whole model by default): a pipeline stage."""
    _layerwise_offload_blocks_attr = "blocks"

    def __init__(self, blocks: list[nn.Module] | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks if blocks is not None else [MLP() for _ in range(BLOCKS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def full_model() -> tuple[Stack, torch.Tensor]:
    torch.manual_seed(0)
    model = Stack().eval()
    return model, torch.randn(MICROBATCHES, 3, WIDTH)


def _local_bytes(module: nn.Module) -> int:
    from offload_compiler.distributed import local_of
    return sum(local_of(p).numel() * local_of(p).element_size() for p in module.parameters())


def tensor_parallel(rank: int, compiler: str, device: str = "cpu") -> dict:
    """Each block's MLP sharded Megatron-style (up: columns, down: rows) over a 2-rank mesh, then offloaded:
    each rank streams its own shards; the all-reduce of the row-parallel layer stays in the graph."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from offload_compiler import OffloadPolicy, describe_plan, offload_compile, offload_stats

    model, x = full_model()
    with torch.no_grad():
        expected = model(x)
    mesh = init_device_mesh(device.split(":")[0], (dist.get_world_size(),))
    for block in model.blocks:
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    shard_bytes = _local_bytes(model)
    m = offload_compile(model, OffloadPolicy(strategy="layerwise", device=device, prefetch=1, compiler=compiler,
                                             debug_poison=True))
    calls = 2
    for _ in range(calls):
        got = m(x.to(device)).cpu()
    stats = offload_stats(m)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert stats.bytes_transferred == calls * shard_bytes, (stats.bytes_transferred, shard_bytes)
    assert stats.live_device_bytes == 0
    return {"rank": rank, "max_abs_diff": (got - expected).abs().max().item(), "shard_bytes": shard_bytes,
            "full_bytes": sum(p.numel() * p.element_size() for p in full_model()[0].parameters()),
            "bytes_transferred": stats.bytes_transferred, "fetch_count": stats.fetch_count,
            "peak_resident_bytes": stats.peak_resident_bytes, "total_bytes": stats.total_bytes,
            "plan": describe_plan(m), "stats": str(stats),
            # shards are packed: one flat host buffer, hence one copy, per group
            "buckets_per_group": max(len(g.buckets) for g in m._offload_runtime.groups)}


def pipeline_parallel(rank: int, compiler: str, device: str = "cpu") -> dict:
    """Rank r keeps blocks [r*B/2, (r+1)*B/2) as a plain stage module, offloaded on its own; microbatches flow
    rank 0 → rank 1 by send/recv. Then the same microbatches in one call: each group is fetched once for all."""
    from offload_compiler import OffloadPolicy, describe_plan, offload_compile, offload_stats, reset_offload_stats

    model, x = full_model()
    with torch.no_grad():
        expected = model(x)
    world = dist.get_world_size()
    per = BLOCKS // world
    stage = Stack(list(model.blocks[rank * per:(rank + 1) * per])).eval()
    stage_bytes = _local_bytes(stage)
    x = x.to(device)
    m = offload_compile(stage, OffloadPolicy(strategy="layerwise", device=device, prefetch=1, compiler=compiler,
                                             debug_poison=True))

    def run(microbatches: list[torch.Tensor]) -> list[torch.Tensor]:
        outs = []
        for mb in microbatches:
            if rank > 0:
                mb = torch.empty_like(mb)
                dist.recv(mb, src=rank - 1)
            y = m(mb)
            if rank < world - 1:
                dist.send(y.contiguous(), dst=rank + 1)
            outs.append(y)
        return outs

    # one microbatch per forward: each microbatch fetches the stage's groups
    outs = run(list(x.unbind(0)))
    per_microbatch = offload_stats(m)
    # the schedule's microbatches in one forward (batched along a new leading dim): one fetch per group
    reset_offload_stats(m)
    batched = run([x])[0]
    once = offload_stats(m)
    result = {"rank": rank, "stage_blocks": list(range(rank * per, (rank + 1) * per)), "stage_bytes": stage_bytes,
              "microbatch_bytes": per_microbatch.bytes_transferred, "microbatch_fetches": per_microbatch.fetch_count,
              "batched_bytes": once.bytes_transferred, "batched_fetches": once.fetch_count,
              "plan": describe_plan(m), "stats": str(per_microbatch)}
    assert per_microbatch.bytes_transferred == MICROBATCHES * stage_bytes, result
    assert once.bytes_transferred == stage_bytes and once.fetch_count == per, result
    if rank == world - 1:
        outs, batched = torch.stack(outs).cpu(), batched.cpu()
        torch.testing.assert_close(outs, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(batched, expected, atol=1e-5, rtol=1e-5)
        result["max_abs_diff"] = (outs - expected).abs().max().item()
    return result


def _worker(rank: int, world: int, port: int, case: str, compiler: str, out_dir: str | None,
            backend: str = "gloo") -> None:
    """``backend="nccl"``: rank r computes on cuda:r (a cuda mesh); gloo computes on the CPU."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import datetime
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        result = {"tp": tensor_parallel, "pp": pipeline_parallel}[case](rank, compiler, device)
        if out_dir:
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                json.dump(result, f)
        print(f"[rank {rank}] {case}/{compiler}: {result['stats']}", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(case: str, compiler: str = "eager", world: int = 2, out_dir: str | None = None,
          backend: str = "gloo") -> None:
    import torch.multiprocessing as mp
    mp.spawn(_worker, args=(world, free_port(), case, compiler, out_dir, backend), nprocs=world, join=True)


if __name__ == "__main__":
    spawn(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "eager", out_dir=os.environ.get("OFFLOAD_TWO_RANKS_OUT"),
          backend=sys.argv[3] if len(sys.argv) > 3 else "gloo")
