"""Host masters: a streamed weight whose bytes live in host memory and whose device is the compute device.

On an accelerator, every offloaded plain weight (parameter or buffer) is replaced in the model by a
`HostMaster` (tied weights by one master), whose ``device`` is the compute device and whose bytes are a view
into its group's packed host buffer (``.host``). That makes a host read impossible by construction:

- every trace sees a device weight (dynamo's fake tensors and shape propagation meet no host tensor beside a
  device activation), and the offloaded graph reads the weight from its device slot, never from the master;
- code that runs outside an offloaded graph and computes with the weight (a frame dynamo ran without a graph,
  a part called by hand, ``x @ self.proj.weight`` in a method) computes on a device copy fetched on demand
  for that op, as a hook-based offloader would, and the bytes are counted (`OnDemand`);
- copies out (``.cpu()``, ``.to(...)``), views, ``state_dict`` (the host view, see `state_dict_hook`) and
  in-place updates (``load_state_dict``, ``p.data = t``, peft's merges, ``p.add_(delta)``) work on the host
  bytes; the runtime sees the change through the master's version counter and data pointer and refreshes the
  packed buffer before the next copy.

Where the device is the host (``cpu``) the weights are masters too: a read outside a graph computes on the host
bytes in place (no copy) and is counted alike, so what a route reads outside its graphs is measured on every
device, and ``.cpu()``, ``.to("cpu")``, ``numpy()`` and ``tolist()`` give the host bytes, as a copy does elsewhere.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import weakref
from typing import Any, Callable

import torch
from torch import nn

from ._torch_private import inlined_only, op_schema, tree_map
from .errors import OffloadRefusal
from .storage import own_storage, span, viewed

aten = torch.ops.aten
_DATA = torch.Tensor.data  # the ``.data`` descriptor: its setter reaches __torch_function__ as ``__set__``


class OnDemand:
    """What a runtime's masters share: the bytes and ops of weights fetched on demand (outside an offloaded
    graph; ``weights``: each weight's bytes by address and size, so a weight read by many ops counts once), and
    ``before_write``, which a write into the host bytes calls first (the runtime waits there for queued copies
    that may still read them)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.ops = 0
        self.weights: set[tuple[int, int]] = set()
        self.before_write: Callable[[], Callable[[], None] | None] | None = None  # a weak method
        # the runtime's `OffloadRuntime.hand_out` (a weak method): told of each plain alias of a weight's host bytes
        # handed out (``state_dict``, ``.cpu()`` where the device is the host, ``numpy``)
        self.hand_out: Callable[[], Callable[..., None] | None] | None = None
        self._lock = threading.Lock()

    def wait_before_write(self) -> None:
        wait = self.before_write() if self.before_write is not None else None
        if wait is not None:
            wait()

    def handed_out(self, master: "HostMaster", alias: torch.Tensor, tracked: bool) -> None:
        hand_out = self.hand_out() if self.hand_out is not None else None
        if hand_out is not None:
            hand_out(master, alias, tracked)

    def add(self, host: torch.Tensor) -> None:
        with self._lock:
            self.bytes += host.numel() * host.element_size()
            self.ops += 1
            self.weights.add((host.data_ptr(), host.numel()))

    def reset(self) -> None:
        with self._lock:
            self.bytes = self.ops = 0
            self.weights.clear()


def _counted(master: "HostMaster") -> torch.Tensor:
    """The master's device copy for one op outside an offloaded graph (where the device is the host, ``cpu``, the
    host bytes themselves: no copy, but a read outside the graph all the same, so counted alike)."""
    host = master.host
    value = host.to(master.device)
    if not torch.compiler.is_compiling():  # a trace's fake propagation moves no bytes
        account = master.account() if master.account is not None else None
        if account is not None:
            account.add(host)
    return value


