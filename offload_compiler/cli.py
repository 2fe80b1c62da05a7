"""Command line: ``python -m offload_compiler plan|run --model pkg.module:fn [flags]``.

``--device-budget-gb X`` (or ``--strategy auto``) lets the planner choose residency and prefetch for a device
budget; the plan then prints as the planner's table (``--json`` as its dict, ``--plots DIR`` as PNGs).

``fn()`` returns ``(model, inputs)``: inputs a tuple of positional arguments or a dict of keyword arguments.
``--model`` may also name a built-in tiny model with random weights (listed below)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import importlib
import json
import os
import sys
import textwrap
import warnings
from typing import Any, Sequence

import torch

from ._tree import tensors_of, to_device
from .api import (describe_plan, offload_compile, offload_plan, offload_stats, reset_offload_stats,
                  runtime_plan_dict)
from .offloaded import state_of
from .planning.planner import InfeasibleBudgetError
from .config import load_stage_configs, policy_from_engine_args, warn_user
from .policy import IMPLEMENTED_STRATEGIES, OffloadPolicy
from .runtime.pinning import can_pin


def builtin_model_names() -> list[str]:
    """Every name ``--model`` takes besides ``pkg.module:fn``: the builders and the architecture matrix."""
    from .testing.models import ARCHITECTURES, BUILDERS
    return sorted(set(BUILDERS) | set(ARCHITECTURES))


def _models_epilog() -> str:
    names = builtin_model_names()
    return f"built-in models for --model ({len(names)}):\n" + textwrap.fill(", ".join(names), width=100,
                                                                            initial_indent="  ", subsequent_indent="  ")


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: at least 1 call")
    return value


def _budget_gb(text: str) -> str:
    """``free`` or GiB above zero (kept as given: `_auto_policy` reads it)."""
    if text == "free":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither GiB (a number, e.g. 4 or 0.5) nor 'free'") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text}: GiB above 0, or 'free' (the device's free memory)")
    return text


def _parser() -> argparse.ArgumentParser:
    epilog = _models_epilog()
    parser = argparse.ArgumentParser(prog="offload-compiler", description=__doc__, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("plan", "capture the model (one forward) and print the groups, bytes, residency and "
                                 "predicted peak"),
                        ("run", "also run the model, print the stats and check outputs against the plain model")):
        p = sub.add_parser(name, help=help_, description=help_, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--model", required=True, help="pkg.module:fn returning (model, inputs), or a built-in "
                                                     "model name (listed at the end)")
        p.add_argument("--device", help="compute device (default: cuda when available, else cpu; 'sim': the simulated "
                                        "accelerator of offload_compiler.testing, a device that is not the host)")
        p.add_argument("--strategy", choices=IMPLEMENTED_STRATEGIES + ("auto",))
        p.add_argument("--device-budget-gb", type=_budget_gb, help="strategy auto: GiB of device memory for weights and activations, "
                                                  "or 'free' (free memory now minus --budget-margin-gb)")
        p.add_argument("--budget-margin-gb", type=float)
        p.add_argument("--plots", metavar="DIR", help="save plots: residency.png (device weights along each graph, verified plan and ledger "
                            "peak); with strategy auto also timeline.png (predicted transfers vs compute)")
        p.add_argument("--calls", type=_at_least_one, default=2, help="calls to run (auto times calls 3 to 5 for the plan)")
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
            close = difflib.get_close_matches(spec, builtin_model_names(), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise SystemExit(f"--model {spec!r}: {hint}expected pkg.module:fn or a built-in model: "
                             f"{', '.join(builtin_model_names())}")
        module_name, fn_name = spec.split(":", 1)
        sys.path.insert(0, os.getcwd())
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
        except (ImportError, AttributeError) as exc:
            raise SystemExit(f"--model {spec!r}: cannot load {fn_name} from {module_name}: {exc}") from None
        try:
            model, inputs = fn()
        except Exception as exc:  # the user's builder: its error, named, without our traceback around it
            raise SystemExit(f"--model {spec!r}: {fn_name}() must take no arguments and return (model, inputs); it "
                             f"raised {type(exc).__name__}: {exc}") from None
    if not isinstance(model, torch.nn.Module):
        raise SystemExit(f"--model {spec!r}: expected (model, inputs) with model an nn.Module, got a "
                         f"{type(model).__name__}")
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


# the library's keyword arguments, as the command line spells them
CLI_SPELLING = {"components=[...]": "--cpu-offload-components a,b (or cpu_offload_components in the stage config)"}


def _error(exc: Exception) -> str:
    """The library's error message, with its keyword arguments named as the command line's flags."""
    message = str(exc)
    for keyword, flag in CLI_SPELLING.items():
        message = message.replace(keyword, flag)
    return f"error: {message}"


def pinning_note(policy: OffloadPolicy, runtime: Any) -> str | None:
    """Why ``pin_memory=True`` gave ``pinned=False`` (None when it did not)."""
    if runtime is None or not policy.pin_memory or runtime.pinned:
        return None
    if runtime.device.type == "cpu":
        return ("pin_memory=True but pinned=False: the compute device is the cpu (no accelerator); pinned memory "
                "only speeds up copies to an accelerator, so there is nothing to pin")
    if not can_pin(runtime.device):
        return (f"pin_memory=True but pinned=False: {runtime.device.type} has no pinned host memory in this torch "
                f"(not CUDA, nor torch's current accelerator: a simulated or out-of-tree device); weights stay in "
                f"pageable host memory")
    return ("pin_memory=True but pinned=False: pinned host memory was unavailable (see the warning); weights stay "
            "in pageable host memory")


def _save_plots(directory: str, plan: Any, runtime: Any) -> None:
    from .planning.plots import save_runtime_plots
    paths = plan.save_plots(directory) if plan is not None else save_runtime_plots(runtime, directory)
    for path in paths:
        print(f"saved {path}", file=sys.stderr)


def _call(model: Any, inputs: tuple, kwargs: dict) -> Any:
    with torch.no_grad():
        return model(*inputs, **kwargs)


EQUAL_TOLERANCE = 1e-4  # largest absolute difference `run` still calls equal (reassociated sums, fused kernels)


def _equivalence(out: Any, expected: Any) -> dict[str, Any]:
    """``equal``: as many outputs, each within `EQUAL_TOLERANCE` of the plain model's (``exact``: bit for bit)."""
    pairs = list(zip(tensors_of(out), tensors_of(expected)))
    diffs = [(a.float() - b.float()).abs().max().item() if a.numel() else 0.0
             for a, b in pairs if a.is_floating_point()]
    worst = max(diffs, default=0.0)
    same_count = len(tensors_of(out)) == len(tensors_of(expected))
    exact = same_count and all(a.shape == b.shape and torch.equal(a.cpu(), b.cpu()) for a, b in pairs)
    return {"max_abs_diff": worst, "equal": same_count and worst <= EQUAL_TOLERANCE, "exact": exact,
            "tolerance": EQUAL_TOLERANCE}


