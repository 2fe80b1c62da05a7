"""Every use of dynamo's private surface, in one place: what a torch upgrade may break is here and nowhere else.

- `compiled_module_of`: the module inside a ``torch.compile`` wrapper (``OptimizedModule``).
- `model_error`: the model's own exception under dynamo's ``TorchRuntimeError`` wrapper.
- `compiled_models`: the modules inside the live ``torch.compile`` wrappers (the backend route finds its model
  among them by the identity of the graph's weights).
- `static_shapes`, `symbolic_sizes`, `user_frame`: a model error traced with symbolic sizes (``s27``) traced
  again with the call's own sizes, and the line of the model's code that failed.
- `capture_config`: the config patch our captures run under (made once per model: torch keeps a ContextVar
  per patch object): raised recompile limits, and logging calls traced as no-ops.
- `compile_under_config`, `config_for_call`: ``torch.compile`` of an offloaded call's function with
  `capture_config` in force only while dynamo compiles one of its frames (nothing entered on a steady call).
- `short_reason`: dynamo's graph-break report, short (auto's capture names the break that stops it).
- `constant_while_tracing`, `inlined_only`, `guards_only_on`: a routed part traced into by our captures (a
  per-thread depth read as a constant of the graph), run as plain Python where called from a frame dynamo
  runs without a graph (a host master's ``__torch_function__`` too), and guarded by its identity alone (a
  host master by its tensor metadata alone).
- `leave_fullgraph_region`, `restore_fullgraph_region`: an offloaded call made from the user's
  ``torch.compile(m, fullgraph=True)`` runs its own compiled frames as a call from plain Python would.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch._dynamo import convert_frame as _convert_frame, eval_frame as _eval_frame
from torch._dynamo.eval_frame import OptimizedModule
from torch._dynamo.exc import TorchDynamoException

from .errors import OffloadRefusal

_EVAL_FRAME = torch._C._dynamo.eval_frame
RECOMPILE_LIMIT = 4096  # every offloaded model of one class is a cache entry of the same code object


def compiled_module_of(obj: Any) -> Any:
    """``torch.compile(model)`` returns a wrapper; the state lives on the model inside it."""
    return obj._orig_mod if isinstance(obj, OptimizedModule) else obj


def short_reason(text: str) -> str:
    """The first line of dynamo's report, with its hints (``Hint: ...``, often the fix: "Enable tracing of
    dynamic shape operators with ...capture_dynamic_output_shape_ops = True")."""
    lines = [line.strip() for line in text.strip().splitlines()]
    hints = [line for line in lines[1:] if line.startswith("Hint:")]
    return " ".join(lines[:1] + hints)


def capture_config(device_type: str | None = None):
    """Raised recompile limits, and the logging methods traced as no-ops: a ``logger.warning_once`` inside a
    model's layer loop (transformers' sdpa attention asked for ``output_attentions``) is otherwise a graph
    break inside a loop, and dynamo runs that frame without a graph, reading the weights from host memory.
    With the compute device's type (an accelerator): fake tensors prefer that device where host weights meet
    device inputs (the rewritten graph fetches the weights; fake tensors would refuse the mix)."""
    patch = torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=RECOMPILE_LIMIT,
                                       ignore_logging_functions=_logging_methods())
    prefer = prefer_device_while_tracing(device_type)
    return patch if prefer is _NOTHING else _Patches(patch, prefer)


def prefer_device_while_tracing(device_type: str | None):
    """Fake tensors prefer the compute device where host weights meet device inputs (the rewritten graph
    fetches the weights, so that is what tracing should assume); nothing for the CPU. Only while our captures
    trace: elsewhere the mix must still fail (tests/test_fake_cuda.py)."""
    functorch = getattr(torch._functorch, "config", None)
    if device_type in (None, "cpu") or not hasattr(functorch, "fake_tensor_prefer_device_type"):
        return _NOTHING
    return functorch.patch(fake_tensor_prefer_device_type=device_type)


