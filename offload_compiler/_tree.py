"""Nested inputs and outputs (tensors inside tuples, lists, dicts and model-output objects)."""

from __future__ import annotations

from typing import Any

import torch


def tensors_of(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value``, in order (``to_tuple()`` for transformers/diffusers outputs)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    return []


def to_device(value: Any, device: torch.device | str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value
