"""`ORTTrainer`: train a PyTorch module or an ONNX model with ONNX Runtime.

Public methods validate their arguments, then delegate to short private steps. The heavy lifting
lives elsewhere: `_build` (export + graphs + buffers), `_session` (ORT runs), `optim` (updates),
`_state` (state dicts) and `checkpoint` (files).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx
import torch
from torch.nn.modules.module import _IncompatibleKeys

from ort_trainer.checkpoint.io import SaveHandle
from ort_trainer.engine._build import BuildRequest, Engine, build_engine, session_options_for
from ort_trainer.engine._distributed import DistributedContext
from ort_trainer.engine._session import resolve_device
from ort_trainer.engine._store import build_store, share_module_state
from ort_trainer.graph._forward import bind_forward_inputs, model_input_names
from ort_trainer.optim.config import _OptimizerConfig

from . import _state
from ._checkpoint_io import CheckpointIO
from ._checkpointing import load_trainer_checkpoint, save_trainer_checkpoint
from ._input_checks import check_input_tensors, check_labels, check_onnx_io, explain_run_errors
from ._names import outer_module
from ._state import StateDictOptions
from .model_desc import ModelDescription, check_inputs, validate_model_desc
from .options import ORTTrainerOptions
from .train_step_info import TrainStepInfo

__all__ = ["ORTTrainer"]


class ORTTrainer:
    """Trains ``model`` on ONNX Runtime with the optimizer described by ``optim_config``.

    ``model`` is a ``torch.nn.Module`` (optionally with ``loss_fn(prediction, label)``; the loss becomes
    the first output and the label the last input) or an ``onnx.ModelProto`` whose loss output is flagged
    ``is_loss=True`` in ``model_desc``. Export and graph building happen on the first step.
    """

    def __init__(
        self,
        model: torch.nn.Module | onnx.ModelProto,
        model_desc: Mapping[str, Any],
        optim_config: _OptimizerConfig,
        loss_fn: Callable | None = None,
        options: ORTTrainerOptions | Mapping[str, Any] | None = None,
    ):
        if not isinstance(model, torch.nn.Module | onnx.ModelProto):
            raise TypeError(f"model must be a torch.nn.Module or an onnx.ModelProto, got {type(model).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
        if loss_fn is not None and isinstance(model, onnx.ModelProto):
            raise ValueError("loss_fn is not allowed with an ONNX model: the loss must be an output of the graph")
        if not isinstance(optim_config, _OptimizerConfig):
            raise TypeError(
                "optim_config must be an optim.AdamConfig, optim.LambConfig or optim.SGDConfig, "
                f"got {type(optim_config).__name__}"
            )
        self.options = ORTTrainerOptions(options)
        self.options.check_implemented()
        self.options.debug.graph_save_paths.check_writable()
        self.model_desc: ModelDescription = validate_model_desc(model_desc, require_loss=True)
        if isinstance(model, torch.nn.Module):  # model_desc names must be forward()'s parameters (legacy rule)
            bind_forward_inputs(outer_module(model), model_input_names(self.model_desc, loss_fn))
        self.optim_config = optim_config
        self.loss_fn = loss_fn
        self._model = model
        self._device = resolve_device(self.options.device.id, self.options.provider_options)
        self._zero_stage = self.options.distributed.deepspeed_zero_optimization.stage
        if self._zero_stage > 0 and optim_config.name == "LambOptimizer":
            raise NotImplementedError(
                "ZeRO with LAMB is not implemented yet: LAMB's per-tensor trust ratio needs norms of whole "
                "tensors, which ZeRO splits across ranks; use AdamConfig or SGDConfig, or zero stage 0"
            )
        dist_options = self.options.distributed
        self._dist = (
            DistributedContext(dist_options.world_rank, dist_options.world_size, self._device.torch_device)
            if dist_options.world_size > 1
            else None
        )
        self._train_step_info = TrainStepInfo(optim_config)
        self._closed = False
        self._engine: Engine | None = None
        self._checkpoint_io: CheckpointIO | None = None  # created by the first save_checkpoint
        if isinstance(model, onnx.ModelProto):
            check_onnx_io(model, self.model_desc)
        # The whole state exists from here on (parameters, optimizer, frozen state), before any graph.
        self._store = build_store(
            model,
            optim_config,
            tuple(self.options.utils.frozen_weights),
            self._device.torch_device,
            self._dist,
            self._zero_stage,
        )
        if self.options.utils.share_module_parameters and isinstance(model, torch.nn.Module):
            share_module_state(model, self._store)

    # ------------------------------------------------------------------ properties
    @property
    def train_step_info(self) -> TrainStepInfo:
        """Counters of this run (``step``, ``optimization_step``), ``all_finite`` and the ``fetches`` list."""
        return self._train_step_info

    @property
    def is_built(self) -> bool:
        return self._engine is not None

    # ------------------------------------------------------------------ steps
    def train_step(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        """Forward + backward (+ optimizer update every ``gradient_accumulation_steps`` calls).

        Returns the loss (or all ``model_desc`` outputs, or the ``fetches``) of the forward pass that ran
        before this step's update, as the legacy ORTTrainer did.
        """
        self._require_open("train_step")
        self._check_background_save()
        inputs = self._gather_inputs(args, kwargs)
        engine = self._ensure_built(inputs)
        # Every rank, every step: raise on all ranks if they loaded different states. The check's collective
        # runs while this step's forward/backward does; it is settled before anything is committed.
        pending_check = _state.start_rank_check(self)
        self._check_fetches()
        info = self._train_step_info
        step = info.step + 1  # committed only once the run succeeded
        accumulation = self.options.batch.gradient_accumulation_steps
        feeds = self._feeds(engine, inputs)
        scaler = self.options.mixed_precision.loss_scaler if engine.loss_scale_input else None
        if scaler is not None:  # constant over an accumulation cycle: the scaler moves only at updates
            feeds[engine.loss_scale_input] = torch.tensor(
                scaler.loss_scale, dtype=torch.float32, device=engine.params.device
            )
        with explain_run_errors(engine.label_specs, engine.input_shapes, self.model_desc.input_names, inputs, feeds):
            outputs = engine.session.run_train(feeds, (step - 1) % accumulation == 0)
        _state.finish_rank_check(self, pending_check)
        info.step = step
        if engine.bn_stats:
            self._store.batches_tracked += 1
        if step % accumulation == 0:
            info.all_finite = self._update(engine, self._current_lr(), accumulation, scaler)
            if info.all_finite:
                info.optimization_step += 1
            if scaler is not None:
                scaler.update(info)
        return self._select_outputs(outputs)

    def eval_step(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        """Forward pass of the eval graph (dropout off, BatchNorm with running statistics)."""
        self._require_open("eval_step")
        self._check_background_save()
        inputs = self._gather_inputs(args, kwargs)
        engine = self._ensure_built(inputs)
        self._check_fetches()
        feeds = self._feeds(engine, inputs)
        with explain_run_errors(engine.label_specs, engine.input_shapes, self.model_desc.input_names, inputs, feeds):
            outputs = engine.session.run_eval(feeds)
        return self._select_outputs(outputs)

    # ------------------------------------------------------------------ export
    def save_as_onnx(self, path: str | os.PathLike) -> None:
        """Write the eval graph with the current trained weights as initializers.

        The file loads in a plain ``onnxruntime.InferenceSession`` (it still computes the loss, so feed
        the label) and gives the same outputs as ``eval_step``.
        """
        target = _check_output_path(path)
        engine = self._require_engine("save_as_onnx")
        onnx.save(_state.eval_model_with_weights(engine), os.fspath(target))

    # ------------------------------------------------------------------ state
    def state_dict(
        self,
        pytorch_format: bool = False,
        *,
        options: StateDictOptions | Any = None,
        submodules: Iterable[str | torch.nn.Module] | None = None,
    ) -> dict:
        """The trainer state in the legacy layout (or ``{torch_fqn: value}`` with ``pytorch_format``).

        Complete from construction on: before the first step it holds the initial weights and zero
        moments. Names are canonical (no ``module.`` / ``_orig_mod.`` wrapper prefixes). ``options`` (ours
        or torch's ``StateDictOptions``): ``full_state_dict``, ``cpu_offload``, ``ignore_frozen_params``,
        ``keep_submodule_prefixes``; ``submodules``: only these submodules' keys (names or modules).
        """
        return _state.trainer_state_dict(self, pytorch_format=pytorch_format, options=options, submodules=submodules)

    def load_state_dict(
        self, state_dict: Mapping, strict: bool = True, *, options: StateDictOptions | Any = None
    ) -> _IncompatibleKeys:
        """Validate ``state_dict`` completely, then copy it into the live buffers (two phases).

        Takes our layout or a plain PyTorch ``state_dict()`` (wrapper prefixes are stripped). Returns
        torch's ``_IncompatibleKeys(missing_keys, unexpected_keys)``; with ``strict`` both must be empty.
        ``options.broadcast_from_rank0``: rank 0's full state goes to every rank (call it on every rank).
        """
        self._before_changing_state()
        return _state.load_trainer_state_dict(self, state_dict, strict=strict, options=options)

    def optimizer_state_dict(self, options: StateDictOptions | Any = None) -> dict:
        """The optimizer state in ``torch.optim``'s format: ``{"state": {fqn: {"step", "exp_avg",
        "exp_avg_sq"}}, "param_groups": [...]}``, as ``get_optimizer_state_dict(model, AdamW(...))`` gives.

        ValueError for configs torch cannot express (LAMB, Adam decay mode 1, no bias correction).
        """
        return _state.optimizer_state_dict(self, options)

    def load_optimizer_state_dict(
        self,
        state_dict: Mapping,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        strict: bool = True,
    ) -> _IncompatibleKeys:
        """Load ``torch.optim`` state: fqn-keyed (``get_optimizer_state_dict``), or ``opt.state_dict()`` with
        ``model=`` (and ``optimizer=`` if its groups do not list parameters in model order).

        Torch's ``step`` N becomes ``optimization_step`` N (``Update_Count`` N + 1, ``step`` N x accumulation).
        Hyper-parameters must match this trainer's config; anything else raises and changes nothing.
        """
        self._before_changing_state()
        return _state.load_optimizer_state_dict(self, state_dict, model=model, optimizer=optimizer, strict=strict)

    def save_checkpoint(
        self,
        path: str | os.PathLike,
        user_dict: Mapping | None = None,
        include_optimizer_states: bool = True,
        overwrite: bool = False,
        *,
        stateful: Mapping[str, Any] | None = None,
        async_save: bool = False,
        storage_options: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Atomically write ``state_dict()`` (+ ``user_dict``) to an HDF5 checkpoint at ``path``.

        ``stateful``: ``{name: object}`` with ``state_dict()`` / ``load_state_dict()`` (a sampler, an EMA, a
        metric tracker) stored alongside, without pickle; give the same names to ``load_checkpoint``.

        ``path`` is a local path or an fsspec URL (``s3://bucket/run/ckpt.ortcp``; ``storage_options``
        go to the filesystem). On W > 1 ranks pass the same path on every rank (rank files + a manifest
        written last), or a different path on each rank (one file each, the legacy style).

        ``async_save=True`` copies the state into a reusable host snapshot (the only time this call
        waits), then writes, checksums, fsyncs and publishes in the background. The next save waits for
        it; its error is raised by the next call to this trainer (or by the returned handle's ``wait()``);
        the process waits for it at exit. Returns a :class:`~ort_trainer.checkpoint.io.SaveHandle`.
        """
        self._require_open("save_checkpoint")
        return save_trainer_checkpoint(
            self,
            path,
            user_dict,
            include_optimizer_states,
            overwrite,
            stateful=stateful,
            async_save=async_save,
            storage_options=storage_options,
        )

    def load_checkpoint(
        self,
        *paths: str | os.PathLike,
        strict: bool = True,
        allow_pickle: bool = False,
        stateful: Mapping[str, Any] | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> dict:
        """Load one checkpoint (or a partitioned set) into this trainer; returns the stored ``user_dict``.

        ``paths``: one checkpoint, a manifest, or every rank file of a distributed save; local paths or
        fsspec URLs (downloaded to a temporary local copy first). From a distributed set each rank gets
        the ``user_dict`` (and ``stateful`` objects) it saved, when the world size is the same; otherwise
        rank 0's. A failure leaves the trainer and the objects unchanged.
        """
        self._require_open("load_checkpoint")
        return load_trainer_checkpoint(
            self, paths, strict=strict, allow_pickle=allow_pickle, stateful=stateful, storage_options=storage_options
        )

    def wait_for_checkpoint(self) -> None:
        """Block until the asynchronous save still running (if any) is published; raise its error.

        Call it before tearing down a process group you created yourself: a distributed asynchronous
        save agrees on its manifest over the process group in the background.
        """
        if self._checkpoint_io is not None:
            self._checkpoint_io.wait()

    def close(self) -> None:
        """Let go of the process group; the last trainer using a group that ort_trainer created destroys it.

        Without ``close()`` that group is destroyed at interpreter exit. A group you created yourself
        (``torch.distributed.init_process_group`` before the trainer) is never destroyed by ort_trainer: call
        ``torch.distributed.destroy_process_group()`` on every rank when you are done with it. Idempotent;
        a closed trainer refuses steps, saves and loads (``state_dict()`` still works).
        """
        try:
            if self._checkpoint_io is not None:  # a background save agrees over the process group: finish it first
                self._checkpoint_io.wait()
        finally:
            if self._dist is not None:
                self._dist.close()
            self._closed = True

    # ------------------------------------------------------------------ private steps
    def _all_gather_objects(self, value: Any) -> list:
        """``value`` of every rank, in rank order (``[value]`` in a single process); used by CheckpointManager."""
        return [value] if self._dist is None else self._dist.all_gather_objects(value)

    def _check_background_save(self) -> None:
        """Raise the error of a finished asynchronous save nobody has been told about yet (never blocks)."""
        if self._checkpoint_io is not None:
            self._checkpoint_io.check()

    def _before_changing_state(self) -> None:
        """An asynchronous save may still be copying the live buffers: wait for that copy (and report its error)."""
        if self._checkpoint_io is not None:
            self._checkpoint_io.check()
            self._checkpoint_io.wait_for_snapshot()

    def _require_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}: this trainer was closed (ORTTrainer.close()); build a new one to continue")

    def _gather_inputs(self, args: Sequence, kwargs: Mapping) -> list[torch.Tensor]:
        names = self.model_desc.input_names
        if len(args) == 1 and isinstance(args[0], list) and len(names) > 1:  # legacy: train_step([x, label])
            args = tuple(args[0])
        if len(args) > len(names):
            raise ValueError(f"got {len(args)} positional inputs, but model_desc declares {len(names)}: {list(names)}")
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ValueError(f"unknown named inputs {unknown}; model_desc inputs are {list(names)}")
        twice = sorted(set(names[: len(args)]) & set(kwargs))
        if twice:
            raise ValueError(f"inputs {twice} were given both positionally and by name")
        inputs = list(args) + [kwargs[n] for n in names[len(args) :] if n in kwargs]
        if len(inputs) != len(names):
            missing = [n for n in names[len(args) :] if n not in kwargs]
            raise ValueError(f"missing inputs {missing}; model_desc inputs are {list(names)}")
        check_inputs(self.model_desc, inputs)
        check_input_tensors(names, inputs)  # dtypes: model_desc holds the graph's input dtypes after the first step
        return [t.to(self._device.torch_device) if t.device != self._device.torch_device else t for t in inputs]

    def _feeds(self, engine: Engine, inputs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Graph inputs by name; inputs the graph does not read are dropped, labels checked against classes."""
        names = self.model_desc.input_names
        feeds = {n: t for n, t in zip(names, inputs, strict=True) if n not in engine.unused_inputs}
        check_labels(engine.label_specs, feeds)
        return feeds

    def _ensure_built(self, inputs: Sequence[torch.Tensor]) -> Engine:
        if self._engine is not None:
            return self._engine
        self._before_changing_state()
        self._engine = build_engine(self._build_request(), inputs)
        try:
            if self.options.debug.check_model_export:
                _state.check_model_export(self, inputs)
        except BaseException:
            self._engine = None
            raise
        self.model_desc = self._engine.typed_description(self.model_desc)  # legacy: dtypes known from now on
        return self._engine

    def _update(self, engine: Engine, lr: float, accumulation: int, scaler=None) -> bool:
        """Average gradients over micro-steps and ranks, clip, update (ZeRO: own range, then all-gather).

        Gradients hold the sum over micro-steps and ranks, times the loss scale; dividing by all of that
        is folded into the optimizer's gradient divisor, which keeps clipping exactly as on averaged,
        unscaled gradients (reference §5.3). With a loss scaler, a step whose gradients are not all
        finite is skipped (weights, moments and counters untouched); returns whether it ran.
        """
        if self._checkpoint_io is not None:  # an asynchronous save may still be copying weights and moments
            self._checkpoint_io.wait_for_snapshot()
        clip = self.options.utils.grad_norm_clip
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
        if norm is None and (scaler is not None or (clip and engine.zero is not None)):
            norm = float(torch.linalg.vector_norm(engine.grads))
        if norm is not None and not math.isfinite(norm):
            return False
        scale = float(scaler.loss_scale) if scaler is not None else 1.0
        engine.optimizer.step(lr, loss_scale=scale * accumulation * world, clip=clip, grad_norm=norm)
        if engine.zero is not None:
            ctx.all_gather_chunks_(engine.padded_params, engine.zero.chunk)
        return True

    def _build_request(self) -> BuildRequest:
        return BuildRequest(
            model=self._model,
            loss_fn=self.loss_fn,
            desc=self.model_desc,
            store=self._store,
            opset_version=self.options._internal_use.onnx_opset_version,
            device=self._device,
            session_options=session_options_for(self.options),
            graph_save_paths=self.options.debug.graph_save_paths,
            extra_postprocess=self.options._internal_use.extra_postprocess,
            zero_stage=self._zero_stage,
            mixed_precision=bool(self.options.mixed_precision.enabled),
            shrink_arena=bool(self.options.utils.shrink_memory_arena),
        )

    def _require_engine(self, what: str) -> Engine:
        if self._engine is None:
            raise RuntimeError(
                f"{what} needs the ONNX graphs, which are built on the first train_step or eval_step; "
                "run one step first"
            )
        return self._engine

    def _current_lr(self) -> float:
        scheduler = self.options.lr_scheduler
        if scheduler is None:
            return float(self.optim_config.lr)
        return float(scheduler._step(self._train_step_info)[0])

    def _check_fetches(self) -> None:
        unknown = sorted(set(self._train_step_info.fetches or []) - set(self.model_desc.output_names))
        if unknown:
            raise ValueError(
                f"fetches {unknown} are not outputs of the model; available: {list(self.model_desc.output_names)}"
            )

    def _select_outputs(self, outputs: Mapping[str, torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
        fetches = list(self._train_step_info.fetches or [])
        names = fetches or [n for n in self.model_desc.output_names if n in outputs]
        results = [outputs[n] for n in names]
        return results[0] if len(results) == 1 else results


def _check_output_path(path: str | os.PathLike) -> Path:
    if not isinstance(path, str | os.PathLike) or not os.fspath(path):
        raise ValueError(f"path must be a non-empty str or os.PathLike, got {path!r}")
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"path {str(target)!r} is a directory; give a file name such as model.onnx")
    if not target.parent.is_dir():
        raise ValueError(f"cannot write {str(target)!r}: folder {str(target.parent)!r} does not exist")
    return target