class HostMaster(torch.Tensor):
    """A weight whose bytes live in host memory (``host``) and whose ``device`` is the compute device."""

    host: torch.Tensor
    account: Callable[[], OnDemand | None] | None
    # the weight this master is a view of (``w[0]``, ``w.detach()``, ``w.data``), None for the weight itself:
    # a write through a view is a write to the weight, which the runtime sees in the weight's version only
    root: "HostMaster | None"
    # the parameter or buffer object this master took the place of, retired (`_retire`), and its attributes
    original: "tuple[torch.Tensor, dict] | None" = None

    @staticmethod
    def __new__(cls, host: torch.Tensor, device: torch.device, account=None, requires_grad: bool = False,
                root: "HostMaster | None" = None):
        return torch.Tensor._make_wrapper_subclass(cls, host.shape, strides=host.stride(), dtype=host.dtype,
                                                   device=device, requires_grad=requires_grad)

    def __init__(self, host: torch.Tensor, device: torch.device, account=None, requires_grad: bool = False,
                 root: "HostMaster | None" = None):
        self.host = _fakifiable(host)
        self.account = account
        self.root = root

    def __repr__(self) -> str:  # no data: printing a weight must not fetch it
        return (f"HostMaster(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
                f"bytes in {self.host.device} memory)")

    # The context is what a compiled graph depends on, and torch's compile caches pickle it with the graph: the
    # device, not the runtime's account (a weak reference, which no pickle takes, and one runtime's). A master
    # torch rebuilds from its parts (a fake one while tracing, a view a compiled graph returns) counts no reads.
    def __tensor_flatten__(self):
        return _INNER_NAMES, (self.device,)

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx: tuple, outer_size, outer_stride) -> "HostMaster":
        return HostMaster(inner["host"], ctx[0])

    def _stable_hash_for_caching(self) -> str:
        """What a graph compiled with this master as an input depends on: its layout and its host bytes' layout,
        never their values. Torch's AOT-autograd cache keys a tensor subclass input by this string (without it,
        by a hash of the flatten context, with a warning that names this method)."""
        host = self.host
        return repr((tuple(self.shape), self.stride(), self.dtype, str(self.device), self.requires_grad,
                     tuple(host.shape), host.stride(), host.dtype, str(host.device)))

    def __deepcopy__(self, memo: dict) -> "HostMaster":
        return HostMaster(copy.deepcopy(self.host, memo), self.device, None, self.requires_grad)

    def __reduce_ex__(self, protocol):  # torch.save / pickle of a master: the host bytes, a plain tensor
        return self.host.__reduce_ex__(protocol)

    @classmethod
    @inlined_only  # from a frame dynamo runs without a graph: plain Python (the op then reads on demand, counted),
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # not a graph compiled per op and weight
        kwargs = kwargs or {}
        if func == _DATA.__set__ and isinstance(args[0], HostMaster):
            master, new = args
            _refuse_new_layout(master, new)  # before anything changes: the weight keeps its bytes and keeps running
            # another weight's master (``a.weight.data = b.weight.data.T``) gives its host bytes: torch's own
            # rebinding of the wrapper left ``host`` as it was, and the weight silently kept its old values
            master.host = _rebound_host(master, host_of(new))  # repacked before the next copy
            torch.autograd.graph.increment_version(master.host)
            return None
        if func in _HOST_SIDE and isinstance(args[0], HostMaster) and args[0].device == args[0].host.device:
            return _on_host(func, args, kwargs)
        return torch.Tensor.__torch_function__(func, (), args, kwargs)  # the default, returning what func does

    @classmethod
    @torch.compiler.disable  # dynamo never traces a dispatch (it runs under fake tensors, as Python); called from
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # eager code, nothing below it is compiled
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, HostMaster):
            if func.is_view:  # a view of the weight is a view of its host bytes, still on the compute device
                # taken of the tensor the bytes were cut from (the same elements): storage sharing stays visible;
                # split, chunk and unbind give a list of views, each a master
                views = func(viewed(first.host), *args[1:], **kwargs)
                root = first.root if first.root is not None else first
                if isinstance(views, (list, tuple)):
                    return type(views)(HostMaster(v, first.device, first.account, root=root) for v in views)
                return HostMaster(views, first.device, first.account, root=root)
            if func is aten._to_copy.default:  # .to(), .cpu(), .float(): a copy of the host bytes
                return func(first.host, **{"device": first.device, **kwargs})
        written = _written_masters(func, args, kwargs)
        if written:  # p.copy_(t), p.add_(delta), load_state_dict, a foreach lerp_ over the weights (an EMA),
            return _write_host(func, args, kwargs, written)  # out=masters: the host bytes change, seen as a change
        args, kwargs = tree_map(lambda a: _counted(a) if isinstance(a, HostMaster) else a, (args, kwargs))
        return func(*args, **kwargs)


