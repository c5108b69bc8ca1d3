"""`HorizontalParallel`: what a trainer with ``horizontal_parallel_size = h > 1`` holds (the seam to the trainer).

At construction: the grid's process groups, rank 0's full model on every rank, the blocks to split
(`plan`) and this rank's slice of the model (`shard`). The trainer builds its state from the sliced
model (so its buffers hold 1/h of every split weight), averages gradients over the data-parallel
view only, and at the first step asks `build_session` for a `ParallelSession` over the graph cut
into segments (`segments`, `runner`) instead of one ONNX Runtime session.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Mapping, Sequence

import onnx
import torch
import torch.distributed as dist

from ort_trainer.checkpoint import PartitionInfo
from ort_trainer.checkpoint.format import schema as S

from .groups import DataParallelView, Grid
from .plan import find_blocks
from .runner import ParallelSession
from .segments import split_graph
from .shard import shard_model

__all__ = ["HorizontalParallel"]

logger = logging.getLogger(__name__)


class HorizontalParallel:
    """The horizontal (Megatron) side of one rank: grid, sliced model, partition specs."""

    def __init__(self, model, options, optim_config, device: torch.device):
        self.check_supported(model, options, optim_config)
        dist_options = options.distributed
        h = dist_options.horizontal_parallel_size
        self.grid = Grid(dist_options.world_rank, dist_options.world_size, h)
        full = copy.deepcopy(model)
        for tensor in full.state_dict().values():  # every rank slices rank 0's model
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.numel():
                dist.broadcast(tensor.data, 0)
        blocks = find_blocks(full, tuple(dist_options.horizontal_parallel_blocks))
        self.blocks = blocks
        self.model, self.specs = shard_model(full, blocks, h, self.grid.horizontal_rank)
        del full
        self.data_parallel = DataParallelView(self.grid, device) if self.grid.data_parallel > 1 else None
        logger.info(
            "horizontal parallel: rank %d is slice %d of %d, replica %d of %d; %d blocks split",
            self.grid.world_rank, self.grid.horizontal_rank, h, self.grid.data_parallel_rank,
            self.grid.data_parallel, len(blocks),
        )  # fmt: skip

    @staticmethod
    def check_supported(model, options, optim_config) -> None:
        """NotImplementedError for what horizontal parallel training does not do (checked before any group)."""
        _check_supported(model, options, optim_config)

    def build_session(
        self, forward: onnx.ModelProto, trainable: Sequence[str], frozen: Sequence[str], store, request
    ) -> ParallelSession:
        """The segments of this rank's forward graph, run over the store's buffers."""
        loss = request.desc.output_names[request.desc.loss_index]
        graph = split_graph(forward, trainable, frozen, loss)
        logger.info(
            "horizontal parallel: %d segments, %d communication points", len(graph.segments), len(graph.markers)
        )
        return ParallelSession(
            forward,
            graph,
            {n: store.param_views[n] for n in trainable},
            {n: store.grad_views[n] for n in trainable},
            {n: store.frozen[n] for n in frozen},
            loss,
            request.desc.output_names,
            request.device,
            request.session_options,
            self.grid.horizontal_group,
        )

    def grad_norm(self, grad_views: Mapping[str, torch.Tensor]) -> float:
        """L2 norm of the full model's gradient: split weights summed over the group, replicated ones once."""
        split = torch.zeros((), dtype=torch.float64)
        whole = torch.zeros((), dtype=torch.float64)
        for name, grad in grad_views.items():
            square = grad.double().square().sum().cpu()
            if name in self.specs:
                split += square
            else:
                whole += square
        dist.all_reduce(split, op=dist.ReduceOp.SUM, group=self.grid.horizontal_group)
        return math.sqrt(float(split + whole))

    def partition_info(self) -> dict[str, dict]:
        """Legacy ``partition_info`` of this rank's split weights."""
        return {
            name: PartitionInfo(original_dim=spec.full_shape, megatron_row_partition=spec.row_partition_flag).to_tree()
            for name, spec in self.specs.items()
        }

    def combined_partition_info(self, zero_info: Mapping[str, dict]) -> dict[str, dict]:
        """This rank's ``partition_info``: Megatron entries, with the ZeRO ``offset`` within the slice where a
        ZeRO range cuts a split weight (the layout ``checkpoint.sets.megatron.partition_grid`` writes), and our
        ``stride`` for fused weights (GPT-2's Q|K|V: each slice holds its share of every part)."""
        infos = {name: PartitionInfo.from_tree(tree) for name, tree in zero_info.items()}
        for name, spec in self.specs.items():
            piece = infos.get(name)
            infos[name] = PartitionInfo(
                original_dim=spec.full_shape,
                megatron_row_partition=spec.row_partition_flag,
                offset=None if piece is None else piece.offset,
                stride=spec.stride if spec.stride > 1 else None,
            )
        return {name: info.to_tree() for name, info in infos.items()}

    def localize(self, state: Mapping, *, pytorch_format: bool) -> dict:
        """A loaded state with full-shaped split weights (and their moments) cut to this rank's slices.

        Entries that already have the slice's shape (a state saved by this same rank) are kept, so a
        full (aggregated, or single-process) state and a rank's own state both load.
        """
        state = dict(state)
        if pytorch_format:
            return {name: self._cut(name, value) for name, value in state.items()}
        model = state.get(S.MODEL_KEY)
        if isinstance(model, Mapping) and isinstance(model.get(S.FULL_PRECISION_KEY), Mapping):
            weights = {n: self._cut(n, v) for n, v in model[S.FULL_PRECISION_KEY].items()}
            state[S.MODEL_KEY] = {**model, S.FULL_PRECISION_KEY: weights}
        optimizer = state.get(S.OPTIMIZER_KEY)
        if isinstance(optimizer, Mapping):
            state[S.OPTIMIZER_KEY] = {
                n: {k: self._cut(n, v) if k in S.SHARDED_OPTIMIZER_KEYS else v for k, v in e.items()}
                if isinstance(e, Mapping)
                else e
                for n, e in optimizer.items()
            }
        state.pop(S.PARTITION_INFO_KEY, None)
        return state

    def _cut(self, name: str, value):
        spec = self.specs.get(name)
        if spec is None or not isinstance(value, torch.Tensor) or tuple(value.shape) != spec.full_shape:
            return value
        return spec.take(value, self.grid.horizontal, self.grid.horizontal_rank)


def _check_supported(model, options, optim_config) -> None:
    if not isinstance(model, torch.nn.Module):
        raise NotImplementedError(
            "horizontal_parallel_size > 1 needs a torch.nn.Module (its blocks are split before export); "
            "an onnx.ModelProto cannot be split"
        )
    if options.mixed_precision.enabled:
        raise NotImplementedError("horizontal_parallel_size > 1 with mixed_precision is not implemented")
    if options.distributed.deepspeed_zero_optimization.stage > 1:
        raise NotImplementedError("horizontal_parallel_size > 1 supports ZeRO stages 0 and 1 only")
    if optim_config.name == "LambOptimizer":
        raise NotImplementedError(
            "horizontal_parallel_size > 1 with LAMB is not implemented: LAMB's per-tensor trust ratio needs the "
            "norms of whole tensors, which are split across the horizontal group; use AdamConfig or SGDConfig"
        )
