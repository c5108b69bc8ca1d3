"""`ORTTrainer`: train a PyTorch module or an ONNX model with ONNX Runtime.

A thin facade: public methods validate their arguments, then hand the trainer's `TrainerState` to the
rooms that do the work: `engine.assemble_trainer_state` (the constructor's work), `engine.build_engine`
(export + graphs + sessions, on the first step), `engine.train_step` (the step and its distributed update),
`_state` (state dicts, checkpoints through `checkpoint/`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx
import torch
from torch.nn.modules.module import _IncompatibleKeys

from ort_trainer.checkpoint.io import SaveHandle
from ort_trainer.engine import (
    BuildRequest,
    Engine,
    TrainerState,
    assemble_trainer_state,
    build_engine,
    eval_step,
    train_step,
)
from ort_trainer.optim.config import OptimizerConfig

from . import _state
from ._state import StateDictOptions, load_trainer_checkpoint, save_trainer_checkpoint
from .config.model_desc import ModelDescription, check_inputs
from .config.options import ORTTrainerOptions
from .diagnosis import check_input_tensors
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
        optim_config: OptimizerConfig,
        loss_fn: Callable | None = None,
        options: ORTTrainerOptions | Mapping[str, Any] | None = None,
    ):
        if not isinstance(model, torch.nn.Module | onnx.ModelProto):
            raise TypeError(f"model must be a torch.nn.Module or an onnx.ModelProto, got {type(model).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
        if loss_fn is not None and isinstance(model, onnx.ModelProto):
            raise ValueError("loss_fn is not allowed with an ONNX model: the loss must be an output of the graph")
        if not isinstance(optim_config, OptimizerConfig):
            raise TypeError(
                "optim_config must be an optim.AdamConfig, optim.LambConfig or optim.SGDConfig, "
                f"got {type(optim_config).__name__}"
            )
        self._trainer_state = assemble_trainer_state(model, model_desc, optim_config, loss_fn, options)

    # ------------------------------------------------------------------ properties
    @property
    def trainer_state(self) -> TrainerState:
        """The one object this trainer's parts live in (``engine.TrainerState``): for tools and benchmarks that
        look inside a trainer (its parameter store, built engine, background writer); training code needs none
        of it."""
        return self._trainer_state

    @property
    def options(self) -> ORTTrainerOptions:
        return self._trainer_state.options

    @property
    def optim_config(self) -> OptimizerConfig:
        return self._trainer_state.optim_config

    @property
    def model_desc(self) -> ModelDescription:
        """The model description; typed (input/output dtypes) once the graphs are built."""
        return self._trainer_state.model_desc

    @property
    def loss_fn(self) -> Callable | None:
        return self._trainer_state.loss_fn

    @property
    def train_step_info(self) -> TrainStepInfo:
        """Counters of this run (``step``, ``optimization_step``), ``all_finite`` and the ``fetches`` list."""
        return self._trainer_state.train_step_info

    @property
    def engine(self) -> str:
        """The graph source this trainer builds with: "onnxblock" or "autograd" (``options.utils.engine``)."""
        return self._trainer_state.engine_name

    @property
    def is_built(self) -> bool:
        return self._trainer_state.engine is not None

    # ------------------------------------------------------------------ steps
    def train_step(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        """Forward + backward (+ optimizer update every ``gradient_accumulation_steps`` calls).

        Returns the loss (or all ``model_desc`` outputs, or the ``fetches``) of the forward pass that ran
        before this step's update, as the legacy ORTTrainer did.
        """
        self._require_open("train_step")
        self._check_background_save()
        inputs = self._gather_inputs(args, kwargs)
        self._check_bindings()
        engine = self._ensure_built(inputs)
        return self._select_outputs(train_step(self._trainer_state, engine, inputs))

    def eval_step(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        """Forward pass of the eval graph (dropout off, BatchNorm with running statistics)."""
        self._require_open("eval_step")
        self._check_background_save()
        inputs = self._gather_inputs(args, kwargs)
        self._check_bindings()
        engine = self._ensure_built(inputs)
        return self._select_outputs(eval_step(self._trainer_state, engine, inputs))

    # ------------------------------------------------------------------ export
    def save_as_onnx(self, path: str | os.PathLike) -> None:
        """Write the eval graph with the current trained weights as initializers.

        The file loads in a plain ``onnxruntime.InferenceSession`` (it still computes the loss, so feed
        the label) and gives the same outputs as ``eval_step``.
        """
        target = _check_output_path(path)
        if self._trainer_state.horizontal is not None:
            raise NotImplementedError("save_as_onnx with horizontal_parallel_size > 1: each rank holds a slice")
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
        return _state.trainer_state_dict(
            self._trainer_state, pytorch_format=pytorch_format, options=options, submodules=submodules
        )

    def load_state_dict(
        self, state_dict: Mapping, strict: bool = True, *, options: StateDictOptions | Any = None
    ) -> _IncompatibleKeys:
        """Validate ``state_dict`` completely, then copy it into the live buffers (two phases).

        Takes our layout or a plain PyTorch ``state_dict()`` (wrapper prefixes are stripped). Returns
        torch's ``_IncompatibleKeys(missing_keys, unexpected_keys)``; with ``strict`` both must be empty.
        ``options.broadcast_from_rank0``: rank 0's full state goes to every rank (call it on every rank).
        """
        self._before_changing_state()
        return _state.load_trainer_state_dict(self._trainer_state, state_dict, strict=strict, options=options)

    def optimizer_state_dict(self, options: StateDictOptions | Any = None) -> dict:
        """The optimizer state in ``torch.optim``'s format: ``{"state": {fqn: {"step", "exp_avg",
        "exp_avg_sq"}}, "param_groups": [...]}``, as ``get_optimizer_state_dict(model, AdamW(...))`` gives.

        ValueError for configs torch cannot express (LAMB, Adam decay mode 1, no bias correction).
        """
        return _state.optimizer_state_dict(self._trainer_state, options)

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
        return _state.load_optimizer_state_dict(
            self._trainer_state, state_dict, model=model, optimizer=optimizer, strict=strict
        )

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
            self._trainer_state,
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
            self._trainer_state,
            paths,
            strict=strict,
            allow_pickle=allow_pickle,
            stateful=stateful,
            storage_options=storage_options,
        )

    def wait_for_checkpoint(self) -> None:
        """Block until the asynchronous save still running (if any) is published; raise its error.

        Call it before tearing down a process group you created yourself: a distributed asynchronous
        save agrees on its manifest over the process group in the background.
        """
        if self._trainer_state.checkpoint_io is not None:
            self._trainer_state.checkpoint_io.wait()

    def close(self) -> None:
        """Let go of the process group; the last trainer using a group that ort_trainer created destroys it.

        Without ``close()`` that group is destroyed at interpreter exit. A group you created yourself
        (``torch.distributed.init_process_group`` before the trainer) is never destroyed by ort_trainer: call
        ``torch.distributed.destroy_process_group()`` on every rank when you are done with it. Idempotent;
        a closed trainer refuses steps, saves and loads (``state_dict()`` still works).
        """
        state = self._trainer_state
        try:
            if state.checkpoint_io is not None:  # a background save agrees over the process group: finish it first
                state.checkpoint_io.wait()
        finally:
            if state.dist is not None:
                state.dist.close()
            state.closed = True

    def __enter__(self) -> ORTTrainer:
        """``with ORTTrainer(...) as trainer:`` closes the trainer at the end of the block (`close`)."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """`close`: a pending asynchronous save is published first, then the process group let go of."""
        self.close()

    def all_gather_objects(self, value: Any) -> list:
        """``value`` of every rank, in rank order (``[value]`` in a single process): how `CheckpointManager`
        makes every rank restore the same checkpoint (call it on every rank)."""
        dist = self._trainer_state.dist
        return [value] if dist is None else dist.all_gather_objects(value)

    # ------------------------------------------------------------------ private steps
    def _check_background_save(self) -> None:
        """Raise the error of a finished asynchronous save nobody has been told about yet (never blocks)."""
        if self._trainer_state.checkpoint_io is not None:
            self._trainer_state.checkpoint_io.check()

    def _check_bindings(self) -> None:
        """Rebind ONNX Runtime if the buffers' storage moved; raise if the shared module was unlinked (`_bindings`)."""
        state = self._trainer_state
        if state.store.guard is not None:
            state.store.guard.check(state.engine.session if state.engine is not None else None)

    def _before_changing_state(self) -> None:
        """An asynchronous save may still be copying the live buffers: wait for that copy (and report its error)."""
        self._trainer_state.wait_for_snapshot()

    def _require_open(self, what: str) -> None:
        if self._trainer_state.closed:
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
        device = self._trainer_state.device.torch_device
        return [t.to(device) if t.device != device else t for t in inputs]

    def _ensure_built(self, inputs: Sequence[torch.Tensor]) -> Engine:
        state = self._trainer_state
        if state.engine is not None:
            return state.engine
        self._before_changing_state()
        state.engine = build_engine(BuildRequest.from_state(state), inputs)
        try:
            if state.options.debug.check_model_export:
                _state.check_model_export(state, inputs)
        except BaseException:
            state.engine = None
            raise
        state.model_desc = state.engine.typed_description(state.model_desc)  # legacy: dtypes known from now on
        return state.engine

    def _require_engine(self, what: str) -> Engine:
        if self._trainer_state.engine is None:
            raise RuntimeError(
                f"{what} needs the ONNX graphs, which are built on the first train_step or eval_step; "
                "run one step first"
            )
        return self._trainer_state.engine

    def _select_outputs(self, outputs: Mapping[str, torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
        fetches = list(self._trainer_state.train_step_info.fetches or [])
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
