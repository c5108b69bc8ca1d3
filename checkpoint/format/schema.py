"""The one module that holds checkpoint key names, attribute names and typed records.

Key names follow the legacy ONNX Runtime ``ORTTrainer`` state dict (``_utils.state_dict_*_key``
helpers and backend constants) so files stay readable by both implementations. Every other module
imports the strings from here; nothing else spells them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .lazy_torch import is_tensor

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LEGACY_FORMAT_VERSION",
    "PartitionInfo",
    "TrainerOptionsRecord",
    "as_scalar",
]

# ---- format identity (root attributes) ----------------------------------------------------------
FORMAT_NAME = "ort_trainer.checkpoint"
FORMAT_VERSION = 2  # 2: per-dataset CRC-32C (attribute ATTR_CRC32C); 1: zlib CRC-32 (ATTR_CRC32), still read
SUPPORTED_FORMAT_VERSIONS = (1, 2)
LEGACY_FORMAT_VERSION = 0  # files without our root attributes: written by the legacy ORTTrainer

ATTR_FORMAT = "ort_trainer.format"
ATTR_FORMAT_VERSION = "ort_trainer.format_version"
ATTR_LIBRARY_VERSION = "ort_trainer.library_version"
ATTR_TREE_CRC32 = "ort_trainer.tree_crc32"
ROOT_ATTRS = (ATTR_FORMAT, ATTR_FORMAT_VERSION, ATTR_LIBRARY_VERSION, ATTR_TREE_CRC32)

# ---- per-dataset attributes ---------------------------------------------------------------------
ATTR_CRC32 = "crc32"  # format version 1: zlib CRC-32 of the dataset's bytes
ATTR_CRC32C = "crc32c"  # format version 2: CRC-32C (Castagnoli) of the dataset's bytes
ATTR_PY_TYPE = "py_type"
ATTR_TORCH_DTYPE = "torch_dtype"

# values of ATTR_PY_TYPE: what python type the stored value had
PY_TENSOR = "tensor"
PY_NDARRAY = "ndarray"
PY_NUMPY_SCALAR = "numpy_scalar"
PY_INT = "int"
PY_FLOAT = "float"
PY_BOOL = "bool"
PY_STR = "str"
PY_BYTES = "bytes"
PY_NONE = "none"
PY_LIST = "list"
PY_TUPLE = "tuple"
PY_TYPES = frozenset(
    {PY_TENSOR, PY_NDARRAY, PY_NUMPY_SCALAR, PY_INT, PY_FLOAT, PY_BOOL, PY_STR, PY_BYTES, PY_NONE, PY_LIST, PY_TUPLE}
)

# ---- user_dict encoding: a group with exactly one of these keys is a tagged value -----------------
TAG_NDARRAY = "__ndarray__"
TAG_NUMPY_SCALAR = "__numpy_scalar__"
TAG_LIST = "__list__"
TAG_TUPLE = "__tuple__"
TAG_DICT = "__dict__"
TAG_PICKLE = "__pickle__"
TAG_INT = "__int__"  # an int outside int64 (numpy Generator states hold 128-bit ints), as its decimal string
TAG_ITEMS = "__items__"  # a dict with int (or mixed int/str) keys, as a list of (key, value) pairs
USER_DICT_TAGS = frozenset(
    {TAG_NDARRAY, TAG_NUMPY_SCALAR, TAG_LIST, TAG_TUPLE, TAG_DICT, TAG_PICKLE, TAG_INT, TAG_ITEMS}
)

# ---- state-dict keys (legacy ORTTrainer layout, see reference §2) --------------------------------
MODEL_KEY = "model"
FULL_PRECISION_KEY = "full_precision"
OPTIMIZER_KEY = "optimizer"
MOMENT_1_KEY = "Moment_1"
MOMENT_2_KEY = "Moment_2"
UPDATE_COUNT_KEY = "Update_Count"
SHARED_OPTIMIZER_STATE_KEY = "shared_optimizer_state"
STEP_KEY = "Step"  # Lamb's global step inside shared_optimizer_state
SHARDED_OPTIMIZER_KEYS = frozenset({MOMENT_1_KEY, MOMENT_2_KEY})
PARTITION_INFO_KEY = "partition_info"
ORIGINAL_DIM_KEY = "original_dim"
MEGATRON_ROW_PARTITION_KEY = "megatron_row_partition"
PARTITION_OFFSET_KEY = "offset"  # ours: start of a ZeRO piece in the flattened tensor
PARTITION_STRIDE_KEY = "stride"  # ours: a fused Megatron slice holds `stride` blocks side by side (Q|K|V)
TRAIN_STEP_INFO_KEY = "train_step_info"
OPTIMIZATION_STEP_KEY = "optimization_step"
TRAIN_STEP_KEY = "step"
USER_DICT_KEY = "user_dict"
LR_SCHEDULER_KEY = "lr_scheduler"  # ours
LOSS_SCALER_KEY = "loss_scaler"  # ours
EXTRA_STATE_KEY = "extra_state"  # ours: model/extra_state/<fqn>, get_extra_state() values (user_dict encoding)
# ours: model/buffers/<name>, the model's persistent buffers that are not float state (integer and bool ones: a step
# counter, BatchNorm's num_batches_tracked, a count the forward keeps), in their own dtypes; absent in older files
BUFFERS_KEY = "buffers"
RANK_USER_DICTS_KEY = "rank_user_dicts"  # ours: aggregated sets keep rank r's user_dict under rank_user_dicts/<r>
STATEFUL_KEY = "stateful"  # ours: stateful/<name>, state_dict() of objects passed to save_checkpoint(stateful=)
RANK_STATEFUL_KEY = "rank_stateful"  # ours: aggregated sets keep rank r's stateful group under rank_stateful/<r>
PER_RANK_KEYS = {USER_DICT_KEY: RANK_USER_DICTS_KEY, STATEFUL_KEY: RANK_STATEFUL_KEY}  # kept per rank by aggregation

# ours: checkpoints of a custom loop's dict of objects (``CheckpointManager.save({"model": m, ...}, step)``):
# objects/<name>/kind and /type describe each object; its state_dict() is stateful/<name> (user_dict encoding);
# a ZeroRedundancyOptimizer's per-parameter state is optimizer/<name>.<index>/... on the rank that owns it
OBJECTS_KEY = "objects"
OBJECT_KIND_KEY = "kind"
OBJECT_TYPE_KEY = "type"
OBJECT_KINDS = ("module", "optimizer", "sharded_optimizer", "object")
OBJECTS_OPTIMIZER_NAME = "torch.optim"  # trainer_options/optimizer_name of such files

# ---- ours: identity of a distributed save, one group per rank file -----------------------------
DISTRIBUTED_KEY = "distributed"
RUN_ID_KEY = "run_id"  # str, identical on every rank of one save (chosen by rank 0)
FLAT_ORDER_KEY = "flat_order"  # optional list[str]: trainable parameters in flat-buffer order
ZERO_ALIGNMENT_PER_RANK = 32  # the ZeRO flat buffer is padded to a multiple of D * 32 elements

# ---- ours: per-rank file names and the manifest of a distributed save ----------------------------
RANK_FILE_INFIX = ".rank{rank}-of-{world_size}"  # <stem><infix>[.<save id>]<suffix>, next to the requested path
SAVE_ID_RE = re.compile(r"[0-9a-f]{8,32}")  # a save's id in its rank file names: a new name for every save
MANIFEST_SUFFIX = ".manifest.json"  # appended to the requested path
MANIFEST_FORMAT_NAME = "ort_trainer.checkpoint.manifest"
MANIFEST_FORMAT_VERSION = 2  # 2: a checksum of every other field (1 is still read)
MANIFEST_CHECKSUM_KEY = "checksum"
MANIFEST_FORMAT_KEY = "format"
MANIFEST_FORMAT_VERSION_KEY = "format_version"
MANIFEST_RUN_ID_KEY = "run_id"
MANIFEST_WORLD_SIZE_KEY = "world_size"
MANIFEST_STEP_KEY = "step"
MANIFEST_FILES_KEY = "files"
MANIFEST_RANK_KEY = "rank"
MANIFEST_NAME_KEY = "name"
MANIFEST_SIZE_KEY = "size"
MANIFEST_CRC32_KEY = "crc32"
MANIFEST_KEYS = (
    MANIFEST_FORMAT_KEY,
    MANIFEST_FORMAT_VERSION_KEY,
    MANIFEST_RUN_ID_KEY,
    MANIFEST_WORLD_SIZE_KEY,
    MANIFEST_STEP_KEY,
    MANIFEST_FILES_KEY,
)
MANIFEST_FILE_KEYS = (MANIFEST_RANK_KEY, MANIFEST_NAME_KEY, MANIFEST_SIZE_KEY, MANIFEST_CRC32_KEY)

TRAINER_OPTIONS_KEY = "trainer_options"
MIXED_PRECISION_KEY = "mixed_precision"
ZERO_STAGE_KEY = "zero_stage"
WORLD_RANK_KEY = "world_rank"
WORLD_SIZE_KEY = "world_size"
OPTIMIZER_NAME_KEY = "optimizer_name"
DATA_PARALLEL_SIZE_KEY = "data_parallel_size"
HORIZONTAL_PARALLEL_SIZE_KEY = "horizontal_parallel_size"
TRAINER_OPTIONS_KEYS = (
    MIXED_PRECISION_KEY,
    ZERO_STAGE_KEY,
    WORLD_RANK_KEY,
    WORLD_SIZE_KEY,
    OPTIMIZER_NAME_KEY,
    DATA_PARALLEL_SIZE_KEY,
    HORIZONTAL_PARALLEL_SIZE_KEY,
)


# ---- value coercion for records read from files (legacy files hold numpy/bytes values) -----------
def as_scalar(value: Any) -> Any:
    """Unwrap one-element tensors and arrays, numpy scalars and utf-8 bytes into python values."""
    if is_tensor(value) and value.numel() == 1:
        value = value.reshape(()).item()
    elif isinstance(value, np.ndarray) and value.size == 1:
        value = value.reshape(()).item()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            pass
    return value


def _type_problems(values: Mapping[str, Any], expected: Mapping[str, type]) -> list[str]:
    """List 'key: expected T, got U' for every value of the wrong type (bool is not an int)."""
    problems = []
    for key in sorted(expected):
        want, value = expected[key], values[key]
        ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
        if not ok:
            problems.append(f"{key}: expected {want.__name__}, got {type(value).__name__} {value!r}")
    return problems


def _check_keys(tree: Mapping[str, Any], required: tuple[str, ...], optional: tuple[str, ...], what: str) -> None:
    if not isinstance(tree, Mapping):
        raise TypeError(f"{what} must be a mapping, got {type(tree).__name__}")
    missing = sorted(set(required) - set(tree))
    unknown = sorted(set(tree) - set(required) - set(optional))
    if missing or unknown:
        raise ValueError(
            f"{what}: missing keys {missing}, unknown keys {unknown}; valid keys are {sorted(required + optional)}"
        )


@dataclass(frozen=True, kw_only=True)
class TrainerOptionsRecord:
    """The ``trainer_options`` group: the topology and optimizer a checkpoint was written with."""

    mixed_precision: bool
    zero_stage: int
    world_rank: int
    world_size: int
    optimizer_name: str
    data_parallel_size: int
    horizontal_parallel_size: int

    def __post_init__(self) -> None:
        types = {k: int for k in TRAINER_OPTIONS_KEYS} | {MIXED_PRECISION_KEY: bool, OPTIMIZER_NAME_KEY: str}
        problems = _type_problems(self.__dict__, types)
        if problems:
            raise TypeError("invalid trainer_options: " + "; ".join(problems))
        if self.zero_stage < 0:
            problems.append(f"zero_stage: expected >= 0, got {self.zero_stage}")
        for key in (WORLD_SIZE_KEY, DATA_PARALLEL_SIZE_KEY, HORIZONTAL_PARALLEL_SIZE_KEY):
            if getattr(self, key) < 1:
                problems.append(f"{key}: expected >= 1, got {getattr(self, key)}")
        if not 0 <= self.world_rank < max(self.world_size, 1):
            problems.append(f"world_rank: expected 0 <= rank < world_size={self.world_size}, got {self.world_rank}")
        if problems:
            raise ValueError("invalid trainer_options: " + "; ".join(problems))

    @classmethod
    def from_tree(cls, tree: Mapping[str, Any]) -> TrainerOptionsRecord:
        """Build from a loaded ``trainer_options`` group (python, numpy, tensor or bytes values)."""
        _check_keys(tree, TRAINER_OPTIONS_KEYS, (), TRAINER_OPTIONS_KEY)
        return cls(**{key: as_scalar(tree[key]) for key in TRAINER_OPTIONS_KEYS})

    def to_tree(self) -> dict[str, Any]:
        """The legacy ``trainer_options`` group as plain python values."""
        return {key: getattr(self, key) for key in TRAINER_OPTIONS_KEYS}


@dataclass(frozen=True, kw_only=True)
class PartitionInfo:
    """Where a stored tensor piece sits in the full tensor.

    ``original_dim`` is the full (global) shape; ``megatron_row_partition`` is -1 (not Megatron
    partitioned), 0 (column partition: split on the last axis) or 1 (row partition: split on axis
    0), as in the legacy backend; ``offset`` (ours, ``None`` in legacy files) is where a ZeRO piece
    starts in the flattened full tensor.
    """

    original_dim: tuple[int, ...]
    megatron_row_partition: int = -1
    offset: int | None = None
    stride: int | None = None  # ours: fused weight (GPT-2's Q|K|V): each slice is `stride` blocks, one per part

    def __post_init__(self) -> None:
        dims = self.original_dim
        if not isinstance(dims, tuple) or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
            raise TypeError(f"original_dim: expected a tuple of int, got {dims!r}")
        problems = [f"original_dim: expected sizes >= 0, got {dims}"] if any(d < 0 for d in dims) else []
        if self.megatron_row_partition not in (-1, 0, 1) or isinstance(self.megatron_row_partition, bool):
            problems.append(f"megatron_row_partition: expected -1, 0 or 1, got {self.megatron_row_partition!r}")
        if self.offset is not None and (not isinstance(self.offset, int) or self.offset < 0):
            problems.append(f"offset: expected None or an int >= 0, got {self.offset!r}")
        if self.stride is not None and (not isinstance(self.stride, int) or self.stride < 1):
            problems.append(f"stride: expected None or an int >= 1, got {self.stride!r}")
        if problems:
            raise ValueError("invalid partition_info: " + "; ".join(problems))

    @classmethod
    def from_tree(cls, tree: Mapping[str, Any]) -> PartitionInfo:
        """Build from one weight's legacy ``partition_info`` entry (lists, arrays or tensors)."""
        optional = (MEGATRON_ROW_PARTITION_KEY, PARTITION_OFFSET_KEY, PARTITION_STRIDE_KEY)
        _check_keys(tree, (ORIGINAL_DIM_KEY,), optional, PARTITION_INFO_KEY)
        dims = tree[ORIGINAL_DIM_KEY]
        dims = dims.tolist() if is_tensor(dims) or isinstance(dims, np.ndarray) else dims
        if not isinstance(dims, list | tuple):
            raise ValueError(f"original_dim: expected a list of sizes (the full shape), got the 0-d value {dims!r}")
        offset = tree.get(PARTITION_OFFSET_KEY)
        flag = tree.get(MEGATRON_ROW_PARTITION_KEY, -1)
        return cls(
            original_dim=tuple(as_scalar(d) for d in dims),
            megatron_row_partition=as_scalar(flag[0] if isinstance(flag, list | tuple) and len(flag) == 1 else flag),
            offset=None if offset is None else as_scalar(offset),
            stride=None if tree.get(PARTITION_STRIDE_KEY) is None else as_scalar(tree[PARTITION_STRIDE_KEY]),
        )

    def to_tree(self) -> dict[str, Any]:
        """The legacy entry (lists of int, the flag as a one-element list) plus ``offset`` if set."""
        tree: dict[str, Any] = {
            ORIGINAL_DIM_KEY: list(self.original_dim),
            MEGATRON_ROW_PARTITION_KEY: [self.megatron_row_partition],
        }
        if self.offset is not None:
            tree[PARTITION_OFFSET_KEY] = self.offset
        if self.stride is not None:
            tree[PARTITION_STRIDE_KEY] = self.stride
        return tree