# op -> the positions (index, or name for a keyword-only argument) of the arguments its schema says it writes:
# ``self`` of an in-place op, ``out=``, each tensor of a foreach op's written list. Read once per op.
_WRITES: dict[Any, tuple] = {}


def _written_positions(func) -> tuple:
    found = _WRITES.get(func)
    if found is None:
        schema = op_schema(func)
        found = () if schema is None or not schema.is_mutable else tuple(
            (i, arg.name, arg.kwarg_only) for i, arg in enumerate(schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write)
        _WRITES[func] = found
    return found


def _written_masters(func, args: tuple, kwargs: dict) -> list[HostMaster]:
    """The masters an op writes: those held by an argument its schema marks written (a tensor, or a list of
    tensors), whatever argument comes first."""
    masters: list[HostMaster] = []
    for index, name, kwarg_only in _written_positions(func):
        value = kwargs.get(name) if kwarg_only or index >= len(args) else args[index]
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, HostMaster):
                masters.append(item)
    return masters


def _write_host(func, args: tuple, kwargs: dict, written: list[HostMaster]):
    """Run a write to masters on their host bytes: after the copies still queued that may read them, every
    master operand as its host bytes (other tensors moved to the host), each written master's version (and its
    root's: a write through a view is a write to the weight) bumped, which is what the runtime's stamps read.
    What the op returns of a written master's bytes is the master."""
    for account in {id(m.account): m.account for m in written if m.account is not None}.values():
        runtime_account = account()
        if runtime_account is not None:  # a copy still queued may read these bytes
            runtime_account.wait_before_write()
    host_device = written[0].host.device
    hosts = {id(m.host): m for m in written}
    rest = tree_map(lambda a: _host_operand(a, host_device), (args, kwargs))
    out = func(*rest[0], **rest[1])
    for master in written:
        torch.autograd.graph.increment_version(master.host)
        if master.root is not None:
            torch.autograd.graph.increment_version(master.root.host)
    return tree_map(lambda a: hosts.get(id(a), a) if isinstance(a, torch.Tensor) else a, out)


_INNER_NAMES = ["host"]  # one list for every master: dynamo's guard on it is recognized by identity (`keep_guards`)


def keep_guards(entries: list) -> list[bool]:
    """A ``guard_filter_fn`` (``torch.compile(..., options={"guard_filter_fn": ...})``): of the guards dynamo
    installs on a host master and on what it reads through the master, only the master's ``TENSOR_MATCH`` (a C++
    check of its class, shape, strides, dtype and device) is kept. Dropped: its type and subclass-metadata guards
    (the flatten context, compared in Python per weight: the device, which ``TENSOR_MATCH`` checks), the guard on
    its inner ``host`` tensor (rebound by ``p.data = t``; the offloaded graph reads the weight's device slot, never
    ``host``) and the guard on the list of inner names (a Python call per weight; one list for all masters).
    The offloaded call checks the weights' identity at every graph call anyway (`GraphRunner`), so a few C++
    checks per weight replace a dozen and Python lambdas (benchmarks/host_master_guards.py).

    Only the entries' public fields are read: ``value``, ``has_value``, ``guard_type``, ``derived_guard_types``.
    What was reached through a master is recognized by identity -- its inner tensor, the shared names list --
    never by how dynamo spells its source."""
    masters = [e.value for e in entries if e.has_value and type(e.value) is HostMaster]
    if not masters:
        return [True] * len(entries)
    inner = {id(m.host) for m in masters}

    def kept(entry: Any) -> bool:
        if not entry.has_value:
            return True
        value = entry.value
        if type(value) is HostMaster:
            return "TENSOR_MATCH" in (entry.guard_type, *entry.derived_guard_types)
        return value is not _INNER_NAMES and not (isinstance(value, torch.Tensor) and id(value) in inner)
    return [kept(e) for e in entries]


