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


def test_without_transformers_the_error_says_which_extra_to_install():
    """A plain `pip install ort_trainer` has no transformers: the import names the extra instead of a bare
    "No module named 'transformers'". (None in sys.modules makes `import transformers` fail as if absent.)"""
    code = (
        "import sys\n"
        "sys.modules['transformers'] = None\n"
        "try:\n"
        "    from ort_trainer.hf import Trainer\n"
        "except ModuleNotFoundError as error:\n"
        "    print(repr(error.name), error)\n"
        "    print(type(error.__cause__).__name__, error.__cause__.name)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    message, cause = out.stdout.splitlines()[-2:]
    assert message.startswith("'transformers' ort_trainer.hf needs transformers"), out.stdout
    assert 'pip install "ort_trainer[hf]"' in message, out.stdout
    assert cause == "ModuleNotFoundError transformers", out.stdout
