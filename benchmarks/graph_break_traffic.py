"""Bytes moved per call where part of a model runs without a graph: the Qwen2.5-Omni thinker (its audio tower's
frame has graph breaks on today's transformers) and Qwen2-VL (its vision tower's and placeholder check's), tiny
random-weight configs, ``sequential`` and ``layerwise``, eager, on the CPU or the simulated accelerator.

The modules such a frame calls run one by one, each as a graph of its own. Measured two ways in one process:
``held`` (the library as it is: the copy each of those graphs evicts is held within the call for the next
one's, `TransferEngine.holding_copies`) and ``refetched`` (holding turned off here, as before: each graph
fetches its group again). For each: bytes moved per call as a multiple of the model's weights (a second call,
after the first captured), fetches, fetches served by held copies, the ledger's peak as a share of the model,
and whether the outputs equal the plain model's and the traffic the verified plans.

    python benchmarks/graph_break_traffic.py --out benchmarks/results/graph_break_traffic.json

About a minute on 2 CPU cores. The bytes are deterministic: one run is the measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, environment, exact_command, write_json  # noqa: E402


def omni_thinker():
    from offload_compiler.testing.omni_models import omni_thinker
    return omni_thinker()


def qwen2_vl():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    torch.manual_seed(0)
    text = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2,
                rope_parameters={"rope_type": "mrope", "mrope_section": [2, 2, 4], "rope_theta": 10000.0})
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=2, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=150, video_token_id=151,
                           vision_start_token_id=152)
    model = Qwen2VLForConditionalGeneration(config).eval()
    ids = torch.tensor([[1, 2, 152] + [150] * 4 + [3, 4, 5]])  # one image: 4x4 patches, merged 2x2 -> 4 tokens
    return model, dict(input_ids=ids, pixel_values=torch.randn(16, 3 * 2 * 2 * 2),
                       image_grid_thw=torch.tensor([[1, 4, 4]]), mm_token_type_ids=(ids == 150).int())


MODELS = {"qwen2_5_omni_thinker": omni_thinker, "qwen2_vl": qwen2_vl}


@contextlib.contextmanager
def refetching():
    """Holding off: each part's graph evicts its copy as the plan says, and the next one fetches it again."""
    from offload_compiler.runtime.transfers import TransferEngine
    held = TransferEngine.holding_copies
    TransferEngine.holding_copies = lambda self: contextlib.nullcontext()
    try:
        yield
    finally:
        TransferEngine.holding_copies = held


def measure(model, kwargs, strategy: str, device: str, expected) -> dict:
    from offload_compiler import OffloadPolicy, offload_compile, reset_offload_stats
    from offload_compiler.testing import assert_traffic_matches_plan, tensors_of
    total = sum(t.numel() * t.element_size() for t in model.parameters())
    m = offload_compile(copy.deepcopy(model), OffloadPolicy(strategy=strategy, device=device, compiler="eager"))
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m(**inputs)
        reset_offload_stats(m)
        got = tensors_of(m(**inputs))
    diff = max((g.cpu().float() - e.float()).abs().max().item() for g, e in zip(got, expected))
    try:
        stats = assert_traffic_matches_plan(m)
        matches = True
    except AssertionError:
        from offload_compiler import offload_stats
        stats, matches = offload_stats(m), False
    whole = stats.bytes_transferred - stats.routed_bytes
    return {"moved_per_call_x_model": round(stats.bytes_transferred / total, 3),
            "whole_fetch_bytes_x_streamed": round(whole / stats.streamed_bytes, 3), "fetches": stats.fetch_count,
            "held_hits": stats.held_hits, "graph_calls": stats.calls,
            "ledger_peak_share": round(stats.peak_resident_bytes / total, 3), "max_abs_diff": diff,
            "traffic_equals_plan": matches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, or sim (the simulated accelerator)")
    parser.add_argument("--out", type=Path, default=RESULTS / "graph_break_traffic.json")
    args = parser.parse_args()
    device = args.device
    if device == "sim":
        from offload_compiler.testing import simulated_device
        device = simulated_device()
    from offload_compiler.testing import tensors_of
    results = {}
    for name, build in MODELS.items():
        model, kwargs = build()
        with torch.no_grad():
            expected = [t.detach() for t in tensors_of(model(**kwargs))]
        for strategy in ("sequential", "layerwise"):
            row = {"held": measure(model, kwargs, strategy, device, expected)}
            with refetching():
                row["refetched"] = measure(model, kwargs, strategy, device, expected)
            results[f"{name}/{strategy}"] = row
            print(f"{name:22s} {strategy:10s} moved per call: held {row['held']['moved_per_call_x_model']:.3f}x "
                  f"the model ({row['held']['held_hits']} held hits), refetched "
                  f"{row['refetched']['moved_per_call_x_model']:.3f}x")
    write_json(args.out, {"command": exact_command(), "environment": environment(), "device": device,
                          "results": results})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
