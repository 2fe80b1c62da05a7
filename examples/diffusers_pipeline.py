"""A diffusers pipeline offloaded in one line: a tiny Stable Diffusion 3 (random weights, no download) run from
a prompt with its text encoders and transformer streamed block by block and its VAE on the device.

    python examples/diffusers_pipeline.py

With a real checkpoint it is the same line:

    pipe = StableDiffusion3Pipeline.from_pretrained("stabilityai/stable-diffusion-3-medium-diffusers",
                                                    torch_dtype=torch.bfloat16)
    offload_compile(pipe, OffloadPolicy(strategy="layerwise", device="cuda"))
    image = pipe("a photo of a cat on the moon").images[0]
"""

import logging

import torch

from offload_compiler import OffloadPolicy, describe_plan, offload_compile, offload_groups, offload_stats
from offload_compiler.testing import one_intra_op_thread
from offload_compiler.testing.pipelines import sd3_pipeline


@one_intra_op_thread()  # the outputs are compared bit for bit (why one thread: its docstring)
def main() -> None:
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pipe, kwargs = sd3_pipeline()
    with torch.no_grad():
        expected = pipe(**kwargs).images
    offload_compile(pipe, OffloadPolicy(strategy="layerwise", device=device))

    kwargs["generator"] = torch.Generator().manual_seed(0)
    image = pipe(**kwargs).images
    stats = offload_stats(pipe)
    print(describe_plan(pipe))
    print(f"SD3 pipeline, 2 steps: {stats}")
    streamed = sorted({g.component for g in offload_groups(pipe) if g.streamed})
    print(f"streamed block by block: {', '.join(streamed)}; on the device: vae")
    print(f"device weight peak {stats.peak_device_weight_bytes / 2**20:.3f} MiB instead of "
          f"{(stats.total_bytes + stats.unmanaged_bytes) / 2**20:.3f} MiB "
          f"({1 - stats.peak_device_weight_bytes / (stats.total_bytes + stats.unmanaged_bytes):.0%} saved)")
    print(f"outputs equal: {torch.equal(image.cpu(), expected)}")


if __name__ == "__main__":
    main()
