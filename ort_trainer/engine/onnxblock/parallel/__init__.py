"""Megatron-style horizontal (tensor) parallel training on torch.distributed; ONNX Runtime runs the compute.

* ``plan``: which blocks are split (found in the module tree, or given by the user);
* ``shard``: one rank's slice of the model, and how slices relate to full weights;
* ``markers``: the f / g communication points as marker ops in the exported graph;
* ``segments``: the graph cut at the markers, each piece's forward and gradient graphs;
* ``runner``: forward/backward over the segments with the all-reduces between them;
* ``groups``: the D x H process groups; ``horizontal``: the seam the trainer uses.

Only the onnxblock engine runs the segments, so this is part of its wing; ``ort_trainer.parallel`` re-exports the
public names. See docs/megatron.md.
"""

from __future__ import annotations

from .horizontal import HorizontalParallel
from .plan import SplitBlock, find_blocks
from .shard import PartitionSpec, shard_model

__all__ = ["HorizontalParallel", "PartitionSpec", "SplitBlock", "find_blocks", "shard_model"]
