"""Typed views of the transfer nodes (`ops`) and of the weights the insert pass builds over a fetch.

The passes and the lowerings read the same few node shapes: a transfer op's arguments, the flat buffers a fetch
returns (``getitem(fetch, bucket)``), a weight's leaf over one of them (``as_strided(buffer, shape, stride,
offset)``), a subclass weight rebuilt around its leaves (`rebuild_weight`) and, after `passes.fuse`, a
transfer's leaves (``getitem(transfer, i)``). This module is the one place that knows where an argument sits:

- `transfer_view` decodes a transfer op's arguments by the op's schema, keywords and defaults included, into an
  immutable view (`Prefetch`, `Wait`, `Evict`, `Resident`, `Transfer`); every other node gives None;
- `fetch_of` walks from anything over a fetch's result (a buffer, a leaf view, a rebuilt weight, a transfer's
  leaf) back to the fetch; `leaf_views` goes the other way, from a buffer to the leaf views over it, and
  `rebuilt_view` decodes a rebuilt weight; `item_source` is what a ``getitem`` picks from;
- `leaf_key` is the key a leaf is found by in its group's layout, and `leaf_positions` / `plain_weight_slots`
  the two indexes built from a layout with it;
- `set_argument` rewrites one argument by name, where the node holds it (positionally or as a keyword).
"""

from __future__ import annotations

import inspect
import operator
from typing import Callable, NamedTuple, Sequence

import torch
import torch.fx as fx

from .._torch_private import OpOverload, op_schema
from ..subclasses import rebuild_weight

AS_STRIDED = torch.ops.aten.as_strided.default
LeafKey = tuple[int, tuple[int, ...], tuple[int, ...], int]  # bucket, shape, stride, offset


# The views are NamedTuples (immutable, fields by name) rather than frozen dataclasses: every pass decodes every
# transfer node, and a frozen dataclass takes about 2.5 times as long to make (1.2 µs against 0.5 µs here)


class Prefetch(NamedTuple):
    node: fx.Node
    runtime: int
    group: int
    key: int
    deps: Sequence[fx.Node]
    mode: int  # `schedule.FETCH`, `ADOPT` or `CARRY`


class Wait(NamedTuple):
    node: fx.Node
    runtime: int
    group: int
    key: int
    deps: Sequence[fx.Node]


class Evict(NamedTuple):
    node: fx.Node
    runtime: int
    group: int
    poison: bool
    buffers: Sequence[fx.Node]  # the fetch's flat buffers (after `passes.fuse`: its transfer's first leaf)
    users: Sequence[fx.Node]    # every reader of the fetched weights (or what orders after one)
    park: bool                    # the copy stays on the device for the next call: its slot is not given back


class Resident(NamedTuple):
    node: fx.Node
    runtime: int
    group: int


class Transfer(NamedTuple):
    node: fx.Node
    runtime: int
    plan: int  # `OffloadRuntime.plan_transfer`'s index
    deps: Sequence[fx.Node]


class Rebuilt(NamedTuple):
    """``rebuild_weight(leaves, runtime_id, group, slot)``: a subclass weight rebuilt around its leaf views."""
    node: fx.Node
    leaves: Sequence[fx.Node]
    runtime_id: int
    group: int
    slot: int


TransferView = Prefetch | Wait | Evict | Resident | Transfer
FetchView = Wait | Resident | Transfer  # the ops whose results hold a group's weights

_REQUIRED = object()  # a parameter with no default
Signature = tuple[tuple[str, object], ...]  # (name, default or _REQUIRED) per parameter, in order


def _op_signature(op: OpOverload) -> Signature:
    return tuple((a.name, a.default_value if a.has_default_value() else _REQUIRED) for a in op_schema(op).arguments)


def _function_signature(fn: Callable) -> Signature:
    return tuple((p.name, _REQUIRED if p.default is inspect.Parameter.empty else p.default)
                 for p in inspect.signature(fn).parameters.values())


def _arguments(node: fx.Node, signature: Signature) -> tuple:
    """``node``'s arguments in ``signature``'s order, whether passed by position or by keyword, with the
    defaults of those not passed. Lists stay as fx keeps them (``immutable_list``: the views are immutable).
    Read from the schema directly: ``fx.Node.normalized_arguments`` gives the same (a test checks it) at ~60 µs
    a node, which the passes would pay for every transfer node of a graph several times over."""
    args = node.args
    if len(args) == len(signature):  # as the passes build them: nothing to look up
        return args
    return tuple(_argument(node, signature, i) for i in range(len(signature)))


def _argument(node: fx.Node, signature: Signature, index: int):
    """``node``'s argument ``index`` of ``signature``, passed by position or by keyword, or its default."""
    if index < len(node.args):
        return node.args[index]
    name, default = signature[index]
    value = node.kwargs.get(name, default)
    if value is _REQUIRED:
        raise TypeError(f"{node.format_node()} passes no {name!r}")
    return value


def _checked(view: type, signature: Signature) -> tuple[type, Signature]:
    """A view's fields are its op's parameters, in order: a schema that changes fails here, at its first use."""
    fields = list(view._fields[1:])
    if fields != [name for name, _ in signature]:
        raise TypeError(f"{view.__name__} has fields {fields}, its op's schema {[n for n, _ in signature]}")
    return view, signature


