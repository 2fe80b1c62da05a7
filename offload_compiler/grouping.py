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
    # the whole model as its one component (`components.WHOLE_MODEL`): no other group can need its room, so it
    # is never kept after its forward, and its device slot is given back after each call (`OffloadRuntime.end_call`)
    whole_model: bool = False
    experts: bool = False  # a block's fused expert weights (`split_experts`): a graph may fetch only those routed
    # an embedding table alone in its group (`split_lookup_tables`): a graph that reads it only by indices fetches
    # the rows looked up (`passes.routed`), so `savings.peak_estimate` counts no slot of its whole size
    lookup: bool = False
    # the blocks calling it, where it is a module several blocks share (`shared_modules`): fetched at each one's
    # call (`savings.peak_estimate` counts its copies)
    users: tuple[str, ...] = ()

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
                         f"(for meta tensors: offload_compile(model, policy, checkpoint=path)), dequantize, or convert these weights to plain tensors or to a traceable "
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


def _module_bytes(module: nn.Module) -> int:
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(leaf_nbytes(t) for t in tensors.values())


def join_path(parent: str, child: str) -> str:
    return ".".join(part for part in (parent, child) if part)


def _inside(path: str, container: str) -> bool:
    """Whether module ``path`` lies strictly inside module ``container`` ("" is the root)."""
    return path != container and (not container or path.startswith(container + "."))


def registered_submodule(model: nn.Module, path: str) -> nn.Module:
    """``model.get_submodule(path)`` through the registered children only: a child may share its name with a
    method (``double``, ``half``), which ``getattr`` would find first."""
    for part in path.split(".") if path else ():
        model = model._modules[part]
    return model


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
        raise ValueError(f"{BLOCKS_ATTR} / blocks_attr = {path!r} on {type(model).__name__} must point at the "
                         f"module holding the blocks (an nn.ModuleList, an nn.Sequential or any module whose "
                         f"children are the blocks); it is a {type(module).__name__} with no child modules")
    return module


def declared_block_paths(model: nn.Module, policy: OffloadPolicy) -> tuple[str, ...] | None:
    declared = policy.blocks_attr if policy.blocks_attr is not None else getattr(type(model), BLOCKS_ATTR, None)
    if declared is None:
        return None
    paths = (declared,) if isinstance(declared, str) else tuple(declared)
    for path in paths:
        _resolve(model, path)
    return paths


# -- kinds of block stack: a module whose children are blocks -------------------------------------------------

def _holders(module: nn.Module) -> list[nn.Module]:
    return [child for child in module.children() if _holds_weights(child)]


def _made_of_layers(module: nn.Module) -> bool:
    return any(_holds_weights(child) for child in module.children())


def _is_block_list(module: nn.Module) -> bool:
    """An nn.ModuleList holding weights: how transformers and diffusers keep their blocks."""
    return isinstance(module, nn.ModuleList) and bool(_holders(module))


def _is_list_of_blocks(module: nn.Module) -> bool:
    """An nn.ModuleList whose members are each made of layers (a T5 block's sublayers, a UNet down block's
    resnets), not a list of single layers (diffusers' ``to_out``, ``ff.net``)."""
    holders = _holders(module)
    return isinstance(module, nn.ModuleList) and bool(holders) and all(map(_made_of_layers, holders))


def _repeats_blocks(module: nn.Module) -> bool:
    """Repeated blocks outside a ModuleList (torchvision's ViT ``encoder.layers``, RegNet's ``trunk_output``,
    DenseNet's ``features`` and ``denseblock1``), named or numbered: an nn.Sequential or nn.ModuleDict with two
    or more weight-holding children of one class made of layers, or another module whose weight-holding
    children are all of one such class. Repeated single layers (q/k/v projections, two norms) and a layer
    that merely holds two blocks of a kind among others (a decoder layer's self and cross attention) are not
    stacks."""
    blocks = [type(child) for child in _holders(module) if _made_of_layers(child)]
    if isinstance(module, (nn.Sequential, nn.ModuleDict)):
        return any(blocks.count(cls) >= 2 for cls in set(blocks))
    return len(blocks) >= 2 and len(set(blocks)) == 1 and len(blocks) == len(_holders(module))


