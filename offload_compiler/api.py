"""Public entry points: `offload_compile`, `offload_stats`, `reset_offload_stats`, `describe_plan`,
`offload_plan`, `release_device_copies`, `remove_offload`, `inject_fault`. All reach the model's one
`OffloadState` through `state_of`."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

from torch import nn

from ._torch_private import compiled_module_of, inductor_generates_code_for
from .components import with_component
from .checkpoint import CheckpointError, check_checkpoint, load_checkpoint, load_layout
from .errors import OffloadSavingWarning
from .grouping import BLOCK_STRATEGIES, block_paths
from .savings import peak_estimate, saving_warning
from .planning import auto
from .planning.auto import OffloadPlan
from .offloaded import (OffloadState, OffloadedModule, add_method, install_output_capture, offload_module,
                        offload_pipeline, PipelineModules, refuse_other_offloaders, state_of)
from .policy import COMPONENT_STRATEGIES, OffloadPolicy, spelled, warn_user
from .runtime import OffloadRuntime, OffloadStats
from .runtime.stats import held_device_weight_bytes, held_pool_bytes
from .storage import FilledBuckets

__all__ = ["OffloadedModule", "offload_compile", "offload_stats", "reset_offload_stats", "release_device_copies",
           "describe_plan", "offload_plan", "plan_offload", "remove_offload", "inject_fault", "register_offload_method",
           "OffloadGroup", "offload_groups", "plan_summary"]


def offload_compile(model: Any, policy: OffloadPolicy | None = None, *, checkpoint: str | os.PathLike | None = None,
                    **fields: Any) -> Any:
    """Offload ``model``'s weights to host memory, in place, and run it through graphs with explicit transfers.

    ``model`` is an nn.Module — returned, now an `OffloadedModule` — or a pipeline object whose components
    are nn.Module attributes (a diffusers pipeline; returned, its components offloaded). On a pipeline,
    ``layerwise``/``budget``/``auto`` stream the components ``policy.components`` names (None: its encoders
    and denoisers) block by block and keep the other components (the VAE unless named) on the device; the
    component strategies alternate its denoisers and encoders.

    ``checkpoint``: a safetensors file or directory (sharded, with its index; for a pipeline, a pipeline folder
    with a subfolder per component) read straight into the offloaded layout, for a model whose weights are on
    the meta device (`empty_weights`): the model is never materialised elsewhere first (`checkpoint`)."""
    if policy is None:
        policy = OffloadPolicy(**fields)
    elif fields:
        policy = policy.replace(**fields)
    if not isinstance(policy, OffloadPolicy):
        raise TypeError(f"policy must be an OffloadPolicy; got {type(policy).__name__}")
    state = state_of(model)
    if state is not None:
        raise ValueError(_already_offloaded(model, state))
    if not isinstance(model, nn.Module) and policy.strategy == "none":
        raise TypeError(f"strategy='none' keeps every weight on the device: for a pipeline object "
                        f"({type(model).__name__}) that is pipe.to(device); offloading takes any other strategy")
    _refuse_inductor_without_code_for(policy)
    refuse_other_offloaders(model, policy)
    if checkpoint is None:
        _offload(model, policy, None)
        return model
    # loading is part of offloading's one transaction (README, "Reliability"): whatever fails after the
    # checkpoint's tensors replaced the model's (packing, the disk tier's file, a refusal of the policy), the
    # model gets back the very tensors it held -- on meta, or its own weights -- and the loaded ones are let go
    held = _held_tensors(model)
    filled: FilledBuckets = {}
    try:
        filled = _load(model, policy, checkpoint)
        _offload(model, policy, filled)
    except BaseException:
        _give_back(held, filled)
        raise
    return model


def _offload(model: Any, policy: OffloadPolicy, filled: FilledBuckets | None) -> None:
    if not isinstance(model, nn.Module):
        offload_pipeline(model, policy, filled)
        return
    state = offload_module(model, policy, filled)
    try:
        _check_saving(model, policy)
    except BaseException:  # a warning made an error (``-W error``): refused, and nothing changed
        state.detach(copy_back=filled is None)  # loaded from a checkpoint: the caller gives back what it held
        raise


def _held_tensors(model: Any) -> list[tuple[dict, str, Any]]:
    """Every parameter and buffer slot of ``model`` (a pipeline: of its components) and the object in it."""
    roots = [model] if isinstance(model, nn.Module) else list(PipelineModules(model).children())
    modules = {id(m): m for root in roots for m in root.modules()}.values()
    return [(table, name, tensor) for module in modules for table in (module._parameters, module._buffers)
            for name, tensor in table.items()]


def _give_back(held: list[tuple[dict, str, Any]], filled: FilledBuckets) -> None:
    """The undo of a failed load-and-offload: each slot holds its tensor from before the call again (never changed:
    loading made new ones), and the files the loaded buckets were in are closed now, not when collected."""
    for table, name, tensor in held:
        table[name] = tensor
    for bucket in filled.values():
        if bucket.file is not None:
            bucket.file.close()


def _refuse_inductor_without_code_for(policy: OffloadPolicy) -> None:
    """A ValueError, before anything changes, where ``compiler='inductor'`` meets a device inductor generates no
    code for (the simulated accelerator): accepted, the model would fail inside inductor at every call."""
    device = policy.torch_device.type
    if policy.compiler == "inductor" and not inductor_generates_code_for(device):
        raise ValueError(f"compiler='inductor' cannot compile for device={policy.device!r}: inductor has no code "
                         f"generator for {device!r} devices, so every call would fail inside it. Use compiler='eager' (the "
                         f"rewritten graph run as is): {spelled(policy, compiler='eager')}; nothing was changed")


def _already_offloaded(model: Any, state: OffloadState) -> str:
    """Why ``model`` cannot be offloaded: it is offloaded already, itself or as a component of an offloaded
    pipeline (kept on the device, or streamed with it), and the call that changes that."""
    policy = state.policy
    if state.owner is model or isinstance(state.owner, nn.Module):  # itself (or a torch.compile wrapper of it)
        return (f"{state.name} is already offloaded (strategy={policy.strategy!r}); to change its policy, offload "
                f"the original again: offload_compile(remove_offload(m), policy)")
    name = state.path_of(model)
    streamed = _offloaded_components(state)
    if name in streamed:
        return (f"{name} is a component of the offloaded {state.name}, which streams it (strategy="
                f"{policy.strategy!r}): a model is offloaded once, as a whole. To change its policy, offload the "
                f"pipeline again: offload_compile(remove_offload(pipe), policy); nothing was changed")
    strategy = "alternating" if policy.strategy == "model" else policy.strategy  # ``model`` takes no components
    fix = spelled(policy, strategy=strategy, components=with_component(streamed, name))
    return (f"{name} is a component of the offloaded {state.name}, kept on the device (strategy={policy.strategy!r} "
            f"offloads {streamed}): a model is offloaded once, as a whole. To stream {name} too, offload the "
            f"pipeline again with it among its components: offload_compile(remove_offload(pipe), {fix}); "
            f"nothing was changed")


def _offloaded_components(state: OffloadState) -> list[str]:
    """The components of an offloaded pipeline that hold groups, in the order of their groups."""
    return list(dict.fromkeys(g.name.split(".", 1)[0] for g in state.runtime.groups)) if state.runtime else []


def _load(model: Any, policy: OffloadPolicy, path: str | os.PathLike) -> FilledBuckets:
    """Read ``path`` into ``model`` laid out as the runtime will pack it (a pipeline: each component from the
    subfolder of its name, in tensors of their own). Every component is checked before any is read. Returns
    what the runtime's buckets were read into (`storage.FilledBuckets`)."""
    if isinstance(model, nn.Module):
        return load_checkpoint(model, path, load_layout(model, policy), policy.host_budget_bytes, policy.disk_dir)
    components = PipelineModules(model)
    folders = {name: pathlib.Path(path) / name for name, _ in components.named_children()}
    missing = [name for name, module in components.named_children()
               if any(t.is_meta for t in module.state_dict(keep_vars=True).values()) and not folders[name].is_dir()]
    if missing:
        raise CheckpointError(f"{path} has no subfolder for the components {missing}, whose weights are on the meta "
                              f"device; a pipeline folder (pipe.save_pretrained) has one per component")
    present = [(name, module) for name, module in components.named_children() if folders[name].is_dir()]
    for name, module in present:
        check_checkpoint(module, folders[name])
    for name, module in present:
        load_checkpoint(module, folders[name], [])
    return {}


