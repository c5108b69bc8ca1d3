"""Arguments the ONNX Runtime integration cannot honour are refused at construction, naming the argument;
nothing is silently ignored."""

from __future__ import annotations

import pytest
import torch

from tests.hf.common import OrtHFTrainer, TokenData, arguments, gpt2, pad_collate


def _make(tmp_path, model=None, **kwargs):
    overrides = kwargs.pop("args", {})
    return OrtHFTrainer(model=model or gpt2(), args=arguments(tmp_path, **overrides), train_dataset=TokenData(24),
                        data_collator=pad_collate, **kwargs)  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"optim": "sgd"}, "TrainingArguments.optim='sgd'"),
        ({"optim": "adafactor"}, "TrainingArguments.optim='adafactor'"),
        ({"torch_compile": True}, "TrainingArguments.torch_compile=True"),
        ({"activation_checkpointing": True}, "TrainingArguments.activation_checkpointing=True"),
        ({"gradient_checkpointing": True}, "TrainingArguments.gradient_checkpointing=True"),
        ({"neftune_noise_alpha": 5.0}, "TrainingArguments.neftune_noise_alpha=5.0"),
        ({"auto_find_batch_size": True}, "TrainingArguments.auto_find_batch_size=True"),
        ({"optim_args": "foo=1"}, "TrainingArguments.optim_args='foo=1'"),
    ],
)
def test_unsupported_training_arguments_are_refused_by_name(tmp_path, overrides, named):
    with pytest.raises(ValueError, match="not supported by ort_trainer.hf.Trainer") as error:
        _make(tmp_path, args=overrides)
    assert named in str(error.value)


def test_gradient_checkpointing_is_refused_under_the_name_the_user_set(tmp_path):
    # transformers 5 sets activation_checkpointing too (its alias): it had been named alone (issue S, point 5)
    with pytest.raises(ValueError, match="not supported by ort_trainer.hf.Trainer") as error:
        _make(tmp_path, args={"gradient_checkpointing": True})
    assert str(error.value).startswith("TrainingArguments.gradient_checkpointing=True")


def test_fp16_on_cpu_says_what_to_do_instead(tmp_path):
    with pytest.raises(ValueError, match=r"fp16=True on CPU: ONNX Runtime's CPU provider has no float16 kernels"):
        _make(tmp_path, args={"fp16": True})


def test_a_torch_optimizer_or_class_is_refused(tmp_path):
    model = gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"optimizers=\(optimizer, scheduler\)"):
        _make(tmp_path, model=model, optimizers=(optimizer, None))
    with pytest.raises(ValueError, match="optimizer_cls_and_kwargs"):
        _make(tmp_path, optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1}))


def test_ort_options_may_not_override_what_training_arguments_set(tmp_path):
    with pytest.raises(ValueError, match=r"ort_options\['batch'\]\['gradient_accumulation_steps'\].*gradient_acc"):
        _make(tmp_path, ort_options={"batch": {"gradient_accumulation_steps": 4}})
    with pytest.raises(ValueError, match="no_such_section"):  # ORTTrainer's own validation, at construction
        _make(tmp_path, ort_options={"no_such_section": {}})
    with pytest.raises(TypeError, match="ort_options must be a dict"):
        _make(tmp_path, ort_options=[("batch", 1)])


def test_an_accumulation_window_cut_short_by_the_epoch_is_refused_before_training(tmp_path):
    # 24 rows / 4 = 6 batches per epoch; windows of 4 leave a window of 2 at the end of the epoch
    trainer = _make(tmp_path, args={"gradient_accumulation_steps": 4, "max_steps": -1, "num_train_epochs": 1})
    with pytest.raises(ValueError, match="gradient_accumulation_steps=4 does not divide the 6 batches"):
        trainer.train()
    assert trainer.ort_trainer is None  # refused before any graph was built


def test_a_batch_entry_that_is_not_a_tensor_is_named(tmp_path):
    def collate(rows):
        return {**pad_collate(rows), "source": ["corpus"] * len(rows)}

    trainer = OrtHFTrainer(model=gpt2(), args=arguments(tmp_path), train_dataset=TokenData(8), data_collator=collate)
    with pytest.raises(TypeError, match="batch entry 'source' is a list"):
        trainer.train()
    assert trainer.ort_trainer is None
