"""Every ```js block of js/README.md and docs/*.md runs in node, in order in one module per file, in a fresh folder
holding ``mlp_artifact/`` (docs/anywhere.md's MLP, exported by ``export_training``) and a node_modules where
``ort-trainer-js`` is this repository's js/ and ``onnxruntime-node`` its installed package: as a user who installed
both would run it. A block that saves ``state.safetensors`` must save one that Python loads back."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from ort_trainer import export_training, load_training_state, optim
from tests.js.runners import JS
from tests.models import MLP, MLP_DESC
from tests.paths import REPO

DOCS = [JS / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```js\n(.*?)^```", re.DOTALL | re.MULTILINE)
WITH_JS = [d for d in DOCS if BLOCK.search(d.read_text())]


def test_js_readme_has_a_js_block():
    assert JS / "README.md" in WITH_JS


@pytest.mark.parametrize("doc", WITH_JS, ids=lambda d: str(d.relative_to(REPO)))
def test_js_blocks_run_in_node(doc, tmp_path):
    torch.manual_seed(0)
    sample = (torch.randn(8, 20), torch.randint(0, 4, (8,)))
    config = optim.AdamConfig(lr=1e-2, weight_decay=0.01)
    export_training(
        MLP(), tmp_path / "mlp_artifact", inputs=sample, model_desc=MLP_DESC, optimizer=config,
        loss_fn=torch.nn.functional.cross_entropy,
    )  # fmt: skip
    modules = tmp_path / "node_modules"
    modules.mkdir()
    (modules / "ort-trainer-js").symlink_to(JS)
    (modules / "onnxruntime-node").symlink_to(JS / "node_modules" / "onnxruntime-node")
    (tmp_path / "package.json").write_text('{"type": "module"}')
    (tmp_path / "blocks.mjs").write_text("\n".join(BLOCK.findall(doc.read_text())))
    done = subprocess.run(["node", "blocks.mjs"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    if (tmp_path / "state.safetensors").exists():
        state = load_training_state(tmp_path / "mlp_artifact", state=tmp_path / "state.safetensors")
        assert state.step >= 1 and set(state.weights) == {n for n, _ in MLP().named_parameters()}
