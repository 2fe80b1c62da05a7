"""Every use of transformers' private surface, in one place: what a transformers upgrade may break is here and
nowhere else.

All of it is transformers' output capture (``transformers.utils.output_capturing``): the forward hooks that
record ``hidden_states`` and ``attentions`` into the collector of the current ``capture_outputs`` call. Each
touch point below has a test in ``tests/test_transformers_private.py`` that fails if a release removes or
changes it (`test_no_private_transformers_outside_this_module` checks that no other module of the package names
them). Where a touch point is missing, what needs it does what it did without it: never an error.

1. ``maybe_install_capturing_hooks`` and the ``_output_capturing_hooks_installed`` mark it sets on a model
   (`install_capturing_hooks`): the hooks are installed at offloading rather than lazily inside a call (see
   `offloaded.install.install_output_capture` for why). transformers has no public call that installs them.
   Missing: nothing is installed here, and transformers installs them at the first call that asks.
   Test: ``test_hooks_are_installed_once_and_marked``.
2. ``_active_collector``, a ``CompileableContextVar``: its ``get`` returns its ``global_var`` when ``compiling``
   is True and reads its ``ContextVar`` otherwise, which dynamo cannot trace (a graph break in every hooked
   module). transformers sets ``compiling`` and ``global_var`` itself when ``capture_outputs`` runs under dynamo,
   so a model call traces in one graph; a part called by hand has no ``capture_outputs`` around it.
   `hooks_see_the_active_collector` shows the traced hooks the collector active in Python the way transformers
   does under compile. Missing or changed: hooks graph-break as before (correct, one graph per hooked piece).
   Test: ``test_traced_hooks_read_the_collector_without_a_graph_break``.
3. The checkpoint conversion of ``from_pretrained`` (``conversion_mapping.get_model_conversion_mapping``, which
   peft calls too, and ``core_model_loading.rename_source_key``, ``WeightConverter`` and its ``operations``
   and ``source_patterns``, ``MergeModulelist``, ``Concatenate``, ``Transpose``): the names ``save_pretrained``
   writes that the model holds under others, the experts it writes one by one that the model holds fused, and
   the tensors it holds transposed (`checkpoint_names`). transformers has no public call that maps a
   checkpoint's names without loading its tensors. Missing: a checkpoint is read under the model's own names
   only, and one saved expert by expert is refused naming the fix.
   Tests: ``test_checkpoint_names_follow_from_pretrained``,
   ``test_without_the_conversion_functions_no_name_is_mapped``; the loads themselves in tests/test_checkpoint.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
from typing import Any, Iterable, Iterator

from torch import nn

_OUTPUT_CAPTURING = "transformers.utils.output_capturing"
_HOOKED = "_output_capturing_hooks_installed"  # set by transformers on a model whose hooks are installed


def _output_capturing() -> Any:
    """transformers' output-capture module where transformers is loaded already (no hook exists otherwise, and
    importing transformers costs seconds), else None."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.utils import output_capturing
    except ImportError:  # a transformers version without output capture
        return None
    return output_capturing


# -- 1: installing the hooks ---------------------------------------------------------------------------

def install_capturing_hooks(model: nn.Module) -> None:
    """Install transformers' output-capturing hooks on every transformers model in ``model`` now, as their first
    call with ``output_hidden_states`` or ``output_attentions`` would. Installing on a model also installs on
    every model nested in it, whether or not that one has its hooks already (it has once it was called with
    ``output_hidden_states``: CLIPTextModel inside CLIPTextModelWithProjection, before offloading); a second set
    would record every layer twice. So a model gets them only when none inside it has any, else its submodules are looked at in
    turn."""
    capturing = _output_capturing()
    install = getattr(capturing, "maybe_install_capturing_hooks", None)
    if install is None:
        return
    from transformers import PreTrainedModel

    def visit(module: nn.Module) -> None:
        if isinstance(module, PreTrainedModel) and not any(capturing_hooks_installed(m) for m in module.modules()):
            install(module)
            return
        for child in module.children():
            visit(child)

    visit(model)


def capturing_hooks_installed(module: nn.Module) -> bool:
    """Whether transformers installed its output-capturing hooks on (transformers model) ``module``."""
    return getattr(module, _HOOKED, False)


# -- 2: the active collector, seen by traced hooks -----------------------------------------------------

