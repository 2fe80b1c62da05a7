"""Configuration as the seeds spell it: stage YAML files (`stage_args: [{stage_id, engine_args: {...}}]`), each
stage's engine args (`cpu_offload_enabled`, `cpu_offload_components`, ...) read by
`offload_compiler.policy.policy_from_engine_args` (re-exported here with `warn_user`)."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any, Mapping

from .policy import OffloadPolicy, policy_from_engine_args, warn_user


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
