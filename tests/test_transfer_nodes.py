"""Typed views of the transfer nodes (`passes.nodes`): one decoder of the ops' arguments by their schemas (a node
built with keywords reads the same as one built positionally; defaults filled in; any other node reads as
None), the walk from a fetched weight back to its fetch, and the leaf index."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx

from offload_compiler import OffloadPolicy
from offload_compiler.backend import rewrite_graph
from offload_compiler.grouping import plan_groups
from offload_compiler.lowering import lower_for_eager
from offload_compiler.passes.analysis import weight_inputs
from offload_compiler.passes.fuse import fuse_transfers
from offload_compiler.passes.nodes import (Evict, Prefetch, Rebuilt, Resident, Transfer, Wait, fetch_of, leaf_key,
                                           leaf_positions, leaf_views, plain_weight_slots, rebuilt_view, set_argument,
                                           transfer_view)
from offload_compiler.passes.schedule import CARRY, FETCH
from offload_compiler.passes.slots import slot_events
from offload_compiler.passes.verify import verify
from offload_compiler.runtime import OffloadRuntime
from offload_compiler.subclasses import rebuild_weight
from offload_compiler.testing import BlockSpec, ModelSpec, build_block_model

OPS = torch.ops.offload_compiler
AS_STRIDED = torch.ops.aten.as_strided.default
SPEC = ModelSpec(16, (BlockSpec("mlp", 32), BlockSpec("attention", 1), BlockSpec("mlp", 16)), False, True, 4, 2)


def _fields(view) -> dict:
    """A view's decoded arguments (its node aside: two nodes built differently are two nodes)."""
    return {name: getattr(view, name) for name in view._fields if name != "node"}


def _named(fields: dict) -> dict:
    """Nodes (alone or in a list or tuple) as their names; lists as tuples."""
    def named(value):
        if isinstance(value, (list, tuple)):
            return tuple(named(v) for v in value)
        return value.name if isinstance(value, (fx.Node, _Token)) else value
    return {k: named(v) for k, v in fields.items()}


class _Token:
    name = "token"


def _schema_names(op) -> list[str]:
    return [a.name for a in op._schema.arguments]


# op, its view, its arguments given a token node (all of them, defaults included, in schema order)
OPS_AND_ARGS = [
    (OPS.prefetch.default, Prefetch, lambda t: (1, 3, 7, [t], CARRY)),
    (OPS.wait.default, Wait, lambda t: (1, 3, 7, [t])),
    (OPS.evict.default, Evict, lambda t: (1, 3, True, [t], [t, t], True)),
    (OPS.resident.default, Resident, lambda t: (1, 3)),
    (OPS.transfer.default, Transfer, lambda t: (1, 5, [t])),
]


def _built(op, args: tuple, keywords_from: int) -> tuple[fx.Graph, fx.Node]:
    """``op``'s node with its first ``keywords_from`` arguments positional and the rest as keywords."""
    graph = fx.Graph()
    token = graph.placeholder("token")
    values = args(token)
    names = _schema_names(op)
    node = graph.call_function(op, values[:keywords_from], dict(zip(names[keywords_from:], values[keywords_from:])))
    return graph, node


@pytest.mark.parametrize("op, view_type, args", OPS_AND_ARGS, ids=lambda v: getattr(v, "__name__", ""))
def test_a_node_built_with_keywords_reads_as_the_same_view_as_one_built_positionally(op, view_type, args):
    n_args = len(_schema_names(op))
    views = [transfer_view(_built(op, args, k)[1]) for k in range(n_args + 1)]  # all keywords ... all positional
    assert all(type(v) is view_type for v in views)
    positional = _named(_fields(views[-1]))  # each graph has its own token node: compared by name
    assert all(_named(_fields(v)) == positional for v in views[:-1])
    assert list(positional) == _schema_names(op)  # the view's fields are the schema's arguments, in order
    assert positional == _named(dict(zip(_schema_names(op), args(_Token()))))


@pytest.mark.parametrize("op, view_type, args", OPS_AND_ARGS, ids=lambda v: getattr(v, "__name__", ""))
def test_the_decoder_agrees_with_fx_normalized_arguments(op, view_type, args):
    for keywords_from in (0, len(_schema_names(op))):
        _, node = _built(op, args, keywords_from)
        normalized = node.normalized_arguments(None, normalize_to_only_use_kwargs=True)
        if normalized is None:
            pytest.skip("torch.fx cannot normalize this op's arguments on this torch")
        assert _fields(transfer_view(node)) == normalized.kwargs


