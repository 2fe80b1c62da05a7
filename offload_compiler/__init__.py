"""offload_compiler: run PyTorch models whose weights live in host memory, with weight transfers as
explicit nodes of the model's graph (eager or inductor)."""

from .api import (OffloadGroup, OffloadedModule, describe_plan, inject_fault, offload_compile, offload_groups,
                  offload_plan, offload_stats, plan_offload, plan_summary, register_offload_method,
                  release_device_copies, remove_offload, reset_offload_stats)
from .checkpoint import CheckpointError, empty_weights
from .config import load_stage_configs
from .errors import OffloadRefusal, OffloadSavingWarning
from .planning.auto import OffloadPlan
from .offloaded import omni_offload
from .planning.planner import InfeasibleBudgetError
from .policy import OffloadPolicy
from .runtime import OffloadStats

__all__ = ["OffloadPolicy", "OffloadStats", "OffloadedModule", "offload_compile", "offload_stats",
           "reset_offload_stats", "release_device_copies", "describe_plan", "remove_offload", "inject_fault", "omni_offload",
           "OffloadPlan", "register_offload_method", "offload_plan", "plan_offload", "InfeasibleBudgetError",
           "OffloadRefusal", "OffloadSavingWarning", "load_stage_configs", "OffloadGroup", "offload_groups",
           "plan_summary", "empty_weights", "CheckpointError"]
__version__ = "0.1.0"
