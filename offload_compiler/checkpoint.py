"""Loading straight from a safetensors checkpoint into the offloaded layout.

``offload_compile(model, policy, checkpoint=PATH)`` takes a model whose weights are on the meta device (built
under `empty_weights`, accelerate's ``init_empty_weights`` or ``torch.device("meta")``) and reads each weight
from the checkpoint directly into its place in its group's flat host buffer, as the host store lays it out
(`runtime.layout.layout_group`), so packing finds the buffers ready and copies nothing: host memory grows by
the model's bytes and no more, and the model is never materialised anywhere else first.

A transformers model's checkpoint is read under the names ``from_pretrained`` gives its tensors: renamed ones,
experts written one by one read into their fused weight, tensors held transposed transposed (`converted`).

Safetensors only: its header is JSON and its data raw bytes, so a file a user names cannot run code when
loaded (a pickled ``.bin``/``.pt`` can). Everything is checked before any byte is read — every weight present
with its shape, every byte range inside its file — so a truncated or mismatched checkpoint is refused naming
the tensor, and the model is left as it was (still on meta). Reads use plain ``readinto`` into the buffer, and
the pages read are dropped from the page cache where the OS allows (``posix_fadvise``), so loading a model
does not leave a second copy of it in the page cache.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import os
import pathlib
import sys
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from ._transformers_private import Merged, checkpoint_names
from .grouping import GroupSpec, plan_groups
from .host_masters import replace_tensors
from .runtime.disk import CheckpointExtents, CheckpointFile, DiskFile, DiskSpace, disk_groups
from .runtime.layout import contiguous_stride, layout_group
from .storage import Filled, FilledBuckets

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
          "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64}
FIX = "the checkpoint must be the model's own weights (model.save_pretrained, or safetensors.torch.save_file)"


class CheckpointError(ValueError):
    """The checkpoint cannot be loaded into this model (missing, truncated, mismatched or not safetensors).
    Raised before any weight is read: the model is unchanged."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: where its bytes are (absolute offsets in ``file``)."""
    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class Assembled:
    """A model weight that the checkpoint holds in pieces (a fused expert weight written expert by expert, as
    transformers' ``save_pretrained`` writes it): each piece's entry and the element of the weight (contiguous,
    ``shape``) where it starts."""
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: tuple[tuple[Entry, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry, _ in self.pieces)


@dataclasses.dataclass(frozen=True)
class Transposed:
    """A model weight that the checkpoint holds transposed (``dims``), as from_pretrained converts it."""
    name: str
    entry: Entry
    dims: tuple[int, int]
    shape: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.entry.dtype

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes


Source = Entry | Assembled | Transposed  # where one weight's bytes are in the checkpoint


# -- the checkpoint's index: headers only ----------------------------------------------------------------------

def read_header(path: str) -> dict[str, Entry]:
    """The tensors of one safetensors file, each checked to lie within the file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 0 or 8 + length > size:
            raise CheckpointError(f"{path} is not a complete safetensors file (its header is cut short: "
                                  f"{size} bytes); {FIX}")
        try:
            meta = json.loads(f.read(length))
        except ValueError as error:
            raise CheckpointError(f"{path} is not a safetensors file: its header is not JSON ({error})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} is not a safetensors file: its header is a JSON {type(meta).__name__}, not an "
                              f"object of tensors; {FIX}")
    entries = {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        if not _well_formed(info):
            raise CheckpointError(f"{name} in {path} is not a safetensors tensor entry (it needs a dtype, a shape and "
                                  f"two data_offsets; it is {str(info)[:120]}): the file is corrupt; {FIX}")
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{name} in {path} has dtype {info.get('dtype')!r}, which torch cannot hold")
        shape = tuple(info["shape"])
        start, end = (8 + length + offset for offset in info["data_offsets"])
        if end - start != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"{name} in {path}: {end - start} bytes for shape {list(shape)} of {dtype}; the "
                                  f"file is corrupt")
        if end > size:
            raise CheckpointError(f"{name} in {path} ends at byte {end} but the file has {size}: the file is "
                                  f"truncated (an interrupted download or copy); {FIX}")
        entries[name] = Entry(name, path, dtype, shape, start, end)
    return entries


def _well_formed(info: Any) -> bool:
    """A header entry as safetensors writes it: a dtype name, a list of sizes and a [start, end] byte range."""
    def whole(values: Any) -> bool:
        return isinstance(values, list) and all(isinstance(v, int) and v >= 0 for v in values)
    return (isinstance(info, dict) and isinstance(info.get("dtype"), str) and whole(info.get("shape"))
            and whole(info.get("data_offsets")) and len(info["data_offsets"]) == 2
            and info["data_offsets"][0] <= info["data_offsets"][1])


def _weight_map(index: pathlib.Path) -> dict[str, str]:
    """A sharded checkpoint's index: each tensor's name -> the shard file holding it."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (ValueError, AttributeError) as error:
        raise CheckpointError(f"{index} is not a checkpoint index (a JSON object with a weight_map): {error}; "
                              f"{FIX}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index} has no weight_map of tensor names to shard files; {FIX}")
    return weight_map


def checkpoint_index(path: str | os.PathLike) -> dict[str, Entry]:
    """Every tensor of a checkpoint: one ``.safetensors`` file, or a directory holding a sharded checkpoint
    (its ``*.safetensors.index.json``) or ``.safetensors`` files."""
    root = pathlib.Path(path)
    if root.is_file():
        if root.suffix != ".safetensors":
            raise CheckpointError(f"{root} is not a .safetensors file. offload_compile loads safetensors only: a "
                                  f"pickled checkpoint (.bin, .pt, .ckpt) can run code when loaded. Convert it once "
                                  f"(safetensors.torch.save_file(torch.load(path, weights_only=True), "
                                  f"'model.safetensors'))")
        return read_header(str(root))
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {root} does not exist")
    indexes = sorted(root.glob("*.safetensors.index.json"))
    weight_map = _weight_map(indexes[0]) if indexes else None
    files = (list(dict.fromkeys(weight_map.values())) if weight_map is not None
             else sorted(p.name for p in root.glob("*.safetensors")))
    if not files:
        found = sorted(p.name for p in root.iterdir())[:8]
        raise CheckpointError(f"{root} holds no .safetensors file (found {found}); offload_compile loads "
                              f"safetensors only")
    headers: dict[str, dict[str, Entry]] = {}
    for name in files:
        shard = root / name
        if not shard.is_file():
            raise CheckpointError(f"{indexes[0].name} names {name}, which is missing from {root}")
        headers[name] = read_header(str(shard))
    if weight_map is None:
        return {tensor: entry for header in headers.values() for tensor, entry in header.items()}
    # each tensor from the shard the index names for it (another shard may hold a tensor of the same name)
    unmet = [tensor for tensor, shard in weight_map.items() if tensor not in headers[shard]]
    if unmet:
        raise CheckpointError(f"{indexes[0].name} places {len(unmet)} tensors in shards that do not hold them, such as "
                              f"{[(t, weight_map[t]) for t in unmet[:3]]}: the index and its shards disagree; {FIX}")
    return {tensor: headers[shard][tensor] for tensor, shard in weight_map.items()}


# -- matching the model to the checkpoint ---------------------------------------------------------------------

def _sources(model: nn.Module, entries: dict[str, Entry]) -> dict[int, Source]:
    """Each of the model's weights that the checkpoint holds, by tensor id (a tied weight under any of its
    names); refuses a weight on meta that it lacks, or holds with another shape. A transformers model's
    checkpoint is read under the names ``from_pretrained`` gives its tensors (`converted`)."""
    named: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor):
            named.setdefault(id(tensor), []).append(name)
            tensors[id(tensor)] = tensor
    entries, consumed = converted(model, entries, {name: tensors[i] for i, names in named.items() for name in names})
    sources, missing = {}, []
    for ident, names in named.items():
        entry = next((entries[n] for n in names if n in entries), None)
        tensor = tensors[ident]
        if entry is None:
            if tensor.is_meta:
                missing.append(names[0])
            continue
        if entry.shape != tuple(tensor.shape):
            raise CheckpointError(f"{entry.name} has shape {list(entry.shape)} in {entry.file} but "
                                  f"{list(tensor.shape)} in {type(model).__name__}: the checkpoint is of another "
                                  f"model or configuration; {FIX}")
        if type(tensor) not in (torch.Tensor, nn.Parameter):
            raise CheckpointError(f"{names[0]} is a {type(tensor).__name__}: loading from a checkpoint takes plain "
                                  f"weights; quantize after loading")
        sources[ident] = entry
    if missing:
        per_expert = _held_per_expert(missing, entries)
        if per_expert:
            raise CheckpointError(
                f"the checkpoint holds {per_expert[0]} expert by expert (such as {per_expert[1]}), as transformers' "
                f"save_pretrained writes a mixture-of-experts model, but {type(model).__name__} holds its experts fused "
                f"({missing[:2]}), and transformers' conversion table has no merge of them for this model (custom "
                f"code, or a transformers without one), so offload_compile cannot tell how they fuse. "
                f"{_WRITE_ONCE}; nothing was changed")
        sample = sorted(entries)[:3]
        raise CheckpointError(f"the checkpoint lacks {len(missing)} weights of {type(model).__name__} that are on the "
                              f"meta device, such as {missing[:4]} (it holds names such as {sample}); {FIX}")
    unmet = [n for n, t in model.named_buffers(remove_duplicate=False) if t.is_meta and id(t) not in sources]
    if unmet:
        raise CheckpointError(f"{unmet[:4]} are buffers on the meta device that no checkpoint holds (they are computed "
                              f"when the model is built, like rotary frequencies): build the model under "
                              f"offload_compiler.empty_weights(), which puts only parameters on meta")
    _warn_kind_casts(model, sources, tensors)
    unused = sorted(set(entries) - {n for names in named.values() for n in names} - consumed)
    if unused:
        warnings.warn(f"offload_compiler: the checkpoint holds {len(unused)} tensors that {type(model).__name__} "
                      f"does not have, such as {unused[:4]}; they are not loaded", RuntimeWarning, stacklevel=4)
    return sources


