"""`OffloadPolicy`: what to offload, where to run, and how far ahead to fetch."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import numbers
import os
import sys
import warnings
from typing import Any, Iterable, Mapping

import torch

log = logging.getLogger("offload_compiler")

IMPLEMENTED_STRATEGIES = ("none", "sequential", "layerwise", "budget", "alternating", "model")
PLANNER_STRATEGIES = ("auto",)  # chosen by offload_compiler.planning.planner, not by a fixed rule
COMPONENT_STRATEGIES = ("alternating", "model")
# the strategies that take components=: the parts that are offloaded (for the block strategies, the components of
# a pipeline streamed block by block); weights outside them stay on the compute device
COMPONENTS_TAKEN_BY = ("alternating", "sequential", "layerwise", "budget", "auto")
COMPILERS = ("eager", "inductor")
GIB = 1 << 30
KNOWN = IMPLEMENTED_STRATEGIES + PLANNER_STRATEGIES
DISK_STRATEGIES = ("layerwise", "budget", "sequential", "auto")

# Torch 2.11 and 2.12 trace a nested compile region with operands that must be plain fake tensors, so a block's
# offloaded weights (host masters, a tensor subclass) cannot enter one; 2.13 takes them.
REGIONS_TAKE_OFFLOADED_WEIGHTS = torch.__version__ >= "2.13"


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_finite(value: Any) -> bool:
    """A real number that is neither NaN nor infinite (GiB figures are turned into byte counts)."""
    return _is_number(value) and math.isfinite(value)


def _names(value: Any) -> tuple | None:
    """A string as a one-name tuple, a list or tuple as a tuple, anything else None (the caller refuses it)."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return None


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    """How a model is offloaded.

    strategy:
        ``none``       every weight group is fetched once and stays on the device (baseline).
        ``sequential`` every module that owns weights is its own group, fetched in graph order and
                       evicted after its last use.
        ``layerwise``  each transformer block (``blocks_per_group`` of them) is a group; weights outside
                       the blocks are grouped by the module that holds them.
        ``budget``     like vLLM's ``cpu_offload_gb``: ``offload_gb`` GiB of weights are streamed
                       (whole blocks, front to back, then the largest other groups), the rest stays
                       resident on the device.
        ``auto``       a planner picks the resident groups, the prefetch depth and ``blocks_per_group``
                       that minimise the predicted forward time with a predicted device peak (weights and
                       activations) within ``device_budget_gb``; it plans at the first call.
    device:            the compute device; weights live in host memory.
    prefetch:          how many groups are fetched ahead of the one being computed.
    prefetch_next_call: prefetch wrap-around: the last groups of a call prefetch the first ``prefetch`` groups
                       of the next call of the same graph (decode loops, denoising steps), so the first fetch
                       overlaps the previous call's tail. Those copies stay on the device between calls
                       (``offload_stats().carried_bytes``; `release_device_copies` drops them); a copy whose
                       host weights changed meanwhile is fetched again.
    blocks_per_group:  consecutive blocks that move together (layerwise, budget).
    offload_gb:        GiB of weights streamed (budget).
    device_budget_gb:  GiB of device memory the model may use (auto), or ``"free"``: what the device has free
                       when planning (available RAM for ``cpu``) minus ``budget_margin_gb``.
    budget_margin_gb:  GiB left unused when ``device_budget_gb="free"`` (default 0.5).
    pin_memory:        pin host masters (one exact-size buffer per group) where an accelerator exists.
    compiler:          ``eager`` runs the rewritten graph as is; ``inductor`` compiles it.
    offload_buffers:   stream buffers with their group; set False to keep every buffer resident.
    blocks_attr:       dotted path(s) of the module(s) whose children are the blocks (a ModuleList, a
                       Sequential with numbered or named children, ...); overrides
                       ``_layerwise_offload_blocks_attr``.
    fullgraph:         ask dynamo for one graph (error on a graph break) in ``offload_compile``.
    regional:          regional compilation: the blocks of a stack (layers of one class) are traced once and
                       that graph reused for the others (``torch.compiler.nested_compile_region`` on their
                       class), so the first call's capture grows far less with depth; each block still
                       streams its own weights. Where dynamo cannot reuse a block (a KV cache updated inside
                       it) it traces each as before; where it refuses the region, the model is captured
                       whole, with one warning.
    debug_poison:      fill every evicted device copy with NaN (or the dtype's max) so that a read after
                       eviction shows in the output instead of silently reading stale memory.
    components:        the parts that are offloaded; weights outside them stay resident on the device.
                       ``alternating`` and ``sequential``: component names, dotted paths or globs (``thinker``,
                       ``thinker.visual``, ``visual.*``); None means every component discovered (``thinker``,
                       ``talker``, ``code2wav``, ``token2wav``, ``visual``, ``audio_tower``, ``language_model``);
                       with ``alternating``, a model with none of them (a stage model loaded on its own) is its
                       one component, fetched for each call and given back after it, device memory included.
                       ``layerwise``, ``budget``, ``auto`` on a pipeline object: the names of its components
                       streamed block by block (``["text_encoder", "transformer", "vae"]``); None means its
                       encoders, then its denoisers. On an nn.Module these refuse it (they stream the blocks of
                       the whole model; ``blocks_attr`` names the blocks).
    keep_after_use:    ``alternating``/``model``: a component stays on the device after its forward until
                       another component needs the room (latency-minimising, the default); False evicts it
                       after use (memory-saving).
    host_budget_gb:    GiB of host memory the packed weights may hold; the streamed groups beyond it (the
                       largest first; of equal groups, blocks, spread evenly over the call) stay in files under
                       ``disk_dir`` and are read from there at each fetch (layerwise, budget, sequential).
    disk_dir:          an existing directory for those files (on a fast local disk); needs ``host_budget_gb``.

    ``alternating``: when a component runs it is on the device and the other components are not.
    ``model``: diffusion model-level offload: the DiT modules (``transformer``, ``transformer_2``, ``dit``,
    ``language_model``, ``transformer_blocks``) and the encoders (``text_encoder``..., ``image_encoder``)
    alternate on the device; everything else (the VAE) stays resident.
    """

    strategy: str = "layerwise"
    device: Any = None
    prefetch: int = 1
    blocks_per_group: int = 1
    offload_gb: float | None = None
    device_budget_gb: float | str | None = None
    budget_margin_gb: float = 0.5
    pin_memory: bool = True
    compiler: str = "eager"
    offload_buffers: bool = True
    blocks_attr: str | tuple[str, ...] | None = None
    fullgraph: bool = False
    regional: bool = False
    debug_poison: bool = False
    components: tuple[str, ...] | None = None
    keep_after_use: bool = True
    prefetch_next_call: bool = False
    host_budget_gb: float | None = None
    disk_dir: str | None = None

    def __new__(cls, *args: Any, **fields: Any) -> "OffloadPolicy":
        _refuse_unknown_fields(cls, fields)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        if not isinstance(self.strategy, str):
            raise ValueError(f"strategy must be a string, one of {KNOWN}; got {self.strategy!r}")
        strategy = self.strategy.strip().lower()
        if strategy not in KNOWN:
            raise ValueError(f"strategy={self.strategy!r} is unknown; choose one of {KNOWN}")
        set_("strategy", strategy)
        set_("device", str(validate_device(self.device)))
        for name, low in (("prefetch", 0), ("blocks_per_group", 1)):
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
            set_(name, int(value))
        if self.offload_gb is not None:
            if not _is_finite(self.offload_gb) or self.offload_gb < 0:
                raise ValueError(f"offload_gb must be a number of GiB >= 0 (finite); got {self.offload_gb!r}")
            set_("offload_gb", float(self.offload_gb))
        if strategy == "budget" and self.offload_gb is None:
            raise ValueError("strategy='budget' needs offload_gb: the GiB of weights to stream from host memory "
                             "(e.g. OffloadPolicy(strategy='budget', offload_gb=8))")
        if strategy != "budget" and self.offload_gb is not None:
            raise ValueError(f"offload_gb is used by strategy='budget' only; got strategy={strategy!r}. Use "
                             f"strategy='budget' to stream offload_gb GiB, or drop offload_gb")
        self._validate_budget(strategy)
        if self.compiler not in COMPILERS:
            raise ValueError(f"compiler={self.compiler!r} is unknown; choose one of {COMPILERS}")
        if self.components is not None:
            names = _names(self.components)
            if not names or not all(isinstance(n, str) and n.strip() for n in names):
                raise ValueError(f"components must be a list of component names or None (all discovered); "
                                 f"got {self.components!r}")
            names = tuple(n.strip() for n in names)
            if strategy not in COMPONENTS_TAKEN_BY:
                raise ValueError(f"components apply to strategies {COMPONENTS_TAKEN_BY}, not {strategy!r}"
                                 + (": 'model' finds a pipeline's denoisers and encoders itself; to choose them, "
                                    "use strategy='alternating' with components" if strategy == "model" else ""))
            set_("components", names)
        for name in ("pin_memory", "offload_buffers", "fullgraph", "regional", "debug_poison", "keep_after_use",
                     "prefetch_next_call"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False; got {getattr(self, name)!r}")
        if self.regional and not REGIONS_TAKE_OFFLOADED_WEIGHTS:
            raise ValueError(f"regional=True needs torch >= 2.13: torch {torch.__version__} cannot pass a block's "
                             f"offloaded weights into a nested compile region. Use regional=False (each block is "
                             f"traced inline, a longer first capture, the same streaming), or upgrade torch")
        if not self.keep_after_use and strategy not in COMPONENT_STRATEGIES:
            raise ValueError(f"keep_after_use=False applies to strategy 'alternating' or 'model' (a component stays on "
                             f"the device after its forward); strategy={strategy!r} already evicts each group after "
                             f"its last use. Drop keep_after_use, or use strategy='alternating'")
        if self.prefetch_next_call and strategy in COMPONENT_STRATEGIES:
            raise ValueError(f"prefetch_next_call does not apply to strategy={strategy!r}: a component is alone on the "
                             f"device, and keep_after_use=True already keeps the last one for the next call")
        if self.prefetch_next_call and self.prefetch == 0 and strategy != "auto":
            raise ValueError("prefetch_next_call=True needs prefetch >= 1: it moves the first prefetches of a call "
                             "into the previous call")
        self._validate_disk(strategy)
        if self.blocks_attr is not None:
            attrs = _names(self.blocks_attr)
            if not attrs or not all(isinstance(a, str) and a for a in attrs):
                raise ValueError(f"blocks_attr must be a dotted attribute path or a list of them; got {self.blocks_attr!r}")
            set_("blocks_attr", attrs if len(attrs) > 1 else attrs[0])

    def _validate_budget(self, strategy: str) -> None:
        budget, margin = self.device_budget_gb, self.budget_margin_gb
        if isinstance(budget, str):
            if budget.strip().lower() != "free":
                raise ValueError(f"device_budget_gb must be a number of GiB > 0 or 'free'; got {budget!r}")
            object.__setattr__(self, "device_budget_gb", "free")
        elif budget is not None:
            if not _is_finite(budget) or budget <= 0:
                raise ValueError(f"device_budget_gb must be a number of GiB > 0 (finite) or 'free'; got {budget!r}")
            object.__setattr__(self, "device_budget_gb", float(budget))
        if not _is_finite(margin) or margin < 0:
            raise ValueError(f"budget_margin_gb must be a number of GiB >= 0 (finite); got {margin!r}")
        object.__setattr__(self, "budget_margin_gb", float(margin))
        if strategy == "auto" and budget is None:
            raise ValueError("strategy='auto' needs device_budget_gb: the GiB of device memory the model may use "
                             "(e.g. OffloadPolicy(strategy='auto', device_budget_gb=6)), or device_budget_gb='free'")
        if strategy != "auto" and budget is not None:
            raise ValueError(f"device_budget_gb is used by strategy='auto' only; got strategy={strategy!r}. "
                             f"Use strategy='auto', or offload_gb with strategy='budget'")

    def _validate_disk(self, strategy: str) -> None:
        budget, folder = self.host_budget_gb, self.disk_dir
        if budget is None and folder is None:
            return
        if budget is None or folder is None:
            raise ValueError("host_budget_gb and disk_dir go together: host_budget_gb GiB of weights stay in host "
                             "memory and the streamed groups beyond it are read from files in disk_dir (e.g. "
                             "OffloadPolicy(host_budget_gb=16, disk_dir='/mnt/nvme/offload'))")
        if not _is_finite(budget) or budget < 0:
            raise ValueError(f"host_budget_gb must be a number of GiB >= 0 (finite); got {budget!r}")
        object.__setattr__(self, "host_budget_gb", float(budget))
        if not isinstance(folder, (str, os.PathLike)) or not os.path.isdir(folder):
            raise ValueError(f"disk_dir must be an existing directory; got {folder!r}")
        if not os.access(folder, os.W_OK):
            raise ValueError(f"disk_dir={str(folder)!r} is not writable: the weights beyond host_budget_gb are "
                             f"written there")
        object.__setattr__(self, "disk_dir", os.fspath(folder))
        if strategy not in DISK_STRATEGIES:
            raise ValueError(f"host_budget_gb (the disk tier) applies to strategies {DISK_STRATEGIES}, which stream "
                             f"groups at every call; strategy={strategy!r} does not")

    @property
    def host_budget_bytes(self) -> int | None:
        return None if self.host_budget_gb is None else int(self.host_budget_gb * GIB)

    @property
    def offload_bytes(self) -> int | None:
        return None if self.offload_gb is None else int(self.offload_gb * GIB)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @classmethod
    def from_engine_args(cls, args: Mapping[str, Any]) -> "OffloadPolicy":
        """The policy named by seed engine args: ``cpu_offload_enabled``, ``cpu_offload_components``,
        ``cpu_offload_strategy``, ``cpu_offload_pin_memory``, ``enable_cpu_offload``,
        ``enable_layerwise_offload``, ``cpu_offload_gb`` (see `policy_from_engine_args`)."""
        return policy_from_engine_args(args)

    def replace(self, **changes: Any) -> "OffloadPolicy":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> "OffloadPolicy":
        """The policy named by ``torch.compile(..., options=...)``: ``{"policy": OffloadPolicy}``, fields, or the
        policy itself (torch hands a backend's ``options`` over as given)."""
        if isinstance(options, OffloadPolicy):
            return options
        try:
            options = dict(options or {})
        except (TypeError, ValueError):  # torch passes options on unchecked: a string, a number
            raise ValueError(f"omni_offload options must be a dict of policy fields, {{'policy': OffloadPolicy(...)}} "
                             f"or an OffloadPolicy; got {type(options).__name__}") from None
        fields = sorted(f.name for f in dataclasses.fields(cls))
        unknown = sorted(set(options) - set(fields) - {"policy"})
        if unknown:
            close = closest_name(unknown[0], [*fields, "policy"])
            hint = f"did you mean {close!r}? " if close else ""
            raise ValueError(f"unknown omni_offload option(s) {unknown}; {hint}valid options are {fields} or 'policy'")
        if "policy" in options:
            policy = options.pop("policy")
            if not isinstance(policy, OffloadPolicy):
                raise ValueError(f"options['policy'] must be an OffloadPolicy; got {type(policy).__name__}")
            return policy.replace(**options) if options else policy
        return cls(**options)


def spelled(policy: OffloadPolicy, **changes: Any) -> str:
    """``policy`` with ``changes`` as the call that makes it, for an error's fix: ``OffloadPolicy(strategy=
    'layerwise', components=['text_encoder', 'vae'])``, the fields that differ from their defaults (``device``
    too, where it is not the default one)."""
    policy = policy.replace(**changes)
    shown = []
    for field in dataclasses.fields(OffloadPolicy):
        value = getattr(policy, field.name)
        default = default_device() if field.name == "device" else field.default
        if value != default or field.name == "strategy":
            shown.append(f"{field.name}={list(value) if isinstance(value, tuple) else value!r}")
    return f"OffloadPolicy({', '.join(shown)})"


def closest_name(name: str, known: Iterable[str]) -> str | None:
    """The known name a misspelt ``name`` most likely meant (``prefech``: ``prefetch``), or None: the one
    suggestion every "unknown field/option/key" message of the policy makes."""
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return close[0] if close else None


def _refuse_unknown_fields(cls: type, fields: Mapping[str, Any]) -> None:
    """A TypeError naming the closest field for a misspelt keyword (``prefech=2``: did you mean 'prefetch'?)."""
    known = sorted(f.name for f in dataclasses.fields(cls))
    for name in fields:
        if name not in known:
            close = closest_name(name, known)
            hint = f"did you mean {close!r}?" if close else f"the fields are {known}"
            raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {name!r}; {hint}")


def validate_device(device: Any) -> torch.device:
    """``device`` as a torch.device that exists on this machine (None: the default one); a ValueError naming the
    devices there are otherwise."""
    if device is None:
        return torch.device(default_device())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a device torch knows (e.g. 'cuda', 'cuda:0', 'cpu'): {exc}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "meta":
        raise ValueError("device='meta' cannot run a model; use 'cuda' or 'cpu'")
    backend = getattr(torch, dev.type, None)
    available = bool(backend is not None and hasattr(backend, "is_available") and backend.is_available())
    if not available:
        raise ValueError(f"device={str(dev)!r} is not available on this machine "
                         f"(torch.{dev.type}.is_available() is False); use device='cpu'")
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    index = dev.index if dev.index is not None else backend.current_device()
    if index >= count:
        raise ValueError(f"device={str(dev)!r} does not exist: this machine has {count} {dev.type} device(s) "
                         f"(indices 0..{count - 1})")
    return torch.device(dev.type, index)


# -- engine args as the seeds spell them (stage YAML files: `offload_compiler.config`) ----------------------

OFFLOAD_ARGS = {
    "cpu_offload_enabled", "cpu_offload_components", "cpu_offload_strategy", "cpu_offload_pin_memory",
    "enable_cpu_offload", "enable_layerwise_offload", "cpu_offload_gb",
}
POLICY_FIELDS = {f.name for f in dataclasses.fields(OffloadPolicy)}
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# engine arguments that are not about offloading: accepted and carried, never interpreted here
ENGINE_ARGS = {
    "model", "model_stage", "model_arch", "dtype", "max_model_len", "max_num_seqs", "gpu_memory_utilization",
    "tensor_parallel_size", "pipeline_parallel_size", "enforce_eager", "trust_remote_code", "swap_space",
    "engine_output_type", "seed", "tokenizer", "revision", "quantization", "max_num_batched_tokens",
    "enable_prefix_caching", "enable_chunked_prefill", "worker_cls", "scheduler_cls", "hf_overrides",
    "vae_use_tiling", "vae_use_slicing", "distributed_executor_backend", "kv_cache_dtype", "block_size",
}


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    raise ValueError(f"{name} must be true or false; got {value!r}")


def _components(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [part for part in value.split(",")]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"cpu_offload_components must be a list of component names (or a comma-separated "
                         f"string); got {value!r}")
    return tuple(v.strip() for v in value if v.strip())


def check_keys(args: Mapping[str, Any], where: str = "engine args") -> None:
    known = OFFLOAD_ARGS | POLICY_FIELDS | ENGINE_ARGS
    for key in args:
        if key not in known:
            close = closest_name(key, known)
            hint = f"; did you mean {close!r}?" if close else ""
            raise ValueError(f"unknown key {key!r} in {where}{hint}")


SELECTORS = ("enable_layerwise_offload", "enable_cpu_offload", "cpu_offload_enabled", "cpu_offload_gb")  # precedence
PRECEDENCE = " > ".join(SELECTORS)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn with the location of the first caller outside this package (the user's code), however many of our
    functions the call went through."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def _offload_gib(value: Any, where: str) -> float | None:
    """``cpu_offload_gb`` as a number of GiB: a number, or the text of one (YAML reads ``1e-6`` as a string)."""
    if value is None:
        return None
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not number >= 0:
        raise ValueError(f"{where}: cpu_offload_gb={value!r} must be the GiB of weights to stream from host memory, "
                         f"a number >= 0 (0: no budget offload), e.g. cpu_offload_gb: 4.0")
    return float(number)


def _on(args: Mapping[str, Any], key: str) -> bool:
    if key == "cpu_offload_gb":
        return bool(args.get(key))
    return _bool(key, args.get(key, False))


def _selected(args: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(strategy, the key that selects it) by the seed precedence; (None, None) when no key selects one."""
    strategy = _component_strategy(args)  # checked even where another key wins: a typo is never ignored
    winner = next((key for key in SELECTORS if _on(args, key)), None)
    if winner != "cpu_offload_enabled":
        return {"enable_layerwise_offload": "layerwise", "enable_cpu_offload": "model",
                "cpu_offload_gb": "budget"}.get(winner), winner
    return strategy, winner


def _component_strategy(args: Mapping[str, Any]) -> str:
    strategy = str(args.get("cpu_offload_strategy", "alternating")).strip().lower()
    if strategy not in ("alternating", "sequential"):
        raise ValueError(f"cpu_offload_strategy={args.get('cpu_offload_strategy')!r} is unknown; choose "
                         f"'alternating' or 'sequential'")
    return strategy


def _ignored(args: Mapping[str, Any], strategy: str | None, winner: str | None) -> list[tuple[str, str]]:
    """(key, why) for each offload key set in ``args`` that has no effect once ``winner`` selected ``strategy``."""
    found = []
    given = str(args.get("strategy", "")).strip().lower()
    if winner is not None and given and given != strategy:
        found.append(("strategy", f"{winner} selects strategy {strategy!r}; remove one of them"))
    if winner is not None:
        # enable_cpu_offload loses only to enable_layerwise_offload, which has the seed guide's own warning
        found += [(key, f"{winner} wins ({PRECEDENCE}); remove one of them")
                  for key in SELECTORS[SELECTORS.index(winner) + 1:] if key != "enable_cpu_offload" and _on(args, key)]
    if winner != "cpu_offload_enabled":
        why = (f"{winner} wins ({PRECEDENCE})" if winner in SELECTORS[:2]
               else "cpu_offload_enabled is not true; set cpu_offload_enabled: true to offload components")
        found += [(key, why) for key in ("cpu_offload_components", "cpu_offload_strategy") if args.get(key) is not None]
    return found


def policy_from_engine_args(args: Mapping[str, Any], where: str = "engine args") -> OffloadPolicy:
    """The policy the seed engine args ask for. Precedence: ``enable_layerwise_offload`` (layerwise) over
    ``enable_cpu_offload`` (diffusion model-level) over ``cpu_offload_enabled`` (component offload with
    ``cpu_offload_strategy``) over ``cpu_offload_gb`` > 0 (budget); none of them means strategy ``none``, or the
    ``strategy`` field when given. Each key that has no effect (an explicit ``strategy`` that a key above
    overrides included) is a UserWarning naming the key and what wins. OffloadPolicy field names
    (``device``, ``prefetch``, ...) pass through."""
    check_keys(args, where)
    if "cpu_offload_gb" in args:
        args = {**args, "cpu_offload_gb": _offload_gib(args["cpu_offload_gb"], where)}
    fields = {k: v for k, v in args.items() if k in POLICY_FIELDS}
    if "cpu_offload_pin_memory" in args:
        fields["pin_memory"] = _bool("cpu_offload_pin_memory", args["cpu_offload_pin_memory"])
    strategy, winner = _selected(args)
    if winner == "enable_layerwise_offload" and _bool("enable_cpu_offload", args.get("enable_cpu_offload", False)):
        warn_user("enable_cpu_offload and enable_layerwise_offload are both set: layerwise offload takes "
                  "priority and model-level offload is ignored")
    for key, why in _ignored(args, strategy, winner):
        warn_user(f"{where}: {key} is ignored: {why}")
    if strategy is None:
        fields.setdefault("strategy", "none")
        return OffloadPolicy(**fields)
    fields["strategy"] = strategy
    if winner == "cpu_offload_enabled":
        fields["components"] = _components(args.get("cpu_offload_components"))
    elif winner == "cpu_offload_gb":
        fields["offload_gb"] = args["cpu_offload_gb"]
    return OffloadPolicy(**fields)
