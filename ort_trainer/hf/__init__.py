"""Hugging Face ``transformers.Trainer`` on ONNX Runtime: ``from ort_trainer.hf import Trainer``.

Needs the ``hf`` extra (``pip install "ort_trainer[hf]"``: transformers and accelerate); importing
``ort_trainer`` itself never imports transformers. See docs/hf.md.

``trainer``: the ``Trainer``; ``_arguments``: which ``TrainingArguments`` are honoured and the options they become;
``_loss_module``: what ORTTrainer exports (``compute_loss`` around the model); ``_optimizer``: the optimizer as
HF sees it; ``_files``: our files inside HF's ``checkpoint-N`` folders and the RNG state, without pickle.
"""

_EXTRA = ("transformers", "accelerate")  # what `pip install "ort_trainer[hf]"` adds

try:
    from .trainer import Trainer
except ModuleNotFoundError as error:
    if error.name not in _EXTRA:
        raise
    raise ModuleNotFoundError(
        f"ort_trainer.hf needs {error.name}, which the 'hf' extra installs: pip install \"ort_trainer[hf]\" "
        f'(transformers and accelerate; from a clone of the repository: pip install ".[hf]")',
        name=error.name,
    ) from error

__all__ = ["Trainer"]
