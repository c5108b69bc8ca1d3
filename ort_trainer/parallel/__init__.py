"""``ort_trainer.parallel``: the public names of Megatron-style horizontal parallel (docs/megatron.md).

The code is the onnxblock wing's (``engine.onnxblock.parallel``: only the onnxblock engine runs Megatron's
segments); this package is its public door, kept where users import it from.
"""

from __future__ import annotations

from ort_trainer.engine.onnxblock.parallel import (
    HorizontalParallel,
    PartitionSpec,
    SplitBlock,
    find_blocks,
    shard_model,
)

__all__ = ["HorizontalParallel", "PartitionSpec", "SplitBlock", "find_blocks", "shard_model"]
