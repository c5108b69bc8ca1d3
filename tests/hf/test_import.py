"""transformers and accelerate are an extra: importing ort_trainer (and its other subpackages) never imports them."""

from __future__ import annotations

import subprocess
import sys


def test_importing_ort_trainer_does_not_import_transformers():
    code = (
        "import sys, ort_trainer, ort_trainer.checkpoint, ort_trainer.optim, ort_trainer.amp\n"
        "loaded = sorted(m for m in ('transformers', 'accelerate', 'ort_trainer.hf') if m in sys.modules)\n"
        "print(loaded)\n"
        "import ort_trainer.hf\n"
        "print('transformers' in sys.modules, ort_trainer.hf.Trainer.__mro__[1].__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    first, second = out.stdout.splitlines()[-2:]
    assert first == "[]", out.stdout
    assert second == "True transformers.trainer", out.stdout