class _Patches:
    """Config patches entered together, as often as needed (each patch object is reusable)."""

    def __init__(self, *patches: Any) -> None:
        self._patches = patches

    def __enter__(self) -> None:
        for patch in self._patches:
            patch.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for patch in reversed(self._patches):
            patch.__exit__(*exc)


def compile_under_config(function: Callable, **options: Any) -> Callable:
    """``torch.compile(function, **options)``, with `capture_config` in force exactly while dynamo compiles a
    frame under it: its own frame, and every frame it compiles during its calls (resume functions after a graph
    break, functions called from the parts it runs eagerly). A steady call, which compiles nothing, enters no
    config patch (``config_for_call`` gives an empty context), and code compiled by anyone else keeps torch's
    defaults.

    How (dynamo's private structure, the same in torch 2.11 and 2.13): ``torch.compile`` returns a
    ``compile_wrapper`` closure that installs its ``callback`` (a ``CatchErrorsWrapper``), as
    ``_callback_from_stance(callback)`` gives it, as the eval-frame callback for the frames under the call. The
    C eval-frame hook calls that callback only on a cache miss (guards of every cached entry failed), and it
    stays the callback of nested frames. The callback checks whether the frame is to be skipped (torch's own
    files, a generator resumed), then, holding dynamo's ``compile_lock``, calls its
    ``_torchdynamo_orig_backend``: the ``ConvertFrame`` (``ConvertFrameAssert`` under ``fullgraph``), whose call
    is where dynamo compiles -- the recompile-limit check (``exceeds_recompile_limit``), the tracing (where a
    logging call met is a no-op if listed in ``ignore_logging_functions``), and our backend. That converter is
    replaced by `_ConfigDuringCompile`, which runs it under the patch (frames that the callback skips never
    enter it).
    The replacement keeps the ``_torchdynamo_orig_backend`` chain (``callback -> converter -> backend``) that
    dynamo walks for the cache entries' backend identity (C ``get_backend``, ``innermost_backend``) and for its
    stances (``eager_then_compile`` takes ``callback._torchdynamo_orig_backend._torchdynamo_orig_backend`` as
    the backend), and forwards every other attribute to the converter (``_export``, ``_clone_with_backend``).

    A stance other than the default (``torch.compiler.set_stance``: ``force_eager``, ``eager_then_compile``, a
    forced backend...) installs a callback of torch's own instead of ours; `config_for_call` then enters the
    patch around the whole call, as it does when this torch's structure is not recognized here (the function is
    then compiled exactly as ``torch.compile`` makes it)."""
    compiled = torch.compile(function, **options)
    device = getattr(options.get("backend"), "device", None)  # a RuntimeBackend's compute device
    if _install_config(compiled, getattr(device, "type", None)):
        compiled.__dict__[_CONFIG_IN_COMPILES] = True
    return compiled


def config_for_call(compiled: Callable, patch: Any) -> Any:
    """What a call of ``compiled`` (from `compile_under_config`) enters: nothing when its compiles carry the config
    themselves and the stance lets them; else ``patch`` (a `capture_config`, kept by the caller)."""
    if compiled.__dict__.get(_CONFIG_IN_COMPILES) and _default_stance():
        return _NOTHING
    return patch


_CONFIG_IN_COMPILES = "_offload_config_in_compiles"
_NOTHING = contextlib.nullcontext()
_CONVERTERS = tuple(getattr(_convert_frame, name) for name in ("ConvertFrame", "ConvertFrameAssert")
                    if isinstance(getattr(_convert_frame, name, None), type))
_compiling_under_config = False  # set while a `_ConfigDuringCompile` runs (under dynamo's compile lock)


def _default_stance() -> bool:
    """Whether the stance lets ``compile_wrapper`` install its own callback (``_callback_from_stance``)."""
    try:
        stance = _eval_frame._stance
        return stance.stance == "default" and stance.backend is None
    except AttributeError:  # not this torch's structure: the patch around every call
        return False