def register_offload_method(model: Any, name: str) -> None:
    """Run ``model.<name>`` (a dotted name reaches a part: ``"vae.decode_latents"``, ``"model.embed"``) through an
    offloaded graph of its own, as ``forward`` and the known entry methods (``encode``, ``decode``,
    ``get_text_features``, ``get_image_features``) are. Without it, a method of your own still streams the parts
    it calls, each on its own, but a weight it reads directly (``x @ self.proj.weight``) is not fetched."""
    state = _state(model)
    path, _, method = name.rpartition(".")
    root = state.modules if state.modules is not None else model
    try:
        module = root.get_submodule(path) if path else root
    except AttributeError as error:
        raise ValueError(f"{state.name} has no part {path!r} (register_offload_method(model, 'part.method'))") from error
    add_method(state, module, method)


def _check_saving(model: nn.Module, policy: OffloadPolicy) -> None:
    """Warn, before the first call, where the groups make layerwise, budget, sequential, alternating or model save
    little (`saving_warning`). ``none`` keeps everything by design; ``auto`` plans at its first call."""
    runtime = state_of(model).runtime
    if runtime is None or policy.strategy not in (*BLOCK_STRATEGIES, *COMPONENT_STRATEGIES, "sequential"):
        return
    stacks = block_paths(model, policy) if policy.strategy in BLOCK_STRATEGIES else ()  # components: no stacks
    message = saving_warning(model, runtime.groups, policy, stacks, runtime.unmanaged_bytes, runtime.unmanaged_ids)
    if message is not None:
        warn_user(message, OffloadSavingWarning)


