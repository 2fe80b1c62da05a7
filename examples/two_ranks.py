"""Offload per rank under torch.distributed: a 2-rank run on CPU with the gloo backend (< 1 minute).

    python examples/two_ranks.py            # tensor parallel (DTensor shards) and pipeline parallel (stages)
    python examples/two_ranks.py tp inductor

Each rank offloads only what it holds: with tensor parallelism (torch.distributed.tensor.parallel,
Megatron-style MLPs) each rank streams its local shards, and the all-reduces stay in the graph, in order with
the transfers; with pipeline parallelism each rank offloads its own stage and microbatches flow by send/recv.
Every rank checks its outputs against the unsharded model and prints its own ledger and plan. The code run
by each rank is `offload_compiler.testing.two_ranks` (tensor_parallel / pipeline_parallel). On GPUs, use the
``nccl`` backend, a ``"cuda"`` mesh and ``OffloadPolicy(device=f"cuda:{rank}")``.
"""

import json
import os
import sys
import tempfile

from offload_compiler.testing.two_ranks import spawn


def main() -> None:
    cases = [sys.argv[1]] if len(sys.argv) > 1 else ["tp", "pp"]
    compiler = sys.argv[2] if len(sys.argv) > 2 else "eager"
    for case in cases:
        with tempfile.TemporaryDirectory() as out:
            spawn(case, compiler, world=2, out_dir=out)  # each rank asserts equivalence and its own bytes
            print(f"== {'tensor' if case == 'tp' else 'pipeline'} parallel, 2 ranks, compiler={compiler}")
            for rank in range(2):
                with open(os.path.join(out, f"rank{rank}.json")) as f:
                    r = json.load(f)
                print(r["plan"])
                print(f"  rank {rank}: {r['stats']}")
                if case == "tp":
                    print(f"  rank {rank}: holds {r['shard_bytes']} of {r['full_bytes']} weight bytes; moved "
                          f"{r['bytes_transferred']} B in 2 calls; max |diff| vs unsharded {r['max_abs_diff']:.2e}")
                else:
                    print(f"  rank {rank}: stage blocks {r['stage_blocks']}; {r['microbatch_fetches']} fetches for "
                          f"{len(r['stage_blocks'])} groups x 4 microbatches one by one, {r['batched_fetches']} "
                          f"with the microbatches in one call")
            print("outputs equal the unsharded model on every rank: OK")


if __name__ == "__main__":
    main()