def _install_config(compiled: Callable, device_type: str | None = None) -> bool:
    """Put `capture_config` around the frame converter of ``compiled`` (see `compile_under_config`); False, with
    nothing changed, where this torch's structure is not the one described there."""
    catch_errors = getattr(_convert_frame, "CatchErrorsWrapper", None)
    code, closure = getattr(compiled, "__code__", None), getattr(compiled, "__closure__", None)
    if catch_errors is None or not _CONVERTERS or code is None or not closure:
        return False
    cells = dict(zip(code.co_freevars, closure))
    try:
        callback, context = cells["callback"].cell_contents, cells["self"].cell_contents
    except (KeyError, ValueError):  # no such free variable, or an empty cell
        return False
    if not (isinstance(context, _eval_frame._TorchDynamoContext) and context.callback is callback
            and "_callback_from_stance" in code.co_names and type(callback) is catch_errors
            and {"_torchdynamo_orig_backend", "compile_lock"} <= set(catch_errors.__call__.__code__.co_names)
            and isinstance(callback.__dict__.get("_torchdynamo_orig_backend"), _CONVERTERS)):
        return False
    converter = callback._torchdynamo_orig_backend
    wrapped = _ConfigDuringCompile(converter, capture_config(device_type))
    if _eval_frame.innermost_backend(wrapped) is not _eval_frame.innermost_backend(converter):
        return False
    callback._torchdynamo_orig_backend = wrapped
    return True


class _ConfigDuringCompile:
    """Dynamo's frame converter of one compiled function, run with `capture_config` in force (see
    `compile_under_config`). Called by ``CatchErrorsWrapper`` holding dynamo's ``compile_lock``, so the patch
    (global in torch 2.11, per thread in 2.13) is never in force while another thread compiles; a compile
    nested in one (on the same thread) finds it already in force."""

    def __init__(self, converter: Callable, patch: Any) -> None:
        self._converter = converter
        self._patch = patch
        self._torchdynamo_orig_backend = converter._torchdynamo_orig_backend  # a plain attribute: C reads it

    def __call__(self, frame: Any, *args: Any, **kwargs: Any) -> Any:
        global _compiling_under_config
        if "skip" in kwargs:  # stack frames that dynamo's logs elide: this one too
            kwargs["skip"] += 1
        if _compiling_under_config:
            return self._converter(frame, *args, **kwargs)
        _compiling_under_config = True
        try:
            with self._patch:
                return self._converter(frame, *args, **kwargs)
        finally:
            _compiling_under_config = False

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_converter", "_patch"):
            raise AttributeError(name)
        value = getattr(self._converter, name)
        if name == "_clone_with_backend":  # DDPOptimizer's converter for its own backend: under the config too
            return lambda backend: _ConfigDuringCompile(value(backend), capture_config())
        return value


def constant_while_tracing(function: Callable[[], Any]) -> Callable[[], Any]:
    """``function`` (no arguments), called by dynamo while it traces and its result taken as a constant of the
    graph, with no guard (``assume_constant_result``): what it tells must hold for as long as the graph can run
    under the backend that compiled it."""
    return torch._dynamo.assume_constant_result(function)


def inlined_only(function: Callable) -> Callable:
    """``function`` is traced into where dynamo meets it in a frame it compiles, but called from code that runs
    without a graph it runs as plain Python: dynamo does not compile its frame on its own (nested frames are
    still compiled). ``torch.compiler.disable(recursive=False)`` would also stop the inlining."""
    _eval_frame.skip_code(function.__code__)
    return function


