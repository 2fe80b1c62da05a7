"""Which weights move together: pure functions from a model and a policy to weight groups."""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch
from torch import nn

from . import components
from .subclasses import leaf_nbytes, plain_leaves, untraceable
from .policy import OffloadPolicy

BLOCKS_ATTR = "_layerwise_offload_blocks_attr"
ROOT = "(root)"


@dataclasses.dataclass(frozen=True)
class Weight:
    """One parameter or buffer, named by its first qualified name (tied weights appear once)."""
    name: str
    tensor: torch.Tensor
    is_buffer: bool

    @property
    def nbytes(self) -> int:
        return leaf_nbytes(self.tensor)  # a subclass weight: its inner tensors (quantized bytes, a rank's shard)


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """A set of weights that move together. ``streamed`` groups are fetched per use; the rest stay resident."""
    name: str
    weights: tuple[Weight, ...]
    streamed: bool
    is_block: bool
    exclusive: bool = False  # alternates on the device with the other exclusive groups

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights)


def _unmovable(tensor: torch.Tensor) -> str | None:
    """Why a weight cannot be packed and moved, else None. A traceable subclass (quantized weights, DTensor)
    moves as its inner tensors, so those are what must be movable."""
    if (why := untraceable(tensor)) is not None:
        return why
    for leaf in plain_leaves(tensor):
        if leaf.is_meta:
            return "on the meta device (not loaded)"
        if leaf.is_quantized:
            return "a quantized tensor of torch.ao (torch.quantize_per_tensor)"
        if leaf.layout != torch.strided:
            return f"a {leaf.layout} tensor"
    return None