def equivalence_line(equivalence: dict[str, Any]) -> str:
    """How the outputs compare with the plain model's, saying how equality was judged: a True beside a
    non-zero difference is the tolerance, not a contradiction."""
    worst, tolerance = equivalence["max_abs_diff"], equivalence["tolerance"]
    if equivalence.get("exact"):
        how = "bit for bit"
    elif equivalence["equal"]:
        how = f"within the tolerance {tolerance:.0e}: max abs diff {worst:.2e}, not bit for bit"
    else:
        how = f"max abs diff {worst:.2e} is over the tolerance {tolerance:.0e}"
    return f"outputs equal the plain model: {equivalence['equal']} ({how})"


def _run(args: argparse.Namespace, offloaded: Any, plain: Any, inputs: tuple, kwargs: dict,
         report: dict[str, Any]) -> bool:
    """``run``: the remaining calls, the stats of the last one and the comparison with the plain model; False
    when the outputs differ."""
    for _ in range(max(args.calls - 1, 1)):
        reset_offload_stats(offloaded)
        out = _call(offloaded, inputs, kwargs)
    stats = offload_stats(offloaded)
    report["stats"] = dataclasses.asdict(stats)
    if not args.json:
        print(f"stats (one call): {stats}")
    if plain is None:
        return True
    report["equivalence"] = _equivalence(out, _call(plain.to(state_of(offloaded).runtime.device), inputs, kwargs))
    if not args.json:
        print(equivalence_line(report["equivalence"]))
    return report["equivalence"]["equal"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.stage is not None and not args.stage_config:
        parser.error("--stage chooses a stage of --stage-config: give the stage YAML too")
    if args.plots and os.path.exists(args.plots) and not os.path.isdir(args.plots):
        parser.error(f"--plots {args.plots}: a file is there; name a directory (made if missing)")
    if args.device is not None and args.device.split(":")[0] == "sim":
        from .testing import simulated_device
        args.device = simulated_device()
    try:
        policy = policy_from_args(args)
    except ValueError as exc:
        raise SystemExit(_error(exc)) from None
    model, inputs, kwargs = load_model(args.model)
    model.eval()
    device = policy.torch_device
    inputs, kwargs = to_device(inputs, device), to_device(kwargs, device)
    plain = copy.deepcopy(model) if args.command == "run" and not args.no_check else None
    try:
        offloaded = offload_compile(model, policy)
    except ValueError as exc:
        raise SystemExit(_error(exc)) from None
    try:
        _call(offloaded, inputs, kwargs)
    except InfeasibleBudgetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"policy": dict(vars(policy))}
    if args.command == "run" and not _run(args, offloaded, plain, inputs, kwargs, report):
        if args.json:
            print(json.dumps(report, default=str))
        return 1
    runtime = state_of(offloaded).runtime
    plan = offload_plan(offloaded) if policy.strategy == "auto" else None
    if args.plots:
        _save_plots(args.plots, plan, runtime)
    note = pinning_note(policy, runtime)
    if args.json:
        report["plan"] = plan.to_dict() if plan is not None else runtime_plan_dict(runtime)
        report["pinning"] = note
        print(json.dumps(report, default=str))
    else:
        print(plan if plan is not None else describe_plan(offloaded))
        if note:
            print(note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
