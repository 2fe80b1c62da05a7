"""What a block plan (layerwise, budget) saves, judged before it runs: the device weight memory it will hold
(`peak_estimate`: resident groups and the device slots of its window) and, where that is little, the warning
that names the largest group and the fix (`saving_warning`). Above the runtime and the passes: the estimate lays
groups out as the runtime does and sizes slots as the slot colouring does."""

from __future__ import annotations

import math
from typing import Iterable

from torch import nn

from .grouping import (BUDGET_SLACK, MODEL_STACKS, ROOT, block_paths, budget_order, discover_stacks, join_path,
                       plan_groups, registered_submodule)
from .passes.schedule import Use, build_schedule
from .passes.slots import class_bytes, schedule_pool_bytes, slot_kind
from .policy import COMPONENT_STRATEGIES, OffloadPolicy, spelled
from .runtime.layout import layout_group
from .runtime.slots import size_class

HALF_THE_MODEL = 0.5
# budget saving less than this share of offload_gb is warned about: the prefetch window eats what it streams
BUDGET_SAVED_SHARE = 0.5


def peak_estimate(groups: Iterable, prefetch: int, carry: bool = False) -> int:
    """Device weight bytes a block plan (layerwise, budget) holds, before any graph is captured: the resident
    groups and its device slots, allocated whole at the first call and held after it. Slots are per size class
    (groups whose flat buffers have the same sizes and dtypes), or shared by a kind (the same dtypes; each slot
    its largest group), whichever is smaller (`passes.slots.Pooling`); either needs as many as its copies alive
    at once, at most ``prefetch`` + 1 (the group computing and those fetched ahead of it) and at most its
    groups. ``groups`` are `GroupSpec`s or a runtime's groups. The planned slots replace it once graphs
    exist.

    With ``prefetch_next_call`` the window is the same: the schedule (`passes.schedule._carry_points`) copies
    the next call's first group i at the wait of group n - prefetch + i, where this call has no group left to
    prefetch, and never before its own copy in this call is gone, so a carried copy takes the slot of a
    prefetch that does not happen: at most prefetch + 1 groups still (the last ones and the first ones, the
    cyclic window). Assumed, as without carrying: each group's copy is gone before the group prefetch + 1 after
    it is waited for (no group's use spans another's).

    Where the order of the groups decides the pool, the estimate is the pool the backend makes
    (`passes.slots.schedule_pool_bytes`) for the schedule of that order (`build_schedule`, the planner's own),
    over the streamed groups in order (`_nominal_uses`):

    - groups on disk (``on_disk``, a ``host_budget_gb`` plan) are read further ahead (``read_ahead``); with
      ``carry`` the first reads from disk are carried to the next call too, their slots held across its end;
    - a group several blocks call (``users``: a module they share) is fetched at each one's call (just before
      each block calling it), and once for its whole span where they are more than the schedule fetches apart
      (`passes.schedule.MAX_RUNS`); its copies may take different slots;
    - a block's fused expert weights (``experts``: a group of their own, right after the rest of their block)
      alternate with the rest of the blocks, two size classes of which the window never holds two of one class
      at once: counting each class at its full window would hold two blocks' experts and two blocks' rests.

    An embedding table alone in its group (``lookup``) counts no slot: a graph reading it only by indices fetches
    the rows looked up into a slot its index sizes, which only the graph knows (the verified plan counts it); a
    graph that reads it whole (a model reading ``embedding.weight`` itself) fetches it whole, and the verified plan
    counts that slot too."""
    groups = list(groups)
    streamed = [g for g in groups if g.streamed and not getattr(g, "lookup", False)]
    classes = [_size_class_of(g) for g in streamed]
    resident = sum(g.nbytes for g in groups if not g.streamed)
    read_ahead = frozenset(i for i, g in enumerate(streamed) if getattr(g, "on_disk", False))
    if read_ahead or any(getattr(g, "users", ()) or getattr(g, "experts", False) for g in streamed):
        schedule = build_schedule(_nominal_uses(streamed), prefetch, carry=carry, read_ahead=read_ahead)
        return resident + schedule_pool_bytes(schedule, classes.__getitem__)
    window = prefetch + 1
    by_class: dict[tuple, int] = {}  # kind -> its slots' bytes, per size class
    for cls in set(classes):
        by_class[slot_kind(cls)] = by_class.get(slot_kind(cls), 0) + min(classes.count(cls), window) * class_bytes(cls)
    slots = 0
    for kind, nbytes in by_class.items():  # or shared by the kind (at most its window's largest), if smaller
        largest = sorted((class_bytes(c) for c in classes if slot_kind(c) == kind), reverse=True)
        slots += min(nbytes, sum(largest[:window]))
    return resident + slots


