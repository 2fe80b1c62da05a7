"""Run a verified graph: eagerly without the dispatcher, or compiled by inductor with one op per fetch.

Eagerly (`lower_for_eager`), the transfer ops become direct calls into the runtime.

The passes rewrite, verify and plan slots on a graph of `ops` (opaque operators with tokens, which dynamo, AOT
autograd and inductor need). Eagerly, Python runs the nodes in graph order, so the tokens order nothing and a
trip through the dispatcher per op (the op's schema, then back into Python) is pure cost, as is one
``as_strided`` per weight per call. `lower_for_eager` substitutes node for node, after verification:

  prefetch(runtime, group, key, deps, mode)        → runtime.prefetch(key, group, mode)
  wait(...) / resident(...) and the weights over them → the slot's weights (views; subclass weights rebuilt
                                                        around them), made once per slot and group
  evict(runtime, group, poison, buffers, users, park) → runtime.evict(group, poison, park)

and the graph returns only the model's outputs (the extra outputs kept slots alive under inductor). What runs
is the verified schedule, position for position; only the calling convention changes.

Under inductor (`compile_for_inductor`), `passes.fuse` folds each wait with the steps before it into one
``transfer`` op returning the weights' leaves; inductor is told never to reuse those leaves' memory and which
of them are not 16-byte aligned (`register_transfer_lowering`), so it needs no runtime size or alignment
check per leaf and no graph output per slot. A materialized weight reader (`ops.materialize`) stays an extern call:
a lowering to a buffer inductor computes itself (the reader fused into its kernel) gave wrong outputs on a
Zamba2 decode (`tests/test_hot_path.py`), so it was taken out.
"""

from __future__ import annotations

import hashlib
import operator
import pathlib
import sys
import weakref
from typing import Callable, Sequence

import torch
import torch.fx as fx

from ._registry import runtime_by_id
from ._torch_private import inductor_cache_salt, inductor_compile, inductor_fallback, inductor_graph, \
    inductor_kernel_of, register_inductor_lowering
from . import ops as offload_ops
from .passes.fuse import fuse_transfers
from .passes.nodes import (Evict, Prefetch, Resident, TransferView, Wait, leaf_views, plain_weight_slots, rebuilt_view,
                           transfer_view)
from .runtime import OffloadRuntime
from .subclasses import plain_leaves, rebuild_weight

OPS = torch.ops.offload_compiler


def _direct_calls(runtime: OffloadRuntime) -> dict:
    """The graph's view of the runtime, held weakly: dynamo's cache keeps graphs for the life of the process,
    and a graph must not keep its model's weights alive."""
    ref = weakref.ref(runtime)

    def offload_prefetch(key: int, group: int, mode: int) -> None:
        ref().prefetch(key, group, mode)

    def offload_wait(key: int, group: int) -> tuple:
        return ref().wait_weights(key, group)

    def offload_evict(group: int, poison: bool, park: bool) -> None:
        ref().evict(group, poison, park)

    def offload_resident(group: int) -> tuple:
        return ref().resident_weights(group)

    # per transfer node's view: the direct call, and its arguments from the view
    return {Prefetch: (offload_prefetch, lambda v: (v.key, v.group, v.mode)),
            Wait: (offload_wait, lambda v: (v.key, v.group)),
            Evict: (offload_evict, lambda v: (v.group, v.poison, v.park)),
            Resident: (offload_resident, lambda v: (v.group,))}


def lower_for_eager(gm: fx.GraphModule, runtime: OffloadRuntime, num_outputs: int) -> fx.GraphModule:
    """``gm`` (a rewritten, verified graph) with its transfer ops as direct runtime calls; see the module doc."""
    graph = gm.graph
    calls = _direct_calls(runtime)
    gone: list[TransferView] = []
    for node in list(graph.nodes):
        view = transfer_view(node)
        if type(view) not in calls:  # not a transfer node (nor a fused transfer: those are inductor's)
            continue
        fn, args_of = calls[type(view)]
        with graph.inserting_before(node):
            direct = graph.call_function(fn, args_of(view))
        if isinstance(view, (Wait, Resident)):
            _weights_from_slot(node, direct, plain_weight_slots(runtime.layout[view.group]))
        gone.append(view)
    output = next(n for n in graph.nodes if n.op == "output")
    results = output.args[0]
    output.args = (tuple(results[:num_outputs if num_outputs >= 0 else 1]),)
    orderings = {a for view in gone if isinstance(view, Evict) for a in view.users}
    for node in reversed([view.node for view in gone]):  # erased consumers first: each has no users left by then
        for user in list(node.users):
            if user.target is operator.getitem and not user.users:
                graph.erase_node(user)
        graph.erase_node(node)
    _erase_unused_orderings(graph, orderings)
    graph.lint()
    gm.recompile()
    return gm