def _is_layer_sequence(module: nn.Module) -> bool:
    """An nn.Sequential of two or more weight-holding layers: the last resort of a model with no blocks."""
    return isinstance(module, nn.Sequential) and len(_holders(module)) >= 2


# most specific first: discovery takes the first kind a model has (a transformer's ModuleList of layers, not
# a Sequential of layers inside its head)
MODEL_STACKS = (_is_block_list, _repeats_blocks, _is_layer_sequence)
# inside a block only stacks of blocks split it: a sequence of single layers stays one block
INNER_STACKS = (_is_list_of_blocks, _repeats_blocks)
SMALLEST_STACK = 0.1  # stacks under this share of the largest are left to the groups outside the blocks


def _outermost(model: nn.Module, is_stack) -> list[str]:
    found: list[str] = []
    for path, module in model.named_modules():
        if not any(_inside(path, p) for p in found) and is_stack(module):
            found.append(path)
    return found


def discover_stacks(model: nn.Module, kinds) -> tuple[str, ...]:
    """The outermost stacks of the first kind ``model`` has, but those under a tenth the size of the largest
    (Flux has two stacks, a UNet several; a list of one norm is not worth streaming on its own)."""
    for is_stack in kinds:
        found = _outermost(model, is_stack)
        if found:
            sizes = {path: _module_bytes(registered_submodule(model, path)) for path in found}
            largest = max(sizes.values())
            return tuple(path for path in found if sizes[path] >= SMALLEST_STACK * largest)
    return ()


def discover_block_paths(model: nn.Module) -> tuple[str, ...]:
    """Block stacks of a model with no declaration: every outermost ``nn.ModuleList`` holding weights; where
    there is none, every outermost stack of repeated blocks (`_repeats_blocks`: an ``nn.Sequential``, a
    ``ModuleDict`` or a plain module, numbered or named children); where there is none, every outermost
    ``nn.Sequential`` of two or more weight-holding layers. Stacks under a tenth the size of the largest are
    left out."""
    return discover_stacks(model, MODEL_STACKS)


def block_paths(model: nn.Module, policy: OffloadPolicy) -> tuple[str, ...]:
    declared = declared_block_paths(model, policy)
    return declared if declared is not None else discover_block_paths(model)


def repeated_blocks(model: nn.Module, policy: OffloadPolicy, keep=lambda block: True) -> list[nn.Module]:
    """The blocks of ``model``'s stacks (`block_paths`) that ``keep`` accepts and whose class has two or more of
    them among those: what regional compilation traces once per class."""
    blocks = [child for stack in block_paths(model, policy) for child in _holders(_resolve(model, stack))
              if keep(child)]
    return [block for block in blocks if sum(type(other) is type(block) for other in blocks) >= 2]


# -- blocks: the children of the stacks, dominant ones split into their own blocks ----------------------------

@dataclasses.dataclass(frozen=True)
class Block:
    """A module whose weights move together: a child of the stack ``stack``; or, with ``stack`` None, what is
    left of a block that was split into its own blocks (a stage's downsampling layer, an MoE layer's
    attention)."""
    path: str
    stack: str | None
    users: tuple[str, ...] = ()  # the blocks reaching it, where it is a module several share (`shared_modules`)


def _blocks_in(model: nn.Module, stacks: Iterable[str]) -> list[Block]:
    return [Block(join_path(stack, name), stack) for stack in stacks
            for name, child in _resolve(model, stack).named_children() if _holds_weights(child)]


def _enclosing(path: str, blocks: set[str]) -> str | None:
    """The innermost of the block paths ``blocks`` that is ``path`` or holds it."""
    parts = path.split(".")
    for depth in range(len(parts), 0, -1):
        if (prefix := ".".join(parts[:depth])) in blocks:
            return prefix
    return None


