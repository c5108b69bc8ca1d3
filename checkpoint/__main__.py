"""``python -m ort_trainer.checkpoint`` and the ``ort-trainer-ckpt`` console script (see ``checkpoint/cli/``)."""

import sys

from .cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
