"""Read the captured graph: which placeholders are offloaded weights and which nodes read them."""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Iterable

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from .._torch_private import GROUPED_MM, OpOverload, op_schema, qualified_op_name
from ..errors import OffloadRefusal
from ..host_masters import host_of
from ..subclasses import is_traceable_subclass, plain_leaves
from .schedule import Use

# the routed ops (`passes.routed`), by name: passes do not import `ops`
ROUTED_OPS = ("offload_compiler::routed", "offload_compiler::routed_grouped")


@dataclasses.dataclass(frozen=True)
class WeightInput:
    group: int
    slot: int
    name: str


@dataclasses.dataclass(frozen=True)
class Reads:
    """The readers of one placeholder through one direct user: ``leaves`` are the nodes that consume the
    weight's data (the evict must follow them); ``escapes`` the views of the weight that are graph outputs (a
    slot's bytes would leave the graph, and be overwritten by the slot's next fill: each is copied out right
    after it is made, and the evict follows the copy); ``unordered`` is set when a reader cannot be depended on
    (the weight itself, or a tuple of its views, escapes as a graph output), so the weight must not be poisoned
    on eviction."""
    direct: fx.Node
    leaves: tuple[fx.Node, ...]
    unordered: bool
    escapes: tuple[fx.Node, ...] = ()


class WeightMutatedError(OffloadRefusal):
    pass


def _value(node: fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


def _storage(value) -> StorageWeakRef | None:
    if isinstance(value, torch.Tensor):
        # a subclass (quantized, DTensor) aliases through its first inner tensor, a host master through its bytes
        value = host_of(plain_leaves(value)[0])
        try:
            return StorageWeakRef(value.untyped_storage())
        except (NotImplementedError, RuntimeError):
            return None
    return None


def _aliases(value, storages: set[StorageWeakRef]) -> bool:
    """Whether ``value`` is a tensor over one of ``storages`` (no tensor, or no storage, aliases nothing)."""
    other = _storage(value)
    return other is not None and other in storages


_AUGMENTED = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
              operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor, operator.ilshift,
              operator.irshift}  # x += y on a tensor writes x


def _is_inplace(node: fx.Node) -> bool:
    if node.op == "call_function" and (node.target is operator.setitem or node.target in _AUGMENTED):  # x[i] = y
        return True
    if node.op == "call_method":
        name = str(node.target)
    elif node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        schema = op_schema(node.target)
        if schema is not None and any(a.is_write for a in schema.arguments if a.alias_info is not None):
            return True
    else:
        return False
    return (name.endswith("_") and not name.endswith("__")) or "out" in node.kwargs


def _is_transfer_op(node: fx.Node) -> bool:
    """One of our transfer ops: its tensor arguments are dependencies (what it must follow), not data it reads.
    The routed ops are not: they read their indices (a lookup's may be a view of a weight, a position table's
    ``position_ids`` buffer), which must stay fetched until they run."""
    return (isinstance(node.target, OpOverload) and node.target.namespace == "offload_compiler"
            and node.target.name() not in ROUTED_OPS)


_RETURNS_ITS_INPUT = {
    torch.nn.functional.dropout, torch.nn.functional.dropout1d, torch.nn.functional.dropout2d,
    torch.nn.functional.dropout3d, torch.nn.functional.alpha_dropout, torch.nn.functional.feature_alpha_dropout,
    torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout,
    torch.ops.aten.dropout.default, torch.ops.aten.alpha_dropout.default, torch.ops.aten.feature_dropout.default,
    torch.ops.aten.feature_alpha_dropout.default,
}


# conversions that return their input when it already is what they ask for
_CONVERSIONS = {"to", "type", "type_as", "contiguous", "float", "half", "bfloat16", "double", "int", "long", "bool",
                "cuda", "cpu"}


