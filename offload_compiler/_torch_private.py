"""Every use of torch's private surface, in one place: what a torch upgrade may break is here and nowhere else.

Each touch point below is a private name or mechanism of torch that this package relies on, why torch offers
no public way to do it, and the test in ``tests/test_torch_private.py`` that fails if a release removes or
changes it (`test_no_private_torch_outside_this_module` checks that no other module of the package names
``torch._`` or ``_C.``). Public API is used everywhere else, this module included where one exists:
``torch.compiler.config`` (recompile limits, automatic dynamic shapes), ``torch.compiler.assume_constant_result``,
``torch.compiler.disable``/``is_compiling``/``reset``, the ``guard_filter_fn`` option of ``torch.compile``,
``torch.library``, ``torch.fx`` (``torch.fx.experimental.symbolic_shapes`` included), ``OpOverload.name()``,
``Tensor.__torch_function__``'s default (`host_masters`), ``Tensor.to``'s documented arguments (`offloaded`).
``_make_wrapper_subclass`` is the documented way to make a wrapper subclass and is not counted, nor is
``_stable_hash_for_caching``, a method torch's AOT-autograd cache calls on a subclass where it exists (its
warning asks subclasses for it): torch calls it, we call nothing, and without it the cache falls back to a hash.

1. ``torch._dynamo.eval_frame.OptimizedModule`` and its ``_orig_mod``: the wrapper ``torch.compile(module)``
   returns, and the model inside it (`compiled_module_of`, `compiled_models`: the ``omni_offload`` backend
   finds its model among the live wrappers by the identity of the graph's weights, since a backend is handed
   a graph and never the module); and ``nn.Module._compiled_call_impl``, set by ``model.compile(...)`` (a
   module compiled in place; ``m.forward = torch.compile(m.forward)``: the wrapper's ``_torchdynamo_orig_callable``
   marks it as torch.compile's, and ``functools.wraps``'s public ``__wrapped__`` leads to the module). No public
   type or accessor. Test: ``test_optimized_module_wraps_the_model``.
2. Dynamo's frame-converter chain (``torch._dynamo.convert_frame.CatchErrorsWrapper``, ``ConvertFrame``,
   ``ConvertFrameAssert``, their ``_torchdynamo_orig_backend``; ``eval_frame._TorchDynamoContext``, ``_stance``,
   ``innermost_backend``): `compile_under_config` runs dynamo's compile of our frames, and only that, under
   `capture_config`; a config patch around every call costs about 14 µs a call (benchmarks/README.md). No
   public hook runs code around dynamo's compile of a frame. Where the structure is not recognized, the patch
   is entered around every call instead (correct, slower).
   Test: ``test_frame_converter_runs_our_compiles_under_config``.
3. ``torch._dynamo.eval_frame.skip_code``: `inlined_only`, a function dynamo inlines where it traces a frame
   that calls it, but never compiles as a frame of its own (``torch.compiler.disable`` would also stop the
   inlining: a graph break per weight op). Test: ``test_skip_code_inlines_but_never_compiles_the_frame``.
4. ``torch._C._dynamo.eval_frame``'s fullgraph state (``set_fullgraph_compiled_frame_count`` in torch 2.13+,
   ``set_eval_frame_override`` in 2.11): `leave_fullgraph_region`, so that an offloaded call made from the
   user's ``torch.compile(m, fullgraph=True)`` compiles its own frames. No public API: torch has no notion of
   a nested compile that leaves the user's region. Test: ``test_leaving_the_fullgraph_region_compiles_nested_frames``.
5. Dynamo's error reports (``torch._dynamo.exc``: ``TorchDynamoException``, ``Unsupported``, ``UserError``,
   ``ObservedException`` (the model's own ``raise``, met while tracing);
   the ``real_stack`` they carry; the text: symbolic sizes ``s27``, ``Hint:`` lines, "graph break"): the model's
   own error inside dynamo's wrappers, the line of the model that failed, a graph break under ``fullgraph``
   (`is_tracing_error`, `model_error`, `user_frame`, `symbolic_sizes`, `short_reason`,
   `cannot_capture_in_one_graph`). Dynamo's exception classes are not public.
   Test: ``test_dynamo_errors_carry_the_model_error_and_its_line``.
6. Private config flags: ``torch._dynamo.config.ignore_logging_functions`` (logging calls traced as no-ops, not
   graph breaks: `capture_config`; ``torch.compiler.config.reorderable_logging_functions`` would run them after
   the graph instead) and ``torch._functorch.config.fake_tensor_prefer_device_type`` (fake tensors prefer the
   compute device where host weights meet device inputs: `prefer_device_while_tracing`). Both are patches of
   torch's config modules with no public counterpart in ``torch.compiler.config``. Torch 2.11 only: the record
   of the first flag that the ``torch._dynamo.metrics_context`` logger reports as a traceback is dropped
   (`_ConfigRecordOfFunctions`). Test: ``test_private_config_flags_do_what_captures_rely_on``.
7. Inductor (``torch._inductor``): ``compile_fx.compile_fx`` (inductor on a graph our backend rewrote; the
   public entry, ``torch.compile``, would trace it again with dynamo and guard every call), and the lowering of
   our ``transfer`` op (``lowering.register_lowering``, ``lowering.fallback_handler``, ``virtualized.V.graph``'s
   ``never_reuse_buffers``/``unaligned_buffers``, ``ir.FallbackKernel``'s codegen and the IR around it:
   ``MultiOutput``, the ``data`` of a lowered value; ``custom_graph_pass.CustomGraphPass``, whose ``uuid``
   salts the FX-graph cache key); ``codegen.common``'s registry of code generators per device type
   (`inductor_generates_code_for`: ``compiler="inductor"`` is refused up front on a device it has none for, the
   simulated one). Inductor has no public Python API. Tests:
   ``test_inductor_entry_points_take_what_we_pass`` (signatures and graph state, fast);
   ``test_inductor_knows_which_devices_it_generates_code_for``;
   ``test_inductor_calls_our_builtins_on_this_torch`` (a compile, on every torch CI runs);
   ``test_inductor_cache_holds_our_lowering_in_its_key`` (fresh processes); tests/test_hot_path.py.
8. ``torch.utils._pytree`` (`pytree`): nested inputs and outputs as torch and transformers register them (model
   outputs, caches). No public module in torch 2.13/2.14 (``torch.utils.pytree`` does not exist).
   Test: ``test_pytree_walks_registered_containers``.
9. Op overloads: ``torch._ops.OpOverload`` (`OpOverload`), its ``_schema`` (`op_schema`: argument names and
    defaults, written arguments), ``OpOverloadPacket._qualified_op_name`` and ``torch._grouped_mm`` (a private
    op that models call, recognized by identity: `grouped_mm_targets`). ``OpOverload.name()`` is public and used
    for names; the schema object has no public accessor. Test: ``test_op_overloads_and_their_schema``.
10. ``torch._C._autograd._profiler_enabled`` (`profiler_enabled`): `ops.transfer_direct` records itself for a
    profiler only while one runs (``torch.profiler.record_function`` costs microseconds, on every transfer).
    No public query. Test: ``test_profiler_enabled_follows_the_profiler``.
11. The fake-tensor logger's name, ``torch._subclasses.fake_tensor`` (`filter_fake_tensor_log`): an offloaded
    call's input error is one short error, not a logged traceback from fake tensors first. Loggers are named
    after torch's private modules. Test: ``test_fake_tensor_failures_are_logged_where_we_filter``.

Not here: ``offload_compiler/testing/simulated.py``, the simulated ``PrivateUse1`` accelerator that tests run
on, registers a device with torch's private device-guard and dispatch-key APIs (``torch._C._acc``,
``torch._C.DispatchKeySet``, ``torch._register_device_module``, ...), and wraps ``torch.accelerator``'s memory
functions and ``synchronize`` for the process (they answer from the device's own counters while it is the current
accelerator: torch's need a C++ allocator and device guard). It is test infrastructure, imported only
through ``offload_compiler.testing`` (never by the offloading code), and is excluded from
`test_no_private_torch_outside_this_module`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree  # touch point 8: re-exported, the package's only import of it
from torch import nn
from torch._dynamo import convert_frame as _convert_frame, eval_frame as _eval_frame
from torch._dynamo.eval_frame import OptimizedModule
from torch._dynamo.exc import TorchDynamoException

from .errors import OffloadRefusal
from .gc_during_capture import DeferFullCollections

_EVAL_FRAME = torch._C._dynamo.eval_frame
RECOMPILE_LIMIT = 4096  # every offloaded model of one class is a cache entry of the same code object


# ---- 1. torch.compile's module wrapper: OptimizedModule, _orig_mod ------------------------------------------

def compiled_module_of(obj: Any) -> Any:
    """``torch.compile(model)`` returns a wrapper; the state lives on the model inside it."""
    return obj._orig_mod if isinstance(obj, OptimizedModule) else obj


def _wraps_own_forward(module: nn.Module) -> bool:
    """Whether the instance's ``forward`` is ``torch.compile`` of the module's own (its wrapper carries dynamo's
    ``_torchdynamo_orig_callable``, and ``functools.wraps``'s ``__wrapped__`` leads to the bound forward)."""
    wrapped = module.__dict__.get("forward")
    if not hasattr(wrapped, "_torchdynamo_orig_callable"):
        return False  # another wrapper (accelerate's hooks wrap the forward too)
    for _ in range(3):  # torch.compile's wrapper, and one more for torch.nn's own modules
        wrapped = getattr(wrapped, "__wrapped__", None)
        if wrapped is None:
            return False
        if getattr(wrapped, "__self__", None) is module:
            return True
    return False


def compiled_models() -> list[nn.Module]:
    """The modules inside every live ``torch.compile`` wrapper (``OptimizedModule``). A backend is handed a graph
    and its inputs, never the module being compiled; the weights among those inputs are the module's own tensor
    objects, so the model is found by identity among these (`offloaded.backend_route.model_holding`), not from where dynamo
    is on the Python stack nor from how it spells a weight's source (both changed under transformers 5's
    wrapped forwards). The garbage collector's list is walked once per graph compiled (about 0.1 s with
    transformers imported); ``type(obj)`` does not run the ``__class__`` properties of lazy module objects."""
    found = []
    for obj in gc.get_objects():
        kind = type(obj)
        if issubclass(kind, OptimizedModule):
            found.append(obj._orig_mod)
        elif issubclass(kind, nn.Module) and (obj.__dict__.get("_compiled_call_impl") is not None
                                              or _wraps_own_forward(obj)):
            found.append(obj)  # compiled in place: ``model.compile(...)``, ``m.forward = torch.compile(m.forward)``
    return found


# ---- 2. the frame-converter chain: our compiles under capture_config ----------------------------------------

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


# ---- 3. skip_code: inlined, never a frame of its own --------------------------------------------------------

def inlined_only(function: Callable) -> Callable:
    """``function`` is traced into where dynamo meets it in a frame it compiles, but called from code that runs
    without a graph it runs as plain Python: dynamo does not compile its frame on its own (nested frames are
    still compiled). ``torch.compiler.disable(recursive=False)`` would also stop the inlining."""
    _eval_frame.skip_code(function.__code__)
    return function


# ---- 4. the user's fullgraph region (C state) ---------------------------------------------------------------

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


# ---- 5. dynamo's error reports: exception classes, real_stack, text -----------------------------------------

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


def model_raised(exc: BaseException) -> BaseException | None:
    """Dynamo's record of a ``raise`` in the model's code that it met while tracing with no handler for it (under
    ``fullgraph=True``: the model refused this call's inputs itself, "You have to specify input_ids"): its text
    names the model's exception. None where the model raised nothing."""
    observed = getattr(torch._dynamo.exc, "ObservedException", None)
    if observed is None:
        return None
    return next((error for error in _chain(exc) if isinstance(error, observed)), None)


def own_refusal(exc: BaseException) -> OffloadRefusal | None:
    """Our refusal under dynamo's wrappers: our backend refused a graph while dynamo compiled it, and dynamo
    reports that as ``BackendCompilerFailed`` (its message ends asking for a PyTorch bug report)."""
    return raised_within(exc, OffloadRefusal)


def raised_within(exc: BaseException, kind: type) -> BaseException | None:
    """The first error of class ``kind`` in ``exc``'s chain (what our backend raised, under dynamo's wrappers)."""
    return next((error for error in _chain(exc) if isinstance(error, kind)), None)


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


_SYMBOL = re.compile(r"\b[su]\d+\b")


def symbolic_sizes(message: str) -> bool:
    """Whether an error message shows dynamo's symbolic sizes (``s27``) instead of numbers."""
    return bool(_SYMBOL.search(message))


def short_reason(text: str) -> str:
    """The first line of dynamo's report, with its hints (``Hint: ...``, often the fix: "Enable tracing of
    dynamic shape operators with ...capture_dynamic_output_shape_ops = True")."""
    lines = [line.strip() for line in text.strip().splitlines()]
    hints = [line for line in lines[1:] if line.startswith("Hint:")]
    return " ".join(lines[:1] + hints)


# ---- 6. private config flags: ignore_logging_functions, fake_tensor_prefer_device_type ----------------------

def capture_config(device_type: str | None = None):
    """Raised recompile limits, full garbage collections deferred (`gc_during_capture`), and the logging methods
    traced as no-ops: a ``logger.warning_once`` inside a model's layer loop (transformers' sdpa attention asked
    for ``output_attentions``) is otherwise a graph break inside a loop, and dynamo runs that frame without a
    graph, reading the weights from host memory.
    With the compute device's type (an accelerator): fake tensors prefer that device where host weights meet
    device inputs (the rewritten graph fetches the weights; fake tensors would refuse the mix)."""
    limits = torch.compiler.config.patch(recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=RECOMPILE_LIMIT)
    logging_calls = torch._dynamo.config.patch(ignore_logging_functions=_logging_methods())  # touch point 6
    prefer = prefer_device_while_tracing(device_type)
    return _Patches(limits, logging_calls, DeferFullCollections(), *(() if prefer is _NOTHING else (prefer,)))


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


def _logging_methods() -> set:
    names = ("debug", "info", "warning", "warn", "error", "exception", "critical", "log", "warning_once",
             "warning_advice", "info_once")  # the last three: transformers' (set on logging.Logger when imported)
    found = {getattr(logging.Logger, name) for name in names if hasattr(logging.Logger, name)}
    return set(torch._dynamo.config.ignore_logging_functions) | found


def prefer_device_while_tracing(device_type: str | None):
    """Fake tensors prefer the compute device where host weights meet device inputs (the rewritten graph
    fetches the weights, so that is what tracing should assume); nothing for the CPU. Only while our captures
    trace: elsewhere the mix must still fail (tests/test_fake_cuda.py)."""
    functorch = getattr(torch._functorch, "config", None)
    if device_type in (None, "cpu") or not hasattr(functorch, "fake_tensor_prefer_device_type"):
        return _NOTHING
    return functorch.patch(fake_tensor_prefer_device_type=device_type)


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


# ---- 7. inductor --------------------------------------------------------------------------------------------

# inductor's modules are imported where first used: importing them takes seconds


def inductor_compile(gm: Any, example_inputs: list, config_patches: dict | None = None) -> Callable:
    """Inductor's compile of a graph our backend made (what ``torch.compile``'s default backend runs)."""
    from torch._inductor.compile_fx import compile_fx
    return compile_fx(gm, example_inputs, config_patches=config_patches)


def inductor_generates_code_for(device_type: str) -> bool:
    """Whether inductor has a kernel code generator (its "scheduling") and a wrapper code generator registered for
    ``device_type``: without them every compile for that device fails inside inductor (``KeyError: 'sim'``, a
    ``LoweringException``), at each call. Inductor registers its own devices' generators lazily
    (``init_backend_registration``); an out-of-tree device registers its own (``register_backend_for_device``)."""
    from torch._inductor.codegen import common
    common.init_backend_registration()
    return (common.get_scheduling_for_device(device_type) is not None
            and common.get_wrapper_codegen_for_device(device_type) is not None)


def register_inductor_lowering(op: Any) -> Callable[[Callable], Callable]:
    """A decorator: the function lowers ``op`` (its arguments as inductor's IR), types unpromoted."""
    from torch._inductor.lowering import register_lowering
    return register_lowering(op, type_promotion_kind=None)


def inductor_fallback(op: Any) -> Callable:
    """Inductor's lowering of ``op`` as an extern kernel call, not added to its set of fallback ops."""
    from torch._inductor.lowering import fallback_handler
    return fallback_handler(op, add_to_fallback_set=False)


def inductor_graph() -> Any:
    """The graph inductor is lowering now (``never_reuse_buffers``, ``unaligned_buffers``, ``cpp_wrapper``)."""
    from torch._inductor.virtualized import V
    return V.graph


def inductor_cache_salt(salt: str) -> dict:
    """Config patches under which inductor's FX-graph cache keys a graph also by ``salt`` (a hash of the code that
    lowers our ops): a graph compiled by another version of this package, whose generated code calls what that
    version's lowering named, is never taken from the cache. The documented way a custom pass enters the key is
    its ``uuid``; this pass changes nothing."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _Salt(CustomGraphPass):
        def __call__(self, graph: Any) -> None:
            pass

        def uuid(self) -> str:
            return salt
    return {"post_grad_custom_post_pass": _Salt()}


def inductor_kernel_of(output: Any) -> Any:
    """The extern kernel call (made by `inductor_fallback`) whose output the lowered value ``output`` is, or None:
    ``TensorBox -> StorageBox ->`` the kernel itself (torch 2.14: one output), or a ``MultiOutput`` whose input
    is the kernel (torch 2.11 and 2.13)."""
    from torch._inductor import ir
    node = output
    for _ in range(2):
        node = getattr(node, "data", None)
    if isinstance(node, ir.MultiOutput):
        node = next(iter(node.inputs or ()), None)
    return node if isinstance(node, ir.FallbackKernel) else None


# ---- 8. pytree: imported above, as `pytree` -----------------------------------------------------------------

tree_map = pytree.tree_map

# ---- 9. op overloads and their schema ----------------------------------------------------------------------

OpOverload = torch._ops.OpOverload  # the class of ``torch.ops.<namespace>.<op>.<overload>``
GROUPED_MM = getattr(torch, "_grouped_mm", None)  # what models call for grouped experts (None where absent)


def op_schema(op: Any) -> Any:
    """The ``FunctionSchema`` of an op overload (its arguments: names, defaults, which it writes); None for any
    other callable."""
    return getattr(op, "_schema", None)


def qualified_op_name(target: Any) -> str | None:
    """``namespace::name`` of an op overload or of an op packet (``torch.ops.ns.op``); None otherwise."""
    return getattr(target, "_qualified_op_name", None) or getattr(op_schema(target), "name", None)


# ---- 10. whether a profiler records -------------------------------------------------------------------------

profiler_enabled = torch._C._autograd._profiler_enabled  # () -> bool: whether a profiler records now


# ---- 11. the fake-tensor logger -----------------------------------------------------------------------------

def filter_fake_tensor_log(log_filter: logging.Filter) -> None:
    """Filter what fake tensors log (each op that fails while dynamo traces, with its traceback, to stderr)."""
    logging.getLogger("torch._subclasses.fake_tensor").addFilter(log_filter)