def _nominal_uses(streamed: list) -> list[Use]:
    """One use per group in order, a shared group's (``users``) just before each of its blocks' instead, or at
    its own place for a user no group is named after (blocks merged by ``blocks_per_group``)."""
    names = {g.name for g in streamed}
    before: dict[str, list[int]] = {}
    order: list[int] = []
    for i, g in enumerate(streamed):
        for user in getattr(g, "users", ()):
            if user in names:
                before.setdefault(user, []).append(i)
    for i, g in enumerate(streamed):
        order += before.get(g.name, [])
        if getattr(g, "users", ()):
            order += [i] * sum(user not in names for user in g.users)
        else:
            order.append(i)
    return [Use(group, at, at) for at, group in enumerate(order)]


def _size_class_of(group) -> tuple:
    """A group's size class (`runtime.slots.size_class`): a `GroupSpec` is laid out first (no tensor data)."""
    return size_class(group if hasattr(group, "buckets") else layout_group(0, group))


def _gib_at_least(nbytes: int, rounded=math.ceil) -> str:
    """``nbytes`` in GiB rounded up (``rounded``) to 3 significant digits, for an ``offload_gb=`` that asks for at
    least it."""
    gib = nbytes / 2**30
    scale = 10 ** (2 - math.floor(math.log10(gib)))
    return f"{rounded(gib * scale) / scale:g}"


def _gib_at_most(nbytes: int) -> str:
    """As `_gib_at_least`, rounded down: an ``offload_gb=`` that asks for at most ``nbytes``."""
    return _gib_at_least(nbytes, math.floor)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def saving_warning(model: nn.Module, groups: Iterable, policy: OffloadPolicy, stacks: tuple[str, ...] = (),
                   unmanaged_bytes: int = 0, kept_ids: set[int] | None = None) -> str | None:
    """Why the block plan of ``model`` saves little, naming its largest group and the fix; None where it saves
    what was asked. Layerwise: its estimated peak (`peak_estimate`) is above half the model. Budget: it streams
    more than ``offload_gb`` by over a quarter (its groups are too coarse to stop near the budget), or it saves
    under half of ``offload_gb`` (`_budget_window_warning`: the prefetch window holds what it streams), or both
    (one warning saying both). Sequential: as layerwise, its estimated peak above half the model
    (`_sequential_warning`). ``stacks``
    are the block stacks in use (`block_paths`), which a suggested ``blocks_attr`` keeps; ``kept_ids`` the ids of
    the tensors outside the groups (``unmanaged_bytes`` of them), which a sequential warning names the modules of."""
    groups = list(groups)
    total = sum(g.nbytes for g in groups) + unmanaged_bytes
    streamed = [g for g in groups if g.streamed]
    if not streamed or not total:
        return None
    name = type(model).__name__
    if policy.strategy == "layerwise":
        peak = peak_estimate(groups, policy.prefetch, policy.prefetch_next_call) + unmanaged_bytes
        if peak <= HALF_THE_MODEL * total:
            return None
        problem = (f"layerwise keeps up to {peak / total:.0%} of {name}'s weights on the device at once "
                   f"({_mib(peak)} of {_mib(total)} with prefetch={policy.prefetch})")
    elif policy.strategy == "budget" and policy.offload_bytes:
        moved = sum(g.nbytes for g in streamed)
        window = _budget_window_warning(name, groups, policy, unmanaged_bytes)
        if moved <= (1 + BUDGET_SLACK) * policy.offload_bytes:
            return window
        problem = (f"budget streams {_mib(moved)} ({moved / total:.0%} of {name}) where offload_gb={policy.offload_gb:g} "
                   f"asked for {_mib(policy.offload_bytes)}")
    elif policy.strategy in COMPONENT_STRATEGIES:
        return _component_pool_warning(name, groups, policy, unmanaged_bytes)
    elif policy.strategy == "sequential":
        return _sequential_warning(model, groups, policy, unmanaged_bytes, kept_ids or set())
    else:
        return None
    largest = max(streamed, key=lambda g: g.nbytes)
    text = (f"{problem}: its largest streamed group, {largest.name!r}, holds {largest.nbytes / total:.0%} of the "
            f"model. {_fix(model, largest.name, groups, policy, stacks, total)}")
    # a budget can overshoot and still save nothing (streaming no more than the prefetch window holds): the
    # overshoot alone reads as "saves more than asked", so both are said, in one warning
    return f"{text} Also: {window}" if policy.strategy == "budget" and window else text