def device_weight_peak(runtime: OffloadRuntime) -> tuple[int, bool] | None:
    """Device memory the plan holds for weights, those kept there included (`held_device_weight_bytes`: its
    device slots, allocated whole at the first call and held after it, the resident groups its graphs read and
    the weights outside the groups) once graphs are compiled (True); else, for a block strategy before its first
    call, `peak_estimate` (False); None otherwise. Not the ledger's peak: that counts a slot only while a copy
    fills it, and the device holds every slot of the pool between calls too."""
    if runtime.graph_plans:
        return held_device_weight_bytes(runtime), True
    if runtime.policy.strategy not in BLOCK_STRATEGIES:
        return None
    policy = runtime.policy
    return peak_estimate(runtime.groups, policy.prefetch, policy.prefetch_next_call) + runtime.unmanaged_bytes, False


def _saving_line(runtime: OffloadRuntime) -> str | None:
    peak = device_weight_peak(runtime)
    total = runtime.total_bytes + runtime.unmanaged_bytes
    if peak is None or not total:
        return None
    nbytes, verified = peak
    how = (f"held from the first call on: {held_pool_bytes(runtime) / 2**20:.3f} MiB of device slots, planned over "
           f"the verified graphs" if verified else "estimated before the first call: resident groups + up to "
           f"prefetch+1 device slots of each group size{_read_ahead_note(runtime)}")
    if verified and runtime.gives_back_slots:
        how = (f"held only while a call runs: its {held_pool_bytes(runtime) / 2**20:.3f} MiB of device slots are "
               f"given back after each call, so between calls the device holds "
               f"{runtime.unmanaged_bytes / 2**20:.3f} MiB of its weights")
    return (f"  device weight peak {nbytes / 2**20:.3f} MiB of {total / 2**20:.3f} MiB: {nbytes / total:.0%} of the "
            f"model ({how})")


def _read_ahead_note(runtime: OffloadRuntime) -> str:
    """The estimate counts more slots where groups on disk are read ahead (`savings.peak_estimate`)."""
    if runtime.policy.prefetch and any(g.on_disk and g.streamed for g in runtime.groups):
        return ", more for the groups on disk, read up to prefetch+1 reads ahead"
    return ""


def _state(module: Any) -> OffloadState:
    state = state_of(module)
    if state is None:
        raise ValueError(
            f"{type(module).__name__} is not offloaded: pass the result of offload_compile(model, policy), or a "
            f"torch.compile(model, backend='omni_offload') module after its first call (which offloads it)")
    return state


def _runtime(module: Any) -> OffloadRuntime | None:
    state = _state(module)
    state.check_usable()
    return state.runtime