def guards_only_on(kinds: dict[type, str]) -> Callable[[list], list[bool]]:
    """A ``guard_filter_fn`` (``torch.compile(..., options={"guard_filter_fn": ...})``) that keeps, of the guards
    dynamo installs on an object of a type in ``kinds`` and on what it reached through one, only the object's
    guard of the kind named there:

    - a `_RoutedPart` (``"ID_MATCH"``; for a callable object, the ``CLOSURE_MATCH`` that stands for it): its
      attributes, its class's ``__call__`` and the module it holds are fixed at construction, so what the
      dropped guards check -- its ``__dict__``, its ``forward`` method's code, ``type(part).__call__``'s code, and
      that the module reached through it is the module it is installed on (an object-aliasing guard, which
      dynamo checks in Python, a lambda per part) -- follows from the identity;
    - a host master (``"TENSOR_MATCH"``, a C++ check of its class, shape, strides, dtype and device): its
      ``__tensor_flatten__`` context (device and account, compared in Python per weight), its inner ``host``
      tensor (rebound by ``p.data = t``; the offloaded graph reads the weight's device slot, never ``host``) and
      the list of its inner attributes (a Python call per weight) follow from the class and the runtime that
      made it; the offloaded call checks the weights' identity at every graph call anyway (`GraphRunner`).

    A few C++ checks per object, instead of a dozen and Python lambdas.

    Private surface: the entries' ``orig_guard.originating_source`` and the sources' ``base`` chain
    (``ChainedSource``)."""
    def keep(entries: list) -> list[bool]:
        held = {e.orig_guard.originating_source: kinds[type(e.value)] for e in entries
                if e.has_value and type(e.value) in kinds}
        if not held:
            return [True] * len(entries)

        def owner(source: Any) -> Any:
            while source is not None:
                if source in held:
                    return source
                source = getattr(source, "base", None)
            return None

        def kept(entry: Any) -> bool:
            source = entry.orig_guard.originating_source
            found = owner(source)
            return found is None or (found == source and held[found] in (entry.guard_type,
                                                                            *entry.derived_guard_types))
        return [kept(e) for e in entries]
    return keep


def _logging_methods() -> set:
    names = ("debug", "info", "warning", "warn", "error", "exception", "critical", "log", "warning_once",
             "warning_advice", "info_once")  # the last three: transformers' (set on logging.Logger when imported)
    found = {getattr(logging.Logger, name) for name in names if hasattr(logging.Logger, name)}
    return set(torch._dynamo.config.ignore_logging_functions) | found


class _ConfigRecordOfFunctions(logging.Filter):
    """torch 2.11 records, with each compile's metrics, the dynamo config with every set in it sorted; the
    functions in `capture_config`'s ``ignore_logging_functions`` do not sort, so every compile under it printed
    an "Unexpected exception logging compilation metrics" traceback to stderr (torch 2.13 leaves that set out
    of the record). The record is lost either way; that traceback, and only it, is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, TypeError):
            return True
        trace = error.__traceback__
        while trace is not None:
            if trace.tb_frame.f_code.co_name == "_get_dynamo_config_for_logging":
                return False
            trace = trace.tb_next
        return True


logging.getLogger("torch._dynamo.metrics_context").addFilter(_ConfigRecordOfFunctions())


_SYMBOL = re.compile(r"\b[su]\d+\b")


def symbolic_sizes(message: str) -> bool:
    """Whether an error message shows dynamo's symbolic sizes (``s27``) instead of numbers."""
    return bool(_SYMBOL.search(message))


def static_shapes():
    """Trace with the call's own sizes (no automatic dynamic shapes): errors then show numbers."""
    return torch._dynamo.config.patch(automatic_dynamic_shapes=False)


def user_frame(exc: BaseException) -> str | None:
    """``file.py:10 in forward: x = self.proj(x)``: the innermost line of the model's code (outside torch and
    offload_compiler) in the user stack that dynamo's exceptions carry (``real_stack``, a ``StackSummary``)."""
    for error in _chain(exc):
        stack = getattr(error, "real_stack", None)
        frames = [f for f in stack or () if not f.filename.startswith(_NOT_USER_CODE)]
        if frames:
            last = frames[-1]
            return f"{os.path.basename(last.filename)}:{last.lineno} in {last.name}: {(last.line or '').strip()}"
    return None


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or during, innermost last (a cycle ends it)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


_NOT_USER_CODE = (os.path.dirname(torch.__file__), os.path.dirname(__file__))


def is_tracing_error(exc: BaseException) -> bool:
    """Whether dynamo was tracing when ``exc`` was raised: one of its exceptions is in the chain (torch 2.13 raises
    its ``TorchRuntimeError`` itself; 2.14 re-raises the model's error with dynamo's in its context)."""
    return any(isinstance(error, TorchDynamoException) for error in _chain(exc))


