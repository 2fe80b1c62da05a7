"""Configuration as the seeds spell it: engine args (`cpu_offload_enabled`, `cpu_offload_components`, ...)
and stage YAML files (`stage_args: [{stage_id, engine_args: {...}}]`)."""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Mapping

from .policy import OffloadPolicy

OFFLOAD_ARGS = {
    "cpu_offload_enabled", "cpu_offload_components", "cpu_offload_strategy", "cpu_offload_pin_memory",
    "enable_cpu_offload", "enable_layerwise_offload", "cpu_offload_gb",
}
POLICY_FIELDS = {f.name for f in dataclasses.fields(OffloadPolicy)}
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# engine arguments that are not about offloading: accepted and carried, never interpreted here
ENGINE_ARGS = {
    "model", "model_stage", "model_arch", "dtype", "max_model_len", "max_num_seqs", "gpu_memory_utilization",
    "tensor_parallel_size", "pipeline_parallel_size", "enforce_eager", "trust_remote_code", "swap_space",
    "engine_output_type", "seed", "tokenizer", "revision", "quantization", "max_num_batched_tokens",
    "enable_prefix_caching", "enable_chunked_prefill", "worker_cls", "scheduler_cls", "hf_overrides",
    "vae_use_tiling", "vae_use_slicing", "distributed_executor_backend", "kv_cache_dtype", "block_size",
}


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    raise ValueError(f"{name} must be true or false; got {value!r}")


def _components(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [part for part in value.split(",")]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"cpu_offload_components must be a list of component names (or a comma-separated "
                         f"string); got {value!r}")
    return tuple(v.strip() for v in value if v.strip())


def check_keys(args: Mapping[str, Any], where: str = "engine args") -> None:
    known = OFFLOAD_ARGS | POLICY_FIELDS | ENGINE_ARGS
    for key in args:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown key {key!r} in {where}{hint}")


