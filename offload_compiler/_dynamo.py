"""Every use of dynamo's private surface, in one place: what a torch upgrade may break is here and nowhere else.

- `compiled_module_of`: the module inside a ``torch.compile`` wrapper (``OptimizedModule``).
- `skipped_frames`: how many frames dynamo has run without a graph (a graph break inside a loop, the
  recompile limit), so an offloaded call can notice that part of its model ran eagerly.
- `model_error`: the model's own exception under dynamo's ``TorchRuntimeError`` wrapper.
- `traced_module`: the module whose frame dynamo is compiling, found from a weight's source name;
  `weight_path`: a weight's dotted name from its source.
- `static_shapes`, `symbolic_sizes`, `user_frame`: a model error traced with symbolic sizes (``s27``) traced
  again with the call's own sizes, and the line of the model's code that failed.
- `capture_config`: the config patch our captures run under (made once per model: torch keeps a ContextVar
  per patch object): raised recompile limits, and logging calls traced as no-ops.
- `graph_breaks`, `graph_breaks_since`: the reasons of the graph breaks of one call, for an error that follows
  from one.
- `module_being_compiled`: the model inside the ``torch.compile`` wrapper whose call dynamo is compiling.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from torch._dynamo.exc import TorchDynamoException, TorchRuntimeError
from torch._dynamo.utils import counters

RECOMPILE_LIMIT = 4096  # every offloaded model of one class is a cache entry of the same code object


def compiled_module_of(obj: Any) -> Any:
    """``torch.compile(model)`` returns a wrapper; the state lives on the model inside it."""
    return obj._orig_mod if isinstance(obj, OptimizedModule) else obj


def skipped_frames() -> int:
    frames = counters["frames"]
    return frames["total"] - frames["ok"]


def graph_breaks() -> dict[str, int]:
    """How often dynamo met each graph-break reason so far (compare with `graph_breaks_since`)."""
    return dict(counters["graph_break"])


def graph_breaks_since(before: dict[str, int]) -> list[str]:
    """The first line of each graph-break reason dynamo met since ``before``."""
    return [reason.strip().splitlines()[0] for reason, count in counters["graph_break"].items()
            if count > before.get(reason, 0)]


def capture_config():
    """Raised recompile limits, and the logging methods traced as no-ops: a ``logger.warning_once`` inside a
    model's layer loop (transformers' sdpa attention asked for ``output_attentions``) is otherwise a graph
    break inside a loop, and dynamo runs that frame without a graph, reading the weights from host memory."""
    return torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=RECOMPILE_LIMIT,
                                      ignore_logging_functions=_logging_methods())


def _logging_methods() -> set:
    names = ("debug", "info", "warning", "warn", "error", "exception", "critical", "log", "warning_once",
             "warning_advice", "info_once")  # the last three: transformers' (set on logging.Logger when imported)
    found = {getattr(logging.Logger, name) for name in names if hasattr(logging.Logger, name)}
    return set(torch._dynamo.config.ignore_logging_functions) | found


_SYMBOL = re.compile(r"\b[su]\d+\b")


def symbolic_sizes(message: str) -> bool:
    """Whether an error message shows dynamo's symbolic sizes (``s27``) instead of numbers."""
    return bool(_SYMBOL.search(message))


def static_shapes():
    """Trace with the call's own sizes (no automatic dynamic shapes): errors then show numbers."""
    return torch._dynamo.config.patch(automatic_dynamic_shapes=False)


def user_frame(exc: BaseException) -> str | None:
    """``file.py:10 in forward: x = self.proj(x)``: the innermost line of the model's code that dynamo's report
    (``from user code:``) names, outside torch and offload_compiler."""
    seen, found = set(), None
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        if "from user code:" in text:
            lines = text.split("from user code:", 1)[1].splitlines()
            for i, line in enumerate(lines):
                match = _FRAME.match(line)
                if match and not match.group(1).startswith(_NOT_USER_CODE):
                    code = lines[i + 1].strip() if i + 1 < len(lines) else ""
                    found = f"{os.path.basename(match.group(1))}:{match.group(2)} in {match.group(3)}: {code}"
            if found:
                return found
        exc = exc.__cause__ or exc.__context__
    return None


_NOT_USER_CODE = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
_FRAME = re.compile(r'\s*File "([^"]+)", line (\d+), in (\S+)')


def is_tracing_error(exc: BaseException) -> bool:
    return isinstance(exc, TorchRuntimeError)


def model_error(exc: BaseException) -> BaseException | None:
    """The error the model's code raised while dynamo traced it (with fake tensors), under dynamo's wrappers."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if not isinstance(exc, TorchDynamoException) and isinstance(exc, (RuntimeError, ValueError, TypeError,
                                                                          IndexError)):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def is_graph_break(exc: BaseException) -> bool:
    return "graph break" in str(exc).lower() or type(exc).__name__ == "Unsupported"


_LOCAL = re.compile(r"^([LG])\['([^']+)'\]")


def traced_module(gm: torch.fx.GraphModule) -> nn.Module | None:
    """The module dynamo is tracing, found from a weight's source name and the frame being compiled."""
    names = []
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.meta.get("grapharg") is not None:
            source = node.meta["grapharg"].source.name
            match = _LOCAL.match(source)
            if match and ("._parameters[" in source or "._buffers[" in source):
                names.append(match.groups())
    if not names:
        return None
    scope, name = max(set(names), key=names.count)
    frame = sys._getframe()
    while frame is not None:
        traced = frame.f_locals.get("frame")
        if traced is not None and hasattr(traced, "f_locals") and hasattr(traced, "f_globals"):
            root = (traced.f_locals if scope == "L" else traced.f_globals).get(name)
            if isinstance(root, nn.Module):
                return root
        frame = frame.f_back
    return None


def weight_path(placeholder: torch.fx.Node) -> str:
    """``blocks.3.lin.weight``, from dynamo's source of a module's parameter (else the placeholder's name)."""
    grapharg = placeholder.meta.get("grapharg")
    source = grapharg.source.name if grapharg is not None else ""
    return ".".join(re.findall(r"_(?:modules|parameters|buffers)\['([^']+)'\]", source)) or placeholder.name


def module_being_compiled() -> nn.Module | None:
    """The model inside the ``torch.compile(model)`` wrapper whose call dynamo is compiling now (from the
    wrapper's frame on the stack), or None when a function was compiled."""
    frame = sys._getframe(1)
    while frame is not None:
        wrapper = frame.f_locals.get("self")
        if isinstance(wrapper, OptimizedModule):
            return wrapper._orig_mod
        frame = frame.f_back
    return None
