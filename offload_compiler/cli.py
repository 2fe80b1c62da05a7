"""Command line: ``python -m offload_compiler plan|run --model pkg.module:fn [flags]``.

``--device-budget-gb X`` (or ``--strategy auto``) lets the planner choose residency and prefetch for a device
budget; the plan then prints as the planner's table (``--json`` as its dict, ``--plots DIR`` as PNGs).

``fn()`` returns ``(model, inputs)``: inputs a tuple of positional arguments or a dict of keyword arguments.
``--model`` may also name a built-in tiny architecture (llama, gpt2, qwen2, dit, flux, unet)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import json
import os
import sys
import warnings
from typing import Any, Sequence

import torch

from ._tree import tensors_of, to_device
from .api import describe_plan, offload_compile, offload_plan, offload_stats, reset_offload_stats
from .planning.planner import InfeasibleBudgetError
from .config import load_stage_configs, policy_from_engine_args, warn_user
from .policy import IMPLEMENTED_STRATEGIES, OffloadPolicy


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="offload-compiler", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("plan", "capture the model (one forward) and print the groups, bytes, residency and "
                                 "predicted peak"),
                        ("run", "also run the model, print the stats and check outputs against the plain model")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--model", required=True, help="pkg.module:fn returning (model, inputs), or a built-in name")
        p.add_argument("--device", help="compute device (default: cuda when available, else cpu)")
        p.add_argument("--strategy", choices=IMPLEMENTED_STRATEGIES + ("auto",))
        p.add_argument("--device-budget-gb", help="strategy auto: GiB of device memory for weights and activations, "
                                                  "or 'free' (free memory now minus --budget-margin-gb)")
        p.add_argument("--budget-margin-gb", type=float)
        p.add_argument("--plots", metavar="DIR", help="strategy auto: save timeline.png and residency.png")
        p.add_argument("--calls", type=int, default=2, help="calls to run (auto times calls 3 to 5 for the plan)")
        p.add_argument("--prefetch", type=int)
        p.add_argument("--prefetch-next-call", action="store_true", default=None,
                       help="the last groups of a call prefetch the first groups of the next call")
        p.add_argument("--blocks-per-group", type=int)
        p.add_argument("--compiler", choices=["eager", "inductor"])
        p.add_argument("--cpu-offload-enabled", action="store_true", default=None)
        p.add_argument("--cpu-offload-components", help="comma-separated, e.g. thinker,talker or visual,audio_tower")
        p.add_argument("--cpu-offload-strategy", choices=["alternating", "sequential"])
        p.add_argument("--cpu-offload-gb", type=float)
        p.add_argument("--cpu-offload-pin-memory", action=argparse.BooleanOptionalAction, default=None)
        p.add_argument("--enable-cpu-offload", action="store_true", default=None)
        p.add_argument("--enable-layerwise-offload", action="store_true", default=None)
        p.add_argument("--stage-config", help="stage YAML; its stage's engine_args give the policy")
        p.add_argument("--stage", type=int, help="stage_id to use from --stage-config (needed if it has several)")
        p.add_argument("--json", action="store_true", help="print the result as JSON")
        if name == "run":
            p.add_argument("--no-check", action="store_true", help="skip the comparison with the plain model")
    return parser


def load_model(spec: str) -> tuple[torch.nn.Module, tuple, dict]:
    from .testing.models import ARCHITECTURES, BUILDERS
    if spec in BUILDERS or spec in ARCHITECTURES:
        try:
            model, inputs = (BUILDERS.get(spec) or ARCHITECTURES[spec])()
        except (ImportError, AttributeError) as exc:
            raise SystemExit(f"--model {spec!r}: the installed transformers/diffusers cannot build it: {exc}") from None
    else:
        if ":" not in spec:
            raise SystemExit(f"--model {spec!r}: expected pkg.module:fn or one of {sorted(BUILDERS)}, or an "
                             f"architecture of offload_compiler.testing.models.ARCHITECTURES: {sorted(ARCHITECTURES)}")
        module_name, fn_name = spec.split(":", 1)
        sys.path.insert(0, os.getcwd())
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
        except (ImportError, AttributeError) as exc:
            raise SystemExit(f"--model {spec!r}: cannot load {fn_name} from {module_name}: {exc}") from None
        model, inputs = fn()
    if isinstance(inputs, dict):
        return model, (), inputs
    return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,), {}


# seed flags that choose what is offloaded; --cpu-offload-pin-memory only says how, so the default still applies
SELECTING_FLAGS = ("cpu_offload_enabled", "cpu_offload_components", "cpu_offload_strategy", "cpu_offload_gb",
                   "enable_cpu_offload", "enable_layerwise_offload")
TUNING_FLAGS = ("cpu_offload_pin_memory", "device", "prefetch", "prefetch_next_call", "blocks_per_group", "compiler")


def _stage_engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The chosen stage's engine args; what they ignore is warned once, when they are read with the flags."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        stages = load_stage_configs(args.stage_config)
    if args.stage is None and len(stages) > 1:
        raise SystemExit(f"{args.stage_config} has stages {[s.stage_id for s in stages]}: choose one with --stage")
    chosen = [s for s in stages if args.stage is None or s.stage_id == args.stage]
    if not chosen:
        raise SystemExit(f"{args.stage_config} has no stage {args.stage}; stages: {[s.stage_id for s in stages]}")
    return {k: v for k, v in chosen[0].engine_args.items() if k not in ("model_stage", "model_arch")}


AUTO_KEEPS = {"device": "device", "compiler": "compiler", "prefetch_next_call": "prefetch_next_call",
              "cpu_offload_pin_memory": "pin_memory"}


def _auto_policy(args: argparse.Namespace, engine: dict[str, Any]) -> OffloadPolicy:
    budget = args.device_budget_gb or "free"
    auto = {"strategy": "auto", "device_budget_gb": budget if budget == "free" else float(budget)}
    if args.budget_margin_gb is not None:
        auto["budget_margin_gb"] = args.budget_margin_gb
    ignored = sorted(k for k in engine if k not in AUTO_KEEPS and k not in ("model_stage", "model_arch"))
    if ignored:
        warn_user(f"strategy auto plans residency, prefetch and grouping from the device budget; ignored: {ignored}")
    return OffloadPolicy(**{AUTO_KEEPS[k]: v for k, v in engine.items() if k in AUTO_KEEPS}, **auto)


def _agrees(key: str, value: Any, strategy: str, reads: tuple[str, ...]) -> bool:
    """Whether a seed key given with ``--strategy`` is read by that strategy or says the same thing."""
    if key in reads:
        return True
    if key == "cpu_offload_enabled":
        return "cpu_offload_components" in reads
    if key in ("cpu_offload_strategy", "strategy"):
        return str(value).strip().lower() == strategy
    return False


def _strategy_engine_args(strategy: str, engine: dict[str, Any]) -> dict[str, Any]:
    """Engine args for ``--strategy``: the strategy wins over the seed keys that select one (each warned about),
    and keeps what it reads (``cpu_offload_components`` for alternating/sequential, ``cpu_offload_gb`` for
    budget)."""
    reads = {"alternating": ("cpu_offload_components",), "sequential": ("cpu_offload_components",),
             "budget": ("cpu_offload_gb",)}.get(strategy, ())
    for key in SELECTING_FLAGS + ("strategy",):
        if engine.get(key) not in (None, False) and not _agrees(key, engine[key], strategy, reads):
            warn_user(f"{key} is ignored: --strategy {strategy} wins")
    kept = {k: v for k, v in engine.items() if k not in SELECTING_FLAGS + ("strategy",) or k in reads}
    if "cpu_offload_components" in reads:
        return {**kept, "cpu_offload_enabled": True, "cpu_offload_strategy": strategy}
    if strategy == "budget" and not kept.get("cpu_offload_gb"):
        raise ValueError("--strategy budget needs --cpu-offload-gb GiB > 0 (or cpu_offload_gb in the stage config): "
                         "the GiB of weights to stream from host memory")
    return kept if strategy == "budget" else {**kept, "strategy": strategy}


def policy_from_args(args: argparse.Namespace) -> OffloadPolicy:
    """The policy the command line asks for: ``--device-budget-gb``/``--strategy auto``, else ``--strategy``, else
    the stage config's stage with the seed flags on top; layerwise when none of them says anything about what to
    offload."""
    engine = _stage_engine_args(args) if args.stage_config else {}
    selecting = {flag: getattr(args, flag) for flag in SELECTING_FLAGS if getattr(args, flag) is not None}
    engine.update(selecting)
    engine.update({flag: getattr(args, flag) for flag in TUNING_FLAGS if getattr(args, flag) is not None})
    if args.device_budget_gb is not None or args.strategy == "auto":
        return _auto_policy(args, engine)
    where = f"--stage-config {args.stage_config} with the flags" if args.stage_config else "command line"
    if args.strategy is not None:
        return policy_from_engine_args(_strategy_engine_args(args.strategy, engine), where)
    if not args.stage_config and not selecting:
        engine["enable_layerwise_offload"] = True  # the default job: layerwise
    return policy_from_engine_args(engine, where)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        policy = policy_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    model, inputs, kwargs = load_model(args.model)
    model.eval()
    device = policy.torch_device
    inputs, kwargs = to_device(inputs, device), to_device(kwargs, device)
    plain = copy.deepcopy(model) if args.command == "run" and not args.no_check else None
    try:
        offloaded = offload_compile(model, policy)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    try:
        with torch.no_grad():
            out = offloaded(*inputs, **kwargs)
    except InfeasibleBudgetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    auto = policy.strategy == "auto"
    report: dict[str, Any] = {"policy": {k: v for k, v in vars(policy).items()}}
    if args.command == "run":
        for _ in range(max(args.calls - 1, 1)):
            reset_offload_stats(offloaded)
            with torch.no_grad():
                out = offloaded(*inputs, **kwargs)
        stats = offload_stats(offloaded)
        report["stats"] = dataclasses.asdict(stats)
        if not args.json:
            print(f"stats (one call): {stats}")
        if plain is not None:
            with torch.no_grad():
                expected = plain.to(device)(*inputs, **kwargs)
            diffs = [(a.float() - b.float()).abs().max().item() if a.numel() else 0.0
                     for a, b in zip(tensors_of(out), tensors_of(expected)) if a.is_floating_point()]
            worst = max(diffs, default=0.0)
            same = len(tensors_of(out)) == len(tensors_of(expected)) and worst <= 1e-4
            report["equivalence"] = {"max_abs_diff": worst, "equal": same}
            if not args.json:
                print(f"outputs equal the plain model: {same} (max abs diff {worst:.2e})")
            if not same:
                if args.json:
                    print(json.dumps(report, default=str))
                return 1
    plan = offload_plan(offloaded) if auto else None
    if plan is not None and args.plots:
        for path in plan.save_plots(args.plots):
            print(f"saved {path}", file=sys.stderr)
    if args.json:
        report["plan"] = plan.to_dict() if plan is not None else describe_plan(offloaded)
        print(json.dumps(report, default=str))
    else:
        print(plan if plan is not None else describe_plan(offloaded))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