SELECTORS = ("enable_layerwise_offload", "enable_cpu_offload", "cpu_offload_enabled", "cpu_offload_gb")  # precedence
PRECEDENCE = " > ".join(SELECTORS)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn with the location of the first caller outside this package (the user's code), however many of our
    functions the call went through."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def _on(args: Mapping[str, Any], key: str) -> bool:
    if key == "cpu_offload_gb":
        return bool(args.get(key))
    return _bool(key, args.get(key, False))


def _selected(args: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(strategy, the key that selects it) by the seed precedence; (None, None) when no key selects one."""
    strategy = _component_strategy(args)  # checked even where another key wins: a typo is never ignored
    winner = next((key for key in SELECTORS if _on(args, key)), None)
    if winner != "cpu_offload_enabled":
        return {"enable_layerwise_offload": "layerwise", "enable_cpu_offload": "model",
                "cpu_offload_gb": "budget"}.get(winner), winner
    return strategy, winner


def _component_strategy(args: Mapping[str, Any]) -> str:
    strategy = str(args.get("cpu_offload_strategy", "alternating")).strip().lower()
    if strategy not in ("alternating", "sequential"):
        raise ValueError(f"cpu_offload_strategy={args.get('cpu_offload_strategy')!r} is unknown; choose "
                         f"'alternating' or 'sequential'")
    return strategy


def _ignored(args: Mapping[str, Any], strategy: str | None, winner: str | None) -> list[tuple[str, str]]:
    """(key, why) for each offload key set in ``args`` that has no effect once ``winner`` selected ``strategy``."""
    found = []
    given = str(args.get("strategy", "")).strip().lower()
    if winner is not None and given and given != strategy:
        found.append(("strategy", f"{winner} selects strategy {strategy!r}; remove one of them"))
    if winner is not None:
        # enable_cpu_offload loses only to enable_layerwise_offload, which has the seed guide's own warning
        found += [(key, f"{winner} wins ({PRECEDENCE}); remove one of them")
                  for key in SELECTORS[SELECTORS.index(winner) + 1:] if key != "enable_cpu_offload" and _on(args, key)]
    if winner != "cpu_offload_enabled":
        why = (f"{winner} wins ({PRECEDENCE})" if winner in SELECTORS[:2]
               else "cpu_offload_enabled is not true; set cpu_offload_enabled: true to offload components")
        found += [(key, why) for key in ("cpu_offload_components", "cpu_offload_strategy") if args.get(key) is not None]
    return found


def policy_from_engine_args(args: Mapping[str, Any], where: str = "engine args") -> OffloadPolicy:
    """The policy the seed engine args ask for. Precedence: ``enable_layerwise_offload`` (layerwise) over
    ``enable_cpu_offload`` (diffusion model-level) over ``cpu_offload_enabled`` (component offload with
    ``cpu_offload_strategy``) over ``cpu_offload_gb`` > 0 (budget); none of them means strategy ``none``, or the
    ``strategy`` field when given. Each key that has no effect (an explicit ``strategy`` that a key above
    overrides included) is a UserWarning naming the key and what wins. OffloadPolicy field names
    (``device``, ``prefetch``, ...) pass through."""
    check_keys(args, where)
    fields = {k: v for k, v in args.items() if k in POLICY_FIELDS}
    if "cpu_offload_pin_memory" in args:
        fields["pin_memory"] = _bool("cpu_offload_pin_memory", args["cpu_offload_pin_memory"])
    strategy, winner = _selected(args)
    if winner == "enable_layerwise_offload" and _bool("enable_cpu_offload", args.get("enable_cpu_offload", False)):
        warn_user("enable_cpu_offload and enable_layerwise_offload are both set: layerwise offload takes "
                  "priority and model-level offload is ignored")
    for key, why in _ignored(args, strategy, winner):
        warn_user(f"{where}: {key} is ignored: {why}")
    if strategy is None:
        fields.setdefault("strategy", "none")
        return OffloadPolicy(**fields)
    fields["strategy"] = strategy
    if winner == "cpu_offload_enabled":
        fields["components"] = _components(args.get("cpu_offload_components"))
    elif winner == "cpu_offload_gb":
        fields["offload_gb"] = args["cpu_offload_gb"]
    return OffloadPolicy(**fields)


@dataclasses.dataclass(frozen=True)
class StageConfig:
    stage_id: int
    model_stage: str | None
    model_arch: str | None
    policy: OffloadPolicy
    engine_args: Mapping[str, Any]


def _stage_policy(engine_args: Mapping[str, Any], where: str) -> OffloadPolicy:
    """The policy of one stage; its errors and warnings start with the file and the stage."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            policy = policy_from_engine_args(engine_args, where="engine_args")
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    for warning in caught:
        warn_user(f"{where}: {warning.message}", warning.category)
    return policy


def load_stage_configs(path: str | Path) -> list[StageConfig]:
    """Per-stage policies of a stage YAML file; errors name the file, the stage and the key."""
    import yaml

    path = Path(path)
    try:
        document = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such stage config file") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("stage_args"), list):
        raise ValueError(f"{path}: expected a top-level 'stage_args' list of stages")
    unknown = sorted(set(document) - {"stage_args"})
    if unknown:
        raise ValueError(f"{path}: unknown top-level key {unknown[0]!r} (only 'stage_args' is read)")
    stages = []
    for position, stage in enumerate(document["stage_args"]):
        where = f"{path}, stage {stage.get('stage_id', position) if isinstance(stage, dict) else position}"
        if not isinstance(stage, dict):
            raise ValueError(f"{where}: each stage must be a mapping with stage_id and engine_args")
        extra = sorted(set(stage) - {"stage_id", "engine_args"})
        if extra:
            raise ValueError(f"{where}: unknown key {extra[0]!r} (a stage has 'stage_id' and 'engine_args')")
        engine_args = stage.get("engine_args") or {}
        if not isinstance(engine_args, dict):
            raise ValueError(f"{where}: engine_args must be a mapping")
        stage_id = stage.get("stage_id", position)
        if not isinstance(stage_id, int) or isinstance(stage_id, bool):
            raise ValueError(f"{where}: stage_id must be an integer; got {stage_id!r}")
        policy = _stage_policy(engine_args, where)
        stages.append(StageConfig(stage_id, engine_args.get("model_stage"), engine_args.get("model_arch"),
                                  policy, dict(engine_args)))
    ids = [s.stage_id for s in stages]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: stage_id values repeat: {ids}")
    return stages