# Guard filters take no effect on a torch before 2.13: its dynamo reads each guarded source once more to make the
# filter's entries, and a property that returns a new object per read (transformers' ``config.per_layer_config``)
# then fails an assertion, with any filter at all. There every guard stays (more checks per call, the same graphs).
GUARD_FILTER = keep_guards if torch.__version__ >= "2.13" else None


# Where the compute device is the host (``cpu``), ``.cpu()`` and ``.to("cpu")`` return the tensor itself, and
# ``numpy``/``tolist`` refuse subclasses: for a master they are the host bytes, as on an accelerator (a copy there).
_HOST_SIDE = frozenset({torch.Tensor.cpu, torch.Tensor.to, torch.Tensor.numpy, torch.Tensor.tolist})


def _on_host(func, args: tuple, kwargs: dict):
    master = args[0]
    if func in (torch.Tensor.cpu, torch.Tensor.to):
        out = torch.Tensor.__torch_function__(func, (), args, kwargs)
        if out is not master:
            return out
        return _handed_out(master, master.host, tracked=True)
    if func is torch.Tensor.numpy:  # an array over the host bytes (it keeps no tensor alive: the array is what
        # is watched), whose writes bump no version counter
        return _handed_out(master, master.host.numpy(*args[1:], **kwargs), tracked=False)
    return func(master.host, *args[1:], **kwargs)  # tolist: a copy


def _handed_out(master: HostMaster, alias: Any, tracked: bool) -> Any:
    """``alias`` (a plain tensor or a numpy array over ``master``'s host bytes) given to the user, who may write it: the runtime
    is told (`OnDemand.handed_out`), and waits for its queued copies now and while the alias lives, and reads
    its version (``tracked``; else treats the weight as changed at each call) in the stamps that decide whether
    a device copy is stale. The weight's own host view needs none of that: a write through it bumps the version
    the stamps read already. Not while a trace runs (fake tensors: nothing to write)."""
    root = master.root if master.root is not None else master
    if alias is root.host or torch.compiler.is_compiling():
        return alias
    account = root.account() if root.account is not None else None
    if account is not None:
        account.handed_out(root, alias, tracked)
    return alias


def _fakifiable(host: torch.Tensor) -> torch.Tensor:
    """Dynamo fakifies a subclass only where its inner tensor starts at its storage's first byte. A view made
    while a trace propagates fake tensors (a master's ``w[3]`` or ``w.split(...)`` in the traced code) has no
    bytes to alias, and needs none: it is never fakified again. A weight at the start of its packed group buffer
    gets a storage of its own too, as every other weight of the group does: ``torch.save`` writes each storage
    whole, so a state_dict tensor over the whole buffer would write the group twice."""
    if not host.storage_offset() and span(host) * host.element_size() >= host.untyped_storage().nbytes():
        return host
    try:
        return own_storage(host)
    except NotImplementedError:  # a fake or meta tensor's storage cannot be sliced
        return host


