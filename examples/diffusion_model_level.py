"""Diffusion model-level offload (``enable_cpu_offload``): text encoder and DiT alternate on the device, the
VAE stays; on a container module and on a pipeline object whose components are attributes.

    python examples/diffusion_model_level.py
"""

import copy
import logging

import torch

from offload_compiler import OffloadPolicy, describe_plan, offload_compile, offload_stats
from offload_compiler.testing import one_intra_op_thread
from offload_compiler.testing.models import diffusion_container, diffusion_pipeline


@one_intra_op_thread()  # the outputs are compared bit for bit (why one thread: its docstring)
def main() -> None:
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)  # the encoders' graph breaks are expected here
    device = "cuda" if torch.cuda.is_available() else "cpu"
    policy = OffloadPolicy.from_engine_args({"enable_cpu_offload": True, "device": device})
    container, inputs = diffusion_container()
    with torch.no_grad():
        expected = container(**inputs)
    offloaded = offload_compile(copy.deepcopy(container), policy)
    image = offloaded(**{k: v.to(device) for k, v in inputs.items()})
    print(describe_plan(offloaded))
    print(f"container: {offload_stats(offloaded)}; outputs equal: {torch.equal(image.cpu(), expected)}")

    pipe, inputs = diffusion_pipeline()
    expected_pipe = pipe(**inputs)
    pipe = offload_compile(pipe, policy)
    image_pipe = pipe(**{k: v.to(device) for k, v in inputs.items()})
    print(f"pipeline:  {offload_stats(pipe)}; outputs equal: {torch.equal(image_pipe.cpu(), expected_pipe)}")


if __name__ == "__main__":
    main()
