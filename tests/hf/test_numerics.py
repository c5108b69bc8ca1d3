"""ort_trainer.hf.Trainer trains like transformers.Trainer on PyTorch: the same losses at every logged step,
the same evaluate() loss and the same final weights, for HF's AdamW with decay/no-decay groups, warmup
schedules, clipping, gradient accumulation over padded batches of different token counts (HF's
num_items_in_batch normalisation) and logging every k steps."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from tests.hf.common import (
    PAD,
    OrtHFTrainer,
    TokenData,
    arguments,
    assert_losses_close,
    assert_weights_close,
    gpt2,
    llama,
    pad_collate,
    pad_collate_without_mask,
    run,
)

CASES = {
    # name: TrainingArguments overrides
    "linear-accumulate": dict(lr_scheduler_type="linear", gradient_accumulation_steps=2, max_steps=5),
    "cosine-clip-log2": dict(lr_scheduler_type="cosine", max_grad_norm=0.5, logging_steps=2, warmup_steps=0.3,
                             adam_beta1=0.8, adam_beta2=0.99, adam_epsilon=1e-6),
    "constant-noclip-epochs": dict(lr_scheduler_type="constant_with_warmup", max_grad_norm=0.0, max_steps=-1,
                                   num_train_epochs=2, weight_decay=0.1, per_device_train_batch_size=6,
                                   label_smoothing_factor=0.1),
}  # fmt: skip


@pytest.mark.parametrize(  # the first case runs in `make test`, the others in `make test-hf`
    "case", [pytest.param(c, marks=() if c == "linear-accumulate" else pytest.mark.hf_long) for c in sorted(CASES)]
)
def test_training_equals_transformers_trainer(tmp_path, case):
    model = gpt2()
    evaluate = TokenData(8, seed=5)
    args = arguments(tmp_path / "torch", **CASES[case])
    reference, expected, expected_eval = run(transformers.Trainer, model, args, evaluate=evaluate)
    args = arguments(tmp_path / "ort", **CASES[case])
    ours, losses, eval_loss = run(OrtHFTrainer, model, args, evaluate=evaluate)

    assert ours.state.global_step == reference.state.global_step > 0
    assert_losses_close(losses, expected)
    assert eval_loss == pytest.approx(expected_eval, rel=1e-4)
    assert_weights_close(ours.model, reference.model)
    rates = [e["learning_rate"] for e in ours.state.log_history if "loss" in e]
    assert rates == pytest.approx([e["learning_rate"] for e in reference.state.log_history if "loss" in e])
    # the weights really moved (equal-to-torch is not the initial model twice)
    assert not torch.equal(ours.model.transformer.wte.weight, model.transformer.wte.weight)


@pytest.mark.parametrize(
    "collate", [pad_collate, pytest.param(pad_collate_without_mask, marks=pytest.mark.hf_long)], ids=["mask", "no-mask"]
)
def test_llama_with_a_padding_idx_trains_like_transformers_trainer(tmp_path, collate):
    """Llama's embeddings have ``padding_idx=0``; id 0 pads and ends rows as EOS, whose row torch never updates
    from a lookup. Without an attention mask (docs/hf.md: not needed) transformers checks for packed sequences."""
    model = llama()
    overrides = dict(lr_scheduler_type="linear", max_steps=4, gradient_accumulation_steps=2)
    args = arguments(tmp_path / "torch", **overrides)
    reference, expected, _ = run(transformers.Trainer, model, args, collate=collate)
    ours, losses, _ = run(OrtHFTrainer, model, arguments(tmp_path / "ort", **overrides), collate=collate)
    assert ours.state.global_step == reference.state.global_step == 4
    assert_losses_close(losses, expected)
    assert_weights_close(ours.model, reference.model)
    rows = ours.model.model.embed_tokens.weight
    assert torch.count_nonzero(rows[PAD]) == 0  # initialised to 0 and never given a gradient: still 0
    assert not torch.equal(rows[1:], model.model.embed_tokens.weight[1:])


class ShiftedLossTrainer(transformers.Trainer):
    """A compute_loss override: the model's logits, our own cross-entropy (mean over real tokens) + a logit penalty."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["labels"]
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        logits = outputs.logits[:, :-1].reshape(-1, outputs.logits.shape[-1])
        target = labels[:, 1:].reshape(-1)
        loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=-100)
        loss = loss + 0.01 * logits.square().mean()
        return (loss, outputs) if return_outputs else loss


class OrtShiftedLossTrainer(OrtHFTrainer):
    compute_loss = ShiftedLossTrainer.compute_loss


class Recorder(transformers.TrainerCallback):
    """Every callback event HF's loop fires, in order, with the step it fired at."""

    def __init__(self):
        self.events = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            return lambda args, state, control, **kw: self.events.append((name, state.global_step))
        return object.__getattribute__(self, name)


def test_compute_loss_override_and_callbacks_behave_as_in_hf(tmp_path):
    model = gpt2(seed=3)
    overrides = dict(gradient_accumulation_steps=2, max_steps=3, logging_steps=1)
    torch_recorder, ort_recorder = Recorder(), Recorder()
    reference, expected, _ = run(
        ShiftedLossTrainer, model, arguments(tmp_path / "torch", **overrides), callbacks=[torch_recorder]
    )
    ours, losses, _ = run(
        OrtShiftedLossTrainer, model, arguments(tmp_path / "ort", **overrides), callbacks=[ort_recorder]
    )
    assert_losses_close(losses, expected)
    assert_weights_close(ours.model, reference.model)
    assert ort_recorder.events == torch_recorder.events
    assert ("on_optimizer_step", 0) in ort_recorder.events and ("on_log", 3) in ort_recorder.events


class Sentences(torch.utils.data.Dataset):
    """Fixed-length token rows with a class label each (the model's own cross-entropy over 3 classes)."""

    def __init__(self, count: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, 64, (count, 10), generator=g)
        self.labels = torch.randint(0, 3, (count,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(10, dtype=torch.int64), "labels": self.labels[i]}


def _weighted_cross_entropy(outputs, labels, num_items_in_batch=None):
    weights = torch.tensor([1.0, 2.0, 0.5])
    return torch.nn.functional.cross_entropy(outputs.logits, labels, weight=weights)


@pytest.mark.hf_long
def test_a_bert_classifier_with_compute_loss_func_trains_like_transformers_trainer(tmp_path):
    """compute_loss_func: HF takes its loss as normalised over the window (no division by the accumulation)."""
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
        attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    overrides = dict(gradient_accumulation_steps=2, max_steps=4, lr_scheduler_type="linear")

    def train(cls, folder):
        trainer = cls(model=copy.deepcopy(model), args=arguments(tmp_path / folder, **overrides),
                      train_dataset=Sentences(16, seed=1), eval_dataset=Sentences(8, seed=2),
                      compute_loss_func=_weighted_cross_entropy)  # fmt: skip
        trainer.train()
        return trainer, [e["loss"] for e in trainer.state.log_history if "loss" in e], trainer.evaluate()["eval_loss"]

    reference, expected, expected_eval = train(transformers.Trainer, "torch")
    ours, losses, eval_loss = train(OrtHFTrainer, "ort")
    assert_losses_close(losses, expected)
    assert eval_loss == pytest.approx(expected_eval, rel=1e-4)
    assert_weights_close(ours.model, reference.model)
