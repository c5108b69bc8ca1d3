"""`export_training`: a self-contained training artifact for any ONNX Runtime (docs/anywhere.md).

The folder holds the training-step graph (forward, backward, clipping, update), the eval graph, the state
(weights, buffers, moments) in safetensors and the manifest that ties them together. The graphs and the state are
the trainer's own: an ``ORTTrainer`` given here is exported as it stands (weights, moments, update count), a module
as a new trainer would start.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from ort_trainer.optim.config import DecayMode, OptimizerConfig

from ._graphs import export_graphs
from ._manifest import VERSION, shape_entry, write_manifest
from ._state_file import FORMAT, write_state
from ._step_graph import LR, STEP, add_update, moment_names

__all__ = ["export_training"]

_log = logging.getLogger("ort_trainer")
TRAIN_FILE, EVAL_FILE, STATE_FILE = "train_step.onnx", "eval_step.onnx", "state.safetensors"


def export_training(
    model_or_trainer: Any,
    path: str | os.PathLike,
    *,
    inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    model_desc: Mapping[str, Any] | None = None,
    optimizer: OptimizerConfig | None = None,
    loss_fn: Callable | None = None,
    options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the training artifact of a model to the folder ``path``; returns it.

    ``model_or_trainer``: an ``ORTTrainer`` (its model, ``model_desc``, optimizer, loss and options, and its
    current state: weights, moments, update count), or a ``torch.nn.Module`` / ``onnx.ModelProto`` with
    ``model_desc``, ``optimizer`` (``optim.AdamConfig``, ``LambConfig`` or ``SGDConfig``), ``loss_fn`` and
    ``options`` as ``ORTTrainer`` takes them (the state a new trainer starts from).
    ``inputs``: one sample batch (tensors in ``model_desc`` order, or by name), used to trace the graphs; the
    dims ``model_desc`` names with strings stay symbolic, so the artifact runs any size of them.
    ``overwrite``: replace an existing folder (else FileExistsError).
    """
    from ort_trainer.trainer import ORTTrainer

    if isinstance(model_or_trainer, ORTTrainer):
        given = {"model_desc": model_desc, "optimizer": optimizer, "loss_fn": loss_fn, "options": options}
        twice = sorted(k for k, v in given.items() if v is not None)
        if twice:
            raise TypeError(f"export_training: {twice} come from the ORTTrainer given; pass them only with a module")
        trainer = model_or_trainer
    else:
        if model_desc is None or optimizer is None:
            raise TypeError("export_training: a module needs model_desc= and optimizer= (an ORTTrainer has them)")
        trainer = ORTTrainer(model_or_trainer, model_desc, optimizer, loss_fn=loss_fn, options=options)
    target = Path(path)
    if target.exists() and not overwrite:
        raise FileExistsError(f"export_training: {target} exists; pass overwrite=True to replace it")
    state = trainer.trainer_state
    _refuse_unsupported(state)
    samples = _sample_inputs(state.model_desc.input_names, inputs)
    train, evaluation = export_graphs(state, samples)
    folder = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent if target.parent.exists() else None))
    try:
        _readable(folder)
        manifest = _write(state, train, evaluation, folder)
        for file in folder.iterdir():
            _readable(file)
        if target.exists():
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        folder.rename(target)
    finally:
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
    _log.info("training artifact written to %s (%s, %d state tensors)", target, manifest["optimizer"]["name"],
              len(manifest["state"]))  # fmt: skip
    return target


