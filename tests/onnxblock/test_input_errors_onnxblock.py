"""The onnxblock engine names a label out of range from its graph's label specs (the autograd engine names it with
PyTorch's own message: tests/engine/test_autograd_engine.py)."""

from __future__ import annotations

import pytest

from ort_trainer import ORTTrainer, optim
from tests.models import LM_DESC, TinyLM, lm_batches, lm_loss


def test_label_index_out_of_range_where_the_graph_does_not_say_the_class_count():
    trainer = ORTTrainer(TinyLM(), LM_DESC, optim.SGDConfig(lr=0.1), loss_fn=lm_loss)
    tokens, label = lm_batches(1)[0]
    trainer.train_step(tokens, label)
    with pytest.raises(
        ValueError, match=r"ONNX Runtime failed on an index: input 'label' holds values in \[\d+, 1\d\d\]"
    ):
        trainer.train_step(tokens, label + 100)