# the transfer ops by their schema's name (`ops` defines them in its NAMESPACE). The passes may not import `ops`
# (it is a higher layer: tests/test_layout.py), so each op's decoder is made from the node's own target when one
# is first met; a graph that holds the op was made after `ops` defined it
_VIEW_OF_OP = {"offload_compiler::prefetch": Prefetch, "offload_compiler::wait": Wait,
               "offload_compiler::evict": Evict, "offload_compiler::resident": Resident,
               "offload_compiler::transfer": Transfer}
_UNSEEN = object()
_decoders: dict[OpOverload, tuple[type, Signature] | None] = {}  # None: not a transfer op


def _decoder(op: OpOverload) -> tuple[type, Signature] | None:
    decoder = _decoders.get(op, _UNSEEN)
    if decoder is _UNSEEN:
        view = _VIEW_OF_OP.get(op.name())  # ``ns::op`` for the default overload, ``ns::op.overload`` otherwise
        decoder = _decoders[op] = None if view is None else _checked(view, _op_signature(op))
    return decoder


_REBUILT = _checked(Rebuilt, _function_signature(rebuild_weight))
_AS_STRIDED = _op_signature(AS_STRIDED)  # self, size, stride, storage_offset


def transfer_view(node: fx.Node) -> TransferView | None:
    """The typed view of a transfer op's node; None for any other node."""
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return None  # (a call_function's target may be any callable, not necessarily hashable)
    decoder = _decoder(node.target)
    if decoder is None:
        return None
    view, signature = decoder
    return view(node, *_arguments(node, signature))


def rebuilt_view(node: fx.Node) -> Rebuilt | None:
    """The typed view of a `rebuild_weight` node; None for any other node."""
    if node.op != "call_function" or node.target is not rebuild_weight:
        return None
    view, signature = _REBUILT
    return view(node, *_arguments(node, signature))


def item_source(node: fx.Node) -> fx.Node | None:
    """What ``getitem(source, i)`` picks an item of (one of an op's several results); None for another node."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    source = node.args[0]
    return source if isinstance(source, fx.Node) else None


def fetch_of(node: fx.Node) -> FetchView | None:
    """The fetch whose result ``node`` is part of: a flat buffer or a transfer's leaf (``getitem(fetch, i)``), a
    weight's leaf view of a buffer (``as_strided``) or a subclass weight rebuilt around leaf views; None when
    ``node`` is none of these."""
    if node.op == "call_function" and node.target is rebuild_weight:
        leaves = _argument(node, _REBUILT[1], 0)
        if not leaves:
            return None
        node = leaves[0]  # all its leaves are views of one fetch's buffers
    if node.op == "call_function" and node.target is AS_STRIDED:
        node = _argument(node, _AS_STRIDED, 0)
    source = item_source(node)
    view = transfer_view(source) if source is not None else None
    return view if isinstance(view, (Wait, Resident, Transfer)) else None


def leaf_key(bucket: int, shape, stride, offset: int) -> LeafKey:
    """How a leaf is found in its group's layout: its flat buffer (bucket) and its layout over it. Shapes and
    strides are lists in graph arguments and tuples in a layout: both as tuples."""
    return bucket, tuple(shape), tuple(stride), offset


class LeafView(NamedTuple):
    """``as_strided(getitem(fetch, bucket), shape, stride, offset)``: one leaf of a weight over a fetch's flat
    buffer, as the insert pass makes it."""
    node: fx.Node
    key: LeafKey


def leaf_views(buffer: fx.Node) -> list[LeafView]:
    """The leaf views over one of a fetch's flat buffers (``buffer``: ``getitem(fetch, bucket)``)."""
    if item_source(buffer) is None:
        return []
    bucket = buffer.args[1]
    views = []
    for user in buffer.users:
        if user.op == "call_function" and user.target is AS_STRIDED:
            _, shape, stride, offset = _arguments(user, _AS_STRIDED)
            views.append(LeafView(user, leaf_key(bucket, shape, stride, offset)))
    return views


GroupLayout = list[tuple[tuple, bool]]  # per weight of a group: (its leaves, each a LeafKey; whether it is rebuilt)


def leaf_positions(layout: GroupLayout) -> dict[LeafKey, int]:
    """Each leaf of a group's weights → its place among the group's leaves (`DeviceSlot.leaves`, the
    ``transfer`` op's results)."""
    flat = [leaf for leaves, _ in layout for leaf in leaves]
    return {leaf_key(*leaf): i for i, leaf in enumerate(flat)}


def plain_weight_slots(layout: GroupLayout) -> dict[LeafKey, int]:
    """A plain weight's one leaf → the weight's place in its group (the order of `DeviceSlot.weights`);
    subclass weights (rebuilt) are found by their `Rebuilt.slot` instead."""
    return {leaf_key(*leaf): slot for slot, (leaves, rebuilt) in enumerate(layout) if not rebuilt for leaf in leaves}


def set_argument(node: fx.Node, name: str, value) -> None:
    """Rewrite a transfer op's argument ``name`` where ``node`` holds it: positionally or as a keyword."""
    _, signature = _decoder(node.target)
    index = [n for n, _ in signature].index(name)
    if index < len(node.args):
        node.update_arg(index, value)
    else:
        node.update_kwarg(name, value)
