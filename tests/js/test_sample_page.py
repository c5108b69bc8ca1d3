"""samples/train_in_browser: its make_artifact.py writes an artifact, and the page fine-tunes it in headless
Chromium through its own button, draws the loss curve on its canvas and offers the trained state as a download
that loads back in Python and trains on from where the page stopped."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from ort_trainer import ArtifactRunner
from tests.paths import REPO

SAMPLE = REPO / "samples" / "train_in_browser"
PRETRAIN, STEPS = 0, 4  # no pretraining: the export alone (ORTTrainer builds no graph of its own)


def test_the_page_fine_tunes_draws_the_curve_and_downloads_a_loadable_state(tmp_path):
    artifact = tmp_path / "artifact"
    subprocess.run(
        [sys.executable, str(SAMPLE / "make_artifact.py"), "--pretrain-steps", str(PRETRAIN), "--out", str(artifact)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    out = tmp_path / "page"
    out.mkdir()
    done = subprocess.run(
        ["node", str(REPO / "tests" / "js" / "drive_sample.mjs"), str(artifact), str(out), str(STEPS)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((out / "result.json").read_text())
    assert len(result["points"]) == STEPS and np.all(np.isfinite(result["points"])), result
    assert result["status"].startswith(f"step {PRETRAIN + STEPS}: loss "), result["status"]
    assert result["curve_pixels"] > 200, result  # the curve is drawn, not only the axes
    assert (out / "page.png").stat().st_size > 10_000
    assert result["downloads"] == [f"state-step{PRETRAIN + STEPS}.safetensors"], result
    # the download is the state after the page's steps: it loads into the reference driver and trains on
    runner = ArtifactRunner(artifact, threads=1, state=out / "downloads" / result["downloads"][0])
    assert runner.step == PRETRAIN + STEPS
    vocab = json.loads((artifact / "vocab.json").read_text())
    ids = np.random.default_rng(0).integers(0, len(vocab["chars"]), (2, vocab["context"] + 1))
    loss = runner.train_step({"tokens": ids[:, :-1].copy(), "label": ids[:, 1:].copy()}, 1e-3)
    assert np.isfinite(loss) and runner.step == PRETRAIN + STEPS + 1
