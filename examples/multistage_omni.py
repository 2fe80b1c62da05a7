"""Multi-stage model: a tiny Qwen2.5-Omni (random weights) driven stage by stage, thinker → talker →
token2wav, with the stages alternating on the device; then the thinker alone with text + image + audio in
one forward, offloading its visual and audio encoders while the language model stays on the device.

    python examples/multistage_omni.py
    python examples/multistage_omni.py --debug-poison   # evicted device copies filled with NaN, as the tests run it
"""

import argparse
import copy
import logging

import torch

from offload_compiler import OffloadPolicy, describe_plan, offload_compile, offload_groups, offload_stats
from offload_compiler.testing import one_intra_op_thread
from offload_compiler.testing.omni_models import omni_full_with_inputs, omni_thinker, run_stages


def mib(n: int) -> str:
    return f"{n / 2**20:.3f} MiB"


@one_intra_op_thread()  # the outputs are compared bit for bit (why one thread: its docstring)
def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug-poison", action="store_true",
                        help="fill every evicted device copy with NaN: a read after an evict shows in the outputs")
    args = parser.parse_args()
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)  # the encoders' graph breaks are expected here
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, inputs = omni_full_with_inputs()
    expected = run_stages(model, inputs)
    policy = OffloadPolicy.from_engine_args({"cpu_offload_enabled": True, "cpu_offload_strategy": "alternating",
                                             "cpu_offload_components": ["thinker", "talker", "token2wav"],
                                             "device": device}).replace(debug_poison=args.debug_poison)
    offloaded = offload_compile(copy.deepcopy(model), policy)
    print("stage by stage, alternating:")
    live = []  # device weight bytes alive after each stage

    def call(module, **kwargs):
        out = module(**kwargs)
        live.append(offload_stats(offloaded).live_device_bytes)
        print(f"  after {type(module).__name__:<45s} device weights alive: {mib(live[-1])}")
        return out

    got = run_stages(offloaded, inputs, call=call)
    stats = offload_stats(offloaded)
    total = sum(g.nbytes for g in offload_groups(offloaded)) + stats.unmanaged_bytes
    same = all(torch.equal(got[k].cpu(), expected[k].cpu()) for k in expected)
    print(describe_plan(offloaded))
    held = stats.peak_device_weight_bytes  # device slots (allocated whole) and what stays on the device
    print(f"device weights held {mib(held)} of {mib(total)} "
          f"({(1 - held / total) * 100:.0f}% saved); outputs equal the plain model: {same}")

    thinker, kwargs = omni_thinker()
    with torch.no_grad():
        expected_logits = thinker(**kwargs).logits
    offloaded_thinker = offload_compile(copy.deepcopy(thinker), OffloadPolicy(
        strategy="alternating", components=["visual", "audio_tower"], device=device, debug_poison=args.debug_poison))
    logits = offloaded_thinker(**kwargs).logits
    print("\nthinker with text + image + audio, visual and audio_tower offloaded:")
    print(f"  {offload_stats(offloaded_thinker)}")
    print(f"  outputs equal the plain model: {torch.equal(logits.cpu(), expected_logits)}")
    if not same or not torch.equal(logits.cpu(), expected_logits):
        raise SystemExit("offloaded outputs differ from the plain model")
    return {"stages": offloaded, "live_after_each_stage": live, "thinker": offloaded_thinker}  # for the tests


if __name__ == "__main__":
    main()
