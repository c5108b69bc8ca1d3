"""`ArtifactRunner`: the reference driver of a training artifact, in Python onnxruntime.

It does exactly what docs/anywhere.md tells any driver to do (the JS driver in ``js/`` does the same): read the
manifest, feed the state tensors by name with the batch, ``lr``, ``step`` and fresh random draws, and replace every
state tensor the manifest lists under ``train.updated`` by its output. Tests and ``benchmarks/anywhere.py`` use it
to check an artifact against ``ORTTrainer.train_step``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from ._errors import ArtifactError
from ._manifest import read_manifest
from ._state_file import read_state, write_state

__all__ = ["ArtifactRunner"]


class ArtifactRunner:
    """A training artifact loaded into onnxruntime sessions (CPU), with its state in numpy arrays.

    ``threads``: intra-op threads of the sessions (None: onnxruntime's default). ``seed``: the generator of the
    random draws (Dropout masks) when a step is not given them. ``state``: a state file to start from instead of
    the artifact's own (one a driver saved back).
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        *,
        threads: int | None = None,
        seed: int = 0,
        state: str | os.PathLike | None = None,
    ):
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        files = self.manifest["files"]
        expected = {e["name"]: e for e in self.manifest["state"]}
        self.state, self.step = read_state(state if state is not None else self.folder / files["state"], expected)
        options = ort.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        self._options = options
        self._train = self._session(files["train"], self.manifest["train"]["inputs"])
        self._eval: ort.InferenceSession | None = None
        self._rng = np.random.default_rng(seed)
        updated = self.manifest["train"]["updated"]
        self._fetch = [self.manifest["train"]["loss"], *updated.values()]
        self._targets = list(updated)

    def _session(self, name: str, inputs: list[str]) -> ort.InferenceSession:
        path = self.folder / name
        if not path.is_file():
            raise ArtifactError(f"{path}: the graph file the manifest names is missing")
        try:
            session = ort.InferenceSession(str(path), self._options, providers=["CPUExecutionProvider"])
        except Exception as error:  # noqa: BLE001 - onnxruntime's load errors, told with the file's name
            raise ArtifactError(f"{path}: onnxruntime cannot load it ({type(error).__name__}: {error})") from None
        got = [i.name for i in session.get_inputs()]
        if got != list(inputs):
            raise ArtifactError(f"{path}: its inputs {got[:8]}... differ from the manifest's {list(inputs)[:8]}...")
        return session

    # ------------------------------------------------------------------ steps
    def train_step(
        self, batch: Mapping[str, np.ndarray], lr: float, *, random: Mapping[str, np.ndarray] | None = None
    ) -> float:
        """One update: the loss of the forward before it. ``random``: the draws by name (else fresh ones)."""
        if isinstance(lr, bool) or not isinstance(lr, int | float) or not math.isfinite(lr) or lr < 0:
            raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
        sizes = self._check_batch(batch)
        self.step += 1
        feeds: dict[str, Any] = {}
        for name in self.manifest["train"]["inputs"]:
            if name in self.state:
                feeds[name] = self.state[name]
            elif name in batch:
                feeds[name] = batch[name]
        feeds["lr"] = np.array(lr, dtype=np.float32)
        feeds["step"] = np.array(self.step, dtype=np.int64)
        feeds.update(self._draws(sizes, random))
        outputs = self._train.run(self._fetch, feeds)
        for name, value in zip(self._targets, outputs[1:], strict=True):
            self.state[name] = value
        return float(outputs[0])

    def eval_step(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The eval graph's outputs by name (dropout off)."""
        self._check_batch(batch)
        if self._eval is None:
            self._eval = self._session(self.manifest["files"]["eval"], self.manifest["eval"]["inputs"])
        names = self.manifest["eval"]["inputs"]
        feeds = {n: self.state[n] if n in self.state else batch[n] for n in names}
        outputs = self._eval.run(self.manifest["eval"]["outputs"], feeds)
        return dict(zip(self.manifest["eval"]["outputs"], outputs, strict=True))

    def save_state(self, path: str | os.PathLike) -> Path:
        """Write the state (same names, the new step) as a driver saves it back; returns ``path``."""
        write_state(path, self.state, self.step)
        return Path(path)

    # ------------------------------------------------------------------ checks
    def _check_batch(self, batch: Mapping[str, np.ndarray]) -> dict[str, int]:
        """The size of each named dim in ``batch``; ValueError naming an input of the wrong dtype or shape."""
        sizes: dict[str, int] = {}
        for entry in self.manifest["inputs"]:
            name = entry["name"]
            if name not in batch:
                raise KeyError(f"the batch lacks the input {name!r} (the artifact takes {self.input_names})")
            value = batch[name]
            if not isinstance(value, np.ndarray) or value.dtype != np.dtype(entry["dtype"]):
                got = value.dtype if isinstance(value, np.ndarray) else type(value).__name__
                raise TypeError(f"input {name!r}: expected a numpy array of {entry['dtype']}, got {got}")
            shape = entry["shape"]
            if value.ndim != len(shape):
                raise ValueError(f"input {name!r}: expected shape {shape}, got {list(value.shape)}")
            for want, got in zip(shape, value.shape, strict=True):
                if isinstance(want, int) and want != got:
                    raise ValueError(f"input {name!r}: expected shape {shape}, got {list(value.shape)}")
                if isinstance(want, str) and sizes.setdefault(want, got) != got:
                    raise ValueError(
                        f"input {name!r}: dim {want!r} is {got}, another input has it {sizes[want]} "
                        f"(shape {list(value.shape)}, expected {shape})"
                    )
        return sizes

    def _draws(self, sizes: dict[str, int], given: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        draws = {}
        for entry in self.manifest["random"]:
            shape = tuple(_size(d, sizes) for d in entry["shape"])
            if given is not None:
                value = given[entry["name"]]
                if tuple(value.shape) != shape:
                    raise ValueError(f"random input {entry['name']!r}: expected shape {list(shape)}, got {value.shape}")
            elif entry["kind"] == "uniform":
                value = self._rng.random(shape, dtype=np.float32)
            else:
                value = self._rng.standard_normal(shape, dtype=np.float32)
            draws[entry["name"]] = value.astype(entry["dtype"], copy=False)
        return draws

    @property
    def input_names(self) -> list[str]:
        return [e["name"] for e in self.manifest["inputs"]]


def _size(entry: int | str, sizes: Mapping[str, int]) -> int:
    """A manifest shape entry for this batch: an int, a dim name, or a product ``"4*batch*seq"``."""
    if isinstance(entry, int):
        return entry
    return math.prod(int(f) if f.isdigit() else sizes[f] for f in entry.split("*"))