def _converts_to_itself(node: fx.Node, source: fx.Node | None) -> bool:
    """A conversion that the trace saw make a new tensor but that returns its input at run time: the trace saw
    the weight in host memory, so ``w.to(device)`` copied; the graph runs with the weight fetched to that
    device, where the same call hands back the fetched copy itself (transformers' rotary ``inv_freq.to(x)``)."""
    if node.op != "call_method" or node.target not in _CONVERSIONS or not node.args or node.args[0] is not source:
        return False
    before, after = _value(source), _value(node)
    return (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and before.dtype == after.dtype
            and before.shape == after.shape)


def _may_be_its_input(node: fx.Node, source: fx.Node | None) -> bool:
    """Whether ``node`` may hand back ``source`` itself when it runs, though the fake trace made a new tensor:
    dropout in eval mode (or with ``p=0``) returns its input eagerly, while its traced value owns a storage of
    its own; so does a conversion to what the fetched weight already is (`_converts_to_itself`). (Under inductor
    every reader is copied: `insert.needs_materializing`.)"""
    if _converts_to_itself(node, source):
        return True
    if node.op != "call_function" or node.target not in _RETURNS_ITS_INPUT:
        return False
    first = node.args[0] if node.args else node.kwargs.get("input")  # F.dropout(input=w, ...) traces as a keyword
    return first is source


def readers(placeholder: fx.Node, direct: fx.Node, weight_name: str) -> Reads:
    """Follow views (outputs sharing the weight's storage), results that may be the weight itself at run time
    (`_may_be_its_input`, and views of those) and tuple outputs down to the nodes that read."""
    storage = _storage(_value(placeholder))
    storages = {storage} if storage is not None else set()  # the weight's, and those of results that may be it
    leaves: list[fx.Node] = []
    escapes: list[fx.Node] = []
    unordered = False
    stack, seen = [(direct, placeholder)], set()
    while stack:
        node, source = stack.pop()
        if node.op == "output":  # (seen from each view it returns)
            if source is not placeholder and isinstance(_value(source), torch.Tensor):
                escapes.append(source)
            else:
                unordered = True
            continue
        if node in seen:
            continue
        seen.add(node)
        if _is_transfer_op(node):  # (re-derived on the rewritten graph) an evict's or a transfer's dependency
            continue
        if _is_inplace(node) and node.args and isinstance(node.args[0], fx.Node) and _aliases(
                _value(node.args[0]), storages):
            raise WeightMutatedError(
                f"the forward modifies weight {weight_name!r} in place ({node.format_node()}); an offloaded weight "
                f"is read-only in the forward (its device copy is dropped after use, so the change would be lost). "
                f"Where the model prepares its weights at its first call (RWKV rescales them in eval mode), call "
                f"the plain model once before offloading; a buffer the forward updates (a running count) stays on "
                f"the device with OffloadPolicy(offload_buffers=False)")
        value = _value(node)
        if isinstance(value, (tuple, list)):
            stack.extend((user, node) for user in node.users)
            if not node.users:
                unordered = True
            continue
        if not _aliases(value, storages):  # reads the data: a tensor result, or none at all (x[mask] = weight
            leaves.append(node)            # writes it into x, returns None)
            if not _may_be_its_input(node, source):
                continue
            if _storage(value) is not None:
                storages.add(_storage(value))
        stack.extend((user, node) for user in node.users)
    return Reads(direct, tuple(dict.fromkeys(leaves)), unordered, tuple(dict.fromkeys(escapes)))


