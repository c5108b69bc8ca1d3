"""One training or evaluation step over a built `Engine`, including the distributed update.

The update (`_update`): gradients are reduced over ranks (ZeRO stage >= 2: reduce-scatter to the owner
of each range; otherwise all-reduce), clipped by the global norm, skipped when a loss scaler sees a
non-finite norm, applied by the flat optimizer, and (ZeRO) the updated ranges all-gathered. The
per-step check that every rank holds the same state (`_rank_check`) runs while the forward/backward does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ort_trainer.diagnosis import check_labels, explain_run_errors

from . import _rank_check
from ._build import Engine
from ._random import step_seed
from ._trainer_state import TrainerState

__all__ = ["check_fetches", "eval_step", "train_step"]


def train_step(state: TrainerState, engine: Engine, inputs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Forward + backward (+ the update every ``gradient_accumulation_steps`` calls); the graph's outputs.

    Every rank, every step: raise on all ranks if they loaded different states. The check's collective
    runs while this step's forward/backward does; it is settled before anything is committed.
    """
    pending_check = _rank_check.start_rank_check(state)
    check_fetches(state)
    info = state.train_step_info
    step = info.step + 1  # committed only once the run succeeded
    accumulation = state.options.batch.gradient_accumulation_steps
    feeds = _feeds(state, engine, inputs)
    scaler = state.options.mixed_precision.loss_scaler if engine.loss_scale_input else None
    if scaler is not None:  # constant over an accumulation cycle: the scaler moves only at updates
        feeds[engine.loss_scale_input] = _loss_scale_feed(engine, scaler.loss_scale)
    # This step's Dropout masks: a function of (seed, rank, step) only. Horizontal (Megatron) sessions keep
    # ORT's own generator: their replicated regions would need one seed per data-parallel group.
    if engine.session.draws_randomness:
        engine.session.seed_step(step_seed(info.seed, 0 if state.dist is None else state.dist.rank, step))
    with _explained(state, engine, inputs, feeds):
        outputs = engine.session.run_train(feeds, (step - 1) % accumulation == 0)
    _rank_check.finish_rank_check(state, pending_check)
    info.step = step
    if engine.tracks_batches:
        state.store.count_batch()
    if step % accumulation == 0:
        info.all_finite = _update(state, engine, _current_lr(state), accumulation, scaler)
        if info.all_finite:
            info.optimization_step += 1
        if scaler is not None:
            scaler.update(info)
    return outputs


def eval_step(state: TrainerState, engine: Engine, inputs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Forward pass of the eval graph (dropout off, BatchNorm with running statistics); its outputs."""
    check_fetches(state)
    feeds = _feeds(state, engine, inputs)
    with _explained(state, engine, inputs, feeds):
        return engine.session.run_eval(feeds)


def _explained(state: TrainerState, engine: Engine, inputs: Sequence[torch.Tensor], feeds: dict[str, torch.Tensor]):
    """A failed run re-raised in the user's terms: the session's own explanation first, then the step's checks."""
    names = state.model_desc.input_names
    explain = engine.session.explain_failure
    return explain_run_errors(engine.label_specs, engine.input_shapes, names, inputs, feeds, explain)


def check_fetches(state: TrainerState) -> None:
    """Every name in ``train_step_info.fetches`` must be an output of the model."""
    output_names = state.model_desc.output_names
    unknown = sorted(set(state.train_step_info.fetches or []) - set(output_names))
    if unknown:
        raise ValueError(f"fetches {unknown} are not outputs of the model; available: {list(output_names)}")


def _feeds(state: TrainerState, engine: Engine, inputs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Graph inputs by name; inputs the graph does not read are dropped, labels checked against classes."""
    names = state.model_desc.input_names
    feeds = {n: t for n, t in zip(names, inputs, strict=True) if n not in engine.unused_inputs}
    check_labels(engine.label_specs, feeds)
    return feeds


def _loss_scale_feed(engine: Engine, scale: float) -> torch.Tensor:
    """The 0-d float32 tensor that feeds the graph's loss-scale input, on the device, filled again only when the
    scale changed: a tensor made from a Python float each step would be a host-to-device copy that waits for
    the device (a fill is a kernel launch, ordered with the runs on the same stream)."""
    if engine.loss_scale_feed is None:
        engine.loss_scale_feed = (math.nan, torch.empty((), dtype=torch.float32, device=engine.params.device))
    value, tensor = engine.loss_scale_feed
    if value != scale:
        tensor.fill_(scale)
        engine.loss_scale_feed = (scale, tensor)
    return tensor


def _current_lr(state: TrainerState) -> float:
    scheduler = state.options.lr_scheduler
    if scheduler is None:
        return float(state.optim_config.lr)
    return float(scheduler.step(state.train_step_info)[0])


def _update(state: TrainerState, engine: Engine, lr: float, accumulation: int, scaler=None) -> bool:
    """Average gradients over micro-steps and ranks, clip, update (ZeRO: own range, then all-gather).

    Gradients hold the sum over micro-steps and ranks, times the loss scale; dividing by all of that
    is folded into the optimizer's gradient divisor, which keeps clipping exactly as on averaged,
    unscaled gradients (reference §5.3). With a loss scaler, a step whose gradients are not all
    finite is skipped (weights, moments and counters untouched); returns whether it ran.
    """
    if state.checkpoint_io is not None:  # an asynchronous save may still be copying weights and moments
        state.checkpoint_io.wait_for_snapshot()
    clip = state.options.utils.grad_norm_clip
    ctx, world, norm = engine.dist, 1, None
    if ctx is not None:
        world = ctx.world_size
        if engine.zero is not None and engine.zero_stage >= 2:
            ctx.reduce_to_owners_(engine.padded_grads, engine.zero.chunk)
            own = engine.padded_grads[engine.zero.rank * engine.zero.chunk :][: engine.zero.chunk]
            if clip or scaler is not None:
                norm = math.sqrt(ctx.sum_scalar(float(own.double().square().sum())))
        else:
            ctx.all_reduce_(engine.padded_grads)
    if norm is None and clip and state.horizontal is not None:  # split weights: the norm spans the group
        norm = state.horizontal.grad_norm(engine.grad_views)
    if norm is None and (scaler is not None or (clip and engine.zero is not None)):
        norm = float(torch.linalg.vector_norm(engine.grads))
    if norm is not None and not math.isfinite(norm):
        return False
    scale = float(scaler.loss_scale) if scaler is not None else 1.0
    engine.optimizer.step(lr, loss_scale=scale * accumulation * world, clip=clip, grad_norm=norm)
    if engine.zero is not None:
        ctx.all_gather_chunks_(engine.padded_params, engine.zero.chunk)
    return True
