"""Plan and run a tiny built-in model under ``strategy="auto"``; prints the plan, predicted vs measured.

    python -m offload_compiler.cli --model llama --budget-gb 0.0004 [--json] [--plots DIR]
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

from . import OffloadPolicy, offload_compile, offload_plan, offload_stats
from .models import BUILDERS
from .planner import InfeasibleBudgetError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama", choices=sorted(BUILDERS))
    parser.add_argument("--budget-gb", default="free", help="GiB of device memory, or 'free'")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compiler", default="eager", choices=["eager", "inductor"])
    parser.add_argument("--calls", type=int, default=6, help="forward calls (the plan times calls 3 to 5)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--plots", metavar="DIR", help="save timeline.png and residency.png (needs matplotlib)")
    args = parser.parse_args(argv)

    budget = args.budget_gb if args.budget_gb == "free" else float(args.budget_gb)
    model, kwargs = BUILDERS[args.model]()
    kwargs = {k: v.to(args.device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    plain = copy.deepcopy(model).to(args.device)
    m = offload_compile(model, OffloadPolicy(strategy="auto", device=args.device, device_budget_gb=budget,
                                             compiler=args.compiler))
    try:
        for _ in range(args.calls):
            out = m(**kwargs)
    except InfeasibleBudgetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    plan = offload_plan(m)
    print(plan.to_json(indent=2) if args.json else plan)
    if not args.json:
        print(offload_stats(m))
        with torch.no_grad():
            expected = plain(**kwargs)
        got, want = (out.logits, expected.logits) if hasattr(out, "logits") else (out[0], expected[0])
        print(f"max |offloaded - plain| = {(got - want).abs().max().item():.3g}")
    if args.plots:
        for path in plan.save_plots(args.plots):
            print(f"saved {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