def weight_inputs(gm: fx.GraphModule, example_inputs: Iterable, group_of: dict[int, tuple[int, int]],
                  name_of: Callable[[int, int], str] | None = None) -> dict[fx.Node, WeightInput]:
    """Placeholders whose real tensor is a registered weight (matched by identity), named in messages by
    ``name_of(group, slot)`` (the weight's name in the model), else by the placeholder's."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found = {}
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, torch.Tensor) and id(value) in group_of:
            group, slot = group_of[id(value)]
            found[node] = WeightInput(group, slot, name_of(group, slot) if name_of is not None else node.name)
    return found


def collect_uses(gm: fx.GraphModule, weights: dict[fx.Node, WeightInput], streamed: set[int]
                 ) -> tuple[list[Use], dict[tuple[fx.Node, int], list[Reads]]]:
    """Uses of each streamed group: one per (direct user, group), spanning to its last reader."""
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    reads: dict[tuple[fx.Node, int], list[Reads]] = {}
    for placeholder, w in weights.items():
        if w.group not in streamed:
            continue
        for user in placeholder.users:
            reads.setdefault((user, w.group), []).append(readers(placeholder, user, w.name))
    uses = []
    for (user, group), rs in reads.items():
        end = max([position[user]] + [position[leaf] for r in rs for leaf in (*r.leaves, *r.escapes)])
        uses.append(Use(group, position[user], end, key=(user, group)))
    return uses, reads


@dataclasses.dataclass(frozen=True)
class RoutedRead:
    """A read of a weight by indices: rows of a table looked up (``F.embedding(ids, w)``: a token embedding needs
    the rows of the tokens in the call, not the vocabulary), ``w[ids]`` (transformers' ``batched_mm`` experts), or
    ``grouped_mm(x, view(w), offs=offs)`` (its ``grouped_mm`` experts: tokens sorted by expert, ``offs`` the
    cumulative token count per expert). The graph needs only the rows named (``ids``, or the experts with tokens
    in ``offs``), at most ``bound`` of the weight's ``experts`` rows along its first dimension (the index's element
    count, or the grouped product's rows, fixed by the graph's shapes, capped at the row count). "Expert" names a
    row of the first dimension: an expert's matrix, or one token's embedding."""
    node: fx.Node  # the ``w[ids]`` getitem, the ``F.embedding`` lookup, or the grouped product
    ids: fx.Node  # the router index, or the offsets
    group: int
    slot: int
    name: str
    experts: int
    bound: int
    expert_bytes: int  # one expert's (row's) bytes of this weight
    views: tuple[fx.Node, ...] = ()  # grouped: the views from the weight to the product's operand (a transpose)

    @property
    def grouped(self) -> bool:
        return _is_grouped_mm(self.node)

    @property
    def bound_bytes(self) -> int:
        return self.bound * self.expert_bytes


def _router_index(node: fx.Node, placeholder: fx.Node) -> fx.Node | None:
    """The index of ``w[ids]`` when ``node`` is one: a 1-D integer tensor computed by the graph (data-dependent,
    not a constant), picking whole experts along the weight's first dimension."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2:
        return None
    source, index = node.args
    if source is not placeholder or not isinstance(index, fx.Node):
        return None
    value = _value(index)
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.dtype not in (torch.int64, torch.int32):
        return None
    return index


def _lookup_index(node: fx.Node, placeholder: fx.Node) -> fx.Node | None:
    """The indices of ``F.embedding(ids, w)`` when ``node`` is one with the weight as its table: rows looked up by
    an integer tensor of any shape. Not with ``max_norm``: that renormalizes the rows it reads, in place."""
    if node.op != "call_function" or node.target is not torch.nn.functional.embedding:
        return None
    args = {**dict(zip(("input", "weight", "padding_idx", "max_norm"), node.args)), **node.kwargs}
    ids = args.get("input")
    if args.get("weight") is not placeholder or args.get("max_norm") is not None or not isinstance(ids, fx.Node):
        return None
    value = _value(ids)
    return ids if isinstance(value, torch.Tensor) and value.dtype in (torch.int64, torch.int32) else None


