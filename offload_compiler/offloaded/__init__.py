"""The offloaded model: the model object itself, with exactly one `OffloadState`, reached one way (`state_of`).

Every entry point ends here — `offload_compile` (modules and pipelines, every strategy, ``auto`` included) and
``torch.compile(model, backend="omni_offload")`` — as FSDP2's ``fully_shard`` does: the model is offloaded in
place. Its class is swapped for a subclass of `OffloadedModule` (and of its own class, with its name) that
carries the guards (``.to``, dtype changes, copy, pickle, ``load_state_dict(assign=True)``); its ``forward``,
and those of the modules that contain its groups or are its components, become `_OffloadedForward` objects
that run the offloaded graphs; hooks registered on any of its modules afterwards are refused (the captured
graphs could not see them).

How a call reaches the weights, route by route:
- a direct call, ``generate()``, a pipeline holding the object, a container or component called on its own:
  ``module.forward`` is an `_OffloadedForward`, which runs the module's own offloaded graph;
- any other module holding offloaded weights, called from Python outside an offloaded call (by hand, from a
  method of the model, from its forward reached around the instance attribute): its class is swapped for a
  routed class (`RoutedPart`, one per class), whose ``forward`` runs that module's own offloaded graph;
- the user's ``torch.compile`` around the model (or around code calling it): `_OffloadedForward.__call__`
  calls a ``torch.compiler.disable``d function there, so the model is a clean boundary in the user's graph
  (its own graph runs, already compiled as the policy says); under ``fullgraph=True`` dynamo's error names the
  reason;
- our own capture: where dynamo traces one of our offloaded calls (a trace-time constant, not a guard), the
  installed forwards' ``__call__`` traces into the module's code (one graph per call, no break per container),
  as the routed classes' ``forward`` traces into each part's own (the same code and class for every layer of a
  stack, so a block marked with ``torch.compiler.nested_compile_region`` is traced once and reused);
- part of the forward run by dynamo without a graph (a graph break inside a loop): the modules it calls are
  parts called from Python, so each runs its own offloaded graph (slower, module by module), and a weight it
  computes with directly is a host master, read on demand for that op (`host_masters`); what such code read,
  measured (bytes fetched by those graphs, bytes and ops on demand), is said once per model.

The package by job, imports flowing down this list: `hooks` (the hook watch) and `outside` (what a call read
outside its graphs) and `pipeline` (a pipeline seen as one model); `state` (`OffloadState`, its `Phase`, every
change of it); `auto_plan` (``auto`` planned at the first call); `targets` (which modules get which forward);
`call_io` (a call's inputs and outputs); `forwards` (the installed callables and their installation); `module`
(the offloaded class); `install` (offloading a model or pipeline in place); `backend_route` (``omni_offload``).
"""

from .backend_route import omni_offload
from .forwards import add_method
from .install import install_output_capture, offload_module, offload_pipeline, refuse_other_offloaders
from .module import OffloadedModule
from .outside import Outside
from .pipeline import PipelineModules
from .state import OffloadState, state_of

__all__ = ["OffloadState", "OffloadedModule", "Outside", "PipelineModules", "add_method",
           "install_output_capture", "offload_module", "offload_pipeline", "omni_offload", "refuse_other_offloaders",
           "state_of"]
