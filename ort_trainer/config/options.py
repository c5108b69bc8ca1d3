"""``ORTTrainerOptions``: the legacy nested options dict, validated once into frozen sections.

``ORTTrainerOptions({"batch": {"gradient_accumulation_steps": 4}, "device": {"id": "cuda:1"}})``
exposes ``options.batch.gradient_accumulation_steps``, ``options.device.id``, ... Unknown keys and
wrong values anywhere are reported together in one ``OptionsError`` (a ValueError;
``OptionTypeError`` when every problem is a wrong type, also a TypeError) naming each dotted path.
The caller's dict is never mutated. ``check_implemented()`` rejects what this release cannot do yet.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from ort_trainer.config._checks import Checker, OptionsError, OptionTypeError, build_section, section_to_dict
from ort_trainer.config._sections import (
    BatchOptions,
    DebugOptions,
    DeepspeedZeroOptions,
    DeviceOptions,
    DistributedOptions,
    GraphSavePaths,
    GraphTransformerOptions,
    InternalUseOptions,
    MixedPrecisionOptions,
    PipelineParallelOptions,
    PropagateCastOpsConfig,
    UtilsOptions,
    default_cast_strategy,
)

__all__ = [
    "BatchOptions",
    "DebugOptions",
    "DeepspeedZeroOptions",
    "DeviceOptions",
    "DistributedOptions",
    "GraphSavePaths",
    "GraphTransformerOptions",
    "InternalUseOptions",
    "MixedPrecisionOptions",
    "ORTTrainerOptions",
    "OptionTypeError",
    "OptionsError",
    "PipelineParallelOptions",
    "PropagateCastOpsConfig",
    "UtilsOptions",
]


def _provider_options(value: Any) -> dict[str, Any]:
    """One execution provider's options ``{option: value}``, copied."""
    if not isinstance(value, Mapping):
        raise TypeError(value)
    return copy.deepcopy(dict(value))


@dataclass(frozen=True, kw_only=True)
class _RootOptions:
    """The top level of the legacy dict (``ORTTrainerOptions`` copies these attributes)."""

    _PATH: ClassVar[str] = ""
    batch: BatchOptions = field(default_factory=BatchOptions)
    device: DeviceOptions = field(default_factory=DeviceOptions)
    distributed: DistributedOptions = field(default_factory=DistributedOptions)
    lr_scheduler: Any = None
    mixed_precision: MixedPrecisionOptions = field(default_factory=MixedPrecisionOptions)
    graph_transformer: GraphTransformerOptions = field(default_factory=GraphTransformerOptions)
    utils: UtilsOptions = field(default_factory=UtilsOptions)
    debug: DebugOptions = field(default_factory=DebugOptions)
    _internal_use: InternalUseOptions = field(default_factory=InternalUseOptions)
    provider_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    session_options: Any = None

    def __post_init__(self) -> None:
        c = Checker(self)
        if self.lr_scheduler is not None:
            self._check_lr_scheduler(c)
        c.string_dict("provider_options", _provider_options, "dict of dicts {provider name: {option: value}}")
        if self.session_options is not None:
            import onnxruntime

            c.instance("session_options", onnxruntime.SessionOptions, "onnxruntime.SessionOptions")
        c.done()

    def _check_lr_scheduler(self, c: Checker) -> None:
        from ort_trainer.optim.lr_scheduler import LRScheduler  # imported here: only when a scheduler is given

        c.instance("lr_scheduler", LRScheduler, "an optim.lr_scheduler._LRScheduler")


def _gt1(value: int) -> bool:
    return value > 1


