"""The JS driver from the tests' side: write a training plan (js/tools/plan.js: plan.json and
batches.safetensors), run it on an artifact in onnxruntime-node or in headless Chromium (js/tools/run-*.mjs), and
the same plan in Python onnxruntime, following manifest.json as the JS driver does (the reference)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import onnxruntime as ort
from safetensors.numpy import load_file, save_file

from tests.paths import REPO

JS = REPO / "js"
NODE_TOOLS = JS / "tools"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


def write_plan(folder: Path, batches: list[dict[str, np.ndarray]], lrs: list[float], eval_batch: dict | None) -> Path:
    """One batch per step (random inputs included where the plan feeds its own draws) and the eval batch."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"{i}/{name}": np.ascontiguousarray(v) for i, b in enumerate(batches) for name, v in b.items()}
    plan: dict = {"steps": [{"lr": lr, "batch": str(i)} for i, lr in enumerate(lrs)]}
    if eval_batch is not None:
        tensors.update({f"e/{name}": np.ascontiguousarray(v) for name, v in eval_batch.items()})
        plan["eval"] = "e"
    save_file(tensors, str(folder / "batches.safetensors"))
    (folder / "plan.json").write_text(json.dumps(plan))
    return folder


def run_js(
    runtime: str,
    artifact: Path,
    plan: Path,
    out: Path,
    state: Path | None = None,
    seed: int = 0,
    timeout: float = 300,
) -> tuple[dict, dict[str, np.ndarray]]:
    """Run the plan in ``runtime`` ("node" or "browser"), the driver's draws seeded with ``seed``; returns
    (result.json's dict, the saved state's tensors)."""
    out.mkdir(parents=True, exist_ok=True)
    command = ["node", str(NODE_TOOLS / f"run-{runtime}.mjs"), str(artifact), str(plan), str(out), "--seed", str(seed)]
    if state is not None:
        command += ["--state", str(state)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env={**os.environ, "CHROMIUM": CHROMIUM}
    )
    if done.returncode != 0:
        raise AssertionError(f"{runtime} run failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return json.loads((out / "result.json").read_text()), load_file(str(out / "state.safetensors"))


class PythonDriver:
    """manifest.json followed in Python onnxruntime (1 thread), as the JS driver follows it."""

    def __init__(self, artifact: Path, state: Path | None = None):
        self.manifest = json.loads((artifact / "manifest.json").read_text())
        files = self.manifest["files"]
        self.state = load_file(str(state or artifact / files["state"]))
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self.train = ort.InferenceSession(str(artifact / files["train"]), options, providers=["CPUExecutionProvider"])
        self.eval = ort.InferenceSession(str(artifact / files["eval"]), options, providers=["CPUExecutionProvider"])
        from safetensors import safe_open

        with safe_open(str(state or artifact / files["state"]), "np") as f:
            self.step = int((f.metadata() or {}).get("step", self.manifest["step"]))

    def _feeds(self, names: list[str], batch: dict[str, np.ndarray], scalars: dict) -> dict:
        return {n: self.state[n] if n in self.state else scalars[n] if n in scalars else batch[n] for n in names}

    def train_step(self, batch: dict[str, np.ndarray], lr: float) -> float:
        train = self.manifest["train"]
        scalars = {"lr": np.array(lr, np.float32), "step": np.array(self.step + 1, np.int64)}
        outputs = dict(
            zip(
                [o.name for o in self.train.get_outputs()],
                self.train.run(None, self._feeds(train["inputs"], batch, scalars)),
                strict=True,
            )
        )
        for name, output in train["updated"].items():
            self.state[name] = outputs[output]
        self.step += 1
        return float(outputs[train["loss"]])

    def eval_loss(self, batch: dict[str, np.ndarray]) -> float:
        names = self.manifest["eval"]["inputs"]
        outputs = self.eval.run(None, self._feeds(names, batch, {}))
        return float(dict(zip([o.name for o in self.eval.get_outputs()], outputs, strict=True))["loss"])

    def run_plan(self, batches: list[dict], lrs: list[float], eval_batch: dict | None) -> dict:
        losses = [self.train_step(b, lr) for b, lr in zip(batches, lrs, strict=True)]
        evaluated = None if eval_batch is None else self.eval_loss(eval_batch)
        return {"losses": losses, "eval_loss": evaluated, "step": self.step}
