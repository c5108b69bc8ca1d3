"""``ort_trainer.hf.Trainer`` on the shapes real data has (issue V): transformers' own collators
(``DataCollatorForLanguageModeling``, ``DataCollatorWithPadding``) padding each batch to its longest row, batches
grouped by length, a last smaller batch and an eval set of another batch size, all from one training graph and
one eval graph, equal to ``transformers.Trainer``."""

from __future__ import annotations

import logging
import warnings

import torch
import transformers

from tests.hf.common import OrtHFTrainer, TokenData, arguments, assert_losses_close, assert_weights_close, gpt2, run


class _Tokenizer:
    """What transformers' collators ask of a tokenizer to pad a batch (nothing is downloaded): pad id 0, right
    padding, and ``pad`` (other features, a label, pass through as a tensor)."""

    pad_token_id = 0
    padding_side = "right"
    model_input_names = ["input_ids", "attention_mask"]

    def pad(self, features, padding=True, max_length=None, pad_to_multiple_of=None, return_tensors="pt", **_):
        width = max(len(f["input_ids"]) for f in features)
        out = {"input_ids": [], "attention_mask": []}
        for f in features:
            ids = [int(t) for t in f["input_ids"]]
            gap = width - len(ids)
            out["input_ids"].append(ids + [0] * gap)
            out["attention_mask"].append([1] * len(ids) + [0] * gap)
        out |= {k: [f[k] for f in features] for k in features[0] if k not in out}
        return {k: torch.tensor(v) for k, v in out.items()}


def test_lm_collator_group_by_length_and_other_eval_batches_use_one_graph_each(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ort_trainer")
    model = gpt2()
    collate = transformers.DataCollatorForLanguageModeling(_Tokenizer(), mlm=False)  # labels -100 under the padding
    train, evaluate = TokenData(22, seed=3), TokenData(7, seed=5)  # 22 rows / 4: the epoch ends in a batch of 2
    options = dict(
        train_sampling_strategy="group_by_length", per_device_eval_batch_size=3, max_steps=-1, num_train_epochs=1
    )
    args = arguments(tmp_path / "torch", **options)
    reference, expected, expected_eval = run(transformers.Trainer, model, args, train, evaluate, collate=collate)
    args = arguments(tmp_path / "ort", **options)
    ours, losses, eval_loss = run(OrtHFTrainer, model, args, train, evaluate, collate=collate)
    assert ours.state.global_step == reference.state.global_step == 6
    assert_losses_close(losses, expected)
    assert abs(eval_loss - expected_eval) <= 1e-4 * abs(expected_eval)
    assert_weights_close(ours.model, reference.model)
    assert "new input shapes" not in caplog.text  # every later shape ran on the first training / eval graph
    assert caplog.text.count("phase 'trace and export the training graph'") == 1


class _Sentences(torch.utils.data.Dataset):
    """``count`` sentences of 4..15 random tokens, each with a class label (0..2), as a tokenized dataset holds them."""

    def __init__(self, count: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        sizes = torch.randint(4, 16, (count,), generator=g)
        self.rows = [(torch.randint(1, 64, (int(n),), generator=g).tolist(), int(c)) for n, c in zip(
            sizes, torch.randint(0, 3, (count,), generator=g), strict=True
        )]  # fmt: skip

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        ids, label = self.rows[i]
        return {"input_ids": ids, "label": label}


def _bert_classifier() -> transformers.BertForSequenceClassification:
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
        pad_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.BertForSequenceClassification(config)


def test_classifier_with_data_collator_with_padding_uses_one_graph_for_every_batch(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ort_trainer")
    model = _bert_classifier()
    collate = transformers.DataCollatorWithPadding(_Tokenizer())  # pads each batch to its longest sentence
    train, evaluate = _Sentences(18, seed=4), _Sentences(5, seed=6)  # 18 rows / 4: the epoch ends in a batch of 2
    options = dict(max_steps=-1, num_train_epochs=1, per_device_eval_batch_size=2, weight_decay=0.0)
    reference, expected, expected_eval = run(
        transformers.Trainer, model, arguments(tmp_path / "torch", **options), train, evaluate, collate=collate
    )
    ours, losses, eval_loss = run(
        OrtHFTrainer, model, arguments(tmp_path / "ort", **options), train, evaluate, collate=collate
    )
    assert ours.state.global_step == reference.state.global_step == 5
    assert_losses_close(losses, expected)
    assert abs(eval_loss - expected_eval) <= 1e-4 * abs(expected_eval)
    assert_weights_close(ours.model, reference.model)
    assert "new input shapes" not in caplog.text
    assert caplog.text.count("phase 'trace and export the training graph'") == 1