def _reached_by(model: nn.Module, blocks: set[str]) -> dict[int, set[str]]:
    """Each weight (by id) -> the blocks of ``blocks`` holding one of its names (a tied weight has several)."""
    reached: dict[int, set[str]] = {}
    for named in (model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)):
        for name, tensor in named:
            if tensor is not None and (block := _enclosing(_owner(name), blocks)) is not None:
                reached.setdefault(id(tensor), set()).add(block)
    return reached


def shared_modules(model: nn.Module, blocks: list[Block]) -> dict[str, tuple[str, ...]]:
    """Modules whose every weight two or more of ``blocks`` reach, outermost only: each one's path -> how many
    blocks reaching its weights. One module object under several block paths, or modules whose weights are all
    tied (Zamba2's shared attention block, reached from each of its hybrid layers). Its weights are named by
    their first path (`collect_weights`), so left to the blocks they would sit in the first block reaching them,
    and every later block calling them would fetch that whole block again. Only modules holding weights under
    that first name count (a later path to them is no group), and a weight tied to one in a module holding
    other weights (an embedding and its head) leaves that module alone."""
    reached = _reached_by(model, {b.path for b in blocks})
    first = {id(w.tensor): w.name for w in collect_weights(model)}
    found: dict[str, tuple[str, ...]] = {}
    for path, module in model.named_modules():  # outer modules first
        if not path or any(_inside(path, f) for f in found):
            continue
        tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
        if (tensors and all(len(reached.get(key, ())) >= 2 for key in tensors)
                and any(_inside(first[key], path) for key in tensors)):
            users = set().union(*(reached[key] for key in tensors))
            found[path] = tuple(b.path for b in blocks if b.path in users)
    return found


def with_shared(model: nn.Module, blocks: list[Block]) -> list[Block]:
    """``blocks`` with each module shared by several of them (`shared_modules`) a block of its own, of no
    stack (never merged with its neighbours), so each block fetches its own weights and the shared one where
    it calls it."""
    shared = shared_modules(model, blocks)
    marked = [dataclasses.replace(b, stack=None, users=shared[b.path]) if b.path in shared else b for b in blocks]
    known = {b.path for b in blocks}
    return marked + [Block(path, None, users) for path, users in shared.items() if path not in known]


def _sub_blocks(model: nn.Module, block: Block) -> list[Block]:
    """The blocks of the stacks inside ``block``; none where it is made of single layers, or where one of them
    is all of it (a list of one block), so that splitting would leave the largest part as large."""
    try:
        module = registered_submodule(model, block.path)
    except KeyError:  # a declared stack reached through a plain attribute: its weights are named elsewhere
        return []
    subs = _blocks_in(model, [join_path(block.path, stack) for stack in discover_stacks(module, INNER_STACKS)])
    whole = _module_bytes(module)
    return subs if all(_module_bytes(registered_submodule(model, b.path)) < whole for b in subs) else []


def _block_of(name: str, by_path: dict[str, Block]) -> Block | None:
    """The innermost block holding weight ``name``: blocks nest where a block was split (or where declared
    stacks nest), and a weight belongs to the deepest."""
    parts = name.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        block = by_path.get(".".join(parts[:depth]))
        if block is not None:
            return block
    return None


def _group_name(w: Weight, by_path: dict[str, Block], stacks: tuple[str, ...]) -> tuple[Block | None, str]:
    block = _block_of(w.name, by_path)
    return (block, block.path) if block is not None else (None, _outside_group(w.name, stacks))


def _group_sizes(weights: list[Weight], blocks: list[Block], stacks: tuple[str, ...]) -> dict[str, tuple[bool, int]]:
    """(is a block, bytes) of each group ``blocks`` make, in the order of their first weight."""
    sizes: dict[str, tuple[bool, int]] = {}
    by_path = {b.path: b for b in blocks}
    for w in weights:
        block, name = _group_name(w, by_path, stacks)
        sizes[name] = (block is not None, sizes.get(name, (False, 0))[1] + w.nbytes)
    return sizes


def _splittable(model: nn.Module, blocks: list[Block], names: Iterable[str]) -> tuple[Block, list[Block]] | None:
    """The first of the groups ``names`` that is a block with blocks of its own, and those."""
    by_path = {b.path: b for b in blocks}
    for name in names:
        block = by_path.get(name)
        if block is not None and (block.stack is not None or block.users) and (subs := _sub_blocks(model, block)):
            return block, subs
    return None