def test_defaults_are_filled_in_from_the_schema():
    graph = fx.Graph()
    token = graph.placeholder("token")
    prefetch = transfer_view(graph.call_function(OPS.prefetch.default, (1, 3, 7, [token])))
    evict = transfer_view(graph.call_function(OPS.evict.default, (1, 3, False, [token], [])))
    by_keyword = transfer_view(graph.call_function(OPS.evict.default, (),
                                                   dict(runtime=1, group=3, poison=False, buffers=[token], users=[])))
    assert prefetch.mode == FETCH == 0 and list(prefetch.deps) == [token]
    assert evict.park is False and by_keyword.park is False and list(evict.users) == list(by_keyword.users) == []


def test_a_missing_required_argument_is_an_error_not_a_default():
    graph = fx.Graph()
    node = graph.call_function(OPS.wait.default, (1, 3), {"key": 7})  # no deps
    with pytest.raises(TypeError, match="deps"):
        transfer_view(node)


def test_the_views_are_immutable():
    graph = fx.Graph()
    token = graph.placeholder("token")
    view = transfer_view(graph.call_function(OPS.wait.default, (1, 3, 7, [token])))
    with pytest.raises(AttributeError):
        view.group = 4
    with pytest.raises((TypeError, NotImplementedError)):  # fx's immutable_list (the node's own, not a copy)
        view.deps.append(token)


def _prefetch(*_):  # a Python function named like an op is not the op
    return None


def test_any_other_node_reads_as_none():
    graph = fx.Graph()
    x = graph.placeholder("x")
    others = [x,
              graph.call_function(operator.getitem, (x, 0)),
              graph.call_function(torch.ops.aten.add.Tensor, (x, x)),
              graph.call_function(OPS.materialize.default, (x,)),  # one of our ops, not a transfer
              graph.call_function(_prefetch, (1, 3, 7, [x])),
              graph.call_method("wait", (x,)),
              graph.get_attr("prefetch")]
    others.append(graph.output(others[1]))
    assert [transfer_view(n) for n in others] == [None] * len(others)
    assert [fetch_of(n) for n in others] == [None] * len(others)
    assert [rebuilt_view(n) for n in others] == [None] * len(others)


def _fetch_and_weights(graph: fx.Graph, fetch: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node]:
    """Over ``fetch``'s flat buffer 1, as the insert pass builds them: a plain weight's leaf view and a subclass
    weight rebuilt around two leaf views."""
    buffer = graph.call_function(operator.getitem, (fetch, 1))
    plain = graph.call_function(AS_STRIDED, (buffer, [4, 2], [2, 1], 8))
    leaves = [graph.call_function(AS_STRIDED, (buffer, [4], [1], o)) for o in (0, 4)]
    return buffer, plain, graph.call_function(rebuild_weight, (leaves, 1, 3, 2))


@pytest.mark.parametrize("op", [OPS.wait.default, OPS.resident.default])
def test_the_walk_from_a_buffer_a_leaf_view_or_a_rebuilt_weight_reaches_its_fetch(op):
    graph = fx.Graph()
    token = graph.placeholder("token")
    fetch = graph.call_function(op, (1, 3, 7, [token]) if op is OPS.wait.default else (1, 3))
    buffer, plain, rebuilt = _fetch_and_weights(graph, fetch)
    assert [fetch_of(n) for n in (buffer, plain, rebuilt)] == [transfer_view(fetch)] * 3
    assert fetch_of(fetch) is None  # the fetch itself is not part of its result
    assert rebuilt_view(rebuilt) == Rebuilt(rebuilt, rebuilt.args[0], 1, 3, 2)
    assert [v.node for v in leaf_views(buffer)] == [plain, *rebuilt.args[0]]
    assert [v.key for v in leaf_views(buffer)] == [(1, (4, 2), (2, 1), 8), (1, (4,), (1,), 0), (1, (4,), (1,), 4)]


def test_the_walk_reaches_a_transfer_from_its_leaves_and_nothing_else_reaches_a_fetch():
    graph = fx.Graph()
    x = graph.placeholder("x")
    transfer = graph.call_function(OPS.transfer.default, (1, 5, [x]))
    leaf = graph.call_function(operator.getitem, (transfer, 2))
    assert fetch_of(leaf) == transfer_view(transfer)
    parts = graph.call_function(torch.ops.aten.split.Tensor, (x, 2))
    part = graph.call_function(operator.getitem, (parts, 0))
    view_of_input = graph.call_function(AS_STRIDED, (x, [2], [1], 0))
    prefetch = graph.call_function(OPS.prefetch.default, (1, 3, 7, [x]))
    token_item = graph.call_function(operator.getitem, (prefetch, 0))  # a token is no fetched weight
    assert [fetch_of(n) for n in (part, view_of_input, token_item)] == [None] * 3
    assert leaf_views(x) == [] and leaf_views(part) == []