def offload_stats(module: Any) -> OffloadStats:
    """Bytes moved, peak device weight bytes (from the live ledger) and fetches since the last reset. Before
    ``strategy="auto"`` has planned (at its first call), nothing has moved."""
    runtime = _runtime(module)
    return OffloadStats(0, 0, 0, 0, 0, 0, 0) if runtime is None else runtime.stats()


def reset_offload_stats(module: Any) -> None:
    runtime = _runtime(module)
    if runtime is not None:
        runtime.reset_stats()


def release_device_copies(module: Any) -> int:
    """Free the device memory an offloaded model holds between calls: resident groups, parked components and
    copies prefetched for the next call (``prefetch_next_call``). The next call fetches what it needs again.
    Returns the bytes released."""
    runtime = _runtime(module)
    return 0 if runtime is None else runtime.release_device_copies()


def describe_plan(module: Any) -> str:
    state = _state(module)
    if state.awaits_plan:
        waiting = (f"offload plan for {state.name}: strategy='auto', not planned yet (it plans at its first call, "
                   f"or at m.plan(*inputs); a part called before that streams one block at a time)")
        return waiting if state.runtime is None else f"{waiting}; streaming now:\n{state.runtime.describe()}"
    saving = _saving_line(state.runtime)
    return state.runtime.describe() + (f"\n{saving}" if saving else "")


@dataclasses.dataclass(frozen=True)
class OffloadGroup:
    """One group of weights that move together, as `offload_groups` reports it."""
    index: int
    name: str  # the module path it covers (``model.layers.0``; on a pipeline, ``transformer.blocks.0``)
    nbytes: int  # its weight bytes (a subclass weight's inner tensors: quantized bytes, a rank's shard)
    streamed: bool  # fetched for each use; False: kept on the device (resident), or empty (no bytes)
    # its host copy is a file of the disk tier (``host_budget_gb``), read at each of its fetches: what
    # `describe_plan` shows as "streamed from disk"
    on_disk: bool = False

    @property
    def component(self) -> str:
        """The first part of its name: on a pipeline, the component holding it (``text_encoder``)."""
        return self.name.split(".", 1)[0]


def offload_groups(module: Any) -> list[OffloadGroup]:
    """The weight groups of an offloaded model or pipeline, in the runtime's order: name, bytes, streamed or
    resident, and ``on_disk`` where its host copy is in the disk tier (what `describe_plan` prints, as data).
    Before ``strategy="auto"`` has planned (at its first call or ``m.plan(...)``): the groups its parts stream
    meanwhile, one block each, once a part was called; none before that."""
    runtime = _runtime(module)
    if runtime is None:
        return []
    return [OffloadGroup(g.index, g.name, g.nbytes, g.streamed, g.on_disk) for g in runtime.groups]


def plan_summary(module: Any) -> dict[str, Any]:
    """The plan of an offloaded model as data (what ``offload-compiler plan --json`` prints): each group's name,
    bytes, residency and ``on_disk`` (its host copy is in the disk tier, ``host_budget_gb``: read at each fetch);
    each captured graph's fetches per call, the bytes they read from disk per call (``disk_bytes_per_call``;
    routed fetches of groups on disk read at most ``routed_disk_bytes_at_most_per_call`` more) and verified peak;
    ``disk_bytes``, the bytes in the disk tier; the device weight peak as a share of the model. Before
    ``strategy="auto"`` has planned: ``{"model": ..., "planned": False}``."""
    state = _state(module)
    if state.awaits_plan:
        return {"model": state.name, "strategy": state.policy.strategy, "planned": False}
    return runtime_plan_dict(state.runtime)