def _replaced(blocks: list[Block], block: Block, subs: list[Block]) -> list[Block]:
    """``block`` split: what its sub-blocks leave (a block of no stack) and then its sub-blocks, which the
    blocks reaching a shared block reach too."""
    at = blocks.index(block)
    subs = [dataclasses.replace(sub, users=block.users) for sub in subs]
    return blocks[:at] + [dataclasses.replace(block, stack=None)] + subs + blocks[at + 1:]


# layerwise with prefetch=1 holds at most its two largest groups on the device at once; split blocks until
# those two are at most half the model (most transformers have many equal blocks and are never split)
SPLIT_UNTIL_SHARE = 0.5


def _split_dominant(model: nn.Module, blocks: list[Block], weights: list[Weight],
                    stacks: tuple[str, ...]) -> list[Block]:
    """``blocks`` with each block that dominates the model's bytes replaced by itself (what its sub-blocks
    leave) and its own blocks, largest first: RegNet's last stage, DenseNet's third dense block, a UNet's
    widest down block. Stops when the two largest groups are at most half the model or cannot be split."""
    total = sum(w.nbytes for w in weights)
    while True:
        largest = sorted(_group_sizes(weights, blocks, stacks).items(), key=lambda kv: (-kv[1][1], kv[0]))[:2]
        if sum(size for _, (_, size) in largest) <= SPLIT_UNTIL_SHARE * total:
            return blocks
        split = _splittable(model, blocks, (name for name, _ in largest))
        if split is None:
            return blocks
        blocks = _replaced(blocks, *split)


def _split_at_budget(model: nn.Module, blocks: list[Block], weights: list[Weight], stacks: tuple[str, ...],
                     target: int) -> list[Block]:
    """``blocks`` with the block at which ``budget`` reaches ``target`` streamed bytes (whole blocks, front to
    back) split while it would overshoot the target by more than `BUDGET_SLACK` (MaxViT's last stage: its
    first layer alone is over a quarter of the model)."""
    while True:
        streamed = 0
        for name, (is_block, size) in _group_sizes(weights, blocks, stacks).items():
            if is_block and streamed < target:
                streamed += size
                if streamed >= target:
                    break
        else:
            return blocks  # the blocks end before the target: the other groups make it up
        split = _splittable(model, blocks, [name]) if streamed > (1 + BUDGET_SLACK) * target else None
        if split is None:
            return blocks
        blocks = _replaced(blocks, *split)


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