def model_error(exc: BaseException) -> BaseException | None:
    """The error the model's code raised while dynamo traced it (with fake tensors): the innermost of the chain
    that is not dynamo's -- the op's or the model's own ``raise``, which dynamo wraps outward, in text of its own
    that changes between releases (it is never parsed here)."""
    found = None
    for error in _chain(exc):
        if not isinstance(error, TorchDynamoException) and isinstance(error, (RuntimeError, ValueError, TypeError,
                                                                              IndexError)):
            found = error
    return found


def own_refusal(exc: BaseException) -> OffloadRefusal | None:
    """Our refusal under dynamo's wrappers: our backend refused a graph while dynamo compiled it, and dynamo
    reports that as ``BackendCompilerFailed`` (its message ends asking for a PyTorch bug report)."""
    return next((error for error in _chain(exc) if isinstance(error, OffloadRefusal)), None)


def cannot_capture_in_one_graph(exc: BaseException) -> bool:
    """Dynamo cannot trace the code into one graph: a graph break under ``fullgraph=True``, or a value that
    depends on tensor data (a data-dependent loop or size: ``UserError``, ``GuardOnDataDependentSymNode``)."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    seen = exc
    while seen is not None:
        if (isinstance(seen, (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError,
                              GuardOnDataDependentSymNode)) or "graph break" in str(seen).lower()):
            return True
        seen = seen.__cause__
    return False


def compiled_models() -> list[nn.Module]:
    """The modules inside every live ``torch.compile`` wrapper (``OptimizedModule``). A backend is handed a graph
    and its inputs, never the module being compiled; the weights among those inputs are the module's own tensor
    objects, so the model is found by identity among these (`offloaded.model_holding`), not from where dynamo
    is on the Python stack nor from how it spells a weight's source (both changed under transformers 5's
    wrapped forwards). The garbage collector's list is walked once per graph compiled (about 0.1 s with
    transformers imported); ``type(obj)`` does not run the ``__class__`` properties of lazy module objects."""
    return [obj._orig_mod for obj in gc.get_objects() if issubclass(type(obj), OptimizedModule)]


_set_fullgraph_count = getattr(_EVAL_FRAME, "set_fullgraph_compiled_frame_count", None)  # torch 2.13
_set_frame_override = getattr(_EVAL_FRAME, "set_eval_frame_override", None)  # torch 2.11


def leave_fullgraph_region() -> tuple | None:
    """Leave the user's ``fullgraph=True`` region for an offloaded call; returns what `restore_fullgraph_region`
    takes. While a ``torch.compile(..., fullgraph=True)`` call runs, every frame called from a compiled frame's
    code runs with no dynamo callback, so without a graph and without being counted as skipped
    (``error_on_dynamo_callback_in_fullgraph_compiled_code`` is off by default): torch 2.13 keeps a frame counter
    in C (>= 0 while active), torch 2.11 an eval-frame override (SKIP). An offloaded call's own frames are called
    from its compiled code: the resume function after a graph break, a submodule's forward that a graph break
    pushed out of the graph. Under the user's ``torch.compile(m, fullgraph=True)`` those ran eagerly, reading
    their weights from host memory, with no error. With the region left during the offloaded call, dynamo runs
    our compiled frames as from plain Python. The user's state is put back after it; a 2.13 count plus one for
    our frames (torch raises "fullgraph=True found no compiled frames" at the end of the user's call when it
    counted none: our compiled frames are its only ones, the model's own frame being a boundary)."""
    if _set_fullgraph_count is not None:
        return _set_fullgraph_count, _set_fullgraph_count(-1)
    if _set_frame_override is not None:
        return _set_frame_override, _set_frame_override(_EVAL_FRAME._EvalFrameOverride.NONE)
    return None


def restore_fullgraph_region(prior: tuple | None) -> None:
    if prior is None:
        return
    setter, value = prior
    if setter is _set_fullgraph_count:
        if value >= 0:
            setter(value + 1)
    else:
        setter(value)