def _budget_window_warning(name: str, groups: list, policy: OffloadPolicy, unmanaged_bytes: int) -> str | None:
    """Why budget saves far less than ``offload_gb`` (under `BUDGET_SAVED_SHARE` of it), naming the fix; None
    where it saves enough. The group computing and the ``prefetch`` fetched ahead of it are on the device at
    once, so streaming little more than those groups saves little: streaming no more than them, nothing."""
    depth, managed = policy.prefetch + 1, sum(g.nbytes for g in groups)
    asked = min(policy.offload_bytes, managed)  # an offload_gb over the model asks to stream all of it
    total = managed + unmanaged_bytes
    saved = managed - peak_estimate(groups, policy.prefetch, policy.prefetch_next_call)
    if saved >= BUDGET_SAVED_SHARE * asked:
        return None
    streamed = [g for g in groups if g.streamed]
    moved, largest = sum(g.nbytes for g in streamed), max(g.nbytes for g in streamed)
    saves = f"saves {_mib(saved)} ({saved / total:.0%} of {name})" if saved > 0 else "saves no device memory"
    ahead = f"the one computing and the {policy.prefetch} fetched ahead of it" if policy.prefetch else "one at a time"
    problem = (f"budget {saves} where offload_gb={policy.offload_gb:g} asked to stream {_mib(asked)}: "
               f"prefetch={policy.prefetch} holds {depth} streamed group(s) on the device at once ({ahead}) and it "
               f"streams {len(streamed)} ({_mib(moved)}), so its device weight peak is "
               f"{(total - saved) / total:.0%} of the model")
    # what the prefetch depth holds, were budget to stream more groups no larger than those it streams now
    # (equal blocks: a transformer's layers)
    window = depth * largest
    if window + asked <= managed:
        fix = (f"Fix: offload_gb={_gib_at_least(window + asked)} or more: what prefetch={policy.prefetch} holds "
               f"({depth} x {_mib(largest)}) plus the {_mib(asked)} you want saved")
    else:
        most = managed - sum(sorted((g.nbytes for g in groups), reverse=True)[:depth])  # every group streamed
        fix = (f"Fix: no offload_gb saves {_mib(asked)} with prefetch={policy.prefetch}; the most, {_mib(most)}, "
               f"is streaming every group (strategy='layerwise')")
    alone = moved - largest  # prefetch=0: one streamed group on the device at a time
    if policy.prefetch and alone >= BUDGET_SAVED_SHARE * asked:
        fix += f"; or prefetch=0 saves {_mib(alone)} (one group at a time: its copies no longer overlap compute)"
    return f"{problem}. {fix}."


