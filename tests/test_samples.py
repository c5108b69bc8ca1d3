"""The samples run end to end: a shortened samples/train_lm.py trains, plots and hands weights back to torch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not found in the sample's output:\n{text}"
    return float(match.group(1))


def test_train_lm_sample_learns_and_writes_the_loss_curve(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "samples" / "train_lm.py"), "--steps", "30", "--eval-every", "10"]
    result = subprocess.run(
        [*command, "--out", str(out)],
        cwd=tmp_path,  # the sample must not depend on the working directory
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"exit code {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"

    png = out / "loss.png"
    assert png.read_bytes()[:8] == PNG_MAGIC, f"{png} is not a PNG"
    summary = next((line for line in result.stdout.splitlines() if line.startswith("summary:")), "")
    assert f"png={png}" in summary, summary
    assert "steps=30 " in summary, summary
    first = _number(r"first_train_loss=([\d.]+)", summary)
    last = _number(r"last_train_loss=([\d.]+)", summary)
    eval_loss = _number(r"eval_loss=([\d.]+)", summary)
    # 81 characters: an untrained model costs about ln(81) = 4.39 nats; 30 steps get well below that
    assert first > 4.0, summary
    assert last < first - 0.8, summary
    assert eval_loss < first - 0.8, summary

    # the ORT -> PyTorch hand-off: the torch module with the trained weights gives ORT's eval loss
    ort_loss = _number(r"ONNX Runtime ([\d.]+)", result.stdout)
    torch_loss = _number(r"PyTorch ([\d.]+)", result.stdout)
    assert abs(ort_loss - torch_loss) < 1e-3, result.stdout
