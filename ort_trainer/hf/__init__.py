"""Hugging Face ``transformers.Trainer`` on ONNX Runtime: ``from ort_trainer.hf import Trainer``.

Needs the ``hf`` extra (``pip install "ort_trainer[hf]"``: transformers and accelerate); importing
``ort_trainer`` itself never imports transformers. See docs/hf.md.
"""

from .trainer import Trainer

__all__ = ["Trainer"]
