"""strategy="auto" on CPU: the first plan's predicted forward time against the measured median (calls 3-5),
per built-in model, before `refine_rates` rescales anything. Budget: 0.6 of the weights (blocks streamed).

    OMP_NUM_THREADS=1 python benchmarks/auto_calibration.py [llama gpt2 qwen2 dit]

Writes ``benchmarks/results/auto_calibration.json`` (each model's predicted and measured time, their ratio, the
prediction's parts, the command and the environment).
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, environment, exact_command, write_json  # noqa: E402

from offload_compiler import OffloadPolicy, offload_compile, offload_plan
from offload_compiler.testing import models

MODELS = ("llama", "gpt2", "qwen2", "dit")


def first_plan(name: str):
    model, kwargs = getattr(models, name)()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    m = offload_compile(model, OffloadPolicy(strategy="auto", device="cpu", device_budget_gb=0.6 * nbytes / 2**30))
    with torch.no_grad():
        for _ in range(6):  # compile, warm up, three timed calls
            m(**kwargs)
    plan = offload_plan(m)
    plan.rates.compute_scale = 1.0  # every model's first plan, as if it were the process's first
    return plan


def main(names) -> None:
    rows = []
    for name in names:
        plan = first_plan(name)
        p = plan.solution.prediction
        ratio = p.time_s / plan.measured_median_s
        rows.append({"model": name, "predicted_s": p.time_s, "measured_median_s": plan.measured_median_s,
                     "predicted_over_measured": ratio, "call_s": p.call_s, "compute_s": p.compute_s,
                     "dispatch_s": plan.table.dispatch_s, "transfer_s": p.transfer_s, "fetches": p.fetches})
        print(f"{name:6s} predicted {p.time_s * 1e3:7.3f} ms (call {p.call_s * 1e3:.3f}, compute "
              f"{p.compute_s * 1e3:.3f} of which dispatch {plan.table.dispatch_s * 1e3:.3f}, transfers "
              f"{p.transfer_s * 1e3:.3f}, {p.fetches} fetches)  measured {plan.measured_median_s * 1e3:7.3f} ms  "
              f"predicted/measured {ratio:.2f}", flush=True)
    write_json(RESULTS / "auto_calibration.json", {"command": exact_command(), "environment": environment(),
                                                   "threads": torch.get_num_threads(), "models": rows})


if __name__ == "__main__":
    main(sys.argv[1:] or MODELS)
