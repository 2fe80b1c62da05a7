"""The entry layer (see `forwards`)."""

from .forwards import (OffloadState, OffloadedModule, Outside, PipelineModules, add_method, detach,
                       install_output_capture, offload_module, offload_pipeline, omni_offload, state_of)

__all__ = ["OffloadState", "OffloadedModule", "Outside", "PipelineModules", "add_method", "detach",
           "install_output_capture", "offload_module", "offload_pipeline", "omni_offload", "state_of"]