def _readable(path: Path) -> None:
    """The mode a plain ``mkdir`` / ``open`` would give (mkdtemp and the safetensors writer make them private)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def _refuse_unsupported(state) -> None:
    options = state.options
    problems = []
    if options.mixed_precision.enabled:
        problems.append("mixed_precision.enabled (the artifact trains in float32)")
    if options.batch.gradient_accumulation_steps != 1:
        problems.append("batch.gradient_accumulation_steps > 1 (one graph run is one update)")
    if state.dist is not None or state.horizontal is not None:
        problems.append("a distributed trainer (the artifact is one process's step)")
    if problems:
        raise ValueError(f"export_training cannot export a trainer with {'; '.join(problems)}")


def _sample_inputs(names: Sequence[str], inputs: Any) -> list[torch.Tensor]:
    if isinstance(inputs, Mapping):
        missing = [n for n in names if n not in inputs]
        extra = sorted(set(inputs) - set(names))
        if missing or extra:
            raise KeyError(f"export_training: inputs must name the model_desc inputs {list(names)}: missing "
                           f"{missing}, unknown {extra}")  # fmt: skip
        values = [inputs[n] for n in names]
    else:
        values = list(inputs)
        if len(values) != len(names):
            raise ValueError(f"export_training: {len(values)} inputs given, model_desc has {len(names)}: {list(names)}")
    bad = [n for n, v in zip(names, values, strict=True) if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"export_training: inputs {bad} are not torch tensors")
    return values


def _write(state, train, evaluation, folder: Path) -> dict[str, Any]:
    store, desc, config = state.store, state.model_desc, state.optim_config
    tensors = _state_tensors(state)
    shapes = {name: list(t.shape) for name, t in tensors.items()}
    dims = sorted({label for axes in train.traced.dynamic.values() for label in axes.values()})
    read = {i.name for i in train.model.graph.input}
    random = [_random_entry(r, dims) for r in train.traced.random_inputs if r.name in read]
    trained = list(train.traced.trained)
    loss = desc.output_names[desc.loss_index]
    step_graph = add_update(
        train.model,
        config=config,
        trained=trained,
        updated_buffers=list(train.traced.updated),
        state_shapes=shapes,
        batch_inputs=desc.input_names,
        random_inputs=[r["name"] for r in random],
        loss=loss,
        clip=state.options.utils.grad_norm_clip,
    )
    onnx.save(train.model, folder / TRAIN_FILE)
    onnx.save(evaluation.model, folder / EVAL_FILE)
    step = _update_count(state)
    write_state(folder / STATE_FILE, {n: t.numpy() for n, t in tensors.items()}, step)
    roles = _roles(store, tensors)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "versions": _versions(),
        "files": {"train": TRAIN_FILE, "eval": EVAL_FILE, "state": STATE_FILE},
        "dims": dims,
        "inputs": [_value_entry(i, dims) for i in train.model.graph.input if i.name in desc.input_names],
        "state": [
            {"name": n, "dtype": str(t.numpy().dtype), "shape": shapes[n], "role": roles[n]} for n, t in tensors.items()
        ],
        "random": random,
        "train": {
            "inputs": step_graph.inputs,
            "scalars": {LR: "float32", STEP: "int64"},
            "loss": loss,
            "updated": step_graph.updated,
            "extra_outputs": step_graph.extra_outputs,
        },
        "eval": {
            "inputs": [i.name for i in evaluation.model.graph.input],
            "outputs": [o.name for o in evaluation.model.graph.output],
        },
        "optimizer": _optimizer_entry(config, state.options.utils.grad_norm_clip),
        "step": step,
    }
    write_manifest(folder, manifest)
    return manifest


def _state_tensors(state) -> dict[str, torch.Tensor]:
    """Every state tensor, CPU copies in manifest order: trainable parameters (layout order), frozen state, the
    other buffers, then each parameter's moments (Adam and LAMB)."""
    store = state.store
    tensors = {name: store.param_views[name] for name in store.layout.names}
    tensors.update(store.frozen)
    tensors.update(store.buffers)
    moments = store.optimizer.state_dict() if state.optim_config.name != "SGDOptimizer" else {}
    for name in store.layout.names if moments else ():
        first, second = moment_names(name)
        tensors[first], tensors[second] = moments[name]["Moment_1"], moments[name]["Moment_2"]
    return {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()}


def _roles(store, tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    trainable = set(store.layout.names)
    state = set(store.frozen) | set(store.buffers)
    return {n: "parameter" if n in trainable else "buffer" if n in state else "optimizer" for n in tensors}


def _update_count(state) -> int:
    """Updates already applied: the optimizer's counter less one (Adam, LAMB), else the trainer's step count."""
    count = state.store.optimizer.update_count() if state.store.optimizer is not None else None
    return count - 1 if count is not None else int(state.train_step_info.optimization_step)


def _value_entry(value: onnx.ValueInfoProto, dims: list[str]) -> dict[str, Any]:
    tensor = value.type.tensor_type
    shape = [d.dim_param if d.dim_param else d.dim_value for d in tensor.shape.dim]
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)).name
    return {"name": value.name, "dtype": dtype, "shape": [shape_entry(d, dims) for d in shape]}


def _random_entry(random, dims: list[str]) -> dict[str, Any]:
    if random.kind not in ("uniform", "normal"):
        raise ValueError(f"export_training: the random draw {random.name} ({random.kind}) has no artifact form")
    try:
        shape = [shape_entry(d, dims) for d in random.shape]
    except ValueError as error:
        raise ValueError(
            f"export_training: the random draw {random.name} (a Dropout mask or another random op) has the shape "
            f"{list(random.shape)}, which the manifest cannot express ({error})"
        ) from None
    dtype = str(random.dtype).removeprefix("torch.")
    return {"name": random.name, "kind": random.kind, "dtype": dtype, "shape": shape}


def _optimizer_entry(config: OptimizerConfig, clip: bool) -> dict[str, Any]:
    defaults = {k: _json_number(v) for k, v in config.defaults.items()}
    if config.name == "AdamOptimizer":
        adamw = config.defaults["weight_decay_mode"] == DecayMode.BEFORE_WEIGHT_UPDATE
        name = "AdamW" if adamw and config.defaults["do_bias_correction"] else "Adam"
    else:
        name = {"LambOptimizer": "LAMB", "SGDOptimizer": "SGD"}[config.name]
    groups = [{k: _json_number(v) if k != "params" else list(v) for k, v in g.items()} for g in config.params]
    max_norm = config.defaults.get("max_norm_clip") if clip and config.name != "SGDOptimizer" else None
    return {"name": name, "config": config.name, "hyper": defaults, "groups": groups, "max_grad_norm": max_norm}


def _json_number(value: Any) -> Any:
    """A hyper-parameter as JSON can hold it: infinities as the strings "inf" / "-inf", enums as ints."""
    if isinstance(value, DecayMode):
        return int(value)
    if isinstance(value, float) and not np.isfinite(value):
        return "inf" if value > 0 else "-inf"
    return value


def _versions() -> dict[str, Any]:
    import onnxruntime

    import ort_trainer

    return {
        "ort_trainer": ort_trainer.__version__,
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "onnx": onnx.__version__,
        "opset": 18,
        "ir_version": 10,
    }
