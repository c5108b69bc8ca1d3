"""`Trainer`: ``transformers.Trainer`` whose forward, backward and AdamW update run in ORTTrainer.

HF's loop stays as it is (data loading, accumulation windows, callbacks, logging, evaluation and
checkpoint scheduling, rotation, best-model tracking); a handful of hooks are redirected:

* ``create_optimizer`` gives HF an `OptimizerView` (HF's groups; HF's scheduler writes its rates);
* ``training_step`` runs ``ORTTrainer.train_step`` on the batch (built on the first batch, inputs named
  after its keys); the update happens on the last micro-batch of a window, with HF's current rate;
* ``prediction_step`` runs ``eval_step`` for the loss (predictions and logits come from PyTorch with
  the trained weights);
* checkpoint folders get our files (`_files`) instead of HF's pickled optimizer/scheduler/RNG files;
  ``resume_from_checkpoint=True`` resumes from the newest folder whose save completed (a preempted save
  leaves the newest one incomplete), and a resumed run re-bases ORTTrainer's micro-step counter on the
  run's ``gradient_accumulation_steps``;
* ``save_model`` (and ``train()``'s end) copy the trained weights into ``trainer.model`` first.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers

from ort_trainer import ORTTrainer, ORTTrainerOptions
from ort_trainer.checkpoint import CheckpointError

from . import _files
from ._arguments import check_training_arguments
from ._arguments import ort_options as _options_from
from ._loss_module import MODEL_PREFIX, NUM_ITEMS, LossModule, describe_inputs, tensor_inputs
from ._optimizer import GroupRates, OptimizerView, adam_config, parameter_groups

__all__ = ["Trainer"]

logger = logging.getLogger(__name__)

_FP16_REFUSED = {
    True: "TrainingArguments.fp16=True on CPU: ONNX Runtime's CPU provider has no float16 kernels, so there is "
    "nothing to run in float16 (ort_trainer.amp keeps the math in float32 there); train with fp16=False",
    False: "TrainingArguments.fp16=True is not supported by ort_trainer.hf.Trainer yet: accelerate's GradScaler "
    "would scale PyTorch gradients that do not exist here; train with fp16=False",
}


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` on ONNX Runtime: same constructor and methods, plus ``ort_options``.

    ``ort_options``: ORTTrainer options the ``TrainingArguments`` do not cover, e.g. ZeRO
    (``{"distributed": {"deepspeed_zero_optimization": {"stage": 1}}}``) or ``debug``. Arguments the
    integration cannot honour raise ValueError here, naming the argument.
    """

    def __init__(self, *args: Any, ort_options: Mapping[str, Any] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        check_training_arguments(self.args)
        if self.args.fp16:
            raise ValueError(_FP16_REFUSED[self.args.device.type == "cpu"])
        if self.optimizer is not None or self.lr_scheduler is not None:
            raise ValueError(
                "Trainer(optimizers=(optimizer, scheduler)) is not supported by ort_trainer.hf.Trainer: the update "
                "runs in ONNX Runtime (AdamW from TrainingArguments, HF's lr_scheduler_type); leave optimizers unset"
            )
        if self.optimizer_cls_and_kwargs is not None:
            raise ValueError(
                "Trainer(optimizer_cls_and_kwargs=...) is not supported by ort_trainer.hf.Trainer: the update runs "
                "in ONNX Runtime, which implements AdamW"
            )
        self._ort_options = _options_from(self.args, ort_options)
        ORTTrainerOptions(self._ort_options).check_implemented()  # bad options fail here, not at the first step
        self.ort_trainer: ORTTrainer | None = None  # built on the first training batch
        self._view: OptimizerView | None = None
        self._ort_inputs: frozenset[str] = frozenset()
        self._ort_factor = 1.0
        self._pending_resume: Path | None = None
        self._synced_step = 0  # ORTTrainer step whose weights trainer.model holds

    # ------------------------------------------------------------------ optimizer
    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """HF's two parameter groups (decay / no decay) in an `OptimizerView`; the update itself runs in ORT."""
        if self.optimizer is None:
            groups = parameter_groups(self.model, self.get_decay_parameter_names(self.model), self.args.weight_decay)
            betas = (self.args.adam_beta1, self.args.adam_beta2)
            self._view = OptimizerView(groups, lr=self.args.learning_rate, betas=betas, eps=self.args.adam_epsilon)
            self.optimizer = self._view
        return self.optimizer

    def _clip_grad_norm(self, model: torch.nn.Module) -> None:
        return None  # clipping is part of ORTTrainer's update (max_grad_norm -> AdamConfig.max_norm_clip)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> None:
        return None  # the norm stays inside ONNX Runtime's update: logs have no "grad_norm"

    def set_initial_training_values(self, args: Any, dataloader: Any) -> tuple:
        values = super().set_initial_training_values(args, dataloader)
        per_epoch, steps_in_epoch, max_steps = values[1], values[5], values[6]
        accumulation = args.gradient_accumulation_steps
        if steps_in_epoch % accumulation and max_steps >= per_epoch:
            raise ValueError(
                f"TrainingArguments.gradient_accumulation_steps={accumulation} does not divide the {steps_in_epoch} "
                "batches of an epoch: ORTTrainer accumulates a fixed number of micro-batches per update, so the "
                "short last window of the epoch cannot be run; change the batch size or gradient_accumulation_steps, "
                "or set dataloader_drop_last / max_steps so that every window is full"
            )
        return values

    # ------------------------------------------------------------------ steps
    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """Forward + backward (+ the update on a window's last micro-batch) in ORTTrainer; HF's loss for logs."""
        accumulation = self.args.gradient_accumulation_steps
        current = getattr(self, "current_gradient_accumulation_steps", accumulation)
        if current != accumulation:
            raise ValueError(
                f"an accumulation window of {current} batches instead of gradient_accumulation_steps={accumulation}: "
                "ORTTrainer updates after a fixed number of micro-batches"
            )
        inputs = self._prepare_inputs(inputs)
        feeds = tensor_inputs(inputs, num_items_in_batch)
        ort = self._ort_for(feeds, accumulation if self._loss_is_scaled(num_items_in_batch) else 1)
        ort.optim_config.lr = self._optimizer_view().learning_rate()  # HF's scheduler set it for this update
        with warnings.catch_warnings():  # a compute_loss that ignores num_items_in_batch is fine
            warnings.filterwarnings("ignore", message=rf"model_desc inputs \['{NUM_ITEMS}'\] are not used")
            # the dims this trainer names itself (describe_inputs): one the model makes static is no news to the user
            warnings.filterwarnings("ignore", message=r"model_desc names the dim '[^']*\.\d+'")
            loss = ort.train_step(**feeds)
        return loss.detach() / accumulation

    def prediction_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: Any = None
    ) -> tuple:
        """The loss from ORTTrainer's eval graph; predictions (logits) from PyTorch with the trained weights."""
        has_labels = bool(self.label_names) and all(inputs.get(k) is not None for k in self.label_names)
        if self.ort_trainer is not None and prediction_loss_only and has_labels:
            inputs = self._prepare_inputs(inputs)
            num_items = self._get_num_items_in_batch([inputs], self.args.device)
            feeds = _tensors_or_none(inputs, num_items)
            if feeds is not None and frozenset(feeds) == self._ort_inputs:
                loss = self.ort_trainer.eval_step(**feeds) / self._ort_factor
                return loss.detach().mean(), None, None
        self._sync_model()
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """HF's ``train``; afterwards ``trainer.model`` holds the trained (or best) weights.

        ``resume_from_checkpoint=True``: the newest ``checkpoint-N`` of ``output_dir`` whose save completed
        (newer, incomplete ones, left by a save that was killed, are skipped with a warning saying why).
        """
        if self.model_init is not None:  # HF builds a new model (and optimizer): a new ORTTrainer follows
            self.ort_trainer, self._view, self._synced_step = None, None, 0
        if isinstance(resume_from_checkpoint, bool) and resume_from_checkpoint:
            resume_from_checkpoint = str(self._newest_complete_checkpoint())
        elif isinstance(resume_from_checkpoint, str | os.PathLike):
            self._check_complete(Path(resume_from_checkpoint))
        output = super().train(resume_from_checkpoint, *args, **kwargs)
        self._sync_model()
        return output

    def _check_complete(self, folder: Path) -> None:
        """A folder named explicitly must be complete: FileNotFoundError (a file is missing) or ValueError."""
        problem = _files.checkpoint_problem(folder, self.args.world_size)
        if problem is None:
            return
        newest, _ = _files.newest_complete_checkpoint(folder.parent, self.args.world_size)
        hint = f"; the newest complete folder there is {newest}" if newest is not None else ""
        message = f"resume_from_checkpoint={str(folder)!r}: {problem}; its save did not complete{hint}"
        if problem.startswith("no "):
            if _files.TRAINER_FILE in problem:  # HF's folders without our state: not saved by this Trainer
                message += " (or it was not saved by ort_trainer.hf.Trainer, which writes ort_trainer.ortcp)"
            raise FileNotFoundError(message)
        raise ValueError(message)

    def _newest_complete_checkpoint(self) -> Path:
        folder, skipped = _files.newest_complete_checkpoint(self.args.output_dir, self.args.world_size)
        for reason in skipped:
            logger.warning("ort_trainer.hf: resume_from_checkpoint=True skips the incomplete %s", reason)
        if folder is None:
            why = f"; skipped: {'; '.join(skipped)}" if skipped else ""
            raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir}){why}")
        return folder

    # ------------------------------------------------------------------ ORTTrainer
    def _loss_is_scaled(self, num_items_in_batch: Any) -> bool:
        """HF's rule (``training_step``): is the loss already normalised over the whole accumulation window?"""
        if self.loss_is_scaled_for_ga is not None:
            return bool(self.loss_is_scaled_for_ga)
        return bool(self.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
            self.compute_loss_func is not None
        )

    def _optimizer_view(self) -> OptimizerView:
        if self._view is None:
            self.create_optimizer()
        if self._view is None:  # a subclass's create_optimizer made something else
            raise TypeError("ort_trainer.hf.Trainer.create_optimizer must create the OptimizerView")
        return self._view

    def _ort_for(self, feeds: Mapping[str, torch.Tensor], factor: float) -> ORTTrainer:
        names = frozenset(feeds)
        if self.ort_trainer is None:
            self.ort_trainer = self._build_ort(feeds, factor)
            self._ort_inputs, self._ort_factor = names, float(factor)
        elif names != self._ort_inputs:
            raise ValueError(
                f"this batch has inputs {sorted(names)}, but the ONNX graph was built for {sorted(self._ort_inputs)} "
                "(from the first batch): every batch must have the same keys"
            )
        elif float(factor) != self._ort_factor:
            raise ValueError("the loss normalisation changed between batches (num_items_in_batch appeared or went)")
        return self.ort_trainer

    def _build_ort(self, feeds: Mapping[str, torch.Tensor], factor: float) -> ORTTrainer:
        view = self._optimizer_view()
        module = LossModule(self.compute_loss, self.model, factor)
        desc = {"inputs": describe_inputs(feeds), "outputs": [("loss", [], True)]}
        config = adam_config(self.args, view.param_groups, MODEL_PREFIX)
        ort = ORTTrainer(module, desc, config, options=self._ort_options)
        if self._pending_resume is not None:
            self._load_ort_checkpoint(ort, self._pending_resume)
            self._pending_resume = None
        logger.info("ort_trainer.hf: training on ONNX Runtime with inputs %s", sorted(feeds))
        return ort

    def _statefuls(self) -> dict[str, Any]:
        return {"lr_scheduler": self.lr_scheduler, "learning_rates": GroupRates(self._optimizer_view())}

    def _sync_model(self) -> None:
        """Copy ORTTrainer's weights into ``trainer.model`` (once per step reached)."""
        ort = self.ort_trainer
        if ort is None or self._synced_step == ort.train_step_info.step:
            return
        state = ort.state_dict(pytorch_format=True)
        weights = {k[len(MODEL_PREFIX) :]: v for k, v in state.items() if k.startswith(MODEL_PREFIX)}
        self.model.load_state_dict(weights, strict=True)
        self._synced_step = ort.train_step_info.step

    def _push_model(self) -> None:
        """Copy ``trainer.model``'s weights into ORTTrainer (after HF loaded the best checkpoint into it)."""
        if self.ort_trainer is not None:
            state = {MODEL_PREFIX + k: v for k, v in self.model.state_dict().items()}
            self.ort_trainer.load_state_dict(state, strict=False)
            self._synced_step = self.ort_trainer.train_step_info.step

    # ------------------------------------------------------------------ saving
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """HF's ``save_model`` (``save_pretrained``: safetensors + config) of the weights trained so far."""
        self._sync_model()
        super().save_model(output_dir, _internal_call=_internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.ort_trainer is None:
            logger.warning("ort_trainer.hf: no training step ran yet, so %s gets no ORTTrainer state", output_dir)
            return
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        path = Path(output_dir) / _files.TRAINER_FILE
        self.ort_trainer.save_checkpoint(path, stateful=self._statefuls(), overwrite=True)

    def _save_scaler(self, output_dir: str) -> None:
        return None  # an fp16 loss scaler is part of ORTTrainer's checkpoint

    def _save_rng_state(self, output_dir: str) -> None:
        _files.save_rng_state(_files.rng_file(output_dir, self.args.process_index, self.args.world_size))

    # ------------------------------------------------------------------ loading
    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = _files.trainer_file(checkpoint, self.args.world_size)
        if not path.is_file():
            raise FileNotFoundError(
                f"resume_from_checkpoint: {checkpoint} has no {path.name} (the ORTTrainer state that "
                "ort_trainer.hf.Trainer writes into checkpoint folders); it was not saved by ort_trainer.hf.Trainer"
            )
        try:
            step, updates = _files.saved_steps(path)
        except CheckpointError as error:
            raise ValueError(f"resume_from_checkpoint: {path} is not a complete checkpoint: {error}") from error
        if updates != self.state.global_step:
            raise ValueError(
                f"resume_from_checkpoint: {checkpoint} mixes two saves: its {_files.TRAINER_STATE} has "
                f"global_step={self.state.global_step}, but {path.name} holds optimization_step={updates} "
                f"(step {step}); resume from another checkpoint folder"
            )
        if self.ort_trainer is None:
            self._pending_resume = path  # loaded when the first batch has built the trainer
        else:
            self._load_ort_checkpoint(self.ort_trainer, path)
            self._synced_step = -1

    def _load_ort_checkpoint(self, ort: ORTTrainer, path: Path) -> None:
        """Load our state; re-base the micro-step counter on this run's accumulation windows.

        HF resumes with the ``gradient_accumulation_steps`` of the new run (its windows restart at the
        resumed update); ORTTrainer's counter (``step``) was saved as updates x the old one, which would put
        its updates in the middle of HF's windows. Step = updates x the new one puts them at HF's window ends.
        """
        accumulation = self.args.gradient_accumulation_steps
        with _QuietMidWindowLoad():
            ort.load_checkpoint(path, stateful=self._statefuls())
        updates = ort.train_step_info.optimization_step
        if ort.train_step_info.step != updates * accumulation:
            logger.info(
                "ort_trainer.hf: %s was saved at micro-step %d after %d updates; this run accumulates %d "
                "micro-batches per update, so ORTTrainer continues from micro-step %d",
                path,
                ort.train_step_info.step,
                updates,
                accumulation,
                updates * accumulation,
            )
            ort.train_step_info.step = updates * accumulation

    def _load_scaler(self, checkpoint: str | None) -> None:
        return None  # restored with ORTTrainer's checkpoint

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = _files.rng_file(checkpoint, self.args.process_index, self.args.world_size)
        if not _files.load_rng_state(path):
            logger.info("ort_trainer.hf: %s has no %s; random state not restored", checkpoint, path.name)

    def _load_best_model(self) -> None:
        super()._load_best_model()
        self._push_model()


def _tensors_or_none(inputs: Mapping[str, Any], num_items: Any) -> dict[str, torch.Tensor] | None:
    """The graph inputs of an eval batch, or None when it has entries ORT cannot take (PyTorch evaluates it)."""
    try:
        return tensor_inputs(inputs, num_items)
    except (TypeError, ValueError):
        return None


class _QuietMidWindowLoad:
    """Drop ORTTrainer's "loaded inside an accumulation window" warning while a resume that re-bases the
    window counter loads (the gradient buffer is empty anyway: nothing ran yet since the load)."""

    def __init__(self) -> None:
        self._logger = logging.getLogger("ort_trainer")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("loaded a state saved at step")

    def __enter__(self) -> _QuietMidWindowLoad:
        self._logger.addFilter(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeFilter(self)