def _fix(model: nn.Module, group: str, groups: list, policy: OffloadPolicy, stacks: tuple[str, ...],
         total: int) -> str:
    """How to split ``group``: into its blocks where it merges several, along a stack inside it where it has
    one; else say it is one piece, and what prefetch=0 would hold."""
    try:
        module = registered_submodule(model, group) if group != ROOT else None
    except KeyError:  # not a module: several blocks merged ("blocks.0-3")
        module = None
    if module is None and policy.blocks_per_group > 1:
        return f"Fix: blocks_per_group=1 streams its blocks one at a time (now {policy.blocks_per_group})."
    inner = discover_stacks(module, MODEL_STACKS) if module is not None else ()
    paths = tuple(dict.fromkeys((*stacks, *(join_path(group, stack) for stack in inner))))
    if inner and not _in_effect(model, policy, paths, stacks, groups):
        return (f"Fix: blocks_attr={paths!r} streams its parts one at a time (blocks_attr names the modules whose "
                f"children are the blocks; blocks_per_group=1 keeps them apart).")
    kind = type(module).__name__ if module is not None else "group"
    alone = peak_estimate(groups, 0)
    fewer = (f"; prefetch=0 would hold {alone / total:.0%} (one group at a time, copies no longer overlap compute)"
             if policy.prefetch and alone <= HALF_THE_MODEL * total else "")
    # its stacks already stream apart (a dominant block split along them): blocks_attr along them changes nothing
    what = (f"{group!r} (a {kind}) streams {', '.join(join_path(group, stack) for stack in inner)} apart already, "
            f"and the rest of it" if inner else f"{group!r} (a {kind})")
    return (f"Fix: {what} holds no stack of blocks to split it along: name smaller blocks with "
            f"blocks_attr='path.to.blocks' where the model has them and keep blocks_per_group=1, or "
            f"{_keep_on_device(groups, policy)}{fewer}.")


def _keep_on_device(groups: list, policy: OffloadPolicy) -> str:
    """The other way out for a group in one piece: keep it on the device. Under ``budget``, which streams whole
    groups in its order (`grouping.choose_streamed`) until ``offload_gb`` is reached, that is a budget that
    stops before the group that passed it."""
    if policy.strategy != "budget":
        return "keep it on the device (strategy='budget' streams the rest)"
    order = budget_order([g for g in groups if g.streamed])
    below = sum(g.nbytes for g in order[:-1])
    if not below:
        return "keep it on the device (strategy='layerwise' streams every group, one at a time)"
    return (f"offload_gb={_gib_at_most(below)} streams the groups before {order[-1].name!r} ({_mib(below)}: budget "
            f"streams whole groups, in order, until offload_gb is reached)")


def _in_effect(model: nn.Module, policy: OffloadPolicy, paths: tuple[str, ...], stacks: tuple[str, ...],
               groups: list) -> bool:
    """Whether ``blocks_attr=paths`` is the plan already in effect: the stacks in use, or the groups it would
    make are those of the plan (the split of a dominant block along the stack inside it already made them), so
    suggesting it would change nothing."""
    if set(paths) == set(stacks):
        return True
    try:
        suggested = plan_groups(model, policy.replace(blocks_attr=paths))
    except (ValueError, TypeError, KeyError, AttributeError):  # a pipeline's paths name its components' parts
        return False
    return [g.name for g in suggested] == [g.name for g in groups]


def _component_pool_warning(name: str, groups: list, policy: OffloadPolicy, unmanaged_bytes: int) -> str | None:
    """Why alternating or model saves far less than one component at a time would (under `BUDGET_SAVED_SHARE`
    of it), naming the largest component and the fix; None where it saves about that. A component is alone on
    the device while it runs (nothing is fetched ahead of it), so its slots hold the largest component -- of
    each dtype kind (`passes.slots`: a slot holds groups of one kind; kept components stay in their slot until
    another needs the room, the same slots): components of different kinds, one holding an int64 buffer
    another lacks, each get slots of their own, together on the device."""
    streamed = [g for g in groups if g.streamed]
    total = sum(g.nbytes for g in groups) + unmanaged_bytes
    largest = max(streamed, key=lambda g: g.nbytes)
    kept = sum(g.nbytes for g in groups if not g.streamed) + unmanaged_bytes
    should = total - kept - largest.nbytes  # one component at a time
    saved = total - peak_estimate(groups, 0) - unmanaged_bytes
    if should <= 0 or saved >= BUDGET_SAVED_SHARE * should:
        return None
    kinds: dict[tuple, list] = {}
    for g in streamed:
        kinds.setdefault(slot_kind(_size_class_of(g)), []).append(g)
    apart = [max(members, key=lambda g: g.nbytes) for members in kinds.values()]
    others = ", ".join(f"{g.name!r} ({'/'.join(str(d).removeprefix('torch.') for d in kind)})"
                       for kind, g in zip(kinds, apart))
    return (f"{policy.strategy} saves {_mib(max(saved, 0))} ({max(saved, 0) / total:.0%} of {name}) where one "
            f"component at a time saves {_mib(should)}: its largest component, {largest.name!r}, holds "
            f"{largest.nbytes / total:.0%} of the model, but components of different dtypes get device slots of "
            f"their own, on the device together ({others}). Fix: give the components the same dtypes; where "
            f"what differs is a buffer (int64 position ids), offload_buffers=False keeps buffers on the device; "
            f"or strategy='layerwise' streams their blocks one at a time.")


