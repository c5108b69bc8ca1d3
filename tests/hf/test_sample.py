"""samples/hf_trainer.py runs end to end, shortened: it learns, checkpoints, resumes from its newest
checkpoint folder, and the saved model loads with from_pretrained and gives ORT's eval loss in PyTorch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _sample(tmp_path: Path, *extra: str) -> str:
    command = [sys.executable, str(ROOT / "samples" / "hf_trainer.py"), "--out", str(tmp_path / "out"), *extra]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"exit code {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


def _number(name: str, text: str) -> float:
    match = re.search(rf"{name}=([\d.]+)", text)
    assert match, f"{name} not in the sample's output:\n{text}"
    return float(match.group(1))


@pytest.mark.processes
@pytest.mark.hf_long
def test_hf_trainer_sample_learns_saves_and_resumes(tmp_path):
    out = _sample(tmp_path, "--steps", "20")
    summary = next(line for line in out.splitlines() if line.startswith("summary:"))
    assert "steps=20 " in summary
    first, last = _number("first_train_loss", summary), _number("last_train_loss", summary)
    assert first > 4.5 and last < first - 1.0, summary  # bytes: untrained ~ ln(256) = 5.5 nats
    pair = re.search(r"eval loss ([\d.]+), PyTorch \(from_pretrained\) ([\d.]+)", out)
    ort, torch_loss = float(pair.group(1)), float(pair.group(2))
    assert abs(ort - torch_loss) < 1e-3, out
    folders = sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*"))
    assert folders == ["checkpoint-10", "checkpoint-20"], folders

    resumed = _sample(tmp_path, "--steps", "30", "--resume")  # newest folder: checkpoint-20, then 10 more steps
    assert "steps=30 " in resumed