def _erase_unused_orderings(graph: fx.Graph, nodes: set[fx.Node]) -> None:
    """What the insert pass made only to order an evict after a subclass reader (its plain leaves), now unused."""
    for node in [n for n in reversed(graph.nodes) if n in nodes]:
        while not node.users and node.op == "call_function" and node.target in (operator.getitem, plain_leaves):
            source = node.args[0]
            graph.erase_node(node)
            node = source if isinstance(source, fx.Node) else None
            if node is None:
                break


def _weights_from_slot(fetched: fx.Node, direct: fx.Node, weight_of: dict[tuple, int]) -> None:
    """Each weight the insert pass made over the fetch's flat buffers (an ``as_strided`` view; a subclass
    rebuilt around its views by `rebuild_weight`) reads the slot's ready-made weight instead."""
    graph = fetched.graph
    views = [view for item in fetched.users for view in leaf_views(item)]
    rebuilt = {user: None for view in views for user in view.node.users if user.target is rebuild_weight}
    for node in rebuilt:
        _replace(node, graph.call_function, (direct, rebuilt_view(node).slot))
    for view in views:
        if view.node.users:  # a plain weight
            _replace(view.node, graph.call_function, (direct, weight_of[view.key]))
        else:
            graph.erase_node(view.node)


def _replace(node: fx.Node, call_function, index_args: tuple) -> None:
    with node.graph.inserting_before(node):
        made = call_function(operator.getitem, index_args)
    made.meta.update(node.meta)
    node.replace_all_uses_with(made)
    node.graph.erase_node(node)


def _code_hash() -> str:
    """What inductor's generated code for our graphs depends on beyond the graph: this lowering, the functions of
    `ops` it calls by name, and `_torch_private`'s reading of inductor's IR (which kernel is renamed)."""
    digest = hashlib.sha256()
    for module in (sys.modules[__name__], offload_ops, sys.modules[inductor_kernel_of.__module__]):
        digest.update(pathlib.Path(module.__file__).read_bytes())
    return digest.hexdigest()


# inductor's per-output checks of extern kernels' results; the transfer op's leaves are described exactly to it
# (`register_transfer_lowering`), and these checks would cost two calls per leaf per call. Always the Python
# wrapper: inductor's C++ wrapper (torch 2.13) reads the transfer op's Tensor[] result as one tensor and crashes
# the process, so a global ``cpp_wrapper=True`` must not reach our graphs. The salt: the caches never hand back
# code another version of this lowering generated
_INDUCTOR_CONFIG = {"size_asserts": False, "alignment_asserts": False, "cpp_wrapper": False,
                    **inductor_cache_salt(_code_hash())}
ALIGNMENT = 16  # bytes: what inductor assumes of an extern kernel's outputs unless told otherwise


def compile_for_inductor(gm: fx.GraphModule, example_inputs: list, runtime: OffloadRuntime, num_outputs: int):
    """``gm`` (a rewritten, verified graph) fused (`passes.fuse`) and compiled with inductor."""
    register_transfer_lowering()
    fused = fuse_transfers(gm, runtime.plan_transfer, runtime.layout, num_outputs)
    read = _drop_unread_inputs(fused)
    compiled = inductor_compile(fused, [example_inputs[i] for i in read], config_patches=_INDUCTOR_CONFIG)
    if len(read) == len(example_inputs):
        return compiled
    pick = picker(read)
    return lambda *args: compiled(*pick(args))


def _drop_unread_inputs(gm: fx.GraphModule) -> list[int]:
    """Remove the inputs the fused graph no longer reads -- the streamed weights, whose leaves the transfers
    return -- and say which positions remain. The host masters never reach inductor: its runtime wrapper would
    otherwise unwrap every one of them (a tensor subclass) at every call, to pass on an inner tensor nothing
    reads. A size (a symbolic integer input) stays, read or not: inductor's code binds each symbol of the graph's
    shapes from the input that carries it (torch 2.14 no longer finds it in a tensor input's sizes)."""
    read = []
    for index, node in enumerate([n for n in gm.graph.nodes if n.op == "placeholder"]):
        if node.users or not isinstance(node.meta.get("val", node.meta.get("example_value")), torch.Tensor):
            read.append(index)
        else:
            gm.graph.erase_node(node)
    gm.recompile()
    return read


def picker(positions: list[int]) -> Callable[[Sequence], tuple]:
    """``args -> tuple(args[i] for i in positions)``, in one C call."""
    if len(positions) > 1:
        return operator.itemgetter(*positions)
    return (lambda args: (args[positions[0]],)) if positions else (lambda args: ())


_registered = False


