"""The way back: a state that a driver trained (in Node, a browser, Python) into ``ORTTrainer`` or a torch module.

`load_training_state` reads an artifact's state file (checked against its manifest when there is one) into a
`TrainingState`: the weights and buffers by the trainer's names, each parameter's moments, and the update count.
From there, `TrainingState.trainer_state_dict` is what ``ORTTrainer.load_state_dict`` and our checkpoint files hold
(``ort-trainer-ckpt convert`` writes it), and `TrainingState.module_state_dict` is a plain ``load_state_dict`` for
the module (tied weights filled under every name the module gives them).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._errors import ArtifactError
from ._manifest import MANIFEST, read_manifest
from ._state_file import read_header, read_state

__all__ = ["TrainingState", "is_training_state", "load_training_state"]

_PREFIX, _MOMENTS = "optimizer.", (".exp_avg", ".exp_avg_sq")
_CONFIGS = ("AdamOptimizer", "LambOptimizer", "SGDOptimizer")


@dataclass
class TrainingState:
    """A training artifact's state: ``weights`` (float parameters and state), ``buffers`` (the other state, e.g.
    integer buffers), ``moments`` ({parameter: (first, second)}), ``step`` (updates applied) and ``optimizer``
    (``"AdamOptimizer"``, ``"LambOptimizer"`` or ``"SGDOptimizer"``)."""

    step: int
    optimizer: str
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    buffers: dict[str, np.ndarray] = field(default_factory=dict)
    moments: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def trainer_state_dict(self) -> dict[str, Any]:
        """The state in ``ORTTrainer.state_dict()``'s layout (and our checkpoints'): ``ORTTrainer.load_state_dict``
        takes it, and training continues from update ``step + 1``."""
        import torch

        from ort_trainer.checkpoint.format import schema as S

        def tensors(values: Mapping[str, np.ndarray]) -> dict[str, Any]:
            return {n: torch.from_numpy(np.array(v)) for n, v in values.items()}

        options = S.TrainerOptionsRecord(
            mixed_precision=False,
            zero_stage=0,
            world_rank=0,
            world_size=1,
            optimizer_name=self.optimizer,
            data_parallel_size=1,
            horizontal_parallel_size=1,
        )
        model = {S.FULL_PRECISION_KEY: tensors(self.weights)} | (
            {S.BUFFERS_KEY: tensors(self.buffers)} if self.buffers else {}
        )
        tree: dict[str, Any] = {
            S.MODEL_KEY: model,
            S.TRAINER_OPTIONS_KEY: options.to_tree(),
            S.TRAIN_STEP_INFO_KEY: {S.OPTIMIZATION_STEP_KEY: self.step, S.TRAIN_STEP_KEY: self.step},
        }
        if self.optimizer == "SGDOptimizer":
            return tree
        count = torch.tensor([self.step + 1], dtype=torch.int64)  # the counter of the next update
        optimizer: dict[str, Any] = {}
        for name, moments in self.moments.items():
            optimizer[name] = dict(
                zip(("Moment_1", "Moment_2"), tensors(dict(enumerate(moments))).values(), strict=True)
            )
            if self.optimizer == "AdamOptimizer":
                optimizer[name]["Update_Count"] = count.clone()
        if self.optimizer == "LambOptimizer":
            optimizer["shared_optimizer_state"] = {"Step": count}
        tree[S.OPTIMIZER_KEY] = optimizer
        return tree

    def module_state_dict(self, module: Any = None) -> dict[str, Any]:
        """``{name: torch.Tensor}`` for ``module.load_state_dict``; with ``module``, every key of its
        ``state_dict()`` (a tied weight under each of its names), KeyError naming the keys the state lacks."""
        import torch

        tensors = {n: torch.from_numpy(np.array(v)) for n, v in {**self.weights, **self.buffers}.items()}
        if module is None:
            return tensors
        aliases: dict[str, str] = {}
        first: dict[int, str] = {}
        for name, value in [
            *module.named_parameters(remove_duplicate=False),
            *module.named_buffers(remove_duplicate=False),
        ]:
            owner = first.setdefault(id(value), name)
            aliases[name] = owner if owner in tensors else name
        out, missing = {}, []
        for key in module.state_dict():
            source = key if key in tensors else aliases.get(key, key)
            if source in tensors:
                out[key] = tensors[source]
            else:
                missing.append(key)
        if missing:
            raise KeyError(f"the training state has no tensor for the module's {missing[:10]}")
        return out


def is_training_state(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a training artifact folder or a state file a training artifact writes."""
    path = Path(path)
    if path.is_dir():
        return (path / MANIFEST).is_file()
    if path.suffix.lower() != ".safetensors" or not path.is_file():
        return False
    try:
        read_header(path)
    except ArtifactError:
        return False
    return True


def load_training_state(
    source: str | os.PathLike, *, state: str | os.PathLike | None = None, optimizer: str | None = None
) -> TrainingState:
    """The state of a training artifact: ``source`` is its folder (the state file its manifest names, or
    ``state``: one a driver saved back, checked against the manifest) or a state file alone (then ``optimizer``,
    ``"AdamOptimizer"`` by default, says whose moments it holds; a file without moments is SGD's)."""
    source = Path(source)
    if source.is_dir():
        manifest = read_manifest(source)
        expected = {e["name"]: e for e in manifest["state"]}
        tensors, step = read_state(state if state is not None else source / manifest["files"]["state"], expected)
        roles = {e["name"]: e["role"] for e in manifest["state"]}
        config = manifest["optimizer"]["config"]
        if config not in _CONFIGS:
            raise ArtifactError(f"{source / MANIFEST}: optimizer.config {config!r} is not one of {list(_CONFIGS)}")
    else:
        if state is not None:
            raise TypeError("load_training_state: state= goes with an artifact folder, not with a state file")
        tensors, step = read_state(source)
        roles = {n: "optimizer" if n.startswith(_PREFIX) and n.endswith(_MOMENTS) else "parameter" for n in tensors}
        moments = any(r == "optimizer" for r in roles.values())
        config = (optimizer or "AdamOptimizer") if moments else "SGDOptimizer"
        if config not in _CONFIGS:
            raise ValueError(f"load_training_state: optimizer must be one of {list(_CONFIGS)}, got {config!r}")
    return _split(tensors, roles, step, config, source)


def _split(
    tensors: Mapping[str, np.ndarray], roles: Mapping[str, str], step: int, config: str, source: Path
) -> TrainingState:
    out = TrainingState(step=step, optimizer=config)
    for name, value in tensors.items():
        if roles[name] == "optimizer":
            continue
        target = out.weights if np.issubdtype(value.dtype, np.floating) else out.buffers
        target[name] = value
    if config == "SGDOptimizer":
        return out
    for name in out.weights:
        first, second = f"{_PREFIX}{name}{_MOMENTS[0]}", f"{_PREFIX}{name}{_MOMENTS[1]}"
        if first in tensors and second in tensors:
            out.moments[name] = (tensors[first], tensors[second])
    orphans = sorted(
        n for n, r in roles.items() if r == "optimizer" and n.removeprefix(_PREFIX).rsplit(".", 1)[0] not in out.moments
    )
    if orphans:
        raise ArtifactError(f"{source}: optimizer tensors {orphans[:10]} belong to no parameter of the state")
    return out