def check_movable(weights: list[Weight]) -> None:
    """The engine moves plain dense tensors (a subclass weight's inner ones); refuse the others before anything
    is touched."""
    bad = [(w.name, why) for w in weights if (why := _unmovable(w.tensor)) is not None]
    if bad:
        listed = "; ".join(f"{name} is {why}" for name, why in bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise ValueError(f"offload_compiler moves plain dense (strided) tensors only (of a subclass weight, its inner "
                         f"tensors): {listed}. Load real weights "
                         f"(for meta tensors), dequantize, or convert these weights to plain tensors or to a traceable "
                         f"tensor subclass (one with __tensor_flatten__/__tensor_unflatten__: torchao's quantize_ "
                         f"configs, optimum-quanto, DTensor weights of torch.distributed.tensor.parallel), whose inner "
                         f"tensors are moved")


def collect_weights(model: nn.Module) -> list[Weight]:
    """Every parameter and buffer once, in registration order; tied tensors keep their first name."""
    seen: set[int] = set()
    weights: list[Weight] = []
    for is_buffer, named in ((False, model.named_parameters(remove_duplicate=False)),
                             (True, model.named_buffers(remove_duplicate=False))):
        for name, tensor in named:
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            weights.append(Weight(name, tensor, is_buffer))
    return weights


def _holds_weights(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _resolve(model: nn.Module, path: str) -> nn.Module:
    module: object = model
    for part in path.split(".") if path else ():
        children = getattr(module, "_modules", {})
        if part in children:  # before getattr: a child may share its name with a method (``double``, ``half``)
            module = children[part]
        elif hasattr(module, part):
            module = getattr(module, part)
        else:
            top = [name for name, _ in model.named_children()]
            raise ValueError(
                f"{BLOCKS_ATTR} / blocks_attr = {path!r} on {type(model).__name__} points at nothing "
                f"(no attribute {part!r}); the model's top-level modules are {top}")
    if not isinstance(module, nn.Module) or not list(module.children()):
        raise ValueError(f"{BLOCKS_ATTR} / blocks_attr = {path!r} on {type(model).__name__} must point at an "
                         f"nn.ModuleList of blocks; it is a {type(module).__name__} with no child modules")
    return module


def declared_block_paths(model: nn.Module, policy: OffloadPolicy) -> tuple[str, ...] | None:
    declared = policy.blocks_attr if policy.blocks_attr is not None else getattr(type(model), BLOCKS_ATTR, None)
    if declared is None:
        return None
    paths = (declared,) if isinstance(declared, str) else tuple(declared)
    for path in paths:
        _resolve(model, path)
    return paths


def discover_block_paths(model: nn.Module) -> tuple[str, ...]:
    """Block lists of a model with no declaration: the largest outermost ``nn.ModuleList`` whose children hold
    weights, plus any other outermost list at least a tenth its size (Flux has two, a UNet several).
    ``nn.Sequential`` (of two or more weight-holding children) only where there is no such list."""
    def candidates(kind: type, least: int) -> list[tuple[str, int]]:
        found: list[tuple[str, int]] = []
        for path, module in model.named_modules():
            if not isinstance(module, kind) or any(path.startswith(p + ".") for p, _ in found):
                continue
            holders = [child for child in module.children() if _holds_weights(child)]
            if len(holders) >= least:
                found.append((path, sum(w.numel() * w.element_size() for w in module.parameters())))
        return found

    found = candidates(nn.ModuleList, 1) or candidates(nn.Sequential, 2)
    if not found:
        return ()
    largest = max(size for _, size in found)
    return tuple(path for path, size in found if size * 10 >= largest)


def block_paths(model: nn.Module, policy: OffloadPolicy) -> tuple[str, ...]:
    declared = declared_block_paths(model, policy)
    return declared if declared is not None else discover_block_paths(model)


def _owner(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ROOT


def _outside_group(name: str, containers: Iterable[str]) -> str:
    """Group of a weight outside the blocks: the first module on its path that holds no block list, so
    siblings of the blocks (embeddings, final norm, head) are separate groups and a parent's own tensors
    (a ``scale_shift_table``) are a group of that parent."""
    parts = name.split(".")
    for depth in range(1, len(parts)):
        prefix = ".".join(parts[:depth])
        if not any(c == prefix or c.startswith(prefix + ".") for c in containers):
            return prefix
    return _owner(name)


def _block_of(name: str, containers: tuple[str, ...]) -> tuple[int, int] | None:
    for ci, path in enumerate(containers):
        if name.startswith(path + ".") or (not path and "." in name):  # "" is a root nn.Sequential
            index = name[len(path) + 1 if path else 0:].split(".", 1)[0]
            return ci, int(index) if index.isdigit() else 0
    return None


def _child_order(model: nn.Module, containers: tuple[str, ...]) -> dict[tuple[int, int], int]:
    """Position of each block in its container (children of a ModuleList are numbered already)."""
    order = {}
    for ci, path in enumerate(containers):
        for pos, (child, _) in enumerate(_resolve(model, path).named_children()):
            order[(ci, int(child) if child.isdigit() else pos)] = pos
    return order


def plan_groups(model: nn.Module, policy: OffloadPolicy, weights: list[Weight] | None = None) -> list[GroupSpec]:
    """The weight groups of ``model`` under ``policy``, blocks in model order, then the other groups."""
    weights = collect_weights(model) if weights is None else weights
    if not policy.offload_buffers:  # buffers are then left alone, on the compute device
        weights = [w for w in weights if not w.is_buffer]
    check_movable(weights)
    component_plan = _component_groups(model, policy, weights)
    if component_plan is not None:
        return component_plan
    if policy.strategy == "sequential":
        groups = _by_key(weights, lambda w: _owner(w.name), is_block=False)
        return [dataclasses.replace(g, streamed=True) for g in groups]

    containers = block_paths(model, policy)
    if not containers and policy.strategy == "layerwise":
        holders = [n for n, m in model.named_children() if _holds_weights(m)]
        raise ValueError(
            f"layerwise offload needs the blocks of {type(model).__name__}: no nn.ModuleList of repeated "
            f"blocks was found. Set the class attribute {BLOCKS_ATTR} = 'path.to.blocks' on "
            f"{type(model).__name__} (or OffloadPolicy(blocks_attr=...)); its top-level modules holding "
            f"weights are {holders}")
    order = _child_order(model, containers)
    per = policy.blocks_per_group

    def key(w: Weight) -> tuple[int, str]:
        block = _block_of(w.name, containers)
        if block is None:
            return (1, _outside_group(w.name, containers))
        ci, index = block
        first = order.get((ci, index), 0) // per * per
        last = min(first + per, sum(1 for c, _ in order if c == ci)) - 1
        prefix = f"{containers[ci]}." if containers[ci] else ""
        label = f"{prefix}{first}" if per == 1 or first == last else f"{prefix}{first}-{last}"
        return (0, f"{ci:04d}:{first:08d}:{label}")

    keyed: dict[tuple[int, str], list[Weight]] = {}
    for w in weights:
        keyed.setdefault(key(w), []).append(w)
    blocks = [GroupSpec(k[1].split(":", 2)[2], tuple(ws), True, True)
              for k, ws in sorted(keyed.items()) if k[0] == 0]
    others = [GroupSpec(k[1], tuple(ws), True, False) for k, ws in keyed.items() if k[0] == 1]
    return choose_streamed(blocks + others, policy)


def _component_groups(model: nn.Module, policy: OffloadPolicy, weights: list[Weight]) -> list[GroupSpec] | None:
    """Groups of the component strategies: one streamed group per component (the innermost holding each
    weight). Weights outside the components are in no group: they live on the compute device. None where
    the strategy is not component-based."""
    if policy.strategy == "model":
        dits, encoders = components.model_level(model)
        paths = dits + encoders
    elif policy.strategy == "alternating" or (policy.strategy == "sequential" and (
            policy.components is not None or components.discover(model))):
        paths = components.resolve(model, policy.components)
    else:
        return None
    exclusive = policy.strategy in ("alternating", "model")
    keyed: dict[str, list[Weight]] = {path: [] for path in paths}
    for w in weights:
        owner = components.component_of(w.name, paths)
        if owner is not None:
            keyed[owner].append(w)
    return [GroupSpec(path, tuple(ws), True, False, exclusive) for path, ws in keyed.items() if ws]


def component_block_groups(model: nn.Module, paths: list[str], policy: OffloadPolicy,
                           planned: dict[str, list[GroupSpec]] | None = None) -> list[GroupSpec]:
    """Groups of a pipeline under the block strategies: each component of ``paths`` grouped block by block
    as a model of its own (one group where it has no blocks), or as ``planned`` gives its groups, named by
    its path in ``model``; ``budget`` then chooses what streams over all of them, in ``paths`` order. Weights
    outside ``paths`` are in no group (they live on the compute device). ``blocks_attr`` paths name the
    component they start with."""
    groups: list[GroupSpec] = []
    seen: set[int] = set()
    for path in paths:
        component = model.get_submodule(path)
        own = policy.replace(strategy="layerwise", offload_gb=None, device_budget_gb=None,
                             blocks_attr=blocks_attr_within(policy.blocks_attr, path))
        specs = (planned or {}).get(path) or (plan_groups(component, own) if block_paths(component, own)
                                              else _whole(component, own))
        for spec in specs:
            weights = tuple(Weight(f"{path}.{w.name}", w.tensor, w.is_buffer) for w in spec.weights
                            if id(w.tensor) not in seen)
            seen.update(id(w.tensor) for w in weights)
            if weights:
                name = path if spec.name == ROOT else f"{path}.{spec.name}"
                groups.append(dataclasses.replace(spec, name=name, weights=weights))
    return choose_streamed(groups, policy)


def _whole(component: nn.Module, policy: OffloadPolicy) -> list[GroupSpec]:
    weights = [w for w in collect_weights(component) if policy.offload_buffers or not w.is_buffer]
    check_movable(weights)
    return [GroupSpec(ROOT, tuple(weights), True, False)]


def blocks_attr_within(blocks_attr: str | tuple[str, ...] | None, path: str) -> tuple[str, ...] | None:
    if blocks_attr is None:
        return None
    paths = (blocks_attr,) if isinstance(blocks_attr, str) else tuple(blocks_attr)
    inside = tuple(p[len(path) + 1:] for p in paths if p.startswith(path + "."))
    return inside or None


def _by_key(weights: list[Weight], key, is_block: bool) -> list[GroupSpec]:
    keyed: dict[str, list[Weight]] = {}
    for w in weights:
        keyed.setdefault(key(w), []).append(w)
    return [GroupSpec(name, tuple(ws), True, is_block) for name, ws in keyed.items()]


def choose_streamed(groups: list[GroupSpec], policy: OffloadPolicy) -> list[GroupSpec]:
    """Residency by strategy. ``budget`` streams whole blocks front to back, then the largest other groups,
    until at least ``offload_gb`` is streamed; everything when the budget exceeds the model."""
    if policy.strategy == "none":
        return [dataclasses.replace(g, streamed=False) for g in groups]
    if policy.strategy != "budget":
        return groups
    target = policy.offload_bytes or 0
    streamed: set[str] = set()
    total = 0
    order = [g for g in groups if g.is_block] + sorted((g for g in groups if not g.is_block),
                                                       key=lambda g: (-g.nbytes, g.name))
    for group in order:
        if total >= target:
            break
        streamed.add(group.name)
        total += group.nbytes
    return [dataclasses.replace(g, streamed=g.name in streamed) for g in groups]