def register_transfer_lowering() -> None:
    """Lower ``transfer`` as the extern call it is, and mark its leaves: never reused for another value
    (they are device slots the runtime owns: inductor reusing one for an activation, or writing in place
    into it, would corrupt a weight) and unaligned where the leaf's offset in its buffer is. ``materialize``,
    ``linear``, ``evict`` and ``routed`` stay the extern calls they are, called past the dispatcher as the transfer
    is."""
    global _registered
    if _registered:
        return
    fallback = inductor_fallback(OPS.transfer.default)
    copy_fallback = inductor_fallback(OPS.materialize.default)
    linear_fallback = inductor_fallback(OPS.linear.default)
    evict_fallback = inductor_fallback(OPS.evict.default)
    routed_fallback = inductor_fallback(OPS.routed.default)

    @register_inductor_lowering(OPS.transfer.default)
    def transfer(runtime: int, plan: int, deps: list):
        leaves = fallback(runtime, plan, deps)
        _call_directly(leaves[0] if leaves else None, "transfer_direct", DIRECT_TRANSFER)
        rt = runtime_by_id(runtime)
        group = rt.groups[rt.transfer_group(plan)]
        graph = inductor_graph()
        for out, leaf in zip(leaves, group.leaves):
            name = out.get_name()
            graph.never_reuse_buffers.add(name)
            if leaf.offset * group.buckets[leaf.bucket].dtype.itemsize % ALIGNMENT:
                graph.unaligned_buffers.add(name)
            else:  # inductor assumes an extern output with an unaligned input (a dep) may be a view of it
                graph.unaligned_buffers.discard(name)
        return leaves

    @register_inductor_lowering(OPS.materialize.default)
    def lower_materialize(value):
        copied = copy_fallback(value)
        _call_directly(copied, "direct_clone", DIRECT_MATERIALIZE)  # what `ops.materialize` runs, no frame of ours
        return copied

    @register_inductor_lowering(OPS.linear.default)
    def lower_linear(input, weight, bias=None):
        out = linear_fallback(input, weight, bias)
        _call_directly(out, "direct_linear", DIRECT_LINEAR)  # what `ops.linear` runs (torch's builtin)
        inductor_graph().unaligned_buffers.discard(out.get_name())  # a new tensor, never a view of an input
        return out

    # an evict left unfused (the last group's, after its last reader) and a routed fetch (an embedding's rows):
    # once per call each, their ops' own Python functions called past the dispatcher too
    @register_inductor_lowering(OPS.evict.default)
    def lower_evict(runtime, group, poison, buffers, users, park=False):
        token = evict_fallback(runtime, group, poison, buffers, users, park)
        _call_directly(token, "evict", DIRECT_EVICT)
        return token

    @register_inductor_lowering(OPS.routed.default)
    def lower_routed(runtime, group, slot, ids, bound, expert_bytes, deps):
        rows = routed_fallback(runtime, group, slot, ids, bound, expert_bytes, deps)
        _call_directly(rows, "routed", DIRECT_ROUTED)
        inductor_graph().unaligned_buffers.discard(rows.get_name())  # a new tensor, never a view of an input
        return rows

    _registered = True


DIRECT_TRANSFER = "offload_transfer"  # the names inductor's generated Python code calls `ops.transfer_direct`
DIRECT_MATERIALIZE = "offload_materialize"  # ``torch.clone`` (what `ops.materialize` does)
DIRECT_LINEAR = "offload_linear"  # torch's builtin linear (what `ops.linear` does)
DIRECT_EVICT = "offload_evict"  # `ops.evict`
DIRECT_ROUTED = "offload_routed"  # and `ops.routed` by


def _call_directly(output, function: str, name: str) -> None:
    """Inductor's Python wrapper calls ``ops.<function>`` itself (`ops.transfer_direct`, or the torch builtin the
    op's own implementation calls, bound in `ops`: ``direct_clone`` for `ops.materialize`, ``direct_linear`` for
    `ops.linear`, with no Python frame of ours around it: a decode token makes about 75 such calls), imported by
    the generated code from `ops` by that name,
    not the op whose extern kernel made ``output``: an op call from the generated code goes through
    ``OpOverload.__call__``, the dispatcher's boxing of the arguments and of the results, and back into Python
    (about 6 µs per transfer and 1 µs per copy on this CPU; a decode token makes 75 copies). Each does what
    the op does, so nothing else changes. An IR this function does not recognise (a torch version that shapes
    it otherwise) keeps the op: correct, only slower. (Our graphs never use inductor's C++ wrapper:
    `_INDUCTOR_CONFIG`.)"""
    getattr(offload_ops, function)  # a name `ops` defines: the generated code imports it when it runs
    kernel = inductor_kernel_of(output)
    if kernel is None:
        return
    codegen = kernel.codegen

    def direct_codegen(wrapper) -> None:
        graph = inductor_graph()
        if not graph.cpp_wrapper and not getattr(graph, "fx_wrapper", False):
            wrapper.add_import_once(f"from {offload_ops.__name__} import {function} as {name}")
            kernel.python_kernel_name = name
        codegen(wrapper)

    kernel.codegen = direct_codegen
