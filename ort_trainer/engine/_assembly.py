"""The assembly of one trainer: from what the user gave to a complete `TrainerState`.

``ORTTrainer.__init__`` checks the types of its arguments and calls :func:`assemble_trainer_state`; everything
else a constructor does happens here, in this order: the options (checked, implemented, debug paths writable),
the graph source (`choose_engine`), the model description, an ONNX model's inputs/outputs, what the graph
source refuses (`GraphSource.check_supported`), the forward binding (the legacy rule: its input names are
``forward()``'s parameters), the device, the refusals that need no process group (ZeRO + LAMB, the
model-parallel plan's own), the process group, then the whole state: this rank's slice of the model
(Megatron), the parameter store (the module's weights become views of its buffers unless
``share_module_parameters`` is off), the counters.

The model-parallel plan comes from the graph source (`GraphSource.model_parallel`: the onnxblock engine's
``ort_trainer.parallel.HorizontalParallel``), so that the engine names no class of a wing or a room above it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import onnx
import torch

from ort_trainer.config.model_desc import validate_model_desc
from ort_trainer.config.options import ORTTrainerOptions
from ort_trainer.diagnosis import check_onnx_io
from ort_trainer.graph import bind_forward_inputs, model_input_names, outer_module
from ort_trainer.optim.config import OptimizerConfig
from ort_trainer.runtime import resolve_device
from ort_trainer.train_step_info import TrainStepInfo

from ._distributed import DistributedContext
from ._random import agreed_run_seed
from ._sources import choose_engine, graph_source
from ._store import build_store
from ._trainer_state import TrainerState

__all__ = ["assemble_trainer_state"]


def assemble_trainer_state(
    model: torch.nn.Module | onnx.ModelProto,
    model_desc: Mapping[str, Any],
    optim_config: OptimizerConfig,
    loss_fn: Callable | None,
    options: ORTTrainerOptions | Mapping[str, Any] | None,
) -> TrainerState:
    """Check the options against the model and build the trainer's complete state (before any graph).

    The arguments' types are the caller's to check (``ORTTrainer.__init__``).
    """
    options = ORTTrainerOptions(options)
    options.check_implemented()
    options.debug.graph_save_paths.check_writable()
    engine_name = choose_engine(options.utils.engine)
    source = graph_source(engine_name)
    model_desc = validate_model_desc(model_desc, require_loss=True)
    if isinstance(model, onnx.ModelProto):
        check_onnx_io(model, model_desc)
    source.check_supported(model, options, model_desc)
    if isinstance(model, torch.nn.Module):  # model_desc names must be forward()'s parameters (legacy rule)
        bind_forward_inputs(outer_module(model), model_input_names(model_desc, loss_fn))
    device = resolve_device(options.device.id, options.provider_options)
    zero_stage = options.distributed.deepspeed_zero_optimization.stage
    if zero_stage > 0 and optim_config.name == "LambOptimizer":
        raise NotImplementedError(
            "ZeRO with LAMB is not implemented yet: LAMB's per-tensor trust ratio needs norms of whole "
            "tensors, which ZeRO splits across ranks; use AdamConfig or SGDConfig, or zero stage 0"
        )
    dist_options = options.distributed
    model_parallel = source.model_parallel() if dist_options.horizontal_parallel_size > 1 else None
    if dist_options.horizontal_parallel_size > 1:  # before any process group exists
        if model_parallel is None:
            raise NotImplementedError(
                f"horizontal_parallel_size > 1: the {engine_name} engine has no model-parallel plan"
            )
        model_parallel.check_supported(model, options, optim_config)
    dist = (
        DistributedContext(dist_options.world_rank, dist_options.world_size, device.torch_device)
        if dist_options.world_size > 1
        else None
    )
    # The whole state exists from here on (parameters, optimizer, frozen state), before any graph.
    # Megatron (horizontal parallel): the state is built from this rank's slice of the model (docs/megatron.md)
    horizontal = model_parallel(model, options, optim_config, device.torch_device) if model_parallel else None
    store_dist = dist
    if horizontal is not None:
        model, store_dist = horizontal.model, horizontal.data_parallel
    share = options.utils.share_module_parameters and isinstance(model, torch.nn.Module)
    store = build_store(  # with share_with, the module's weights become views of the store's (held once)
        model,
        optim_config,
        tuple(options.utils.frozen_weights),
        device.torch_device,
        store_dist,
        zero_stage,
        share_with=model if share else None,
    )
    return TrainerState(
        options=options,
        optim_config=optim_config,
        model_desc=model_desc,
        loss_fn=loss_fn,
        model=model,
        device=device,
        store=store,
        train_step_info=TrainStepInfo(optim_config, seed=agreed_run_seed(dist)),
        dist=dist,
        horizontal=horizontal,
        engine_name=engine_name,
    )