def test_the_leaf_index_keys_a_layout_as_the_graph_views_read_it():
    layout = [(((0, (2, 3), (3, 1), 0),), False),                      # a plain weight: one leaf
              (((0, (4,), (1,), 6), (1, (2,), (1,), 0)), True),        # a subclass weight: two leaves, rebuilt
              (((1, (2, 2), (1, 2), 2),), False)]
    assert leaf_positions(layout) == {(0, (2, 3), (3, 1), 0): 0, (0, (4,), (1,), 6): 1, (1, (2,), (1,), 0): 2,
                                      (1, (2, 2), (1, 2), 2): 3}
    assert plain_weight_slots(layout) == {(0, (2, 3), (3, 1), 0): 0, (1, (2, 2), (1, 2), 2): 2}
    assert leaf_key(1, [2, 2], [1, 2], 2) == (1, (2, 2), (1, 2), 2)  # graph args are lists, a layout's tuples


def test_set_argument_rewrites_the_argument_where_the_node_holds_it():
    for keywords_from in (0, 2, 3):
        graph, node = _built(OPS.transfer.default, lambda t: (1, 5, [t]), keywords_from)
        set_argument(node, "deps", [])
        assert list(transfer_view(node).deps) == [] and transfer_view(node).plan == 5
        assert len(node.args) == keywords_from and not node.all_input_nodes


# -- on graphs the passes make ---------------------------------------------------------------------------------

POLICIES = {"layerwise carry": dict(strategy="layerwise", prefetch=1, prefetch_next_call=True),
            "budget (resident groups)": dict(strategy="budget", offload_gb=2e-6),
            "alternating (a parked copy)": dict(strategy="alternating", components=["blocks.*"])}


def _rewritten(policy: dict):
    from capture import capture
    model, x = build_block_model(SPEC, 5)
    gm, inputs = capture(model, x)
    offload_policy = OffloadPolicy(device="cpu", **policy)
    runtime = OffloadRuntime(offload_policy, plan_groups(model, offload_policy), pack_now=False)
    new_gm, num_outputs, plan = rewrite_graph(gm, inputs, runtime)
    return gm, inputs, new_gm, num_outputs, plan, runtime


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_every_fetched_weight_and_every_evict_walks_back_to_its_own_fetch(policy):
    _, _, gm, _, _, runtime = _rewritten(policy)
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    weights = [n for n in nodes if "offload_slot" in n.meta]
    assert weights
    for weight in weights:
        fetch = fetch_of(weight)
        assert isinstance(fetch, (Wait, Resident)) and fetch.group == weight.meta["offload_slot"][0]
        assert position[fetch.node] < position[weight]
    evicts = [v for v in map(transfer_view, nodes) if isinstance(v, Evict)]
    assert evicts
    for evict in evicts:
        (fetch,) = {fetch_of(buffer) for buffer in evict.buffers}  # one fetch: the evict's own
        assert isinstance(fetch, Wait) and fetch.group == evict.group
    for fetch in {fetch_of(w) for w in weights}:
        layout = runtime.layout[fetch.group]
        for buffer in fetch.node.users:
            assert all(view.key in leaf_positions(layout) for view in leaf_views(buffer))


def _as_keywords(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy with every transfer node's arguments passed by keyword (fx's own normalization, defaults included)."""
    copied = copy.deepcopy(gm)
    for node in copied.graph.nodes:
        if transfer_view(node) is not None:
            normalized = node.normalized_arguments(copied, normalize_to_only_use_kwargs=True)
            if normalized is None:
                pytest.skip("torch.fx cannot normalize the transfer ops' arguments on this torch")
            node.args, node.kwargs = (), normalized.kwargs
    copied.recompile()
    return copied


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_the_passes_read_a_graph_of_keyword_transfer_nodes_as_the_positional_one(policy):
    gm, inputs, rewritten, num_outputs, plan, runtime = _rewritten(policy)
    keywords = _as_keywords(rewritten)
    assert any(n.kwargs for n in keywords.graph.nodes) and keywords.code != rewritten.code
    assert slot_events(keywords) == slot_events(rewritten)
    weights = weight_inputs(gm, inputs, runtime.group_of)
    group_bytes = {g.index: g.nbytes for g in runtime.groups}
    assert verify(keywords, weights, group_bytes) == verify(rewritten, weights, group_bytes) == plan.verified
    assert lower_for_eager(copy.deepcopy(keywords), runtime, num_outputs).code == lower_for_eager(
        copy.deepcopy(rewritten), runtime, num_outputs).code
    fused = [fuse_transfers(copy.deepcopy(g), runtime.plan_transfer, runtime.layout, num_outputs)
             for g in (keywords, rewritten)]
    # one runtime records both: a step decoded otherwise would have made a plan of its own, with another index
    transfers = [[(v.runtime, v.plan, [d.name for d in v.deps]) for v in map(transfer_view, f.graph.nodes)
                  if isinstance(v, Transfer)] for f in fused]
    assert transfers[0] and transfers[0] == transfers[1]