def converted(model: nn.Module, entries: dict[str, Entry], weights: dict[str, torch.Tensor]
              ) -> tuple[dict[str, Source], set[str]]:
    """``entries`` with what ``from_pretrained`` would read under other names added under the model's names: a
    renamed tensor (Mixtral's ``block_sparse_moe.gate`` is ``mlp.gate``) and a fused expert weight from its
    experts' pieces (``experts.0.gate_proj.weight``, ``experts.0.up_proj.weight``, ... into
    ``experts.gate_up_proj [E, 2I, H]``); and the checkpoint names so taken. Names the model holds are read as
    they are, unless from_pretrained converts their values (refused); an expert weight whose pieces do not make
    the model's shape is refused naming them."""
    names = checkpoint_names(model, entries, weights)
    model_name = type(model).__name__
    out = dict(entries)
    pieces: dict[str, list[tuple[str, Merged]]] = {}
    for key, (target, merged) in names.items():
        if target not in weights or key in weights and target != key:
            continue
        if target != key and target in entries:  # which from_pretrained takes depends on its order
            raise CheckpointError(f"the checkpoint holds {target} twice: under that name, and as {key}, which "
                                  f"from_pretrained converts into it; keep one of them. {_WRITE_ONCE}")
        if merged is not None and merged.transpose is not None:
            out[target] = _transposed(target, weights[target], entries[key], merged.transpose, model_name)
        elif target == key:  # from_pretrained changes the values of a tensor whose name it keeps
            raise CheckpointError(f"from_pretrained converts {key} of the checkpoint with {merged.unsupported} while "
                                  f"loading it into {model_name}; offload_compile reads tensors as they are or "
                                  f"stacked, concatenated or transposed. {_WRITE_ONCE}")
        elif merged is None:
            out[target] = entries[key]
        else:
            pieces.setdefault(target, []).append((key, merged))
    for target, keys in pieces.items():
        out[target] = _assembled(target, weights[target], keys, entries, model_name)
    return out, {key for key, (target, _) in names.items() if target in out}