def _is_grouped_mm(node: fx.Node) -> bool:
    """Torch's private grouped matmul (`GROUPED_MM`), ``F.grouped_mm``, or transformers' fallback op (matched
    by name: transformers registers it, and may not be imported)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target in (GROUPED_MM, getattr(torch.nn.functional, "grouped_mm", None)):
        return True
    return qualified_op_name(target) == "transformers::grouped_mm_fallback"


def _swaps_last_two(node: fx.Node) -> bool:
    """``w.transpose(-2, -1)`` on a 3-D weight (how transformers hands an expert weight to grouped_mm): the
    experts stay along the first dimension, which the offsets index."""
    if node.op != "call_method" or node.target != "transpose" or len(node.args) != 3 or node.kwargs:
        return False
    value = _value(node.args[0])
    return isinstance(value, torch.Tensor) and value.dim() == 3 and {a % 3 for a in node.args[1:]
                                                                    if isinstance(a, int)} == {1, 2}


def _grouped_read(user: fx.Node, placeholder: fx.Node, experts: int
                  ) -> tuple[fx.Node, fx.Node, tuple[fx.Node, ...], int] | None:
    """(the product, its offsets, the views between, its rows) when ``user`` starts a read of the weight as
    the operand of a grouped product: ``grouped_mm(x, w.transpose(-2, -1), offs=offs)`` (or ``w`` itself).
    The views must be read by the product alone."""
    views: list[fx.Node] = []
    node = user
    while _swaps_last_two(node) and len(node.users) == 1:
        views.append(node)
        node = next(iter(node.users))
    if not _is_grouped_mm(node) or len(node.args) < 2:
        return None
    operand = views[-1] if views else placeholder
    offs = node.kwargs.get("offs", node.args[2] if len(node.args) > 2 else None)
    if node.args[1] is not operand or not isinstance(offs, fx.Node):
        return None
    offs_value, rows = _value(offs), _value(node.args[0])
    if not isinstance(offs_value, torch.Tensor) or offs_value.dim() != 1 or offs_value.shape[0] != experts or (
            offs_value.dtype not in (torch.int32, torch.int64)) or not isinstance(rows, torch.Tensor):
        return None
    if any(v.args[0] is not (views[i - 1] if i else placeholder) for i, v in enumerate(views)):
        return None
    return node, offs, tuple(views), rows.shape[0]


def routed_reads(weights: dict[fx.Node, WeightInput], streamed: set[int]) -> dict[int, list[RoutedRead]]:
    """The streamed groups that this graph reads only by indices (a table's lookup, ``w[ids]``, an expert weight
    as a grouped product's operand with offsets), with a bound below their row count: group -> its reads. A group
    read whole anywhere (a layer's matmuls, the ``eager`` experts, an embedding tied to the output projection, an
    index of symbolic size) or whose bound is all its rows (prefill: tokens x top_k >= E) is left out: it is
    fetched whole, as any group."""
    found: dict[int, list[RoutedRead]] = {}
    whole: set[int] = set()
    for placeholder, w in weights.items():
        if w.group not in streamed or w.group in whole:
            continue
        value = _value(placeholder)
        users = list(placeholder.users)
        if not isinstance(value, torch.Tensor) or is_traceable_subclass(value) or value.dim() < 2:
            whole.add(w.group)
            continue
        experts = value.shape[0]
        for user in users:
            ids = _router_index(user, placeholder)
            if ids is None:
                ids = _lookup_index(user, placeholder)
            read, views = user, ()
            if ids is not None:
                numel = _value(ids).numel()
            else:  # grouped_mm: at most one expert per row of the product has tokens
                grouped = _grouped_read(user, placeholder, experts)
                read, ids, views, numel = grouped if grouped is not None else (user, None, (), None)
            if ids is None or not isinstance(numel, int):
                whole.add(w.group)
                break
            bound = min(numel, experts)
            if bound >= experts:
                whole.add(w.group)
                break
            expert_bytes = value[0].numel() * value.element_size()
            found.setdefault(w.group, []).append(
                RoutedRead(read, ids, w.group, w.slot, w.name, experts, bound, expert_bytes, views))
    return {g: rs for g, rs in found.items() if g not in whole}
