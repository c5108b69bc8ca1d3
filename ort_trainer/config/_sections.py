"""The option sections behind ``ORTTrainerOptions``: one frozen dataclass per legacy sub-dict.

Each section knows its dotted location (``_PATH``) and validates itself once in ``__post_init__``
(every problem reported together); lists are stored as tuples and dicts are copied, so a section
never shares mutable data with the caller. Defaults follow the legacy schema except where noted.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from ort_trainer.amp import DynamicLossScaler, LossScaler
from ort_trainer.config._checks import Checker

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
    "PipelineParallelOptions",
    "PropagateCastOpsConfig",
    "UtilsOptions",
    "default_cast_strategy",
]

_DEVICE_ID = re.compile(r"cpu|cuda(:\d+)?")


class _CastStrategy(enum.Enum):
    """Stand-in for ``onnxruntime.training.PropagateCastOpsStrategy`` where onnxruntime-training is not installed."""

    NONE = 0
    INSERT_AND_REDUCE = 1
    FLOOD_FILL = 2


def default_cast_strategy() -> Any:
    """Default cast-propagation strategy (imported lazily: onnxruntime is slow to import).

    onnxruntime-training's enum where it is installed; with the stock onnxruntime, a stand-in with its names.
    """
    try:
        from onnxruntime.training import PropagateCastOpsStrategy
    except ImportError:
        return _CastStrategy.FLOOD_FILL
    return PropagateCastOpsStrategy.FLOOD_FILL


@dataclass(frozen=True, kw_only=True)
class BatchOptions:
    _PATH: ClassVar[str] = "batch"
    gradient_accumulation_steps: int = 1

    def __post_init__(self) -> None:
        c = Checker(self)
        c.integer("gradient_accumulation_steps", lo=1)
        c.done()


@dataclass(frozen=True, kw_only=True)
class DeviceOptions:
    """``id`` is "cpu", "cuda" or "cuda:N"; ``mem_limit`` > 0 caps the CUDA arena (bytes)."""

    _PATH: ClassVar[str] = "device"
    id: str = "cpu"
    mem_limit: int = 0

    def __post_init__(self) -> None:
        c = Checker(self)
        c.string("id")
        if c.ok("id") and not _DEVICE_ID.fullmatch(self.id):
            c.fail("id", f"expected 'cpu', 'cuda' or 'cuda:N', got {self.id!r}")
        c.integer("mem_limit", lo=0)
        c.done()


def _int_tuple(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise TypeError(value)
    return tuple(value)


def _plain_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(value)
    return value


@dataclass(frozen=True, kw_only=True)
class PipelineParallelOptions:
    _PATH: ClassVar[str] = "distributed.pipeline_parallel"
    pipeline_parallel_size: int = 1
    num_pipeline_micro_batches: int = 1
    pipeline_cut_info_string: str = ""
    sliced_schema: dict[str, tuple[int, ...]] = field(default_factory=dict)
    sliced_axes: dict[str, int] = field(default_factory=dict)
    sliced_tensor_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        c = Checker(self)
        c.integer("pipeline_parallel_size", lo=1)
        c.integer("num_pipeline_micro_batches", lo=1)
        c.string("pipeline_cut_info_string")
        c.string_dict("sliced_schema", _int_tuple, "dict of str -> list of int")
        c.string_dict("sliced_axes", _plain_int, "dict of str -> int")
        c.string_list("sliced_tensor_names")
        c.done()


@dataclass(frozen=True, kw_only=True)
class DeepspeedZeroOptions:
    """ZeRO stage: 0 (off), 1 (optimizer state sharded) or 2 (+ gradients sharded)."""

    _PATH: ClassVar[str] = "distributed.deepspeed_zero_optimization"
    stage: int = 0

    def __post_init__(self) -> None:
        c = Checker(self)
        c.integer("stage", lo=0, hi=2)
        c.done()


def _env_int(var: str, default: int) -> int | str:
    """torchrun's environment variable ``var`` as an int, ``default`` if unset (raw text if not an int)."""
    raw = os.environ.get(var, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        return raw


_ENV_DEFAULTS = {"world_rank": ("RANK", 0), "world_size": ("WORLD_SIZE", 1), "local_rank": ("LOCAL_RANK", 0)}


@dataclass(frozen=True, kw_only=True)
class DistributedOptions:
    """Process topology. ``None`` for world_rank/world_size/local_rank means: read torchrun's
    RANK/WORLD_SIZE/LOCAL_RANK (else 0/1/0); ``data_parallel_size`` None means
    ``world_size // horizontal_parallel_size``. After construction all are ints."""

    _PATH: ClassVar[str] = "distributed"
    world_rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    data_parallel_size: int | None = None
    horizontal_parallel_size: int = 1
    horizontal_parallel_blocks: tuple = ()  # [(columns, row), ...] module names / fnmatch patterns (docs/megatron.md)
    pipeline_parallel: PipelineParallelOptions = field(default_factory=PipelineParallelOptions)
    allreduce_post_accumulation: bool = False
    deepspeed_zero_optimization: DeepspeedZeroOptions = field(default_factory=DeepspeedZeroOptions)
    enable_adasum: bool = False

    def __post_init__(self) -> None:
        c = Checker(self)
        for name, (var, default) in _ENV_DEFAULTS.items():
            if getattr(self, name) is None:
                value = _env_int(var, default)
                if isinstance(value, str):
                    c.fail(name, f"environment variable {var}={value!r} is not an int")
                    continue
                object.__setattr__(self, name, value)
            c.integer(name, lo=1 if name == "world_size" else 0)
        c.integer("horizontal_parallel_size", lo=1)
        if isinstance(self.horizontal_parallel_blocks, list):
            object.__setattr__(self, "horizontal_parallel_blocks", tuple(self.horizontal_parallel_blocks))
        if not isinstance(self.horizontal_parallel_blocks, tuple):
            c.fail("horizontal_parallel_blocks", "must be a list of (columns, row) module-name pairs", is_type=True)
        if self.data_parallel_size is not None:
            c.integer("data_parallel_size", lo=1)
        c.instance("pipeline_parallel", PipelineParallelOptions, "PipelineParallelOptions", optional=False)
        c.boolean("allreduce_post_accumulation")
        c.instance("deepspeed_zero_optimization", DeepspeedZeroOptions, "DeepspeedZeroOptions", optional=False)
        c.boolean("enable_adasum")
        self._check_topology(c)
        c.done()

    def _check_topology(self, c: Checker) -> None:
        """Ranks inside the world; H divides the world; D = world_size // H."""
        if not c.ok("world_rank", "world_size", "local_rank", "horizontal_parallel_size", "data_parallel_size"):
            return
        for name in ("world_rank", "local_rank"):
            if getattr(self, name) >= self.world_size:
                c.fail(name, f"must be < distributed.world_size={self.world_size}, got {getattr(self, name)}")
        size, h = self.world_size, self.horizontal_parallel_size
        if size % h:
            c.fail("horizontal_parallel_size", f"must divide distributed.world_size={size}, got {h}")
        elif self.data_parallel_size is None:
            object.__setattr__(self, "data_parallel_size", size // h)
        elif self.data_parallel_size != size // h:
            c.fail(
                "data_parallel_size",
                f"must equal world_size // horizontal_parallel_size = {size} // {h} = {size // h}, "
                f"got {self.data_parallel_size} (leave it out to have it computed)",
            )


@dataclass(frozen=True, kw_only=True)
class MixedPrecisionOptions:
    """fp16 training; enabling it without a scaler creates a ``DynamicLossScaler()``.

    ``dtype`` (ours, default "float16"): the low-precision type, "float16" or "bfloat16" (the autograd engine
    only: it traces the step under ``torch.autocast`` with that dtype where the provider has the kernels).
    """

    _PATH: ClassVar[str] = "mixed_precision"
    enabled: bool = False
    loss_scaler: LossScaler | None = None
    dtype: str = "float16"

    def __post_init__(self) -> None:
        c = Checker(self)
        c.boolean("enabled")
        c.instance("loss_scaler", LossScaler, "an amp.LossScaler")
        if not isinstance(self.dtype, str):
            c.fail("dtype", "must be 'float16' or 'bfloat16'", is_type=True)
        elif self.dtype not in ("float16", "bfloat16"):
            c.fail("dtype", f"must be 'float16' or 'bfloat16', got {self.dtype!r}")
        if c.ok("enabled", "loss_scaler"):
            if self.loss_scaler is not None and not self.enabled:
                c.fail("loss_scaler", "Loss Scaler cannot be specified when Mixed Precision is not enabled")
            elif self.enabled and self.loss_scaler is None:
                object.__setattr__(self, "loss_scaler", DynamicLossScaler())
        c.done()


@dataclass(frozen=True, kw_only=True)
class PropagateCastOpsConfig:
    """``strategy`` is an ``onnxruntime.training.PropagateCastOpsStrategy`` or None."""

    _PATH: ClassVar[str] = "graph_transformer.propagate_cast_ops_config"
    strategy: Any = field(default_factory=default_cast_strategy)
    level: int = 1
    allow: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        c = Checker(self)
        c.instance("strategy", type(default_cast_strategy()), "an onnxruntime.training.PropagateCastOpsStrategy")
        c.integer("level", lo=-1)
        c.string_list("allow")
        c.done()


@dataclass(frozen=True, kw_only=True)
class GraphTransformerOptions:
    _PATH: ClassVar[str] = "graph_transformer"
    attn_dropout_recompute: bool = False
    gelu_recompute: bool = False
    transformer_layer_recompute: bool = False
    number_recompute_layers: int = 0
    propagate_cast_ops_config: PropagateCastOpsConfig = field(default_factory=PropagateCastOpsConfig)

    def __post_init__(self) -> None:
        c = Checker(self)
        for name in ("attn_dropout_recompute", "gelu_recompute", "transformer_layer_recompute"):
            c.boolean(name)
        c.integer("number_recompute_layers", lo=0)
        c.instance("propagate_cast_ops_config", PropagateCastOpsConfig, "PropagateCastOpsConfig", optional=False)
        c.done()


@dataclass(frozen=True, kw_only=True)
class UtilsOptions:
    """``frozen_weights`` (a tuple of parameter names) are not trained.

    ``share_module_parameters`` (ours, default True): the torch module's float parameters and buffers
    become views of the trainer's buffers, so the weights are held once and the module shows the
    trained values as training goes, as a module trained by a torch optimizer does (docs/performance.md);
    False leaves the module as it was (the legacy trainer's behaviour) at the price of a copy of the weights.
    ``shrink_memory_arena`` (ours, default False; CPU): ONNX Runtime's arena gives its free memory back
    after every run, so activations are not kept resident between steps (costs page faults per step).
    ``engine`` (ours, default "auto"): where the training graph comes from, "onnxblock" (onnxruntime-training's
    gradient builder) or "autograd" (PyTorch's autograd, any onnxruntime); "auto" takes onnxblock where
    onnxruntime-training is installed, else autograd (docs/engines.md). ``graph_cache`` (ours, default True):
    the autograd engine keeps exported graphs on disk (``ORT_TRAINER_GRAPH_CACHE*`` environment variables).
    ``intra_op_threads`` (ours, default 0 = one per core): ONNX Runtime's intra-op threads, set on the session
    options we make, so our other session settings stay (a user's own ``session_options`` replaces all of them;
    then set the threads there). docs/performance.md lists the settings we make and why.
    """

    _PATH: ClassVar[str] = "utils"
    frozen_weights: tuple[str, ...] = ()
    grad_norm_clip: bool = True
    memory_efficient_gradient: bool = False
    run_symbolic_shape_infer: bool = False
    share_module_parameters: bool = True
    shrink_memory_arena: bool = False
    engine: str = "auto"
    graph_cache: bool = True
    intra_op_threads: int = 0

    def __post_init__(self) -> None:
        c = Checker(self)
        c.string_list("frozen_weights")
        flags = ("grad_norm_clip", "memory_efficient_gradient", "run_symbolic_shape_infer")
        for name in (*flags, "share_module_parameters", "shrink_memory_arena", "graph_cache"):
            c.boolean(name)
        if not isinstance(self.engine, str):
            c.fail("engine", "must be 'auto', 'onnxblock' or 'autograd'", is_type=True)
        elif self.engine not in ("auto", "onnxblock", "autograd"):
            c.fail("engine", f"must be 'auto', 'onnxblock' or 'autograd', got {self.engine!r}")
        c.integer("intra_op_threads", lo=0)
        c.done()


@dataclass(frozen=True, kw_only=True)
class GraphSavePaths:
    """Where to save intermediate ONNX graphs ('' = do not save)."""

    _PATH: ClassVar[str] = "debug.graph_save_paths"
    model_after_graph_transforms_path: str = ""
    model_with_gradient_graph_path: str = ""
    model_with_training_graph_path: str = ""
    model_with_training_graph_after_optimization_path: str = ""

    def __post_init__(self) -> None:
        c = Checker(self)
        for f in fields(self):
            c.string(f.name)
        c.done()

    def check_writable(self) -> None:
        """ValueError naming every set path that is a directory or lies in a folder that does not exist.

        Run when a trainer is built, so that a bad path fails at once instead of after the export.
        """
        problems = []
        for f in fields(self):
            path = getattr(self, f.name)
            if not path:
                continue
            folder = os.path.dirname(os.path.abspath(path))
            if os.path.isdir(path):
                problems.append(f"{self._PATH}.{f.name}={path!r} is a directory; expected a file name such as g.onnx")
            elif not os.path.isdir(folder):
                problems.append(f"{self._PATH}.{f.name}={path!r}: folder {folder!r} does not exist")
        if problems:
            raise ValueError("Invalid options: " + "; ".join(problems))


@dataclass(frozen=True, kw_only=True)
class DebugOptions:
    _PATH: ClassVar[str] = "debug"
    deterministic_compute: bool = False
    check_model_export: bool = False
    graph_save_paths: GraphSavePaths = field(default_factory=GraphSavePaths)

    def __post_init__(self) -> None:
        c = Checker(self)
        c.boolean("deterministic_compute")
        c.boolean("check_model_export")
        c.instance("graph_save_paths", GraphSavePaths, "GraphSavePaths", optional=False)
        c.done()


@dataclass(frozen=True, kw_only=True)
class InternalUseOptions:
    """``extra_postprocess(model: onnx.ModelProto) -> onnx.ModelProto`` runs after export."""

    _PATH: ClassVar[str] = "_internal_use"
    enable_internal_postprocess: bool = True
    extra_postprocess: Callable[[Any], Any] | None = None
    onnx_opset_version: int = 17
    enable_onnx_contrib_ops: bool = True

    def __post_init__(self) -> None:
        c = Checker(self)
        c.boolean("enable_internal_postprocess")
        c.callable_or_none("extra_postprocess")
        c.integer("onnx_opset_version", lo=14, hi=17)
        c.boolean("enable_onnx_contrib_ops")
        c.done()