_WRITE_ONCE = ("Write the checkpoint once from the model loaded on the CPU: "
               "safetensors.torch.save_file(model.state_dict(), 'model.safetensors')")


def _transposed(target: str, weight: torch.Tensor, entry: Entry, transpose: tuple[int, int, bool], model_name: str
                ) -> Entry | Transposed:
    """``entry`` as from_pretrained gives it to ``target``: transposed, or as it is where the conversion transposes
    only a shape that is not the weight's (``check_dims``) and the shapes agree."""
    first, second, only_if_different = transpose
    shape = tuple(weight.shape)
    if only_if_different and entry.shape == shape:
        return entry
    swapped = list(entry.shape)
    swapped[first], swapped[second] = swapped[second], swapped[first]
    if tuple(swapped) != shape:
        raise CheckpointError(f"{entry.name} has shape {list(entry.shape)} in {entry.file}, which from_pretrained "
                              f"transposes (dims {first} and {second}) into {target} of shape {list(shape)} in "
                              f"{model_name}: they do not agree; the checkpoint is of another model or "
                              f"configuration; {FIX}")
    return Transposed(target, entry, (first, second), shape)


def _assembled(target: str, weight: torch.Tensor, keys: list[tuple[str, Merged]], entries: dict[str, Entry],
               model_name: str) -> Assembled:
    """The fused expert weight ``target`` from its pieces: experts stacked along the first dimension in the order
    of their names, each expert's parts (gate, up) concatenated along its own first dimension."""
    unsupported = next((m.unsupported for _, m in keys if m.unsupported), None)
    if unsupported is not None:
        raise CheckpointError(f"{target} is written in the checkpoint as {keys[0][0]} and others, which "
                              f"from_pretrained converts with {unsupported}; offload_compile reads tensors as they are "
                              f"or stacked, concatenated or transposed. {_WRITE_ONCE}")
    parts = keys[0][1].parts
    by_part = [sorted((key for key, m in keys if m.part == p), key=_natural) for p in range(parts)]
    shape = tuple(weight.shape)
    first = [entries[k[0]].shape if k else None for k in by_part]
    fits = (len(shape) >= 2 and all(len(k) == shape[0] for k in by_part)
            and all(s is not None and tuple(s[1:]) == shape[2:] for s in first)
            and sum(s[0] for s in first) == shape[1]
            and all(entries[k].shape == first[p] for p in range(parts) for k in by_part[p]))
    if not fits:
        sample = [(k, list(entries[k].shape)) for k, _ in keys[:3]]
        raise CheckpointError(f"{target} has shape {list(shape)} in {model_name}, but its pieces in the "
                              f"checkpoint ({len(keys)} tensors such as {sample}) do not stack into it: the "
                              f"checkpoint is of another model or configuration; {FIX}")
    per_expert = math.prod(shape[1:])
    row = math.prod(shape[2:])
    offsets = [sum(s[0] for s in first[:p]) * row for p in range(parts)]
    placed = tuple((entries[key], expert * per_expert + offsets[p])
                   for p in range(parts) for expert, key in enumerate(by_part[p]))
    return Assembled(target, entries[keys[0][0]].dtype, shape, placed)