def _refuse_new_layout(master: HostMaster, new: torch.Tensor) -> None:
    """``p.data = t`` may give a streamed weight new bytes, never a new shape or dtype: its place in the packed
    host buffer, its device slot and the graphs compiled for it have the old ones (accepted, every later call
    failed inside the runtime). Refused before anything changes; what transformers' ``resize_token_embeddings``
    does, so it stops here too, before it replaces any module."""
    if new.shape == master.shape and new.dtype == master.dtype:
        return
    raise OffloadRefusal(
        f"p.data = t would change an offloaded weight of shape {tuple(master.shape)} and dtype {master.dtype} to "
        f"shape {tuple(new.shape)} and dtype {new.dtype} (as resize_token_embeddings does): an offloaded weight "
        f"keeps its shape and dtype (its host buffer and compiled graphs are laid out for them). Nothing was "
        f"changed. Resize or convert the plain model, then offload it again: m = remove_offload(m); <change m>; "
        f"m = offload_compile(m, policy). New values of the same shape and dtype need no re-offload: "
        f"p.data = t, p.copy_(t) or load_state_dict")


def _rebound_host(master: HostMaster, new: torch.Tensor) -> torch.Tensor:
    """The host bytes ``p.data = new`` gives ``master``, in the master's own layout: a trace rebuilds the master
    from them and requires the strides it reports (``p.data = q.T`` of a square weight failed in dynamo)."""
    host = new.detach().to(master.host.device)
    if host.stride() != master.stride():
        host = torch.empty_strided(master.shape, master.stride(), dtype=host.dtype, device=host.device).copy_(host)
    return _fakifiable(host)


def _host_operand(value: Any, host_device: torch.device) -> Any:
    if isinstance(value, HostMaster):
        return value.host
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != host_device:
        return value.to(host_device)
    return value


def host_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor holding a weight's bytes: a master's host view, else the tensor itself."""
    return tensor.host if isinstance(tensor, HostMaster) else tensor


def with_host_masters(model: nn.Module, specs: list, device: torch.device, account) -> list:
    """Replace each plain weight of ``specs`` in ``model`` by a host master over its bytes (one master per
    tensor: tied weights stay tied), and return the specs naming the masters. The masters are new objects (a
    wrapper subclass cannot take over a tensor object), so each original becomes a `RetiredWeight` (`_retire`):
    code that kept a reference from before offloading (an optimizer, an EMA copy, ``w = m.lm_head.weight``)
    fails naming the fix at its first use, instead of silently computing with, or writing, bytes the model no
    longer reads; `release_masters` gives the originals back."""
    masters: dict[int, torch.Tensor] = {}
    originals: list[tuple[torch.Tensor, HostMaster, str]] = []
    for spec in specs:
        for w in spec.weights:
            tensor = w.tensor
            if type(tensor) in (torch.Tensor, nn.Parameter) and id(tensor) not in masters:
                master = HostMaster(tensor.detach(), device, account)
                if isinstance(tensor, nn.Parameter):
                    master = nn.Parameter(master, requires_grad=tensor.requires_grad)
                    master.root = None  # a parameter is made as a view of its data: it is the weight itself
                masters[id(tensor)] = master
                originals.append((tensor, master, f"get_{'buffer' if w.is_buffer else 'parameter'}({w.name!r})"))
    replace_tensors(model, masters)
    specs = [dataclasses.replace(spec, weights=tuple(dataclasses.replace(w, tensor=masters.get(id(w.tensor), w.tensor))
                                                     for w in spec.weights)) for spec in specs]
    for tensor, master, name in originals:
        _retire(tensor, master, name)
    return specs


class RetiredWeight(torch.Tensor):
    """What a parameter or buffer object becomes while its weight is offloaded (`_retire`): it holds no bytes,
    and any use of it is refused, naming the weight and the fix."""

    weight_name: str  # how the model gives the weight: ``get_parameter('blocks.0.weight')`` (``name`` is a tensor's
    #   dimension-names field)

    @staticmethod
    def __new__(cls, like: torch.Tensor, name: str):
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, strides=like.stride(), dtype=like.dtype,
                                                   device=like.device)

    def __init__(self, like: torch.Tensor, name: str):
        self.weight_name = name

    def __repr__(self) -> str:
        return f"RetiredWeight({self.weight_name}: offloaded, see offload_compiler.host_masters.RetiredWeight)"

    def __hash__(self) -> int:  # a set or dict holding the reference (an optimizer's state) still works
        return id(self)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        names = [a.weight_name for a in (*args, *(kwargs or {}).values()) if isinstance(a, RetiredWeight)]
        name = names[0] if names else "get_parameter(<name>)"
        raise OffloadRefusal(
            f"this tensor was the weight model.{name} before the model was offloaded; offloading gave the model a "
            f"new tensor for it (its bytes now live in a packed host buffer), and this one holds no data: using it "
            f"would compute with, or write, values the model no longer reads. Take references after offloading: "
            f"model.{name} (or its attribute, as m.lm_head.weight), an optimizer or EMA made again from "
            f"model.parameters() or model.state_dict(); remove_offload(model) makes this very object the model's "
            f"weight again, with the current values")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return cls.__torch_function__(func, types, args, kwargs)


def _retire(original: torch.Tensor, master: HostMaster, name: str) -> None:
    """Make ``original`` (a parameter or buffer object the model no longer holds) a `RetiredWeight`, in place:
    the same Python object, so a reference taken before offloading fails loudly; ``master.original`` keeps it
    (with its attributes) for `release_masters`. ``torch.utils.swap_tensors`` refuses an object that something
    holds a weak reference to (dynamo, for a model compiled before offloading) or whose tensor is used
    elsewhere: that reference then keeps its bytes as they were (README, "The module stays the module")."""
    attrs = dict(original.__dict__)
    try:
        torch.utils.swap_tensors(original, RetiredWeight(original, name))
    except RuntimeError:
        return
    # (the other object, now holding the old bytes and attributes, is dropped here)
    master.original = (original, attrs)


def release_masters(model: nn.Module, owns: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The undo of `with_host_masters`: each master (by id, with its own copy of the host bytes) becomes a plain
    parameter or buffer over that copy again -- the very object the model held before offloading where it was
    retired (its identity, class and attributes back, holding the current values)."""
    plain = {}
    for i, (master, own) in owns.items():
        value = nn.Parameter(own, requires_grad=master.requires_grad) if isinstance(master, nn.Parameter) else own
        kept = master.__dict__.pop("original", None)
        if kept is not None:
            original, attrs = kept
            try:
                torch.utils.swap_tensors(original, value if value is not own else own.detach())
            except RuntimeError:  # something took a weak reference to the retired object: the model gets a new
                pass  # one, as where `_retire` could not swap (the retired object keeps refusing every use)
            else:
                original.__dict__.clear()
                original.__dict__.update(attrs)
                value = original
        plain[i] = value
    replace_tensors(model, plain)