# One collector can be shown at a time: ``compiling``/``global_var`` are attributes of one object shared by every
# thread. The lock keeps two threads' by-hand calls from interleaving their saves and restores (which could
# leave ``compiling`` True after both ended: every later hook, in any thread, would read a dead collector). A
# thread runs nested calls under it (an RLock), each restoring what it found. Other threads that run
# transformers hooks eagerly meanwhile read ``global_var`` too; transformers' own compile path has the same
# window (its docstring: "not thread-safe when compilation is triggered"), and ours lasts one by-hand call.
_SHOWING = threading.RLock()


def _collector_var() -> Any:
    """transformers' ``_active_collector`` where it has the attributes shown below, else None."""
    var = getattr(_output_capturing(), "_active_collector", None)
    if var is None or not all(hasattr(var, name) for name in ("compiling", "global_var", "get")):
        return None
    return var


@contextlib.contextmanager
def hooks_see_the_active_collector() -> Iterator[None]:
    """For code dynamo traces inside the block: transformers' hooks read the collector active here (None where no
    ``capture_outputs`` call is under way) as a plain attribute, as they do under ``torch.compile``, instead of
    its ``ContextVar`` (a graph break). Read here in Python, where the ``ContextVar`` can be read; a compiled
    graph guards on what it saw, so a call with another collector recompiles. The previous state is restored at
    the end, also on error."""
    var = _collector_var()
    if var is None:
        yield
        return
    with _SHOWING:
        saved = var.compiling, var.global_var
        var.global_var = var.get()  # the ContextVar's value, or the global shown by an enclosing block
        var.compiling = True
        try:
            yield
        finally:
            var.compiling, var.global_var = saved


# -- 3: the names from_pretrained loads a checkpoint under --------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Merged:
    """A checkpoint tensor that ``from_pretrained`` converts into a model weight: one expert's piece (``part`` of
    ``parts``: gate then up, concatenated along the expert's first dimension) of a fused expert weight, the
    experts stacked in the order of their names; or one tensor transposed. ``unsupported``: the conversion's
    operations, where they are neither (nothing of such a weight is read)."""
    part: int
    parts: int
    unsupported: str | None = None
    transpose: tuple[int, int, bool] | None = None  # a tensor transposed (dims), where its shape is not the weight's
    #   (True) or always (False); one piece, ``part`` 0 of 1


def _conversion() -> Any:
    """transformers' conversion functions where transformers is loaded and has them, else None."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose, WeightConverter, \
            rename_source_key
    except ImportError:  # a transformers version without weight conversion
        return None
    return PreTrainedModel, get_model_conversion_mapping, rename_source_key, WeightConverter, \
        (MergeModulelist, Concatenate, Transpose)


def checkpoint_names(model: nn.Module, keys: Iterable[str], names: Iterable[str]
                     ) -> dict[str, tuple[str, Merged | None]]:
    """For a transformers model: each checkpoint name in ``keys`` that ``from_pretrained`` loads under another of the
    model's ``names`` -> (that name, None), and each it converts -> (the weight's name, how it is `Merged`);
    names it loads as they are, or not at all, are left out. Empty for any other model."""
    found = _conversion()
    if found is None or not isinstance(model, found[0]):
        return {}
    _, mapping, rename, converter_type, operation_types = found
    transforms = mapping(model)
    converters = [t for t in transforms if isinstance(t, converter_type)]
    renamings = [t for t in transforms if not isinstance(t, converter_type)]
    present = dict.fromkeys(names, True)
    prefix = getattr(model, "base_model_prefix", None) or None
    result: dict[str, tuple[str, Merged | None]] = {}
    for key in keys:
        for converter in converters:
            target, pattern = rename(key, renamings, [converter], prefix, present)
            if pattern is not None:
                result[key] = (target, _merged(converter, pattern, *operation_types))
                break
        else:
            target, _ = rename(key, renamings, [], prefix, present)
            if target != key and target in present:
                result[key] = (target, None)
    return result


def _merged(converter: Any, pattern: str, merge_type: type, concat_type: type, transpose_type: type) -> Merged:
    operations = list(converter.operations)
    sources = list(converter.source_patterns)
    kinds = [(type(op), getattr(op, "dim", None)) for op in operations]
    if len(sources) == 1 and len(operations) == 1 and type(operations[0]) is transpose_type:
        op = operations[0]
        return Merged(0, 1, transpose=(op.dim0, op.dim1, bool(getattr(op, "check_dims", False))))
    stacked = kinds[:1] == [(merge_type, 0)] and (kinds[1:] == [] and len(sources) == 1
                                                   or kinds[1:] == [(concat_type, 1)])
    return Merged(sources.index(pattern), len(sources),
                  None if stacked else ", ".join(type(op).__name__ for op in operations))