def _natural(name: str) -> tuple:
    """A name's order with its numbers as numbers (``experts.10`` after ``experts.9``)."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split("."))


def _warn_kind_casts(model: nn.Module, sources: dict[int, Source], tensors: dict[int, torch.Tensor]) -> None:
    """A checkpoint's tensor is cast to its weight's dtype (bfloat16 into float32 is usual); integers into floating
    point or back, rarely meant (a checkpoint of another model, or indices saved as weights), are said once."""
    crossed = [(entry.name, entry.dtype, tensors[ident].dtype) for ident, entry in sources.items()
               if entry.dtype.is_floating_point != tensors[ident].dtype.is_floating_point]
    if crossed:
        name, saved, held = crossed[0]
        warnings.warn(f"offload_compiler: {len(crossed)} checkpoint tensors are cast between integer and floating "
                      f"point into {type(model).__name__}, such as {name} ({saved} in the file, {held} in the model); "
                      f"check that the checkpoint is this model's", RuntimeWarning, stacklevel=4)


def _held_per_expert(missing: list[str], entries: dict[str, Entry]) -> tuple[str, str] | None:
    """(``<module>.experts``, a checkpoint name under it) where a missing fused expert weight
    (``<module>.experts.gate_up_proj``) is held by the checkpoint per expert (``<module>.experts.0.gate_proj.weight``)."""
    for name in missing:
        module, _, _ = name.rpartition(".")
        if not module.endswith("experts"):
            continue
        held = next((key for key in entries if key.startswith(module + ".0.")), None)
        if held is not None:
            return module, held
    return None


# -- reading -------------------------------------------------------------------------------------------------

class _Reader:
    """Reads tensors' bytes from their files into given tensors; one open file per shard."""

    def __init__(self, total: int, label: str) -> None:
        self.files: dict[str, Any] = {}
        self.progress = _progress(total, label)

    def read_into(self, target: torch.Tensor, entry: Source) -> None:
        """``target`` (host, the checkpoint's shape) gets the entry's values, cast to its dtype if they differ."""
        if isinstance(entry, Assembled):
            self._assemble(target, entry)
        elif isinstance(entry, Transposed):
            held = torch.empty(entry.entry.shape, dtype=entry.dtype)
            self.read_into(held, entry.entry)
            with torch.no_grad():
                target.copy_(held.transpose(*entry.dims))
        elif entry.nbytes:
            direct = target.dtype == entry.dtype and target.is_contiguous()
            into = target if direct else torch.empty(entry.shape, dtype=entry.dtype)
            self._read(into.data_ptr(), entry)
            if not direct:
                with torch.no_grad():
                    target.copy_(into)
        if self.progress is not None:
            self.progress.update(entry.nbytes)

    def _assemble(self, target: torch.Tensor, weight: Assembled) -> None:
        """Each piece read into its place: straight into ``target`` where it is contiguous and of the piece's
        dtype, else through a buffer of the piece's own (a piece in another dtype is cast, as a whole tensor is)."""
        direct = target.is_contiguous()
        into = target if direct else torch.empty(weight.shape, dtype=target.dtype)
        flat = into.view(-1)
        for entry, element in weight.pieces:
            if entry.dtype == into.dtype:
                self._read(into.data_ptr() + element * into.element_size(), entry)
            else:
                held = torch.empty(entry.shape, dtype=entry.dtype)
                self._read(held.data_ptr(), entry)
                with torch.no_grad():
                    flat[element:element + held.numel()].copy_(held.view(-1))
            if self.progress is not None:
                self.progress.update(entry.nbytes)
        if not direct:
            with torch.no_grad():
                target.copy_(into)

    def _read(self, address: int, entry: Entry) -> None:
        f = self.files.get(entry.file)
        if f is None:
            f = self.files[entry.file] = open(entry.file, "rb", buffering=0)
        view = memoryview((ctypes.c_char * entry.nbytes).from_address(address)).cast("B")
        f.seek(entry.start)
        done = 0
        while done < entry.nbytes:
            got = f.readinto(view[done:])
            if not got:
                raise CheckpointError(f"{entry.file} ended while reading {entry.name} ({done} of {entry.nbytes} "
                                      f"bytes): the file changed or was truncated while loading")
            done += got
        if hasattr(os, "posix_fadvise"):  # the bytes are in the buffer now: no second copy in the page cache
            os.posix_fadvise(f.fileno(), entry.start, entry.nbytes, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        if self.progress is not None:
            self.progress.close()


def _progress(total: int, label: str) -> Any:
    """A progress bar over the bytes loaded where tqdm is installed (shown on a terminal, as transformers'
    and diffusers' are), else none."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {label}", disable=None, leave=False)


# -- loading --------------------------------------------------------------------------------------------------

def check_checkpoint(model: nn.Module, path: str | os.PathLike) -> dict[int, Source]:
    """Where each of ``model``'s weights is in the checkpoint at ``path``, everything checked; reads no weight."""
    return _sources(model, checkpoint_index(path))


def load_layout(model: nn.Module, policy: Any) -> list[GroupSpec]:
    """The groups the runtime will pack ``model``'s weights in, known before they are loaded; none under
    ``auto``, which chooses them at its first call (its weights are then packed by copying, group by group)."""
    if policy.strategy == "auto":
        return []
    return plan_groups(model, policy, loading=True)


def load_checkpoint(model: nn.Module, path: str | os.PathLike, specs: list[GroupSpec],
                    host_budget: int | None = None, disk_dir: str | None = None) -> FilledBuckets:
    """Give ``model`` the checkpoint's weights: those of ``specs`` (the groups the runtime will build, laid out
    as it lays them out) as views into one new flat buffer per group and dtype — in host memory, or for the
    groups beyond ``host_budget`` (`runtime.disk.disk_groups`, as the host store chooses them) in a file under
    ``disk_dir``, written through one tensor-sized buffer —, the others in tensors of their own (with no ``specs``:
    views of a private mapping of their file where it holds them as the model does, `_file_views`). Checked in full
    before any byte is read; the model's tensors are replaced only once every read succeeded, so a failure
    leaves the model as it was. Returns what each bucket was read into, for the runtime that packs them."""
    if sys.byteorder != "little":
        raise CheckpointError("safetensors stores little-endian bytes; this host is big-endian")
    sources = check_checkpoint(model, path)
    tensors = {id(t): t for _, t in model.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}
    groups = [layout_group(index, spec) for index, spec in enumerate(specs)]
    on_disk = disk_groups(groups, host_budget) if host_budget is not None else frozenset()
    mapped = _MappedFiles()
    direct: dict[int, Any] = {}
    buffers: dict[tuple[int, int], torch.Tensor | DiskFile] = {}  # (group, bucket) -> its flat, or its file
    space = None
    reader = None
    try:
        try:
            for group in groups:
                if group.index in on_disk:
                    direct[group.index] = _extents(group, sources, mapped)
        finally:
            for file in mapped.values():  # what is left open: the files the groups kept read from
                file.release()
        direct = {index: views for index, views in direct.items() if views is not None}
        places: dict[int, tuple[Any, tuple[int, int]]] = {}  # weight id -> (its leaf, (group, bucket))
        # the buckets bound for disk: regions of one file, in the groups' order (`runtime.disk.DiskSpace`)
        to_disk = [(g.index, bi) for g in groups if g.index in on_disk and g.index not in direct
                   for bi in range(len(g.buckets))]
        space = DiskSpace(disk_dir, [groups[g].buckets[bi].nbytes for g, bi in to_disk]) if to_disk else None
        region = {key: i for i, key in enumerate(to_disk)}
        for group in groups:
            if group.index in direct:  # left where the checkpoint has it: nothing read, nothing written
                continue
            for bi, bucket in enumerate(group.buckets):
                buffers[group.index, bi] = space.file(region[group.index, bi]) if group.index in on_disk else \
                    torch.empty(bucket.numel, dtype=bucket.dtype)
            for leaf in group.leaves:
                if type(leaf.tensor) in (torch.Tensor, nn.Parameter):  # a subclass is packed from itself, as always
                    places[id(leaf.tensor)] = (leaf, (group.index, leaf.bucket))
                    tensors.setdefault(id(leaf.tensor), leaf.tensor)
        in_place = {ident for views, _ in direct.values() for ident in views}
        rest = {ident: entry for ident, entry in sources.items() if ident not in places and ident not in in_place}
        # no groups to read into (``auto`` groups at its first call; a pipeline's components): each weight the
        # checkpoint holds as it is a view of the file's private mapping, which packing copies group by group,
        # giving each group's pages back once copied (`runtime.disk.release_mapped_pages`), so host memory holds
        # the host budget and a group, never the model: read into tensors of their own, the whole model would be
        # resident at once, and its freed heap kept by the allocator after packing (measured on a 129 MiB Llama
        # with a 17 MiB host budget: 296 MiB of growth after the first call, against 125 MiB under layerwise)
        viewed_in_file = _file_views(rest, tensors) if not specs else {}
        own = {ident: torch.empty(entry.shape, dtype=tensors[ident].dtype) for ident, entry in rest.items()
               if ident not in viewed_in_file}
        reader = _Reader(sum(e.nbytes for e in sources.values()), type(model).__name__)
        largest = max((leaf.numel * leaf.value.element_size() for leaf, key in places.values()
                       if key[0] in on_disk), default=0)
        bounce = torch.empty(largest, dtype=torch.uint8)  # one buffer every weight bound for a file goes through
        for ident, (leaf, key) in places.items():
            _fill_place(leaf, buffers[key], sources.get(ident), reader, bounce)
        for ident, target in own.items():
            reader.read_into(target, sources[ident])
        flats = {key: b.mapped(groups[key[0]].buckets[key[1]].dtype, groups[key[0]].buckets[key[1]].numel)
                 if isinstance(b, DiskFile) else b for key, b in buffers.items()}
    except BaseException:  # nothing of the model changed yet: what was opened for it is closed now
        for buffer in buffers.values():
            if isinstance(buffer, DiskFile):
                buffer.close()
        if space is not None:
            space.abandon()
        for _, extents in direct.values():
            for bucket in extents:
                bucket.close()
        raise
    finally:
        if reader is not None:
            reader.close()
    filled = {flat.data_ptr(): Filled(flat, buffers[key] if isinstance(buffers[key], DiskFile) else None)
              for key, flat in flats.items()}
    targets = {**own, **viewed_in_file}
    targets.update((ident, leaf.host_view(flats[key])) for ident, (leaf, key) in places.items())
    for views, extents in direct.values():
        targets.update(views)
        filled.update((bucket.addresses[0], Filled(None, bucket)) for bucket in extents)
    new = {ident: nn.Parameter(target, requires_grad=tensors[ident].requires_grad)
           if isinstance(tensors[ident], nn.Parameter) else target for ident, target in targets.items()}
    replace_tensors(model, new)
    return filled


class _MappedFiles(dict):
    """Each checkpoint file opened and mapped once, privately (`runtime.disk.CheckpointFile`)."""

    def __missing__(self, path: str) -> CheckpointFile:
        self[path] = CheckpointFile(path)
        return self[path]


def _file_views(entries: dict[int, Source], tensors: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """The weights of ``entries`` that a private mapping of their file holds as the model holds them (same dtype,
    an offset that dtype can start at, a plain tensor), as views of it; the others are read. ``torch.from_file``
    keeps no descriptor open: the mapping lives as long as a view of it, and a write into one stays in this
    process (copy on write), never in the file."""
    views: dict[int, torch.Tensor] = {}
    mappings: dict[str, torch.Tensor] = {}
    for ident, entry in entries.items():
        tensor = tensors[ident]
        if (not isinstance(entry, Entry) or not entry.nbytes or entry.dtype != tensor.dtype
                or entry.start % entry.dtype.itemsize or type(tensor) not in (torch.Tensor, nn.Parameter)):
            continue
        if entry.file not in mappings:
            try:
                mappings[entry.file] = torch.from_file(entry.file, shared=False, size=os.path.getsize(entry.file),
                                                       dtype=torch.uint8)
            except (RuntimeError, OSError):  # a file this process may not map: read as before
                mappings[entry.file] = None
        mapping = mappings[entry.file]
        if mapping is not None:
            views[ident] = mapping[entry.start:entry.end].view(entry.dtype).view(entry.shape)
    return views


def _extents(group: Any, sources: dict[int, Source], mapped: _MappedFiles
             ) -> tuple[dict[int, torch.Tensor], list[CheckpointExtents]] | None:
    """A group on disk left in the checkpoint's own file: each weight a view of its bytes in a private mapping
    of the file, each bucket the extents a fill reads. None where a weight is not there as the group lays it
    out (absent, another dtype, a strided layout, an offset its dtype cannot start at): the group is then
    written to the disk tier's file."""
    views: dict[int, torch.Tensor] = {}
    extents = []
    for bi, bucket in enumerate(group.buckets):
        members = [leaf for leaf in group.leaves if leaf.bucket == bi]
        parts, addresses = [], []
        for leaf in members:
            entry = sources.get(id(leaf.tensor))
            itemsize = bucket.dtype.itemsize
            if (not isinstance(entry, Entry) or type(leaf.tensor) not in (torch.Tensor, nn.Parameter)
                    or entry.dtype != bucket.dtype
                    or leaf.stride != contiguous_stride(leaf.shape) or entry.start % itemsize):
                return None
            try:
                view = mapped[entry.file].tensor[entry.start:entry.end].view(bucket.dtype).view(entry.shape)
            except (RuntimeError, OSError, ValueError):  # a file this process may not map
                return None
            views[id(leaf.tensor)] = view
            parts.append((entry.file, entry.start, entry.nbytes, leaf.offset * itemsize))
            addresses.append(view.data_ptr())
        extents.append(CheckpointExtents(parts, tuple(addresses), mapped))
    return views, extents


def _fill_place(leaf: Any, buffer: torch.Tensor | DiskFile, entry: Source | None, reader: _Reader,
                bounce: torch.Tensor) -> None:
    """A weight's bytes into its place in its group's flat buffer, or in its file (through ``bounce``): from
    the checkpoint, or, for a real weight the checkpoint lacks (a buffer computed at construction), from the
    weight itself."""
    in_memory = isinstance(buffer, torch.Tensor)
    dtype = leaf.value.dtype
    target = leaf.host_view(buffer) if in_memory else \
        bounce[:leaf.numel * dtype.itemsize].view(dtype).as_strided(leaf.shape, leaf.stride)
    if entry is not None:
        reader.read_into(target, entry)
    else:
        with torch.no_grad():
            target.copy_(leaf.value)
    if not in_memory:
        buffer.write(leaf.offset * target.element_size(), target)


@contextmanager
def empty_weights() -> Iterator[None]:
    """Build a model with its parameters on the meta device (no memory, no initialisation cost) and its
    buffers real (rotary frequencies and other values computed at construction, which no checkpoint holds):
    ``with empty_weights(): model = Model(config)``, then ``offload_compile(model, policy, checkpoint=path)``."""
    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or param.is_meta:
            return None
        return nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    handle = register_module_parameter_registration_hook(to_meta)
    try:
        yield
    finally:
        handle.remove()