def _owner(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ROOT


def _merged(run: list[tuple[Block, list[Weight]]]) -> GroupSpec:
    """One group of consecutive blocks of one stack, named by the first and last (``blocks.0-3``)."""
    first, last = run[0][0], run[-1][0]
    if len(run) == 1:
        name = first.path
    else:
        skip = len(first.stack) + 1 if first.stack else 0
        name = f"{first.path}-{last.path[skip:]}"
    users = tuple(dict.fromkeys(u for block, _ in run for u in block.users))
    return GroupSpec(name, tuple(w for _, ws in run for w in ws), True, True, users=users)


def _block_groups(blocks: list[tuple[Block, list[Weight]]], per: int) -> list[GroupSpec]:
    """Runs of ``per`` consecutive blocks of one stack become one group; a split block's rest is alone."""
    groups: list[GroupSpec] = []
    run: list[tuple[Block, list[Weight]]] = []
    for block, ws in blocks:
        if run and (block.stack is None or block.stack != run[0][0].stack or len(run) == per):
            groups.append(_merged(run))
            run = []
        if block.stack is None:
            groups.append(GroupSpec(block.path, tuple(ws), True, True, users=block.users))
        else:
            run.append((block, ws))
    return groups + ([_merged(run)] if run else [])


def plan_groups(model: nn.Module, policy: OffloadPolicy, weights: list[Weight] | None = None,
                loading: bool = False) -> list[GroupSpec]:
    """The weight groups of ``model`` under ``policy``: blocks in definition order, then the other groups. A
    group of no bytes (weights with no elements) is never streamed: fetching it would move nothing, yet count
    as a fetch in the plan, the verifier and the ledger. ``loading``: the weights are still on the meta device,
    about to be read from a checkpoint."""
    return [_never_streamed_if_empty(g) for g in _plan_groups(model, policy, weights, loading)]


def _never_streamed_if_empty(group: GroupSpec) -> GroupSpec:
    """``group`` resident when it holds no bytes (the components that alternate keep their own residency)."""
    if group.streamed and not group.exclusive and group.nbytes == 0:
        return dataclasses.replace(group, streamed=False)
    return group


def _plan_groups(model: nn.Module, policy: OffloadPolicy, weights: list[Weight] | None,
                 loading: bool) -> list[GroupSpec]:
    weights = collect_weights(model) if weights is None else weights
    if not policy.offload_buffers:  # buffers are then left alone, on the compute device
        weights = [w for w in weights if not w.is_buffer]
    if not loading:
        check_movable(weights)
    component_plan = _component_groups(model, policy, weights)
    if component_plan is not None:
        return component_plan
    refuse_components_of_a_model(model, policy)
    if policy.strategy == "sequential":
        groups = _by_key(weights, lambda w: _owner(w.name), is_block=False)
        return [dataclasses.replace(g, streamed=True) for g in groups]

    stacks = block_paths(model, policy)
    if not stacks and policy.strategy == "layerwise":
        holders = [n for n, m in model.named_children() if _holds_weights(m)]
        raise ValueError(
            f"layerwise offload needs the blocks of {type(model).__name__}: no stack of repeated blocks "
            f"(nn.ModuleList, nn.Sequential) was found. Set the class attribute {BLOCKS_ATTR} = 'path.to.blocks' "
            f"on {type(model).__name__} (or OffloadPolicy(blocks_attr=...)); its top-level modules holding "
            f"weights are {holders}")
    blocks = _split_dominant(model, with_shared(model, _blocks_in(model, stacks)), weights, stacks)
    if policy.strategy == "budget" and policy.offload_bytes:
        blocks = _split_at_budget(model, blocks, weights, stacks, policy.offload_bytes)
    by_path = {b.path: b for b in blocks}
    in_blocks: dict[str, tuple[Block, list[Weight]]] = {}  # by block path, in the order of their first weight
    outside: dict[str, list[Weight]] = {}
    for w in weights:
        block, name = _group_name(w, by_path, stacks)
        if block is None:
            outside.setdefault(name, []).append(w)
        else:
            in_blocks.setdefault(name, (block, []))[1].append(w)
    groups = _block_groups(list(in_blocks.values()), policy.blocks_per_group)
    streams_blocks = policy.strategy in STREAMING_BLOCKS
    if streams_blocks:
        groups = split_experts(model, groups)
    groups += [GroupSpec(name, tuple(ws), True, False) for name, ws in outside.items()]
    if streams_blocks:
        groups = split_lookup_tables(model, groups)
    return choose_streamed(groups, policy)


def expert_modules(model: nn.Module) -> dict[str, int]:
    """Modules holding fused mixture-of-experts weights (transformers 5: ``experts.gate_up_proj [E, 2I, H]``,
    ``experts.down_proj [E, H, I]``): a module with an int ``num_experts`` and a 3-D parameter whose first
    dimension is that count (a router also has ``num_experts``, but a 2-D weight it reads whole). Path -> number
    of experts."""
    found = {}
    for path, module in model.named_modules():
        count = getattr(module, "num_experts", None)
        if isinstance(count, int) and count > 1 and any(
                p.dim() == 3 and p.shape[0] == count for p in module.parameters(recurse=False)):
            found[path] = count
    return found


def _shapes(module: nn.Module) -> tuple:
    return tuple((name, tuple(p.shape), p.dtype) for name, p in module.named_parameters())


def expert_lists(model: nn.Module) -> dict[str, str]:
    """Mixture-of-experts blocks whose experts are modules of their own (the older Mixtral style: an
    ``nn.ModuleList`` or ``nn.ModuleDict`` named ``experts`` of two or more modules with the same parameters):
    the list's path -> the path of the module holding it (the block with the router)."""
    found = {}
    for path, module in model.named_modules():
        if path.rsplit(".", 1)[-1] != "experts" or not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            continue
        children = list(module.children())
        if len(children) > 1 and _shapes(children[0]) and all(_shapes(c) == _shapes(children[0]) for c in children):
            found[path] = path.rsplit(".", 1)[0] if "." in path else ROOT
    return found


def _expert_list_group(name: str, lists: dict[str, str]) -> str | None:
    """The group of weight ``name`` under `split_experts` for a list of expert modules: its expert's (``.experts.3``),
    the rest of the block holding the list (its router, a shared expert), or None (elsewhere in the block)."""
    for path, holder in lists.items():
        if name.startswith(path + "."):
            return path + "." + name[len(path) + 1:].split(".", 1)[0]
        if holder != ROOT and name.startswith(holder + "."):
            return holder
    return None


def split_experts(model: nn.Module, groups: list[GroupSpec]) -> list[GroupSpec]:
    """Under a strategy that streams blocks, a block's expert weights form a group of their own right after the
    block's group: a graph that reads them only by router indices can then fetch the experts named instead of the
    block's every expert (`passes.analysis.routed_reads`), while the rest of the block streams as before; a graph that
    reads them whole (prefill) fetches both groups, the same bytes as one block group.

    Experts that are modules of their own (`expert_lists`) are called in a loop over the experts with tokens,
    which dynamo cannot trace (a data-dependent branch): that loop runs without a graph and each module it
    calls runs as its own offloaded graph, fetching the group holding its weights. So each expert is a group
    (a call fetches that expert alone, not the block), and so is the rest of the block holding them (its
    router, called from the loop's frame too, fetches that, not the block again)."""
    experts, lists = expert_modules(model), expert_lists(model)
    if not experts and not lists:
        return groups
    out: list[GroupSpec] = []
    for group in groups:
        split: dict[str, list[Weight]] = {}
        rest = []
        for w in group.weights:
            owner = _owner(w.name)
            if owner in experts and w.tensor.dim() >= 2 and w.tensor.shape[0] == experts[owner]:
                split.setdefault(owner, []).append(w)
            elif (listed := _expert_list_group(w.name, lists)) is not None and listed != group.name:
                split.setdefault(listed, []).append(w)
            else:
                rest.append(w)
        if not split or not rest:
            out.append(group)
            continue
        out.append(dataclasses.replace(group, weights=tuple(rest)))
        out += [GroupSpec(path, tuple(ws), group.streamed, True, group.exclusive, experts=path in experts,
                          users=group.users)
                for path, ws in split.items()]
    return out


MIN_LOOKUP_ROWS = 64  # a smaller table (token types, relative-position buckets) stays in its group: a lookup of
# a few tokens would save little beside a fetch of its own


def lookup_tables(model: nn.Module) -> set[int]:
    """Ids of the embedding tables of ``model`` that a lookup reads by rows: an ``nn.Embedding``'s weight (of more
    than `MIN_LOOKUP_ROWS` rows, without ``max_norm``, which renormalizes the rows it reads in place) that no
    other kind of module holds too (a table tied to the output projection is read whole by it at every call)."""
    tables: set[int] = set()
    whole: set[int] = set()
    for module in model.modules():
        for tensor in module.parameters(recurse=False):
            if (isinstance(module, nn.Embedding) and tensor is module.weight and module.max_norm is None
                    and tensor.dim() == 2 and tensor.shape[0] > MIN_LOOKUP_ROWS):
                tables.add(id(tensor))
            else:
                whole.add(id(tensor))
    return tables - whole


def split_lookup_tables(model: nn.Module, groups: list[GroupSpec]) -> list[GroupSpec]:
    """Under a strategy that streams blocks, each embedding table (`lookup_tables`) is a group of its own, named by
    its weight, just before the rest of the group it was in: a routed fetch (`passes.analysis.routed_reads`) moves
    the rows a graph looks up only where every weight of the group is read by indices, so a table beside a scale
    buffer or a norm (Gemma 3n/4's per-layer table, BERT-style embedding modules) would otherwise be fetched whole
    at every call. A group that is one table already keeps its name."""
    tables = lookup_tables(model)
    if not tables:
        return groups
    out: list[GroupSpec] = []
    for group in groups:
        own = [w for w in group.weights if id(w.tensor) in tables]
        rest = tuple(w for w in group.weights if id(w.tensor) not in tables)
        if not own:
            out.append(group)
        elif len(own) == 1 and not rest:
            out.append(dataclasses.replace(group, lookup=True))
        else:
            out += [dataclasses.replace(group, name=w.name, weights=(w,), lookup=True) for w in own]
            if rest:
                out.append(dataclasses.replace(group, weights=rest))
    return out


# -- what a plan saves, known before anything runs -------------------------------------------------------------

BLOCK_STRATEGIES = ("layerwise", "budget")  # the strategies that group by blocks and stream a window of them
BUDGET_SLACK = 0.25  # budget streams whole groups: up to this much more than offload_gb passes unremarked
def _component_groups(model: nn.Module, policy: OffloadPolicy, weights: list[Weight]) -> list[GroupSpec] | None:
    """Groups of the component strategies: one streamed group per component (the innermost holding each
    weight). Weights outside the components are in no group: they live on the compute device. None where
    the strategy is not component-based."""
    if policy.strategy == "model":
        dits, encoders = components.model_level(model)
        paths = dits + encoders
    elif policy.strategy == "alternating" or (policy.strategy == "sequential" and (
            policy.components is not None or components.discover(model))):
        paths = components.resolve(model, policy.components, whole=not isinstance(model, components.PipelineModules))
    else:
        return None
    if paths == [components.WHOLE_MODEL]:
        # "offload when not in use" for a model that is one stage: on the device while a call runs, on the host
        # between calls. Kept after its forward (keep_after_use), it would stay until another component needs
        # the room, which none ever does: the device would hold the whole model from the first call on
        return [GroupSpec(ROOT, tuple(weights), True, False, whole_model=True)] if weights else []
    exclusive = policy.strategy in ("alternating", "model")
    keyed: dict[str, list[Weight]] = {path: [] for path in paths}
    for w in weights:
        owner = components.component_of(w.name, paths)
        if owner is not None:
            keyed[owner].append(w)
    return [GroupSpec(path, tuple(ws), True, False, exclusive) for path, ws in keyed.items() if ws]


STREAMING_BLOCKS = ("layerwise", "budget", "auto")  # the strategies that stream blocks (auto once planned)


def refuse_components_of_a_model(model: nn.Module, policy: OffloadPolicy) -> None:
    """``components=`` under a block strategy names the components of a pipeline object that stream; an
    nn.Module streams the blocks of the whole model. Refused with the ways to stream part of a model."""
    if policy.components is None or policy.strategy not in STREAMING_BLOCKS:
        return
    raise ValueError(
        f"components={list(policy.components)!r} with strategy={policy.strategy!r} names the components of a "
        f"pipeline object to stream block by block; {type(model).__name__} is a model, whose blocks all stream. "
        f"To stream only some of its parts: strategy='sequential' with components=[...] (each part a group), "
        f"strategy='budget' with offload_gb (the rest stays resident), or blocks_attr='path.to.blocks' to name "
        f"its blocks; or offload the part on its own: offload_compile(model.<part>, policy) without components")


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
        own = policy.replace(strategy="layerwise", offload_gb=None, device_budget_gb=None, components=None,
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


def budget_order(groups: list) -> list:
    """The order ``budget`` streams groups in (`choose_streamed`): whole blocks front to back, then the largest
    other groups. ``groups``: `GroupSpec`s or a runtime's groups."""
    return [g for g in groups if g.is_block] + sorted((g for g in groups if not g.is_block),
                                                      key=lambda g: (-g.nbytes, g.name))


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
    for group in budget_order(groups):
        if total >= target:
            break
        streamed.add(group.name)
        total += group.nbytes
    return [dataclasses.replace(g, streamed=g.name in streamed) for g in groups]