def _sequential_warning(model: nn.Module, groups: list, policy: OffloadPolicy, unmanaged_bytes: int,
                        kept_ids: set[int]) -> str | None:
    """Why sequential saves little, naming what holds the device: its estimated peak (`peak_estimate`: the group
    computing and the ``prefetch`` fetched ahead, with the weights outside the groups, which stay on the device)
    above half the model; None where it is not. Its groups are components where some are named or found (a
    vision-language model's tower, projector and language model: the language model one group, most of the
    model), so the fix streams the blocks instead (strategy='layerwise', its own estimate said) and, where the
    weights no component covers are much of the model, names them as components too."""
    total = sum(g.nbytes for g in groups) + unmanaged_bytes
    peak = peak_estimate(groups, policy.prefetch, policy.prefetch_next_call) + unmanaged_bytes
    if peak <= HALF_THE_MODEL * total:
        return None
    name = type(model).__name__
    streamed = [g for g in groups if g.streamed]
    largest = max(streamed, key=lambda g: g.nbytes)
    kept_paths = _kept_modules(model, kept_ids, policy)
    kept = (f"; {_mib(unmanaged_bytes)} ({unmanaged_bytes / total:.0%}) is outside its groups and stays on the "
            f"device ({_listed(kept_paths)})" if unmanaged_bytes else "")
    text = (f"sequential keeps up to {peak / total:.0%} of {name}'s weights on the device at once ({_mib(peak)} of "
            f"{_mib(total)} with prefetch={policy.prefetch}): its largest streamed group, {largest.name!r}, holds "
            f"{largest.nbytes / total:.0%} of the model{kept}.")
    fixes = []
    layerwise = _layerwise_share(model, policy)
    if layerwise is not None and layerwise < peak / total:
        fixes.append(f"strategy='layerwise' streams its blocks one at a time (estimated peak {layerwise:.0%} of "
                     f"the model): {spelled(policy, strategy='layerwise', components=None)}")
    if kept_paths and unmanaged_bytes > largest.nbytes:
        names = [g.name for g in streamed] + kept_paths
        fixes.append(f"components={names!r} streams the weights outside its groups too")
    if not fixes:
        fixes.append(f"{largest.name!r} is one group: name its parts with components=[...] (names, dotted paths "
                     f"or globs: '{largest.name}.*' is each of its children)")
    return f"{text} Fix: {'; or '.join(fixes)}."


def _listed(paths: list[str], shown: int = 6) -> str:
    more = f", and {len(paths) - shown} more" if len(paths) > shown else ""
    return ", ".join(repr(p) for p in paths[:shown]) + more


def _kept_modules(model: nn.Module, kept_ids: set[int], policy: OffloadPolicy) -> list[str]:
    """The outermost modules holding the weights outside the groups (``kept_ids``: the rest of a model beside its
    components), but the buffers offload_buffers=False keeps on purpose and the root's own (no module to name)."""
    named = [*model.named_parameters(), *(() if not policy.offload_buffers else model.named_buffers())]
    owners = [n.rsplit(".", 1)[0] for n, t in named if "." in n and id(t) in kept_ids]
    kept: list[str] = []
    for path in sorted(set(owners), key=lambda p: (p.count("."), p)):
        if not any(path.startswith(k + ".") for k in kept):
            kept.append(path)
    return kept


def _layerwise_share(model: nn.Module, policy: OffloadPolicy) -> float | None:
    """The estimated device weight peak of ``strategy='layerwise'`` on ``model``, a share of the model; None where
    it has no blocks to stream."""
    layerwise = policy.replace(strategy="layerwise", components=None)
    try:
        if not block_paths(model, layerwise):
            return None
        groups = plan_groups(model, layerwise)
    except (ValueError, TypeError):  # no stack of blocks it can stream
        return None
    total = sum(g.nbytes for g in groups)
    return peak_estimate(groups, layerwise.prefetch, layerwise.prefetch_next_call) / total if total else None
