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
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Iterator

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