# What this release cannot do yet: (dotted option path, predicate on its value, feature name).
# Delete a row when the feature lands; check_implemented() reads nothing else.
_NOT_IMPLEMENTED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("distributed.pipeline_parallel.pipeline_parallel_size", _gt1, "pipeline parallel training"),
    ("distributed.pipeline_parallel.num_pipeline_micro_batches", _gt1, "pipeline parallel training"),
    ("distributed.pipeline_parallel.pipeline_cut_info_string", bool, "pipeline parallel training"),
    ("distributed.pipeline_parallel.sliced_schema", bool, "pipeline parallel training"),
    ("distributed.pipeline_parallel.sliced_axes", bool, "pipeline parallel training"),
    ("distributed.pipeline_parallel.sliced_tensor_names", bool, "pipeline parallel training"),
    ("distributed.enable_adasum", bool, "Adasum gradient reduction"),
    ("graph_transformer.attn_dropout_recompute", bool, "recomputation"),
    ("graph_transformer.gelu_recompute", bool, "recomputation"),
    ("graph_transformer.transformer_layer_recompute", bool, "recomputation"),
    ("graph_transformer.number_recompute_layers", bool, "recomputation"),
    (
        "graph_transformer.propagate_cast_ops_config.strategy",
        lambda v: v != default_cast_strategy(),
        "cast propagation",
    ),
    ("graph_transformer.propagate_cast_ops_config.level", lambda v: v != 1, "cast propagation"),
    ("graph_transformer.propagate_cast_ops_config.allow", bool, "cast propagation"),
    ("utils.memory_efficient_gradient", bool, "the memory-efficient gradient builder"),
)


class ORTTrainerOptions:
    """Validated, immutable trainer options built from the legacy nested dict (or another instance).

    Attributes: ``batch``, ``device``, ``distributed``, ``lr_scheduler``, ``mixed_precision``,
    ``graph_transformer``, ``utils``, ``debug``, ``_internal_use``, ``provider_options``,
    ``session_options``. Plain data is copied; schedulers, scalers, session options and callables
    are kept by reference (so a copy shares e.g. the loss scaler with the original).
    """

    batch: BatchOptions
    device: DeviceOptions
    distributed: DistributedOptions
    lr_scheduler: Any
    mixed_precision: MixedPrecisionOptions
    graph_transformer: GraphTransformerOptions
    utils: UtilsOptions
    debug: DebugOptions
    _internal_use: InternalUseOptions
    provider_options: dict[str, dict[str, Any]]
    session_options: Any

    def __init__(self, options: Mapping[str, Any] | ORTTrainerOptions | None = None) -> None:
        if isinstance(options, ORTTrainerOptions):
            options = options.to_dict()
        root = build_section(_RootOptions, {} if options is None else options, "")
        for f in fields(root):
            object.__setattr__(self, f.name, getattr(root, f.name))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"ORTTrainerOptions is immutable (cannot set {name!r}); build new options from to_dict()")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"ORTTrainerOptions is immutable (cannot delete {name!r})")

    def to_dict(self) -> dict[str, Any]:
        """The legacy nested dict with every key (tuples as lists; objects by reference)."""
        return {f.name: self._to_plain(getattr(self, f.name)) for f in fields(_RootOptions)}

    @staticmethod
    def _to_plain(value: Any) -> Any:
        if hasattr(value, "_PATH"):
            return section_to_dict(value)
        return copy.deepcopy(value) if isinstance(value, dict) else value

    def check_implemented(self) -> None:
        """Raise NotImplementedError naming every set option that this release does not support yet."""
        offenders = []
        for path, is_set, feature in _NOT_IMPLEMENTED:
            value = self._lookup(path)
            if is_set(value):
                offenders.append(f"{path}={value!r}: {feature} is not implemented yet")
        if offenders:
            lines = "\n".join(f"  - {o}" for o in sorted(offenders))
            raise NotImplementedError(f"ORTTrainerOptions: these options are not supported yet:\n{lines}")

    def _lookup(self, path: str) -> Any:
        value: Any = self
        for name in path.split("."):
            value = getattr(value, name)
        return value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ORTTrainerOptions):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # holds dicts; equality is by value

    def __repr__(self) -> str:
        inner = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(_RootOptions))
        return f"ORTTrainerOptions({inner})"