def replace_tensors(model: nn.Module, new: dict[int, torch.Tensor]) -> None:
    """Every parameter or buffer of ``model`` whose id is in ``new`` becomes that tensor (ties stay ties)."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None and id(tensor) in new:
                    table[name] = new[id(tensor)]


def point_at(tensor: torch.Tensor, host: torch.Tensor) -> None:
    """Point a weight at new host bytes (a view into its packed buffer): a master's ``host``, else ``.data``."""
    if isinstance(tensor, HostMaster):
        tensor.host = _fakifiable(host)
    else:
        tensor.data = host


def state_dict_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """``state_dict`` of a module holding masters: each master as its host view (a plain tensor, as before
    offloading; safetensors and torch.save take it). Plain PyTorch's state_dict tensors alias the weights, so
    ``m.state_dict()[k].mul_(2)`` edits the model: a write through one is seen as a write to the weight
    (`_handed_out`), never racing a copy that reads the bytes."""
    for key, value in state_dict.items():
        if key.startswith(prefix) and isinstance(value, HostMaster):
            state_dict[key] = _handed_out(value, value.host, tracked=True)


def watch_state_dict(module: nn.Module, handles: dict[int, Any]) -> None:
    """Register `state_dict_hook` once on ``module`` (kept in ``handles`` by module id, for removal)."""
    if id(module) not in handles:
        handles[id(module)] = (weakref.ref(module), module.register_state_dict_post_hook(state_dict_hook))