def runtime_plan_dict(runtime: OffloadRuntime) -> dict[str, Any]:
    """`plan_summary` of ``runtime``."""
    policy = runtime.policy
    groups = [{"index": g.index, "name": g.name, "bytes": g.nbytes, "residency": "streamed" if g.streamed else
               "resident" if g.nbytes else "empty", "on_disk": g.on_disk} for g in runtime.groups]
    # a group on disk is read whole from its file at each of its fetches, once per schedule instance a call
    # (a carried fetch is read by the call before); a routed fetch reads the rows it names, at most its bound
    disk = {g.index: g.nbytes for g in runtime.groups if g.on_disk}
    graphs = [{"nodes": plan.num_nodes, "fetches_per_call": plan.verified.fetches,
               "disk_bytes_per_call": sum(disk.get(inst.group, 0) for inst in plan.schedule.instances),
               "routed_disk_bytes_at_most_per_call": sum(r.bound * r.expert_bytes for r in plan.routed
                                                         if r.group in disk),
               "predicted_peak_bytes": plan.verified.peak_bytes, "resident_bytes": plan.verified.resident_bytes,
               "streamed_peak_bytes": plan.verified.streamed_peak_bytes, "carried_bytes": plan.verified.carried_bytes,
               "routed_fetches_per_call": plan.verified.routed_fetches,
               "routed": [{"weight": runtime.groups[r.group].slots[r.slot].name, "group": r.group, "rows": r.experts,
                           "at_most": r.bound, "row_bytes": r.expert_bytes} for r in plan.routed]}
              for plan in runtime.graph_plans]
    peak = device_weight_peak(runtime)
    total = runtime.total_bytes + runtime.unmanaged_bytes
    saving = None if peak is None else {"device_weight_peak_bytes": peak[0],
                                        "share_of_model": peak[0] / total if total else None, "verified": peak[1],
                                        "pool_bytes": held_pool_bytes(runtime) if peak[1] else None,
                                        # held during a call only: the device holds the rest between calls
                                        "between_calls_bytes": runtime.unmanaged_bytes
                                        if runtime.gives_back_slots else peak[0]}
    return {"model": runtime.model_name, "strategy": policy.strategy, "device": str(runtime.device),
            "prefetch": policy.prefetch, "prefetch_next_call": policy.prefetch_next_call,
            "compiler": policy.compiler, "pinned": runtime.pinned, "planned": True, "groups": groups,
            "graphs": graphs, "total_bytes": runtime.total_bytes, "unmanaged_bytes": runtime.unmanaged_bytes,
            "disk_bytes": runtime.host.disk_bytes,
            "saving": saving}


def offload_plan(module: Any) -> OffloadPlan:
    """The plan of a ``strategy="auto"`` model (made at its first call or by ``m.plan(...)``)."""
    state = state_of(module)
    if state is None or state.plan is None:
        raise ValueError(f"{type(module).__name__} has no auto offload plan: pass the result of "
                         f"offload_compile(model, OffloadPolicy(strategy='auto', device_budget_gb=...)) after its "
                         f"first call, or call m.plan(*inputs) first")
    return state.plan


def plan_offload(model: nn.Module, policy: OffloadPolicy, *args: Any, **kwargs: Any) -> OffloadPlan:
    """Plan ``strategy="auto"`` for ``model`` called with ``args``/``kwargs``: nothing runs and no weight
    moves. Raises `InfeasibleBudgetError` (a ValueError) naming the smallest budget that works. An offloaded
    model is planned as its own forward, as it would be at its first call."""
    state = state_of(model)
    if state is None:
        install_output_capture(model)  # as offloading would: its lazy installation breaks the graph
        return auto.plan_offload(model, policy, *args, **kwargs)
    with state.lock, state.tracing_through():
        return auto.plan_offload(compiled_module_of(model), policy, *args, **kwargs)


def remove_offload(module: Any) -> Any:
    """Undo offloading, in place: every weight gets its own host storage back (with its original strides),
    device copies are dropped, the model's class, forwards and hooks are restored; returns the model (or
    pipeline), equal to what was offloaded. (Calling a ``torch.compile(model, backend="omni_offload")`` wrapper
    of it again offloads it again, as its first call did.)"""
    return _state(module).detach()


def inject_fault(module: Any, stage: str, group: int | str | None = None, exception: BaseException | None = None,
                 times: int = 1) -> None:
    """Debug surface: make the next ``times`` fetches or evicts (``stage``) of ``group`` (an index, a group
    name, or None for any) raise ``exception`` — to check that a failing copy or an interrupt in the middle of
    a forward leaves the model whole."""
    runtime = _runtime(module)
    if runtime is None:
        raise ValueError("inject_fault needs a planned model: call it (or m.plan(...)) first")
    if isinstance(group, str):
        names = [g.name for g in runtime.groups]
        if group not in names:
            raise ValueError(f"unknown group {group!r}; the groups are {names}")
        group = names.index(group)
    runtime.inject_fault(stage, group, exception, times)
